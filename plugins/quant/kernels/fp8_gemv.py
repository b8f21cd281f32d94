"""An fp8 (W8A8) GEMV for decode batches of a few rows: ``y = (xq sx) @ (w s)^T``.

The fp8 method quantizes each activation row to e4m3 (``per_token_fp8``) and calls
``torch._scaled_mm``, which serves large batches well; at one row the GEMM pads the
batch and reached 0.90x of bf16's batch-1 step on the H200 (docs/quantization.md),
where the int8 GEMV, reading the same bytes, reached 1.29x. This kernel streams the
``[N, K]`` e4m3 weight once per row of ``x``: each program owns ``BLOCK_N`` output
channels of one row, multiplies e4m3 values in fp32 (the product of two e4m3 values
is exact in fp32) with partial sums kept 2-D over the K range and reduced once, then
applies both scales. Same operands and semantics as the reference path
(``Fp8Kernel.reference``: the quantized row times the dequantized weight); only the
order of the fp32 additions differs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import launch_options, release, wait

GEMV_ROWS = 4  # the most rows of x this kernel serves (each row re-reads the weight)


def gemv_offered() -> bool:
    """On by default since it was measured (session 10, one H200: llama-3-8b fp8 batch 1
    5.14 -> 3.98 ms per step); ``TOKENLOOM_FP8_GEMV=0`` turns it off."""
    return os.environ.get("TOKENLOOM_FP8_GEMV", "1") != "0"


@triton.jit
def _fp8_gemv_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_xq,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    # the first weight tile is read before the wait (PDL: while the kernel before runs)
    ks = tl.arange(0, BLOCK_K)
    mask_k = ks < K
    w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    wait(USE_PDL)
    release(USE_PDL)
    xq = tl.load(xq_ptr + row * stride_xq + ks, mask=mask_k, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * xq[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        xq = tl.load(xq_ptr + row * stride_xq + ks, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += w.to(tl.float32) * xq[None, :]
    scale = tl.load(xs_ptr + row) * tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    y = tl.sum(acc, axis=1) * scale
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def fp8_gemv(
    xq: torch.Tensor,
    x_scales: torch.Tensor,
    weight: torch.Tensor,
    w_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    block_n: int = 16,
    block_k: int = 512,
) -> torch.Tensor:
    """``xq [M, K]`` e4m3 with ``x_scales [M, 1]`` fp32, ``weight [N, K]`` e4m3 with
    ``w_scales [N, 1]`` fp32 -> ``[M, N]`` in ``out_dtype``."""
    m, k = xq.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and xq.stride(1) == 1 and weight.stride(1) == 1
    # the kernel reads one fp32 scale per row and per channel, one bias value per channel
    assert x_scales.numel() == m and x_scales.dtype == torch.float32
    assert w_scales.numel() == n and w_scales.dtype == torch.float32
    assert (m == 1 or x_scales.stride(0) == 1) and (n == 1 or w_scales.stride(0) == 1)
    assert bias is None or (bias.numel() == n and bias.stride(-1) == 1)
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    block_k = min(block_k, triton.next_power_of_2(k))
    _fp8_gemv_kernel[(triton.cdiv(n, block_n), m)](
        xq,
        x_scales,
        weight,
        w_scales,
        bias if bias is not None else w_scales,
        y,
        n,
        k,
        xq.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        **launch_options(xq.device),
    )
    return y
