"""The int4 GEMV over two or four rows of ``x`` per program (decode batches of a few
rows): each weight tile is loaded and turned into floats once, then one FMA per row.
Launched by ``weight_gemv.launch_gemv`` where the tuner chose ``rows > 1``; the same
layout (``[K / 8, N]``), arguments and conversions (``gemv_weights``) as the one-row
kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenloom.plugins.quant.kernels.gemv_weights import (
    first_tile,
    nibble_floats,
    weight_rows,
    word_row_groups,
)


@triton.jit
def _row_x(x_ptr, row, stride_xm, offs, mask, M):
    """Row ``row`` of ``x`` at ``offs`` as fp32 (zeros past the last row)."""
    ok = mask & ((offs * 0 + row) < M)  # the row test as a tensor: the interpreter needs it
    return tl.load(x_ptr + row.to(tl.int64) * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _row_store(
    y_ptr,
    acc,
    row,
    M,
    pid_k,
    offs_n,
    mask_n,
    s_ptr,
    b_ptr,
    stride_ym,
    stride_ysplit,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    out = tl.sum(acc, axis=0)
    if GROUP == 0:
        out = out * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    mask = mask_n & ((offs_n * 0 + row) < M)
    if not PARTIAL:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + pid_k * stride_ysplit + row * stride_ym + offs_n, out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _weight_gemv_rows_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    K_CHUNK,
    stride_xm,
    stride_ym,
    stride_ysplit,
    nibble,
    BITS: tl.constexpr,  # 4 (int8 has no GEMV over [K, N])
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    ROWS: tl.constexpr,  # 2 or 4 rows of x per program
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``_weight_gemv_kernel`` for two or four rows of ``x`` at once (a few decode
    rows): each weight tile is loaded and turned into floats once, then one FMA per
    row. The rows are spelt out, one 2-D accumulator each (a 3-D ``[rows, k, n]``
    tile compiled to four times the logic ops and register spills)."""
    tl.static_assert(BITS == 4, "the GEMV serves int4 only")
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r0 = tl.program_id(2) * ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc0 = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    k_begin = pid_k * K_CHUNK
    k_end = tl.minimum(K, k_begin + K_CHUNK)
    tile = first_tile(qw_ptr, k_begin, k_end, offs_n, mask_n, N, BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mask_kw = kw < k_end // 8
        tile_next = weight_rows(qw_ptr, kw + BLOCK_K // 8, k_end // 8, offs_n, mask_n, N)
        high = tile >> 12
        part0 = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
        part1 = tl.zeros_like(part0)
        part2 = tl.zeros_like(part0)
        part3 = tl.zeros_like(part0)
        xs0 = tl.zeros([BLOCK_K // 8], tl.float32)
        xs1 = tl.zeros_like(xs0)
        xs2 = tl.zeros_like(xs0)
        xs3 = tl.zeros_like(xs0)
        for j in tl.static_range(8):
            qj = nibble_floats(tile, high, nibble, j)
            x0 = _row_x(x_ptr, r0, stride_xm, kw * 8 + j, mask_kw, M)
            x1 = _row_x(x_ptr, r0 + 1, stride_xm, kw * 8 + j, mask_kw, M)
            part0 += qj * x0[:, None]
            part1 += qj * x1[:, None]
            xs0 += x0
            xs1 += x1
            if ROWS == 4:
                x2 = _row_x(x_ptr, r0 + 2, stride_xm, kw * 8 + j, mask_kw, M)
                x3 = _row_x(x_ptr, r0 + 3, stride_xm, kw * 8 + j, mask_kw, M)
                part2 += qj * x2[:, None]
                part3 += qj * x3[:, None]
                xs2 += x2
                xs3 += x3
        if GROUP == 0:
            acc0 += part0
            acc1 += part1
            acc2 += part2
            acc3 += part3
        else:
            if GROUP >= BLOCK_K:  # the tile lies in one group
                g = (k0 // GROUP) * N + offs_n
                s = tl.load(s_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            else:  # groups smaller than the tile: the scale of each word row
                s = word_row_groups(s_ptr, kw, mask_kw, offs_n, mask_n, N, GROUP)
            if HAS_ZEROS:
                if GROUP >= BLOCK_K:
                    z = tl.load(z_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                else:
                    z = word_row_groups(z_ptr, kw, mask_kw, offs_n, mask_n, N, GROUP)
                acc0 += s * (part0 - z * xs0[:, None])
                acc1 += s * (part1 - z * xs1[:, None])
                if ROWS == 4:
                    acc2 += s * (part2 - z * xs2[:, None])
                    acc3 += s * (part3 - z * xs3[:, None])
            else:
                acc0 += s * part0
                acc1 += s * part1
                acc2 += s * part2
                acc3 += s * part3
        tile = tile_next
    args = (
        M,
        pid_k,
        offs_n,
        mask_n,
        s_ptr,
        b_ptr,
        stride_ym,
        stride_ysplit,
        GROUP,
        HAS_BIAS,
        PARTIAL,
    )
    _row_store(y_ptr, acc0, r0, *args)
    _row_store(y_ptr, acc1, r0 + 1, *args)
    if ROWS == 4:
        _row_store(y_ptr, acc2, r0 + 2, *args)
        _row_store(y_ptr, acc3, r0 + 3, *args)
