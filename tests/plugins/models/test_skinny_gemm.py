"""The skinny Triton GEMM equals F.linear (interpreter on the CPU, native on the GPU),
and a Linear uses it only for inputs of at most 16 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.plugins.models.layers import Linear
from tokenloom.plugins.models.skinny_gemm import CONFIGS, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 64), (5, 40, 100), (16, 64, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_equals_linear(dtype, rows, n, k, bias):
    torch.manual_seed(0)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE) / k**0.5
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    small = (16, 32, 4, 1)  # small tiles keep the interpreter quick; K not a multiple
    for config in [small] + ([CONFIGS[0]] if DEVICE == "cuda" else []):
        got = skinny_gemm(x, w, config, b)
        assert got.shape == (rows, n) and got.dtype == dtype
        err = (got.double() - expected).norm() / expected.norm()
        assert err < TOL[dtype], (config, float(err))


def test_linear_uses_the_skinny_kernel_only_for_few_rows(monkeypatch):
    from tokenloom.plugins.models import skinny_gemm as module

    layer = Linear(32, (16,), False, torch.float32).to(DEVICE)
    torch.nn.init.normal_(layer.weight)
    calls = []

    def spy(x, w, config, bias=None):
        calls.append(x.shape[0])
        return F.linear(x, w, bias)

    monkeypatch.setattr(module, "skinny_gemm", spy)
    layer.skinny = (16, 32, 4, 1)
    layer(torch.randn(4, 32, device=DEVICE))
    layer(torch.randn(17, 32, device=DEVICE))
    layer.skinny = None
    layer(torch.randn(4, 32, device=DEVICE))
    assert calls == [4]
