"""The dot-tile GEMM for weight-only quantized linears, ``y = x @ W^T (+ bias)`` with
``W`` stored as int8 (W8A16) or packed int4 (W4A16) and dequantized inside the kernel,
for batches past the GEMVs' (``weight_gemm`` chooses; this module holds the kernel, its
launch and the split-K sum).

One logical layout serves both widths: the transposed matrix, ``qweight [K / P, N]``
with ``P`` values per element (int8: ``P = 1``, one int8 each; int4: ``P = 8``, packed
in an int32 whose nibble ``j`` holds row ``8 i + j``, GPTQ's layout). A tile of
``[BLOCK_K, BLOCK_N]`` weights is then a plain 2-D load along ``N`` (coalesced), and
the int4 nibbles come out by shifting each word by ``4 * (k % 8)``. int8 is stored
``[N, K]`` since session 16 (``qweight`` the transposed view): decode batches run
``int8_gemv_nk`` on it, and the dot tiles read it through its strides (a contiguous
``[K, N]`` int8 weight runs the dot tiles: its GEMVs went with kernels v14). int4 may be
stored row-major per output channel too (``int4_tiles.int4_row_major``: the transposed
view of a contiguous ``[N, K / 8]``): the dot tiles and the dequantization read it
through its strides, and one row runs ``int4_gemv_nk`` on it (session 17).

Scales: per output channel (``group = 0``: ``scales [1, N]``, applied once to the
accumulator) or per group of ``group`` input rows (``scales [G, N]``, optional
``zeros [G, N]``; ``w = (q - z) * s``, applied per element before the dot; the last
group may be partial when ``K`` is no multiple of ``group``).

int4 with ``kmajor`` builds the tile ``[N, K]`` (``int4_tiles.kmajor_tile``), and with
``swap`` computes ``out^T = W x^T``. Its PTX path rounds ``m + z`` and ``s`` to the
activations' 16-bit dtype: exact for what every loader here produces (integer zero
points 0-15, scales in the model dtype), and only then bit-identical to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig
from tokenloom.plugins.quant.kernels.int4_tiles import (
    dequant_asm_ok,
    kmajor_tile,
    word_offsets,
    word_rows,
)


@triton.jit(do_not_specialize=["M"])
def _weight_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    KQ,  # qweight's rows, K / 8 for int4 (its divisibility known, unlike K // 8's)
    K_CHUNK,  # K range of one split, a multiple of BLOCK_K
    stride_xm,
    stride_ym,
    stride_ysplit,
    stride_qk,  # the weights' strides as [K', N] (N, 1; or 1, K' when stored [N, K'])
    stride_qn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,  # 0: one scale per output channel
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split K: write fp32 partial sums
    EXPAND: tl.constexpr,
    KMAJOR: tl.constexpr,  # int4, one group per tile: the tile built [N, K] (see below)
    DEQUANT_ASM: tl.constexpr,  # KMAJOR: dequantize two values per instruction (PTX)
    SWAP: tl.constexpr,  # KMAJOR: the weights as the MMA's first operand
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    if SWAP:  # out^T = W x^T: the weights are the MMA's A operand, from registers
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin = pid_k * K_CHUNK
    k_end = tl.minimum(K, k_begin + K_CHUNK)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        if KMAJOR:
            # The tile is built transposed, [BLOCK_N, BLOCK_K]: each thread unpacks a
            # word into 8 consecutive K values, so the dequantized tile goes to shared
            # memory (K-major, as the MMA reads a transposed operand) in 16-byte
            # stores; built [K, N] it went out as one 2-byte store per value.
            w_t = kmajor_tile(
                qw_ptr,
                s_ptr,
                z_ptr,
                k0,
                offs_n,
                mask_n,
                N,
                KQ,
                stride_qk,
                stride_qn,
                x,
                GROUP,
                HAS_ZEROS,
                DEQUANT_ASM,
                BLOCK_K,
            )
            if SWAP:
                acc += tl.dot(w_t, tl.trans(x), input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(x, tl.trans(w_t), input_precision=DOT_PRECISION)
        else:
            if BITS == 8:
                q = tl.load(
                    qw_ptr
                    + ks[:, None].to(tl.int64) * stride_qk
                    + offs_n[None, :].to(tl.int64) * stride_qn,
                    mask=mask_w,
                    other=0,
                )
            elif EXPAND:  # each word loaded once, its 8 nibbles laid out as 8 rows
                kw = word_rows(k0, BLOCK_K)
                mask_kw = (kw < KQ)[:, None] & mask_n[None, :]
                words = tl.load(
                    qw_ptr + word_offsets(kw[:, None], offs_n[None, :], stride_qk, stride_qn),
                    mask=mask_kw,
                    other=0,
                )
                nibbles = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
                q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N))
                # a nibble OR-ed into the mantissa of 2^23 reads as the float 2^23 + q: no
                # integer-to-float conversion (a quarter-rate instruction on the H200; the
                # zero point below takes the 2^23 back, exactly: every int4 format here
                # stores integer zero points)
                q_magic = (q | 0x4B000000).to(tl.float32, bitcast=True)
            else:  # each word gathered by the 8 rows it holds
                words = tl.load(
                    qw_ptr
                    + word_offsets((ks // 8)[:, None], offs_n[None, :], stride_qk, stride_qn),
                    mask=mask_w,
                    other=0,
                )
                q = (words >> ((ks % 8) * 4)[:, None]) & 0xF
            if GROUP == 0:  # the channel's scale comes after the loop
                w = q.to(x.dtype)
            elif EXPAND and BLOCK_K <= GROUP:  # the tile lies in one group
                g = (k0 // GROUP) * N + offs_n
                s = tl.load(s_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                if HAS_ZEROS:
                    z = tl.load(z_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                else:
                    z = tl.zeros([1, BLOCK_N], tl.float32)
                w = ((q_magic - (z + 8388608.0)) * s).to(x.dtype)
            elif EXPAND:  # BLOCK_K // GROUP whole groups
                gs = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                g = gs[:, None] * N + offs_n[None, :]
                mask_g = (gs * GROUP < K)[:, None] & mask_n[None, :]
                s = tl.load(s_ptr + g, mask=mask_g, other=0.0).to(tl.float32)
                q3 = tl.reshape(q_magic, (BLOCK_K // GROUP, GROUP, BLOCK_N))
                if HAS_ZEROS:
                    z = tl.load(z_ptr + g, mask=mask_g, other=0.0).to(tl.float32)
                    q3 = q3 - (z[:, None, :] + 8388608.0)
                else:
                    q3 = q3 - 8388608.0
                w = tl.reshape(q3 * s[:, None, :], (BLOCK_K, BLOCK_N)).to(x.dtype)
            else:  # any nesting: the group of every row
                g = (ks // GROUP)[:, None] * N + offs_n[None, :]
                s = tl.load(s_ptr + g, mask=mask_w, other=0.0).to(tl.float32)
                if HAS_ZEROS:
                    z = tl.load(z_ptr + g, mask=mask_w, other=0.0).to(tl.float32)
                    w = ((q.to(tl.float32) - z) * s).to(x.dtype)
                else:
                    w = (q.to(tl.float32) * s).to(x.dtype)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    if GROUP == 0:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc * s[None, :]
    mask_y = mask_m[:, None] & mask_n[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_y)
    else:  # fp32 partial sums, added on the host side of the launch
        y = y_ptr + pid_k * stride_ysplit + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y, acc, mask=mask_y)


@triton.jit
def _split_sum_kernel(
    y_ptr, b_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """``out = sum_s y[s] (+ bias)`` in ``out``'s dtype: the split-K partial sums
    reduced, biased and cast in one launch (torch took two or three, each a few
    microseconds of a decode step's launch budget per layer)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(y_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group: int,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    m: int,
    n: int,
    k: int,
    k_chunk: int,
    split: int,
    cfg: GemmConfig,
) -> None:
    """The dot tile over ``x [M, K]`` into ``y`` (``[M, N]`` in ``x``'s dtype, or with
    ``split > 1`` ``[split, M, N]`` fp32 partial sums of ``k_chunk`` rows each, for
    ``split_sum``), with ``cfg``'s tiles."""
    stride_split = y.stride(0) if split > 1 else 0
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    _weight_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,
        bias if bias is not None else scales,
        y,
        m,
        n,
        k,
        qweight.shape[0],
        k_chunk,
        x.stride(0),
        n,
        stride_split,
        qweight.stride(0),
        qweight.stride(1),
        BITS=bits,
        GROUP=group,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None and split == 1,
        PARTIAL=split > 1,
        EXPAND=cfg.expand and bits == 4 and cfg.fits(bits, group),
        KMAJOR=cfg.kmajor_fits(bits, group),
        DEQUANT_ASM=cfg.kmajor_fits(bits, group) and dequant_asm_ok(x),
        SWAP=cfg.swap and cfg.kmajor_fits(bits, group),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def split_sum(y: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out [M, N] = sum_s y[s] (+ bias)``: ``y [split, M, N]`` fp32 partial sums."""
    split, m, n = y.shape
    block = 1024
    _split_sum_kernel[(triton.cdiv(m * n, block),)](
        y,
        bias if bias is not None else y,
        out,
        m * n,
        n,
        SPLIT=split,
        HAS_BIAS=bias is not None,
        BLOCK=block,
    )
    return out
