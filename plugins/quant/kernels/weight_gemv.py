"""A Triton GEMV for weight-only quantized linears at one to a few rows (decode).

``weight_gemm``'s tiles feed ``tl.dot``: at one row they pad the batch to 16 and
convert every weight to the activation dtype first (integer to float conversions run
at a quarter of the FMA rate), so a batch-1 decode of int4 Llama-3-8B ran slower
than bf16 (issue 12). Here each program streams a ``[BLOCK_K, BLOCK_N]`` slice of
the weight for ONE row of ``x`` and does the dot products with plain FMAs:

- int4 nibbles become floats without a conversion instruction: OR-ing a value
  ``q < 2^23`` into the mantissa of ``2^23`` (``0x4B000000``) gives the float
  ``2^23 + q`` exactly, and one subtraction leaves ``q``;
- int8 the same way after a sign-preserving offset (``q + 128``);
- per group, ``sum_k (q - z) s x = s (sum_k q x - z sum_k x)``: the zero point and the
  scale are applied once per ``[group, BLOCK_N]`` tile, not per weight;
- the FMAs accumulate ``[BLOCK_K / 8, BLOCK_N]`` (int8: ``[BLOCK_K, BLOCK_N]``)
  partial products over the whole K range and reduce across rows once, at the end
  (a reduction per tile, through shared memory, held the first version at 20-45% of
  the bandwidth on the H200).

Same layouts and arguments as ``weight_gemm`` (``qweight [K / 8, N]`` int32 for int4,
``[K, N]`` int8 for int8; scales per group or per channel). The grid is ``(N tiles,
K splits, rows)``; split ``K`` writes fp32 partial sums that the caller adds. Which
tiling (or ``weight_gemm``'s) a layer runs is measured per shape (``dispatch``).
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)  # the bits of 2.0 ** 23 in fp32
MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def _weight_rows(qw_ptr, rows, limit, offs_n, mask_n, N):
    """``qweight[rows, offs_n]`` (zeros from row ``limit`` on): int8 weights, or the
    int4 words that pack eight rows each."""
    return tl.load(
        qw_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
        mask=(rows < limit)[:, None] & mask_n[None, :],
        other=0,
    )


@triton.jit
def _first_tile(
    qw_ptr, k_begin, k_end, offs_n, mask_n, N, BITS: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The weights of the split's first ``BLOCK_K`` rows (the register double buffer's
    first fill)."""
    if BITS == 8:
        return _weight_rows(qw_ptr, k_begin + tl.arange(0, BLOCK_K), k_end, offs_n, mask_n, N)
    else:
        kw = k_begin // 8 + tl.arange(0, BLOCK_K // 8)
        return _weight_rows(qw_ptr, kw, k_end // 8, offs_n, mask_n, N)


@triton.jit
def _int8_floats(q):
    """int8 weights as floats: offset by 128 into the mantissa of 2^23, then back."""
    return ((q.to(tl.int32) + (MAGIC + 128)).to(tl.float32, bitcast=True)) - (MAGIC_F + 128.0)


@triton.jit
def _nibble_floats(words, high, nibble, j: tl.constexpr):
    """Nibble ``j`` of each word as a float. It sits at bit p = 4j (j < 5) or, in
    ``high = words >> 12``, at 4j - 12 (j >= 5): p <= 16 either way. OR-ed under the
    exponent of 2^(23 - p) it reads as the float 2^(23 - p) + q exactly, so a weight
    costs one logic op (and + or), one subtraction and one FMA, without a shift.
    ``nibble`` is 0xF passed at run time: a constant mask was re-materialised by a
    move before every use."""
    if j < 5:
        bits = (words & (nibble << (4 * j))) | ((150 - 4 * j) << 23)
        return bits.to(tl.float32, bitcast=True) - (2.0 ** (23 - 4 * j))
    else:
        bits = (high & (nibble << (4 * j - 12))) | ((162 - 4 * j) << 23)
        return bits.to(tl.float32, bitcast=True) - (2.0 ** (35 - 4 * j))


@triton.jit
def _weight_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    K_CHUNK,  # K range of one split, a multiple of BLOCK_K
    stride_xm,
    stride_ym,
    stride_ysplit,
    nibble,  # 0xF, passed at run time: the masks stay in registers, not in per-use moves
    BITS: tl.constexpr,
    GROUP: tl.constexpr,  # 0: one scale per output channel (applied at the end)
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # int4 with groups: divides GROUP (a tile lies in one group)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    # Partial products stay 2-D across the whole K loop: one cross-thread reduction at
    # the end instead of one per tile.
    if BITS == 8:
        acc2 = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
    k_begin = pid_k * K_CHUNK
    k_end = tl.minimum(K, k_begin + K_CHUNK)
    # The next tile's weights are loaded before this one's FMAs (a register double
    # buffer): at one row a program holds too few bytes in flight to cover the memory
    # latency otherwise.
    tile = _first_tile(qw_ptr, k_begin, k_end, offs_n, mask_n, N, BITS, BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if BITS == 8:
            ks = k0 + tl.arange(0, BLOCK_K)
            mask_k = ks < k_end
            x = tl.load(x_row + ks, mask=mask_k, other=0.0).to(tl.float32)
            tile_next = _weight_rows(qw_ptr, ks + BLOCK_K, k_end, offs_n, mask_n, N)
            w = _int8_floats(tile)
            acc2 += w * x[:, None]
            tile = tile_next
        else:
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            mask_kw = kw < k_end // 8
            tile_next = _weight_rows(qw_ptr, kw + BLOCK_K // 8, k_end // 8, offs_n, mask_n, N)
            high = tile >> 12
            part = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
            xs = tl.zeros([BLOCK_K // 8], tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_row + kw * 8 + j, mask=mask_kw, other=0.0).to(tl.float32)
                qj = _nibble_floats(tile, high, nibble, j)
                part += qj * xj[:, None]
                xs += xj
            if GROUP == 0:
                acc2 += part
            else:  # per word row: s (sum_j q x - z sum_j x); the tile lies in one group
                g = (k0 // GROUP) * N + offs_n
                s = tl.load(s_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                if HAS_ZEROS:
                    z = tl.load(z_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                    acc2 += s * (part - z * xs[:, None])
                else:
                    acc2 += s * part
            tile = tile_next
    acc = tl.sum(acc2, axis=0)
    if GROUP == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(y_ptr + pid_k * stride_ysplit + row * stride_ym + offs_n, acc, mask=mask_n)


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
    BITS: tl.constexpr,
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
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r0 = tl.program_id(2) * ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if BITS == 8:
        acc0 = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    k_begin = pid_k * K_CHUNK
    k_end = tl.minimum(K, k_begin + K_CHUNK)
    tile = _first_tile(qw_ptr, k_begin, k_end, offs_n, mask_n, N, BITS, BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if BITS == 8:
            ks = k0 + tl.arange(0, BLOCK_K)
            mask_k = ks < k_end
            tile_next = _weight_rows(qw_ptr, ks + BLOCK_K, k_end, offs_n, mask_n, N)
            w = _int8_floats(tile)
            acc0 += w * _row_x(x_ptr, r0, stride_xm, ks, mask_k, M)[:, None]
            acc1 += w * _row_x(x_ptr, r0 + 1, stride_xm, ks, mask_k, M)[:, None]
            if ROWS == 4:
                acc2 += w * _row_x(x_ptr, r0 + 2, stride_xm, ks, mask_k, M)[:, None]
                acc3 += w * _row_x(x_ptr, r0 + 3, stride_xm, ks, mask_k, M)[:, None]
            tile = tile_next
        else:
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            mask_kw = kw < k_end // 8
            tile_next = _weight_rows(qw_ptr, kw + BLOCK_K // 8, k_end // 8, offs_n, mask_n, N)
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
                qj = _nibble_floats(tile, high, nibble, j)
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
                g = (k0 // GROUP) * N + offs_n
                s = tl.load(s_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                if HAS_ZEROS:
                    z = tl.load(z_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
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


ROWS_PER_PROGRAM = (1, 2, 4)  # the row counts the kernels spell out


def gemv_fits(bits: int, group: int, block_k: int, has_zeros: bool, rows: int = 1) -> bool:
    """Whether the GEMV serves this format with this ``BLOCK_K`` and ``rows`` per
    program: int4 groups must hold whole tiles; per-channel int4 with zero points is
    not a format we store; other row counts would leave rows unwritten."""
    if rows not in ROWS_PER_PROGRAM:
        return False
    if bits == 8:
        return group == 0 and not has_zeros
    if group == 0:
        return not has_zeros and block_k % 8 == 0
    return group % block_k == 0 and block_k % 8 == 0


def launch_gemv(x, qweight, scales, zeros, bits, group, bias, y, m, n, k, k_chunk, split, cfg):
    """Run the kernel into ``y`` (``[m, n]``, or ``[split, m, n]`` fp32 when split);
    ``cfg.rows > 1`` takes that many rows of ``x`` per program."""
    rows = cfg.rows if m > 1 else 1
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, rows))
    common = (
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,
        bias if bias is not None else scales,
        y,
    )
    strides = (k, k_chunk, x.stride(0), n, y.stride(0) if split > 1 else 0, 0xF)
    flags = dict(
        BITS=bits,
        GROUP=group,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None and split == 1,
        PARTIAL=split > 1,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if rows == 1:
        _weight_gemv_kernel[grid](*common, n, *strides, **flags)
    else:
        _weight_gemv_rows_kernel[grid](*common, m, n, *strides, ROWS=rows, **flags)
