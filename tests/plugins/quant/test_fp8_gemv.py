"""The fp8 (W8A8) GEMV for a few decode rows equals the fp8 reference path (the
quantized rows times the dequantized weight): tiny shapes in the interpreter (its
e4m3 -> fp32 loads are exact for every finite byte, which is checked), Llama-3-8B shapes through
``Fp8Kernel.apply`` on a GPU with fp8 (sm_89+); offered only when asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenloom.plugins.quant.fp8 import FP8, quantize_fp8_rows
from tokenloom.plugins.quant.kernels.fp8_gemv import GEMV_ROWS, fp8_gemv

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8_GPU = CUDA and torch.cuda.get_device_capability() >= (8, 9)


@triton.jit
def _widen(x_ptr, y_ptr):
    offs = tl.arange(0, 256)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.float32))


@pytest.mark.skipif(CUDA and not FP8_GPU, reason="e4m3 loads need sm_89+")
def test_every_e4m3_byte_widens_exactly():
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(FP8)
    out = torch.empty(256, device=DEVICE)
    _widen[(1,)](codes, out)
    expected = codes.float()
    finite = ~expected.isnan()
    assert torch.equal(out[finite], expected[finite])
    if CUDA:  # the interpreter reads the two NaN codes as +-480; quantized data never has them
        assert out[~finite].isnan().all()


def _operands(m, n, k):
    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    w_scales = w.abs().amax(dim=1, keepdim=True) / 448.0
    weight = (w / w_scales).to(FP8)
    x = torch.randn(m, k, device=DEVICE)
    x[:, 3] *= 40  # an outlier channel
    xq, x_scales = quantize_fp8_rows(x)
    ref = F.linear(xq.double() * x_scales.double(), weight.double() * w_scales.double())
    return xq, x_scales, weight, w_scales, ref


@pytest.mark.skipif(CUDA and not FP8_GPU, reason="e4m3 loads need sm_89+")
@pytest.mark.parametrize(
    ("m", "n", "k", "block_n", "block_k"),
    [
        (1, 40, 96, 16, 32),  # N and K not multiples of the tile
        (3, 48, 64, 16, 64),
        (GEMV_ROWS, 16, 200, 8, 64),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_equals_the_reference(m, n, k, block_n, block_k, bias):
    xq, x_scales, weight, w_scales, ref = _operands(m, n, k)
    b = torch.randn(n, device=DEVICE) if bias else None
    got = fp8_gemv(xq, x_scales, weight, w_scales, b, torch.float32, block_n, block_k)
    if b is not None:
        ref = ref + b.double()
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6


def test_offered_by_default_and_off_when_asked(monkeypatch):
    from tokenloom.plugins.quant.fp8 import Fp8Kernel

    weight = torch.zeros(32, 16).to(FP8)
    scales = torch.ones(32, 1)
    monkeypatch.delenv("TOKENLOOM_FP8_GEMV", raising=False)
    assert Fp8Kernel(weight, scales).gemv_rows == GEMV_ROWS
    monkeypatch.setenv("TOKENLOOM_FP8_GEMV", "0")
    assert Fp8Kernel(weight, scales).gemv_rows == 0


def test_scales_the_kernel_cannot_read_are_refused():
    xq, x_scales, weight, w_scales, _ = _operands(2, 16, 64)
    with pytest.raises(AssertionError):  # a strided view: the kernel reads element i at i
        fp8_gemv(xq, x_scales, weight, torch.ones(16, 2)[:, :1], None, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with fp8 (sm_89+)")
@pytest.mark.parametrize("m", [1, GEMV_ROWS])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_fp8_gemv_through_the_kernel_on_llama_shapes_gpu(monkeypatch, m, n, k):
    from tokenloom.config import EngineConfig
    from tokenloom.plugins.models.layers import Linear
    from tokenloom.plugins.quant.fp8 import Fp8Quant

    monkeypatch.setenv("TOKENLOOM_FP8_GEMV", "1")
    torch.manual_seed(0)
    layer = Linear(k, (n,), False, torch.bfloat16).cuda()
    torch.nn.init.normal_(layer.weight, std=k**-0.5)
    kernel = Fp8Quant(EngineConfig()).make_kernel(layer)

    def not_this_path(*args):
        raise AssertionError("rows this few must take the GEMV")

    monkeypatch.setattr(torch, "_scaled_mm", not_this_path)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = kernel.apply(x, None).float()
    ref = kernel.reference(x, None).float()
    # the same operands: only fp32 summation order and the bf16 output rounding differ
    assert float((got - ref).norm() / ref.norm()) < 5e-3
