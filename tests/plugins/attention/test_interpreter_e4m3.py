"""tests/interpreter_e4m3.py: under TRITON_INTERPRET=1, Triton kernels convert to and from
fp8 e4m3 as the GPU does (torch's rounding, saturated at 448; the NaN byte read as NaN)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's conversions only"
)


@triton.jit
def _to_e4m3_and_back(x_ptr, bits_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    e4m3 = tl.load(x_ptr + offs).to(tl.float8e4nv)
    tl.store(bits_ptr + offs, e4m3.to(tl.uint8, bitcast=True))
    tl.store(y_ptr + offs, e4m3.to(tl.float32))


@triton.jit
def _read_e4m3(raw_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(raw_ptr + offs).to(tl.float8e4nv, bitcast=True).to(tl.float32))


def test_e4m3_writes_round_and_saturate_as_the_gpu():
    x = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 1000 - 500
    x[:4] = torch.tensor([124.8, -124.8, 500.0, float("nan")])
    bits, y = torch.empty(4096, dtype=torch.uint8), torch.empty(4096)
    _to_e4m3_and_back[(1,)](x, bits, y, N=4096)
    assert torch.equal(bits, x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert y[0] == 128 and y[1] == -128  # Triton's own interpreter gave 64: a lost carry
    assert y[2] == 448 and torch.isnan(y[3])


def test_e4m3_reads_are_the_gpu_s_nan_included():
    raw = torch.arange(256, dtype=torch.uint8)
    y = torch.empty(256)
    _read_e4m3[(1,)](raw, y, N=256)
    expected = raw.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(expected)
    assert int(nan.sum()) == 2 and torch.equal(torch.isnan(y), nan)  # 0x7F, 0xFF
    assert torch.equal(y[~nan], expected[~nan])
