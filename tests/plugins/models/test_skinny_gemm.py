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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(48, 64), (40, 100), (64, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_gemv_equals_linear(dtype, n, k, bias):
    from tokenloom.plugins.models.skinny_gemm import GEMV_CONFIGS, gemv

    torch.manual_seed(0)
    x = torch.randn(1, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE) / k**0.5
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    # N and K not multiples of the tile; K over several tiles (the prefetch's masks)
    for config in [(16, 32, 4), (8, 512, 4)] + (GEMV_CONFIGS if DEVICE == "cuda" else []):
        got = gemv(x, w, config, b)
        assert got.shape == (1, n) and got.dtype == dtype
        err = (got.double() - expected).norm() / expected.norm()
        assert err < TOL[dtype], (config, float(err))


def test_linear_uses_the_gemv_only_for_one_row(monkeypatch):
    from tokenloom.plugins.models import skinny_gemm as module

    layer = Linear(32, (16,), False, torch.float32).to(DEVICE)
    torch.nn.init.normal_(layer.weight)
    calls = []

    def spy(name):
        def run(x, w, config, bias=None):
            calls.append((name, x.shape[0]))
            return F.linear(x, w, bias)

        return run

    monkeypatch.setattr(module, "gemv", spy("gemv"))
    monkeypatch.setattr(module, "skinny_gemm", spy("skinny"))
    layer.skinny, layer.gemv = (16, 32, 4, 1), (16, 32, 4)
    layer(torch.randn(1, 32, device=DEVICE))
    layer(torch.randn(4, 32, device=DEVICE))
    layer.gemv = None
    layer(torch.randn(1, 32, device=DEVICE))
    assert calls == [("gemv", 1), ("skinny", 4), ("skinny", 1)]


def test_the_gemv_is_never_chosen_off_the_gpu():
    from tokenloom.plugins.models.skinny_dispatch import SkinnyDispatch

    assert SkinnyDispatch().choose_gemv(torch.randn(16, 32), None) is None


def test_choices_are_measured_once_then_read_back_from_the_cache_file(tmp_path, monkeypatch):
    from tokenloom.plugins.models import skinny_dispatch as module

    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    monkeypatch.setattr(module, "_DECIDED", {})
    calls = []

    def measure(choice):
        calls.append(choice)
        return choice

    assert module._decided("gemv|a", lambda: measure((8, 512, 4))) == (8, 512, 4)
    assert module._decided("b", lambda: measure(None)) is None  # cuBLAS kept
    assert module._decided("gemv|a", lambda: measure((1, 1, 1))) == (8, 512, 4)
    monkeypatch.setattr(module, "_DECIDED", {})  # a new process: the file answers
    assert module._decided("gemv|a", lambda: measure((1, 1, 1))) == (8, 512, 4)
    assert module._decided("b", lambda: measure((1, 1, 1))) is None
    assert calls == [(8, 512, 4), None]
