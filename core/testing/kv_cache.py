"""The KV cache manager conformance suite, in one subclass.

    from tokenloom.testing import KVCacheConformance

    class TestMyKVCache(KVCacheConformance):
        factory = MyKVCache  # called as factory(config, num_blocks, block_size)

It checks the interface's promises one by one (refusals change nothing, ``free`` is
idempotent, cached-prefix lookups change nothing and leave a token to compute), then
runs the scheduler harness (``harness.Harness``) with the ``continuous`` scheduler on
top of ``factory``: random adds, aborts and steps, synchronous and pipelined, under
KV pressure, where a block shared between different prefixes, handed out twice or
leaked fails the run, and the fake model's tokens expose any KV mix-up.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.config import EngineConfig
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.testing.harness import (
    KVCacheFactory,
    SchedulerFactory,
    operations,
    pressure_operations,
    run_operations,
)

BS = 4


class KVCacheConformance:
    """Subclass it with ``factory`` set; see the module docstring."""

    factory: ClassVar[KVCacheFactory]
    scheduler_factory: ClassVar[SchedulerFactory] = ContinuousScheduler

    def make(self, num_blocks: int = 8, caching: bool = True) -> Any:
        return type(self).factory(EngineConfig(enable_prefix_caching=caching), num_blocks, BS)

    def test_allocate_covers_the_tokens_and_free_is_idempotent(self) -> None:
        kv = self.make(8)
        assert (kv.num_blocks, kv.block_size, kv.num_free_blocks) == (8, BS, 8)
        assert kv.allocate("a", list(range(1, 11)), 10) == 0
        assert len(kv.block_ids("a")) * BS >= 10
        assert kv.num_free_blocks == 8 - len(kv.block_ids("a"))
        kv.free("a")
        kv.free("a")
        assert kv.block_ids("a") == [] and kv.num_free_blocks == 8

    def test_refusals_change_nothing(self) -> None:
        kv = self.make(4)
        assert kv.allocate("a", list(range(1, 13)), 12) == 0
        table, free = list(kv.block_ids("a")), kv.num_free_blocks
        assert kv.allocate("b", list(range(20, 28)), 8) is None
        assert kv.block_ids("b") == [] and kv.num_free_blocks == free
        assert not kv.append("a", 4 * BS + 1)
        assert kv.block_ids("a") == table and kv.num_free_blocks == free

    def test_append_grows_the_table_to_cover_the_tokens(self) -> None:
        kv = self.make(4)
        kv.allocate("a", [1, 2, 3], 3)
        for num_tokens in (4, 5, 9, 16):
            assert kv.append("a", num_tokens)
            table = kv.block_ids("a")
            assert len(table) * BS >= num_tokens and len(set(table)) == len(table)

    def test_cached_prefix_lookup_changes_nothing_and_leaves_a_token(self) -> None:
        kv = self.make(8)
        prompt = list(range(1, 9))  # exactly two blocks
        kv.allocate("a", prompt, 8)
        kv.commit("a", prompt, 8)
        free = kv.num_free_blocks
        cached = kv.num_cached_prefix_tokens(prompt)
        assert cached % BS == 0 and cached < len(prompt)
        assert kv.num_free_blocks == free
        reused = kv.allocate("b", prompt, 8)
        assert reused is not None and reused < len(prompt)

    @pytest.mark.parametrize("pipelined", [False, True])
    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        ops=st.one_of(operations, pressure_operations),
        num_blocks=st.integers(3, 24),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 32),
        caching=st.booleans(),
    )
    def test_under_a_scheduler_blocks_are_never_leaked_or_owned_twice(
        self,
        pipelined: bool,
        ops: list[tuple[Any, ...]],
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        budget: int,
        caching: bool,
    ) -> None:
        cls = type(self)
        run_operations(
            cls.scheduler_factory,
            cls.factory,
            ops,
            num_blocks,
            block_size,
            max_num_seqs,
            budget,
            caching,
            pipelined,
        )
