"""The one-row int4 GEMV in f16x2 arithmetic (``int4_gemv_h2``) equals the dequantized
reference: its arithmetic emulated in the interpreter on the CPU (fp32 and fp16
activations), its PTX on the GPU (bf16) at the Llama-3-8B shapes; the range guard keeps
the f16 chains finite and precise under any activation; the tuner offers it unless
withheld."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.kernels.dispatch import h2_candidates
from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, weight_gemm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.float16]
# the kernel's own error is ~5e-4 of |y| (f16 chains of 8 products); bf16 output
# rounding adds ~1.7e-3 on the GPU
TOL = 4e-3 if CUDA else 2e-3


def _layer(n, k, fractional=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    qweight, scales, zeros = quantize_int4(w.to(DEVICE), 128)
    if fractional:  # Q4_1's -m / d zero points: the fp32 epilogue takes them exactly
        zeros = zeros + torch.rand(zeros.shape, generator=gen).to(DEVICE) - 0.5
    ref = dequantize_int4(qweight, scales, zeros, 128, torch.float64)
    return qweight, scales, zeros, ref


def _x(k, dtype, outlier=0.0, seed=1, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen) * scale
    if outlier:
        x[0, 7], x[0, k // 2 + 3] = outlier, -outlier / 3
    return x.to(DEVICE, dtype)


def _rel_err(y, x, ref, bias=None):
    expected = x.double() @ ref.t()
    if bias is not None:
        expected = expected + bias.double()
    return float((y.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("outlier", [0.0, 1e3])
def test_matches_the_dequantized_reference(dtype, split, outlier):
    qweight, scales, zeros, ref = _layer(128, 512)
    x = _x(512, dtype, outlier)
    cfg = GemmConfig(1, 64, 128, split, 2, 3, h2=True)
    y = weight_gemm(x, qweight, scales, zeros, 4, 128, None, cfg)
    assert y.shape == (1, 128) and y.dtype == dtype
    assert _rel_err(y, x, ref) < TOL


@pytest.mark.parametrize("split", [1, 2])
def test_bias_and_fractional_zeros(split):
    qweight, scales, zeros, ref = _layer(96, 512, fractional=True)  # a partial column tile
    dtype = DTYPES[0]
    x = _x(512, dtype, 0.0)
    bias = torch.randn(96).to(DEVICE, dtype)
    cfg = GemmConfig(1, 64, 128, split, 2, 3, h2=True)
    y = weight_gemm(x, qweight, scales, zeros, 4, 128, bias, cfg)
    assert _rel_err(y, x, ref, bias) < TOL


def test_the_range_guard_keeps_huge_activations_finite():
    """1e6 x 2^-4 (a fixed scale) times a nibble of 8 overflows f16 (65,504): without the
    per-split shift the output is inf (checked by hand in session 13)."""
    qweight, scales, zeros, ref = _layer(128, 512)
    dtype = torch.float32 if not CUDA else torch.bfloat16
    x = _x(512, dtype, 1e6)
    y = weight_gemm(
        x, qweight, scales, zeros, 4, 128, None, GemmConfig(1, 64, 128, 2, 2, 3, h2=True)
    )
    assert torch.isfinite(y).all()
    assert _rel_err(y, x, ref) < TOL


@pytest.mark.parametrize("magnitude", [1e-6, 1e-20, 1e30])
def test_tiny_and_huge_activations_keep_their_precision(magnitude):
    """The shift scales small activations up (a fixed 2^-4 lost them in f16's subnormals:
    25% error at 1e-5) and large ones down, so the error stays that of unit ones."""
    qweight, scales, zeros, ref = _layer(128, 512)
    x = (_x(512, torch.float32, 0.0) * magnitude).to(DTYPES[0])
    y = weight_gemm(
        x, qweight, scales, zeros, 4, 128, None, GemmConfig(1, 64, 128, 2, 2, 3, h2=True)
    )
    assert _rel_err(y, x, ref) < TOL


def test_zero_activations_give_zero():
    qweight, scales, zeros, _ = _layer(128, 256)
    x = torch.zeros(1, 256).to(DEVICE, DTYPES[0])
    y = weight_gemm(
        x, qweight, scales, zeros, 4, 128, None, GemmConfig(1, 64, 128, 1, 2, 3, h2=True)
    )
    assert torch.equal(y, torch.zeros_like(y))


def test_inputs_it_cannot_serve_fall_back():
    qweight, scales, zeros, ref = _layer(64, 256)
    x = torch.randn(2, 256).to(DEVICE, DTYPES[0])  # two rows: the one-row kernel cannot
    y = weight_gemm(
        x, qweight, scales, zeros, 4, 128, None, GemmConfig(1, 64, 128, 1, 2, 3, h2=True)
    )
    expected = x.double() @ ref.t()
    assert float((y.double() - expected).norm() / expected.norm()) < TOL


def test_offered_to_the_tuner_unless_withheld(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_INT4_H2", "0")
    assert h2_candidates(4096, 4096, 4, 128, True, torch.bfloat16) == []
    monkeypatch.delenv("TOKENLOOM_INT4_H2", raising=False)
    offered = h2_candidates(4096, 4096, 4, 128, True, torch.bfloat16)
    assert offered and all(c.h2 for c in offered)
    assert {c.split_k for c in offered} == {1, 2, 4, 8, 16}
    # down's K: 112 tiles of 128, split 16 leaves 7 each
    assert {c.split_k for c in h2_candidates(4096, 14336, 4, 128, True, torch.bfloat16)} == {
        1, 2, 4, 8, 16,
    }  # fmt: skip
    assert h2_candidates(4096, 256, 4, 128, True, torch.bfloat16)  # split 1 only
    assert {c.split_k for c in h2_candidates(4096, 256, 4, 128, True, torch.bfloat16)} == {1}
    # formats it does not serve
    assert h2_candidates(4096, 4096, 4, 128, False, torch.bfloat16) == []
    assert h2_candidates(4096, 4096, 4, 64, True, torch.bfloat16) == []  # groups < tile
    assert h2_candidates(4096, 4096, 4, 128, True, torch.float16) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
)  # fmt: skip
@pytest.mark.parametrize("cfg", [(64, 2, 4), (128, 8, 8), (128, 4, 1), (64, 2, 16)])
def test_gpu_llama_shapes(n, k, cfg):
    block_n, warps, split = cfg
    qweight, scales, zeros, ref = _layer(n, k)
    for outlier in (0.0, 3e3, 1e5):
        x = _x(k, torch.bfloat16, outlier)
        config = GemmConfig(1, block_n, 128, split, warps, 3, h2=True)
        y = weight_gemm(x, qweight, scales, zeros, 4, 128, None, config)
        assert _rel_err(y, x, ref) < TOL, outlier
