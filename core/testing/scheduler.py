"""The scheduler conformance suite: what every scheduler must pass, in one subclass.

    from tokenloom.testing import SchedulerConformance

    class TestMyScheduler(SchedulerConformance):
        factory = MyScheduler  # called as factory(config, kv_cache, clock=clock)

pytest then runs, against ``factory`` and the reference ``paged`` KV manager, random
sequences of adds, aborts and steps (hypothesis), synchronous and pipelined (async
scheduling: step N+1 built before step N's update), with a roomy pool and under KV
pressure (preemption). ``harness.Harness`` lists what is checked after each call:
the step limits, exact tokens, no block leaked or owned twice, every request
finishing once with a fitting reason. Set ``reports_metrics = False`` for a
scheduler that does not put ``RequestMetrics`` on last deltas (the built-ins do).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.config import EngineConfig
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.testing.harness import (
    FakeClock,
    KVCacheFactory,
    SchedulerFactory,
    operations,
    pressure_operations,
    run_operations,
)


class SchedulerConformance:
    """Subclass it with ``factory`` set; see the module docstring."""

    factory: ClassVar[SchedulerFactory]
    kv_cache_factory: ClassVar[KVCacheFactory] = PagedKVCache
    reports_metrics: ClassVar[bool] = True

    def _run(self, ops: list[tuple[Any, ...]], *args: Any) -> Any:
        cls = type(self)
        return run_operations(cls.factory, cls.kv_cache_factory, ops, *args)

    @pytest.mark.parametrize("pipelined", [False, True])
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        ops=operations,
        num_blocks=st.integers(4, 32),
        block_size=st.sampled_from([1, 2, 4, 8]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 48),
        caching=st.booleans(),
    )
    def test_random_operations_keep_the_pool_and_steps_consistent(
        self,
        pipelined: bool,
        ops: list[tuple[Any, ...]],
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        budget: int,
        caching: bool,
    ) -> None:
        harness = self._run(ops, num_blocks, block_size, max_num_seqs, budget, caching, pipelined)
        if self.reports_metrics:
            assert harness.metrics_seen == len(harness.done), "a last delta without metrics"

    @pytest.mark.parametrize("pipelined", [False, True])
    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        ops=pressure_operations,
        num_blocks=st.integers(3, 12),
        max_num_seqs=st.integers(2, 6),
        caching=st.booleans(),
    )
    def test_random_operations_under_kv_pressure_preempt_and_stay_exact(
        self,
        pipelined: bool,
        ops: list[tuple[Any, ...]],
        num_blocks: int,
        max_num_seqs: int,
        caching: bool,
    ) -> None:
        self._run(ops, num_blocks, 4, max_num_seqs, 16, caching, pipelined)

    def test_idle_scheduler_builds_empty_steps(self) -> None:
        cls = type(self)
        config = EngineConfig(max_model_len=64, block_size=4)
        scheduler = cls.factory(config, cls.kv_cache_factory(config, 8, 4), clock=FakeClock())
        assert not scheduler.has_unfinished_requests()
        step = scheduler.schedule()
        assert step.chunks == [] and step.num_tokens == 0

    def test_abort_of_a_waiting_request_returns_one_abort_delta(self) -> None:
        cls = type(self)
        config = EngineConfig(max_model_len=64, block_size=4)
        scheduler = cls.factory(config, cls.kv_cache_factory(config, 8, 4), clock=FakeClock())
        scheduler.add_request(GenerateRequest("a", [1, 2, 3], SamplingParams(max_tokens=4)))
        (delta,) = scheduler.abort_requests(["a", "unknown"])
        assert (delta.request_id, delta.finish_reason, delta.new_token_ids) == ("a", "abort", [])
        assert not scheduler.has_unfinished_requests()
        assert scheduler.abort_requests(["a"]) == []
