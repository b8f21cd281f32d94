"""The whole-weight dequantization (``kernels/dequant.py``) equals the reference
dequantization bit for bit, and ``weight_gemm`` through it (the ``dequant`` tiling:
dequantize, then ``F.linear``) equals the dequantized linear; tiny shapes in the
interpreter, Llama-3-8B shapes and the PTX path on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.plugins.quant.int4 import dequantize_int4, quantize_int4
from tokenloom.plugins.quant.int8 import dequantize_int8, quantize_int8
from tokenloom.plugins.quant.kernels import dequant
from tokenloom.plugins.quant.kernels.dispatch import candidates
from tokenloom.plugins.quant.kernels.weight_gemm import GemmConfig, weight_gemm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="interpreter")),
]
DEQUANT = GemmConfig(0, 0, 0, dequant=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "group"), [(72, 320, 64), (40, 96, 64), (64, 256, 128)])
def test_int4_is_the_reference_bit_for_bit(dtype, n, k, group):
    # (40, 96, 64): N and K not multiples of the 64-wide tile, a partial last group
    torch.manual_seed(0)
    q, s, z = quantize_int4(torch.randn(n, k, device=DEVICE).to(dtype), group)
    assert torch.equal(
        dequant.dequantize_into(q, s, z, 4, group, dtype), dequantize_int4(q, s, z, group, dtype)
    )
    no_zeros = dequantize_int4(q, s, torch.zeros_like(z), group, dtype)
    assert torch.equal(dequant.dequantize_into(q, s, None, 4, group, dtype), no_zeros)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_is_the_reference_bit_for_bit(dtype):
    torch.manual_seed(0)
    q, s = quantize_int8(torch.randn(72, 100, device=DEVICE))  # K not a multiple of 64
    assert torch.equal(
        dequant.dequantize_into(q, s, None, 8, 0, dtype), dequantize_int8(q, s, dtype)
    )


def test_one_scratch_buffer_grows_and_is_reused():
    torch.manual_seed(0)
    device = torch.device(DEVICE)
    dequant.release(torch.float32, device)
    q2, s2, z2 = quantize_int4(torch.randn(32, 128, device=DEVICE), 64)
    small = dequant.dequantize_into(q2, s2, z2, 4, 64, torch.float32)
    assert dequant.reserve(1, torch.float32, device).numel() == 32 * 128
    q, s, z = quantize_int4(torch.randn(64, 256, device=DEVICE), 64)
    big = dequant.dequantize_into(q, s, z, 4, 64, torch.float32)  # grows it
    buf = dequant.reserve(10, torch.float32, device)
    assert buf.numel() == 64 * 256 and big.data_ptr() == buf.data_ptr()
    assert torch.equal(big, dequantize_int4(q, s, z, 64, torch.float32))
    again = dequant.dequantize_into(q2, s2, z2, 4, 64, torch.float32)  # fits: reused
    assert again.data_ptr() == buf.data_ptr()
    assert torch.equal(again, dequantize_int4(q2, s2, z2, 64, torch.float32))
    assert not torch.equal(big, dequantize_int4(q, s, z, 64, torch.float32))  # overwritten
    assert small.data_ptr() != buf.data_ptr()
    dequant.release(torch.float32, device)
    assert dequant.reserve(1, torch.float32, device).numel() == 1  # released: a new one
    if device.type == "cuda":  # "cuda" and the tensors' "cuda:0" name one buffer
        indexed = torch.device("cuda", torch.cuda.current_device())
        assert dequant.reserve(1, torch.float32, indexed) is dequant.reserve(
            1, torch.float32, device
        )
        dequant.release(torch.float32, indexed)
        assert dequant.reserve(2, torch.float32, device).numel() == 2


@pytest.mark.parametrize(("bits", "group"), [(4, 64), (8, 0), (4, 32)])
def test_weight_gemm_through_the_dequantized_weight(bits, group):
    # groups of 32 cannot be served (tiles are 64 wide): weight_gemm falls back
    assert DEQUANT.fits(bits, group) == (group != 32)
    torch.manual_seed(0)
    w = torch.randn(48, 192, device=DEVICE) / 192**0.5
    if bits == 8:
        (q, s), z = quantize_int8(w), None
        ref_w = dequantize_int8(q, s, torch.float64)
    else:
        q, s, z = quantize_int4(w, group)
        ref_w = dequantize_int4(q, s, z, group, torch.float64)
    x = torch.randn(5, 192, device=DEVICE)
    b = torch.randn(48, device=DEVICE)
    got = weight_gemm(x, q, s, z, bits, group, b, DEQUANT)
    expected = F.linear(x.double(), ref_w, b.double())
    assert float((got.double() - expected).norm() / expected.norm()) < 1e-5


def test_offered_by_default_to_the_largest_bucket_and_off_when_asked(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_WEIGHT_DEQUANT", "0")
    assert not any(c.dequant for i in range(5) for c in candidates(i, 4096, 4096, 4, 128, 132))
    monkeypatch.delenv("TOKENLOOM_WEIGHT_DEQUANT", raising=False)
    assert any(c.dequant for c in candidates(4, 4096, 4096, 4, 128, 132))
    assert any(c.dequant for c in candidates(4, 4096, 4096, 8, 0, 132))
    assert not any(c.dequant for c in candidates(3, 4096, 4096, 4, 128, 132))
    assert not any(c.dequant for c in candidates(4, 4096, 4096, 4, 32, 132))
    # not for an LM head's size (128k x 4,096: 1 GB of 16-bit scratch)
    assert not any(c.dequant for c in candidates(4, 128256, 4096, 4, 128, 132))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_dequantized_linear_on_llama_shapes_gpu(bits, n, k):
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda") / k**0.5
    if bits == 8:
        (q, s), z, group = quantize_int8(w), None, 0
        ref_w = dequantize_int8(q, s, torch.bfloat16)
    else:
        group = 128
        q, s, z = quantize_int4(w.to(torch.bfloat16), group)
        ref_w = dequantize_int4(q, s, z, group, torch.bfloat16)
    assert torch.equal(dequant.dequantize_into(q, s, z, bits, group, torch.bfloat16), ref_w)
    x = torch.randn(1024, k, device="cuda", dtype=torch.bfloat16)
    got = weight_gemm(x, q, s, z, bits, group, None, DEQUANT)
    expected = F.linear(x, ref_w.contiguous())
    assert torch.equal(got, expected)  # the same cuBLAS call on the same 16-bit weight
