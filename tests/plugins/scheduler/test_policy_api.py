"""The public policy API of ``BatchScheduler``: a waiting queue whose keys change,
aging through ``reprioritize_interval``, ``choose_victim``, metrics per request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tokenloom.config import EngineConfig
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.plugins.scheduler.fake_executor import FakeExecutor
from tokenloom.plugins.scheduler.request_state import RequestState
from tokenloom.plugins.scheduler.waiting_queue import WaitingQueue
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.testing import FakeClock

BS = 4


def _state(request_id: str, prompt_len: int, seq: int) -> RequestState:
    request = GenerateRequest(request_id, [1] * prompt_len, SamplingParams())
    return RequestState(request, seq, 100, None, arrival_time=float(seq))


def test_waiting_queue_rekeys_one_request_or_all_of_them() -> None:
    boost: dict[str, int] = {}
    queue = WaitingQueue(key=lambda s: (s.num_tokens - boost.get(s.request_id, 0), s.arrival_seq))
    states = [_state(name, n, i) for i, (name, n) in enumerate([("a", 5), ("b", 9), ("c", 7)])]
    for state in states:
        queue.push(state)
    assert queue.peek() is states[0]
    boost["b"] = 8  # 9 - 8 = 1: b now goes first, once re-keyed
    assert queue.peek() is states[0]
    queue.update(states[1])
    assert queue.peek() is states[1] and len(queue) == 3
    boost.update(a=0, b=0, c=6)  # c: 1
    queue.reprioritize()
    assert [queue.pop().request_id for _ in range(3)] == ["c", "a", "b"]  # type: ignore[union-attr]
    assert queue.pop() is None and len(queue) == 0


class OldestTenantFirst(BatchScheduler):
    """Aging by tenant: waiting time counts double for tenant "vip"."""

    reprioritize_interval = 1.0

    def priority(self, state: RequestState, now: float) -> Any:
        weight = 2.0 if state.tenant == "vip" else 1.0
        return (-(now - state.arrival_time) * weight, state.arrival_seq)


def _scheduler(cls: type[BatchScheduler], clock: FakeClock, **options: Any) -> BatchScheduler:
    config = EngineConfig(max_model_len=128, block_size=BS, **options)
    return cls(config, PagedKVCache(config, options.pop("num_blocks", 64), BS), clock=clock)


def test_reprioritize_interval_rekeys_the_queue_as_time_passes() -> None:
    clock = FakeClock()
    scheduler = _scheduler(OldestTenantFirst, clock, max_num_seqs=1)
    params = SamplingParams(max_tokens=1)
    scheduler.add_request(GenerateRequest("running", [1, 2], params))
    assert [c.request_id for c in scheduler.schedule().chunks] == ["running"]
    scheduler.add_request(GenerateRequest("plain", [3], params))
    clock.now = 1.0
    scheduler.add_request(GenerateRequest("vip", [4], params, tenant="vip"))
    # Keys at queueing: plain waited 0 s, vip 0 s -> plain (earlier) first. After 3 s
    # more and a re-key: plain waited 3 s, vip 2 s x 2 = 4 -> vip first.
    assert scheduler.waiting.peek().request_id == "plain"  # type: ignore[union-attr]
    clock.now = 3.0
    scheduler.schedule()
    assert scheduler.waiting.peek().request_id == "vip"  # type: ignore[union-attr]


class EvictLongest(BatchScheduler):
    def choose_victim(self, candidates: Sequence[RequestState]) -> RequestState:
        return max(candidates, key=lambda s: s.num_tokens)


class EvictScheduled(BatchScheduler):
    def choose_victim(self, candidates: Sequence[RequestState]) -> RequestState:
        return self.running[0]  # may already be scheduled this step: not a candidate


def _pressure(cls: type[BatchScheduler]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Four requests decoding in a pool too small for all: preemptions per request,
    and the tokens each produced."""
    config = EngineConfig(max_model_len=64, block_size=BS, max_num_batched_tokens=64)
    scheduler = cls(config, PagedKVCache(config, 12, BS), clock=FakeClock())
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    for name, length in (("a", 3), ("b", 10), ("c", 6), ("d", 2)):
        scheduler.add_request(GenerateRequest(name, list(range(1, length + 1)), params))
    executor = FakeExecutor(12, BS)
    preemptions: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        for delta in scheduler.update(step, executor.execute(step)):
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.metrics is not None:
                preemptions[delta.request_id] = delta.metrics.num_preemptions
    return preemptions, tokens


def test_choose_victim_picks_who_is_preempted() -> None:
    default, default_tokens = _pressure(BatchScheduler)
    longest, longest_tokens = _pressure(EvictLongest)
    assert default != longest  # another victim ...
    assert default_tokens == longest_tokens  # ... and the same tokens
    assert longest["b"] > 0 and default["d"] > 0  # the longest; the latest arrival


def test_choose_victim_outside_the_candidates_is_refused() -> None:
    with pytest.raises(ValueError):
        _pressure(EvictScheduled)


def test_last_delta_carries_metrics_with_preemptions_on_the_clock() -> None:
    clock = FakeClock()
    scheduler = _scheduler(BatchScheduler, clock, num_blocks=6, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for name in ("a", "b"):
        scheduler.add_request(GenerateRequest(name, [5, 6, 7, 8], params, arrival_time=0.5))
    executor = FakeExecutor(6, BS)
    metrics = {}
    while scheduler.has_unfinished_requests():
        clock.now += 1.0
        step = scheduler.schedule()
        for delta in scheduler.update(step, executor.execute(step)):
            if delta.finish_reason is not None:
                metrics[delta.request_id] = delta.metrics
    assert metrics.keys() == {"a", "b"}
    assert sum(m.num_preemptions for m in metrics.values()) == scheduler.num_preemptions > 0
    for m in metrics.values():
        assert m.arrival_time == 0.5 and m.first_scheduled_time == 1.0
        assert m.first_token_time == 1.0 and m.finished_time >= 10.0
