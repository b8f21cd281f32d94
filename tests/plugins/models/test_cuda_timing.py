"""``time_graph`` times on one side stream per device: timing cuBLAS again and again
leaves no memory behind (a new stream per call gave each its own cuBLAS workspace)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.plugins.models import cuda_timing
from tokenloom.plugins.models.cuda_timing import time_graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_timing_cublas_repeatedly_does_not_grow_the_allocated_memory():
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    assert time_graph(lambda: F.linear(x, w)) > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(6):
        time_graph(lambda: F.linear(x, w))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20
    assert len(cuda_timing._SIDE_STREAMS) == 1
