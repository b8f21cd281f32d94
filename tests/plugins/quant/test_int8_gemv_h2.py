"""The one-row int8 GEMV in f16x2 arithmetic (``int8_gemv_h2``) equals the dequantized
reference: its arithmetic emulated in the interpreter on the CPU (fp32 and fp16
activations), its PTX on the GPU (bf16) at the Llama-3-8B shapes; the range guard keeps
the f16 chains finite and precise under any activation; the tuner offers it unless
withheld. ``test_int4_gemv_h2_ptx.py`` runs its PTX strings on the CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenloom.plugins.quant.int8 import dequantize_int8, quantize_int8
from tokenloom.plugins.quant.kernels import weight_gemm as weight_gemm_module
from tokenloom.plugins.quant.kernels.dispatch import H2_INT8, h2_candidates
from tokenloom.plugins.quant.kernels.int8_gemv_h2 import int8_h2_fits
from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, weight_gemm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.float16]
# f16 chains of four products: ~3e-4 of |y|; bf16 output rounding adds ~1.7e-3 on the GPU
TOL = 4e-3 if CUDA else 2e-3


def _layer(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    qweight, scales = quantize_int8(w.to(DEVICE))
    qweight = qweight.contiguous()  # stored [K, N], the layout this kernel reads
    return qweight, scales, dequantize_int8(qweight, scales, torch.float64)


def _x(k, dtype, outlier, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen)
    if outlier:
        x[0, 7], x[0, k // 2 + 3] = outlier, -outlier / 3
    return x.to(DEVICE, dtype)


def _rel_err(y, x, ref, bias=None):
    expected = x.double() @ ref.t()
    if bias is not None:
        expected = expected + bias.double()
    return float((y.double() - expected).norm() / expected.norm())


def _cfg(block_n=64, block_k=128, split=1, warps=4):
    return GemmConfig(1, block_n, block_k, split, warps, 3, h2=True)


@pytest.fixture
def launches(monkeypatch):
    """The calls that reach ``launch_int8_h2`` (so a silent fallback fails the test)."""
    calls = []
    real = weight_gemm_module.launch_int8_h2

    def spy(*args, **kwargs):
        calls.append(args[-2] if len(args) >= 14 else kwargs.get("split"))  # the split
        return real(*args, **kwargs)

    monkeypatch.setattr(weight_gemm_module, "launch_int8_h2", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("outlier", [0.0, 1e3])
def test_matches_the_dequantized_reference(dtype, split, outlier, launches):
    qweight, scales, ref = _layer(128, 1024)
    x = _x(1024, dtype, outlier)
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, _cfg(split=split))
    assert launches == [split]  # the f16x2 kernel ran, not a fallback
    assert y.shape == (1, 128) and y.dtype == dtype
    assert _rel_err(y, x, ref) < TOL


@pytest.mark.parametrize("split", [1, 2])
def test_bias_a_partial_column_tile_and_a_partial_k_tile(split, launches):
    qweight, scales, ref = _layer(100, 576)  # 100 = 64 + 36 columns; K 576 = 4.5 tiles
    x = _x(576, DTYPES[0], 0.0)
    bias = torch.randn(100).to(DEVICE, DTYPES[0])
    y = weight_gemm(x, qweight, scales, None, 8, 0, bias, _cfg(split=split))
    assert launches == [split]
    assert _rel_err(y, x, ref, bias) < TOL


def test_the_emulated_chains_round_in_f16():
    """Not the fp32 GEMV under another name: with x scaled to f16, products of 127 and a
    value with 11 significant bits round, so the result differs from the exact fp32 sum
    by about f16's precision, and not by more."""
    qweight, scales, ref = _layer(64, 512)
    x = _x(512, torch.float32, 0.0) * (1 + 2.0**-20)  # bits that f16 cannot hold
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, _cfg())
    exact = weight_gemm(x, qweight, scales, None, 8, 0, None, GemmConfig(1, 64, 128, gemv=True))
    if not CUDA:
        assert not torch.equal(y, exact)
    assert _rel_err(y, x, ref) < TOL


@pytest.mark.parametrize("outlier", [1e6, 3e38])
def test_the_range_guard_keeps_huge_activations_finite(outlier, launches):
    """127 x 1e6 overflows f16 (65,504) on the first product without the shift; 3e38 is
    near the largest finite x (a shift of 122)."""
    qweight, scales, ref = _layer(128, 512)
    x = _x(512, torch.float32, 0.0).to(DTYPES[0])
    x[0, 7] = outlier
    x[0, 300] = -outlier
    qweight[7] = -127  # the largest products of the outliers, in every column
    qweight[300] = 127
    ref = dequantize_int8(qweight, scales, torch.float64)
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, _cfg(split=1))
    assert launches == [1]
    expected = x.double() @ ref.t()
    assert torch.isfinite(expected).all()
    if torch.isfinite(expected.to(y.dtype)).all():
        assert torch.isfinite(y).all()
        assert _rel_err(y, x, ref) < TOL


@pytest.mark.parametrize("magnitude", [1e-6, 1e-20, 1e30])
def test_tiny_and_huge_activations_keep_their_precision(magnitude):
    qweight, scales, ref = _layer(128, 512)
    x = (_x(512, torch.float32, 0.0) * magnitude).to(DTYPES[0])
    if not torch.isfinite(x).all() or not x.abs().max() > 0:
        pytest.skip("the magnitude does not exist in this dtype")
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, _cfg(split=2))
    assert _rel_err(y, x, ref) < TOL


def test_zero_activations_give_zero():
    qweight, scales, _ = _layer(128, 256)
    x = torch.zeros(1, 256).to(DEVICE, DTYPES[0])
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, _cfg())
    assert torch.equal(y, torch.zeros_like(y))


def test_what_it_serves():
    qweight, _, _ = _layer(64, 256)
    x = torch.randn(1, 256).to(DEVICE, DTYPES[0])
    assert int8_h2_fits(x, qweight, 0, 128)
    assert not int8_h2_fits(x, qweight, 0, 128, has_zeros=True)
    assert not int8_h2_fits(x, qweight, 128, 128)  # groups: not a format of int8
    assert not int8_h2_fits(x, qweight.view(torch.uint8), 0, 128)
    assert not int8_h2_fits(torch.cat([x, x]), qweight, 0, 128)
    assert not int8_h2_fits(x, qweight[:, 2:62], 0, 128)  # a strided view


def test_inputs_it_cannot_serve_fall_back():
    qweight, scales, ref = _layer(64, 256)
    x = torch.randn(2, 256).to(DEVICE, DTYPES[0])  # two rows: the one-row kernel cannot
    y = weight_gemm(x, qweight, scales, None, 8, 0, None, _cfg())
    assert _rel_err(y, x, ref) < TOL
    odd, odd_scales, odd_ref = _layer(66, 256)  # N % 4: no whole words
    y = weight_gemm(x[:1], odd, odd_scales, None, 8, 0, None, _cfg())
    assert _rel_err(y, x[:1], odd_ref) < TOL


def test_offered_to_the_tuner_unless_withheld(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_INT8_H2", "0")
    assert h2_candidates(4096, 4096, 8, 0, False, torch.bfloat16) == []
    monkeypatch.delenv("TOKENLOOM_INT8_H2", raising=False)
    offered = h2_candidates(4096, 4096, 8, 0, False, torch.bfloat16)
    assert offered and all(c.h2 and replace(c, split_k=1) in H2_INT8 for c in offered)
    assert {replace(c, split_k=1) for c in offered} == set(H2_INT8)
    assert {c.split_k for c in offered} == {1, 2, 4, 8, 16}
    assert h2_candidates(4096, 4096, 8, 0, False, torch.float16)
    assert h2_candidates(4096, 4096, 8, 0, False, torch.float32) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
)  # fmt: skip
@pytest.mark.parametrize(
    "cfg", [(64, 128, 4, 4), (128, 256, 8, 8), (128, 128, 4, 1), (64, 128, 4, 16)]
)
def test_gpu_llama_shapes(n, k, cfg):
    block_n, block_k, warps, split = cfg
    qweight, scales, ref = _layer(n, k)
    for outlier in (0.0, 3e3, 1e5):
        x = _x(k, torch.bfloat16, outlier)
        y = weight_gemm(x, qweight, scales, None, 8, 0, None, _cfg(block_n, block_k, split, warps))
        assert _rel_err(y, x, ref) < TOL, outlier
