"""A Triton GEMM for skinny activations (a few rows: small-batch decode).

``y = x @ w.T`` with ``x`` of at most ``BLOCK_M`` (16) rows: each program owns
``BLOCK_N`` output columns and streams its ``[BLOCK_N, K]`` slice of the weight
through ``K`` in ``BLOCK_K`` tiles (rows of ``x`` padded to 16 for ``tl.dot``).
Decode at small batch is a pure weight stream, and for the narrower projections
(attention in and out) cuBLAS's choice reaches ~75% of the copy bandwidth on an
H200 while wider tiles streamed this way do better. ``skinny_dispatch.SkinnyDispatch``
measures both on the actual shapes at start-up and keeps the faster per shape (this
module holds the kernels only).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import (
    early_release,
    launch_options,
    release,
    release_early,
    wait,
)

MAX_ROWS = 16
# (BLOCK_N, BLOCK_K, num_warps, num_stages): candidates measured per shape.
CONFIGS = [(16, 512, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 3), (16, 1024, 4, 3)]


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    mask_m = offs_m[:, None] < M
    # the first tile of the weight before the wait (PDL: while the kernel before runs)
    if EVEN:
        w = tl.load(w_rows + offs_k[None, :])
    else:
        mask_w = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_w, other=0.0)
    wait(USE_PDL)
    release(USE_PDL)
    x = tl.load(x_rows + offs_k[None, :], mask=mask_m & (offs_k[None, :] < K), other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k[None, :]
        if EVEN:
            w = tl.load(w_rows + ks)
            x = tl.load(x_rows + ks, mask=mask_m, other=0.0)
        else:
            w = tl.load(w_rows + ks, mask=(offs_n[:, None] < N) & (ks < K), other=0.0)
            x = tl.load(x_rows + ks, mask=mask_m & (ks < K), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m & (offs_n[None, :] < N))


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    config: tuple[int, int, int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x`` [M <= 16, K] and ``w`` [N, K], last dims
    contiguous."""
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, warps, stages = config
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        bias if bias is not None else w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN=n % block_n == 0 and k % block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        HAS_BIAS=bias is not None,
        num_warps=warps,
        num_stages=stages,
        **launch_options(x.device),
    )
    return y


# The one-row GEMV: (BLOCK_N, BLOCK_K, num_warps), measured per shape against the
# faster of cuBLAS and the skinny GEMM at one row.
GEMV_VERSION = 1  # part of its tuning key: bump when the kernel or its configs change
GEMV_CONFIGS = [(8, 512, 4), (16, 512, 4), (8, 1024, 4), (16, 256, 4), (4, 1024, 4)]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr = False,  # release before the wait (pdl.next_reads_weights_first)
):
    """``y = w @ x`` for one row ``x [K]``: each program streams ``[BLOCK_N, K]`` of the
    weight with plain FMAs into ``[BLOCK_N, BLOCK_K]`` fp32 partial sums (reduced once,
    at the end), the next tile loaded before this one's FMAs (a register double
    buffer). No padding of the row to 16 for ``tl.dot``; with PDL the first tile
    streams while the kernel before finishes."""
    if EARLY:
        release_early(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n[:, None] < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    w = tl.load(w_rows + offs_k[None, :], mask=mask_n & (offs_k[None, :] < K), other=0.0)
    wait(USE_PDL)
    if not EARLY:
        release(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        nxt = ks[None, :] + BLOCK_K
        w_next = tl.load(w_rows + nxt, mask=mask_n & (nxt < K), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    config: tuple[int, int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for one row ``x [1, K]`` and ``w [N, K]``, last dims
    contiguous."""
    n, k = w.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and w.stride(1) == 1
    block_n, block_k, warps = config
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        bias if bias is not None else w,
        y,
        n,
        k,
        w.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=warps,
        EARLY=early_release(),
        **launch_options(x.device),
    )
    return y


def gemv_offered() -> bool:
    """``TOKENLOOM_BF16_GEMV=0`` keeps the one-row GEMV out of the choice."""
    return os.environ.get("TOKENLOOM_BF16_GEMV", "1") != "0"
