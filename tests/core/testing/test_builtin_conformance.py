"""The built-in KV manager, attention backends and proposer pass their conformance
suites (the schedulers' run in tests/plugins/scheduler/test_scheduler_properties.py)."""

from __future__ import annotations

import pytest

from tokenloom.plugins.attention.torch_backend import TorchAttention
from tokenloom.plugins.kv_cache.paged import PagedKVCache
from tokenloom.plugins.proposer.ngram import NgramProposer
from tokenloom.testing import (
    AttentionConformance,
    KVCacheConformance,
    ProposerConformance,
)


class TestPagedConformance(KVCacheConformance):
    factory = PagedKVCache


class TestTorchAttentionConformance(AttentionConformance):
    factory = TorchAttention


class TestTritonAttentionConformance(AttentionConformance):
    """Under TRITON_INTERPRET=1 on the CPU (float32), on CUDA as it is."""

    @staticmethod
    def factory(config, info):  # type: ignore[no-untyped-def]
        from tokenloom.plugins.attention.triton_backend import TritonAttention

        return TritonAttention(config, info)


class TestNgramConformance(ProposerConformance):
    factory = NgramProposer


@pytest.mark.gpu
class TestTritonAttentionConformanceOnCUDA(TestTritonAttentionConformance):
    """The compiled kernels, float16 (the interpreter runs the float32 class above)."""

    device = "cuda"
    dtype = "float16"
    atol = 1e-2


@pytest.mark.gpu
class TestTorchAttentionConformanceOnCUDA(TestTorchAttentionConformance):
    device = "cuda"
    dtype = "bfloat16"
    atol = 4e-2
