"""What the one-row f16x2 int4 GEMV (``int4_gemv_h2``) uses, and ``int4_gemv_nk`` in part:
whether PTX runs, the range guard's shift, and the epilogue (bias, output or split
partial, the split sum in the kernel)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.quant.kernels.weight_gemv import _reduce_splits


def _ptx(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def ptx_bf16_ok(x: torch.Tensor) -> bool:
    """The PTX path's input: bf16 on sm_90 or later (the PTX scales bf16x2 pairs), 4-byte
    aligned (read as int32 words)."""
    return (
        x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and x.data_ptr() % 4 == 0
    )


@triton.jit
def _range_shift(x_ptr, k_begin, k_end, AMAX_BLOCK: tl.constexpr, HEADROOM: tl.constexpr = 7):
    """``e - HEADROOM`` in [-100, 126] for ``2^e <= max |x[k_begin:k_end]| < 2^(e + 1)``:
    every bit pattern built from it stays valid (zeros: -100), unclamped up to the largest
    x for any HEADROOM >= 1. Elementwise maxima per block, one reduction at the end."""
    amax = tl.zeros([AMAX_BLOCK], tl.float32)
    for a0 in range(k_begin, k_end, AMAX_BLOCK):
        offs = a0 + tl.arange(0, AMAX_BLOCK)
        xa = tl.load(x_ptr + offs, mask=offs < k_end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(xa))
    largest = tl.max(amax, axis=0)
    exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.minimum(tl.maximum(exponent - HEADROOM, -100), 126)


@triton.jit
def store_one_row(
    acc,
    y_ptr,
    o_ptr,
    b_ptr,
    cnt_ptr,
    pid_n,
    pid_k,
    offs_n,
    mask_n,
    N,
    stride_ysplit,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    REDUCE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The one-row f16x2 GEMVs' epilogue: ``acc`` (fp32, scaled) with the bias into the
    output, or as split ``pid_k``'s partial (summed in the kernel with ``REDUCE``)."""
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(y_ptr + pid_k * stride_ysplit + offs_n, acc, mask=mask_n)
        if REDUCE:
            _reduce_splits(
                y_ptr, o_ptr, b_ptr, cnt_ptr, acc, 0, pid_n, offs_n, mask_n, N,
                stride_ysplit, HAS_BIAS, SPLIT,
            )  # fmt: skip
