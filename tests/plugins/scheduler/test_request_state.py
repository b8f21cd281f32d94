"""Stopping rules shared by every scheduler."""

from __future__ import annotations

from tokenloom.plugins.scheduler.request_state import RequestState, max_total_len
from tokenloom.plugins.scheduler.waiting_queue import WaitingQueue
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams

EOS = 2


def state(prompt_len: int = 3, max_model_len: int = 100, **params: object) -> RequestState:
    request = GenerateRequest("r", [9] * prompt_len, SamplingParams(**params), [EOS])  # type: ignore[arg-type]
    return RequestState(request, 1, max_total_len(request, max_model_len, 10_000), None)


def test_eos_stops_and_stays_in_the_output() -> None:
    s = state()
    assert s.append_tokens([5]) == 1 and s.finish_reason is None
    assert s.append_tokens([EOS]) == 1
    assert s.finish_reason == "stop" and s.all_token_ids[-1] == EOS


def test_eos_is_ignored_before_min_tokens_and_with_ignore_eos() -> None:
    s = state(min_tokens=3)
    s.append_tokens([EOS, EOS])
    assert s.finish_reason is None
    s.append_tokens([EOS])
    assert s.finish_reason == "stop"
    ignoring = state(ignore_eos=True)
    ignoring.append_tokens([EOS, EOS])
    assert ignoring.finish_reason is None


def test_stop_token_ids_stop_like_eos() -> None:
    s = state(stop_token_ids=[7], ignore_eos=True)
    s.append_tokens([EOS, 7])
    assert s.finish_reason == "stop" and s.num_output_tokens == 2


def test_max_tokens_stops_with_length_and_drops_extra_speculative_tokens() -> None:
    s = state(max_tokens=2)
    assert s.append_tokens([5, 6, 8]) == 2
    assert s.finish_reason == "length" and s.all_token_ids[-2:] == [5, 6]


def test_model_length_stops_with_length_when_max_tokens_is_none() -> None:
    s = state(prompt_len=4, max_model_len=6, max_tokens=None)
    s.append_tokens([5])
    assert s.finish_reason is None
    s.append_tokens([5])
    assert s.finish_reason == "length" and s.num_tokens == 6


def test_a_token_that_is_both_stop_and_last_reports_stop() -> None:
    s = state(max_tokens=1)
    s.append_tokens([EOS])
    assert s.finish_reason == "stop"


def test_waiting_queue_pops_by_priority_then_arrival_and_skips_discarded() -> None:
    queue = WaitingQueue()
    states = []
    for seq, priority in enumerate([1, 0, 1, 0]):
        request = GenerateRequest(f"r{seq}", [1], SamplingParams(), priority=priority)
        states.append(RequestState(request, seq, 10, None))
        queue.push(states[-1])
    queue.discard(states[3])
    assert len(queue) == 3
    assert [queue.pop().request_id for _ in range(3)] == ["r1", "r0", "r2"]  # type: ignore[union-attr]
    assert queue.pop() is None and len(queue) == 0
