"""The conformance suites fail components that break their contracts: each suite is
run here against a deliberately faulty component and must raise."""

from __future__ import annotations

from typing import Any

import pytest

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.torch_backend import TorchAttention, write_kv_cache
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.plugins.proposer.ngram import NgramProposer
from tokenloom.plugins.scheduler.continuous import ContinuousScheduler
from tokenloom.testing import (
    AttentionConformance,
    ProposerConformance,
    SchedulerConformance,
    run_operations,
)

# Two requests sharing a 24-token prefix, then enough steps to finish both.
OPS: list[tuple[Any, ...]] = [
    ("add", 24, 6, 0, 0, 0, 1, None),
    ("add", 20, 6, 0, 0, 0, 2, None),
    ("step", 4),
    ("add", 9, 3, 1, -1, 0, 3, None),
    ("abort", 2),
    ("step", 4),
]


class LeakyKV(PagedKVCache):
    def free(self, request_id: str) -> None:
        pass  # keeps every block


class MixedUpKV(PagedKVCache):
    def block_ids(self, request_id: str) -> list[int]:
        return list(reversed(super().block_ids(request_id)))  # wrong block order


class OverBudget(ContinuousScheduler):
    def admit(self, budget: int) -> int:
        return super().admit(budget + 8)


class ZeroAttention(TorchAttention):
    def forward(self, q: Any, k: Any, v: Any, k_cache: Any, v_cache: Any, meta: Any, scale: float):
        super().forward(q, k, v, k_cache, v_cache, meta, scale)
        return q * 0


class UnscaledAttention(TorchAttention):
    """Stores the quantized rows, then attends over the raw fp8/int8 values."""

    def forward(self, q: Any, k: Any, v: Any, k_cache: Any, v_cache: Any, meta: Any, scale: float):
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        raw = (k_cache.float().contiguous(), v_cache.float().contiguous())  # fp8: V strided
        return super().forward(q, k, v, *raw, meta, scale)


class DoubledScales(TorchAttention):
    """Attends correctly, but leaves the new rows' scales twice too large."""

    def forward(self, q: Any, k: Any, v: Any, k_cache: Any, v_cache: Any, meta: Any, scale: float):
        out = super().forward(q, k, v, k_cache, v_cache, meta, scale)
        slots, block_size = meta.slot_mapping, k_cache.shape[1]
        kv_quant.scales_of(k_cache)[slots // block_size, slots % block_size] *= 2
        return out


class Greedy(NgramProposer):
    def propose(self, request_ids: Any, token_histories: Any, num_tokens: Any) -> list[list[int]]:
        return [[1] * (n + 1) for n in num_tokens]  # one more than asked


@pytest.mark.parametrize("pipelined", [False, True])
def test_reference_components_pass_the_fixed_sequence(pipelined: bool) -> None:
    harness = run_operations(ContinuousScheduler, PagedKVCache, OPS, 16, 4, 4, 16, True, pipelined)
    assert len(harness.done) == 3 and harness.metrics_seen == 3


@pytest.mark.parametrize(
    ("scheduler", "kv", "message"),
    [
        (ContinuousScheduler, LeakyKV, "holds blocks"),
        (ContinuousScheduler, MixedUpKV, "differs|never written"),
        (OverBudget, PagedKVCache, "budget"),
    ],
)
def test_harness_fails_a_faulty_scheduler_or_kv_manager(scheduler, kv, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AssertionError, match=message):
        run_operations(scheduler, kv, OPS, 16, 4, 4, 16, True)


def test_attention_suite_fails_a_backend_that_does_not_attend() -> None:
    class Suite(AttentionConformance):
        factory = ZeroAttention

    with pytest.raises(AssertionError):
        Suite().test_forward_equals_dense_causal_attention("mixed")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("backend", [UnscaledAttention, DoubledScales])
def test_attention_suite_fails_a_backend_that_mishandles_a_quantized_cache(
    backend: Any, kv_cache_dtype: str
) -> None:
    class Suite(AttentionConformance):
        factory = backend

    with pytest.raises(AssertionError):
        Suite().test_forward_over_a_quantized_cache("mixed", kv_cache_dtype)


def test_proposer_suite_fails_a_proposer_that_drafts_too_many() -> None:
    class Suite(ProposerConformance):
        factory = Greedy

    with pytest.raises(AssertionError):
        Suite().test_proposes_at_most_the_asked_tokens_within_the_vocabulary()


def test_scheduler_suite_fails_a_scheduler_over_its_budget() -> None:
    class Suite(SchedulerConformance):
        factory = OverBudget

    # Hypothesis raises the one failure, or an ExceptionGroup of the distinct ones.
    with pytest.raises((AssertionError, ExceptionGroup), match="budget|distinct failures"):
        Suite().test_random_operations_keep_the_pool_and_steps_consistent(pipelined=False)
