"""The contrib ``static`` baseline: whole batches, same tokens as ``continuous``."""

from __future__ import annotations

import random

import pytest

from tokenloom.config import EngineConfig
from tokenloom.contrib.schedulers.static import StaticScheduler, tokenloom_register_components
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.plugins.scheduler.fake_executor import FakeExecutor, Generation, run_until_idle
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams

BS = 4


def make(
    cls: type[BatchScheduler], num_blocks: int, **options: int
) -> tuple[BatchScheduler, PagedKVCache, FakeExecutor]:
    config = EngineConfig(max_model_len=256, block_size=BS, **options)  # type: ignore[arg-type]
    kv = PagedKVCache(config, num_blocks, BS)
    return cls(config, kv), kv, FakeExecutor(num_blocks, BS)


def add_requests(scheduler: BatchScheduler, count: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    for i in range(count):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(2, 40))]
        params = SamplingParams(max_tokens=rng.randrange(1, 30))
        scheduler.add_request(GenerateRequest(f"r{i}", prompt, params, [0], priority=i % 2))


def test_registers_as_scheduler_static() -> None:
    (spec,) = tokenloom_register_components()
    assert (spec.kind, spec.name, spec.factory) == ("scheduler", "static", StaticScheduler)


@pytest.mark.parametrize("num_blocks", [400, 20])
def test_static_and_continuous_generate_identical_tokens(num_blocks: int) -> None:
    results: list[dict[str, Generation]] = []
    for cls in (ContinuousScheduler, StaticScheduler):
        scheduler, _, executor = make(cls, num_blocks, max_num_seqs=4, max_num_batched_tokens=24)
        add_requests(scheduler, 16)
        results.append(run_until_idle(scheduler, executor))
    continuous, static = results
    assert {k: (g.token_ids, g.finish_reason) for k, g in static.items()} == {
        k: (g.token_ids, g.finish_reason) for k, g in continuous.items()
    }


def test_no_request_joins_until_the_whole_batch_finished() -> None:
    scheduler, _, executor = make(StaticScheduler, 400, max_num_seqs=3)
    add_requests(scheduler, 10, seed=4)
    batch: set[str] = set()
    batches = []
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        joined = {new.request_id for new in step.new_requests}
        if joined:
            assert not batch, f"{joined} joined while {batch} still ran"
            batch = set(joined)
            batches.append(len(joined))
        for delta in scheduler.update(step, executor.execute(step)):
            if delta.finish_reason is not None:
                batch.discard(delta.request_id)
    assert batches == [3, 3, 3, 1]


def test_batch_size_is_limited_by_blocks_for_whole_prompts() -> None:
    scheduler, kv, _ = make(StaticScheduler, 10, max_num_seqs=8)
    for i in range(4):
        scheduler.add_request(GenerateRequest(f"r{i}", [5] * 15, SamplingParams(), [0]))
    step = scheduler.schedule()
    assert [new.request_id for new in step.new_requests] == ["r0", "r1"]  # 4 blocks each
    assert all(len(kv.block_ids(f"r{i}")) == 4 for i in range(2))
