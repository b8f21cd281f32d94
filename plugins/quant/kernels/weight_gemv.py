"""A Triton GEMV for int4 weight-only quantized linears stored ``[K / 8, N]``, at one to a
few rows (decode).

``weight_gemm``'s tiles feed ``tl.dot``: at one row they pad the batch to 16 and
convert every weight to the activation dtype first (integer to float conversions run
at a quarter of the FMA rate), so a batch-1 decode of int4 Llama-3-8B ran slower
than bf16 (issue 12). Here each program streams a ``[BLOCK_K, BLOCK_N]`` slice of
the weight for ONE row of ``x`` and does the dot products with plain FMAs:

- the weights become floats without conversion instructions (``gemv_weights``: OR-ed
  into the mantissa of a power of two; PTX on a GPU for the biased nibbles);
- per group, ``sum_k (q - z) s x = s (sum_k q x - z sum_k x)``: the zero point and the
  scale are applied once per word row of eight weights, not per weight (one scale row
  per tile where the tile lies in one group; groups smaller than the tile, such as
  llama.cpp's 32, load the scales and zeros of each word row);
- the FMAs accumulate ``[BLOCK_K / 8, BLOCK_N]`` partial products over the whole K
  range and reduce across rows once, at the end (a reduction per tile, through shared
  memory, held the first version at 20-45% of the bandwidth on the H200);
- split K: the one-row kernel sums its splits itself (the last split of each tile to
  finish, ``_reduce_splits``); the rows kernel (``weight_gemv_rows``) writes fp32 partial sums that the
  caller adds.

Same layout and arguments as ``weight_gemm`` for int4 (``qweight [K / 8, N]`` int32;
scales per group or per channel). int8 has no GEMV here: it is stored ``[N, K]`` and
runs ``int8_gemv_nk`` (the int8 GEMVs over ``[K, N]`` went with kernels v14;
``gemv_fits(8, ...)`` is False, so ``weight_gemm`` gives such a tiling a dot tile). The
grid is ``(N tiles, K splits, rows)``. Which tiling (or ``weight_gemm``'s) a layer runs
is measured per shape (``dispatch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import launch_options, release, wait
from tokenloom.plugins.quant.kernels.gemv_weights import (
    biased_word_rows,
    first_tile,
    nibble_floats,
    weight_rows,
    word_row_groups,
)
from tokenloom.plugins.quant.kernels.weight_gemv_rows import _weight_gemv_rows_kernel


@triton.jit
def _gemv_loop(
    x_row,
    qw_ptr,
    s_ptr,
    z_ptr,
    k_begin,
    k_end,
    offs_n,
    mask_n,
    N,
    nibble,
    m8,
    m12,
    m16,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BIASED: tl.constexpr,
    ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The GEMV's K loop over one row of ``x``: ``[BLOCK_N]`` dot products (before
    per-channel scales)."""
    # Partial products stay 2-D across the whole K loop: one cross-thread reduction at
    # the end instead of one per tile.
    acc2 = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
    # The next tile's weights are loaded before this one's FMAs (a register double
    # buffer): at one row a program holds too few bytes in flight to cover the memory
    # latency otherwise.
    tile = first_tile(qw_ptr, k_begin, k_end, offs_n, mask_n, N, BLOCK_K)
    wait(USE_PDL)  # the first weight tile is in flight; x comes from the kernel before
    release(USE_PDL)  # after the wait, as every PDL kernel (pdl.py)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mask_kw = kw < k_end // 8
        tile_next = weight_rows(qw_ptr, kw + BLOCK_K // 8, k_end // 8, offs_n, mask_n, N)
        high = tile >> 12
        part = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
        xs = tl.zeros([BLOCK_K // 8], tl.float32)
        if BIASED:
            part, xs = biased_word_rows(tile, x_row + kw * 8, mask_kw, m8, m12, m16, ASM)
        else:
            for j in tl.static_range(8):
                xj = tl.load(x_row + kw * 8 + j, mask=mask_kw, other=0.0).to(tl.float32)
                part += nibble_floats(tile, high, nibble, j) * xj[:, None]
                xs += xj
        if GROUP == 0:
            acc2 += part
        elif GROUP >= BLOCK_K:  # per word row: s (sum_j q x - z sum_j x); one group
            g = (k0 // GROUP) * N + offs_n
            s = tl.load(s_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HAS_ZEROS:
                z = tl.load(z_ptr + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                acc2 += s * (part - z * xs[:, None])
            else:
                acc2 += s * part
        else:  # groups smaller than the tile: the scale and zero of each word row
            s = word_row_groups(s_ptr, kw, mask_kw, offs_n, mask_n, N, GROUP)
            if HAS_ZEROS:
                z = word_row_groups(z_ptr, kw, mask_kw, offs_n, mask_n, N, GROUP)
                acc2 += s * (part - z * xs[:, None])
            else:
                acc2 += s * part
        tile = tile_next
    return tl.sum(acc2, axis=0)


@triton.jit
def _weight_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    o_ptr,  # REDUCE: the [M, N] output (y_ptr holds the fp32 partial sums)
    cnt_ptr,  # REDUCE: int32 arrival counters, one per (row, N tile), zero (and left zero)
    N,
    K,
    K_CHUNK,  # K range of one split, a multiple of BLOCK_K
    stride_xm,
    stride_ym,
    stride_ysplit,
    nibble,  # 0xF, passed at run time: the masks stay in registers, not in per-use moves
    # int4 with BIASED: 0xF << 8, 12, 16, at run time (derived in the kernel, the
    # compiler turns (w << 12) & (0xF << 12) into ((w & 0xF) << 12): two more ops)
    mask8,
    mask12,
    mask16,
    BITS: tl.constexpr,  # 4 (int8 has no GEMV over [K, N])
    GROUP: tl.constexpr,  # 0: one scale per output channel (applied at the end)
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # with groups: divides GROUP or is a multiple of it
    BIASED: tl.constexpr = False,  # nibble_biased (16-bit activations)
    ASM: tl.constexpr = False,  # PTX (a CUDA GPU): BIASED_ASM
    REDUCE: tl.constexpr = False,  # PARTIAL: the last split to finish a tile sums them
    USE_PDL: tl.constexpr = False,  # plugins/models/pdl.py: weights stream before the wait
    SPLIT: tl.constexpr = 1,  # REDUCE: the number of splits (the grid's second axis)
):
    tl.static_assert(BITS == 4, "the GEMV serves int4 only")
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    k_begin = pid_k * K_CHUNK
    k_end = tl.minimum(K, k_begin + K_CHUNK)
    acc = _gemv_loop(
        x_row,
        qw_ptr,
        s_ptr,
        z_ptr,
        k_begin,
        k_end,
        offs_n,
        mask_n,
        N,
        nibble,
        mask8,
        mask12,
        mask16,
        GROUP,
        HAS_ZEROS,
        BLOCK_N,
        BLOCK_K,
        BIASED,
        ASM,
        USE_PDL,
    )
    if GROUP == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(y_ptr + pid_k * stride_ysplit + row * stride_ym + offs_n, acc, mask=mask_n)
        if REDUCE:
            _reduce_splits(
                y_ptr,
                o_ptr,
                b_ptr,
                cnt_ptr,
                acc,
                row,
                pid_n,
                offs_n,
                mask_n,
                stride_ym,
                stride_ysplit,
                HAS_BIAS,
                SPLIT,
            )


@triton.jit
def _reduce_splits(
    y_ptr,
    o_ptr,
    b_ptr,
    cnt_ptr,
    acc,
    row,
    pid_n,
    offs_n,
    mask_n,
    stride_ym,
    stride_ysplit,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The split-K sum inside the GEMV (no second launch: at batch 1 the split-sum
    kernel was 128 launches and ~0.2 ms of a 3.2 ms int4 step). Each program has stored
    its partial; the barrier orders every thread's store before the one-thread release
    of the counter, and the program that arrives last (acquire) sums every split's
    partial (read from L2, its own too), adds the bias, writes the output and resets
    the counter for the next launch. ``SPLIT`` must be the grid's second axis. Every
    launch on a device shares the counters: they assume one stream (as the engine
    runs), and a launch aborted midway would leave one non-zero."""
    tl.static_assert(SPLIT > 1, "REDUCE needs SPLIT, the number of K splits")
    tl.debug_barrier()
    counter = cnt_ptr + row * tl.num_programs(0) + pid_n
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == SPLIT - 1:
        # every split's partial from memory (this one's too), in split order: the same
        # sum, bit for bit, whichever split arrived last (and as the split-sum
        # kernel's). Unrolled, so the loads are in flight together: a loop over the
        # splits waited on one L2 round trip per split (session 14, one H200: the sum
        # cost ~4 us of a 12 us qkv GEMV at split 8)
        total = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT):
            total += tl.load(
                y_ptr + s * stride_ysplit + row * stride_ym + offs_n,
                mask=mask_n,
                other=0.0,
                cache_modifier=".cg",
            )
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * stride_ym + offs_n, total.to(o_ptr.dtype.element_ty), mask=mask_n)
        tl.atomic_xchg(counter, 0, sem="relaxed")


ROWS_PER_PROGRAM = (1, 2, 4)  # the row counts the kernels spell out


def gemv_fits(bits: int, group: int, block_k: int, has_zeros: bool, rows: int = 1) -> bool:
    """Whether the GEMV serves this format with this ``BLOCK_K`` and ``rows`` per
    program: int4 only (int8 runs ``int8_gemv_nk`` or the dot tiles); groups must hold
    whole tiles, or tiles whole groups of whole words (a multiple of 8 rows); per-channel
    int4 with zero points is not a format we store; other row counts would leave rows
    unwritten."""
    if rows not in ROWS_PER_PROGRAM or bits != 4:
        return False
    if group == 0:
        return not has_zeros and block_k % 8 == 0
    if block_k % 8 != 0:
        return False
    return group % block_k == 0 or (group % 8 == 0 and block_k % group == 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
COUNTERS = 1 << 16  # (row, N tile) pairs one split launch can reduce in the kernel


def reduce_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The zeroed int32 arrival counters of ``_reduce_splits`` on ``device`` (allocated
    once, never inside a CUDA graph capture), or None where ``needed`` exceeds them or
    they do not exist yet during a capture (the caller then sums the splits itself)."""
    device = torch.device(device)
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda":
            with torch.cuda.device(device):  # the capture state of that device's stream
                if torch.cuda.is_current_stream_capturing():
                    return None
        buf = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf if needed <= buf.numel() else None


def launch_gemv(
    x,
    qweight,
    scales,
    zeros,
    bits,
    group,
    bias,
    y,
    m,
    n,
    k,
    k_chunk,
    split,
    cfg,
    biased=None,
    out=None,
    counters=None,
):
    """Run the kernel into ``y`` (``[m, n]``, or ``[split, m, n]`` fp32 when split) for int4
    (``bits`` 4: ``gemv_fits``); ``cfg.rows > 1`` takes that many rows of ``x`` per
    program. One row takes ``nibble_biased`` for 16-bit activations unless ``biased``
    says otherwise. With ``out`` and ``counters`` (one-row kernel, split), the last split
    of each tile sums the partials into ``out`` (with the bias). Returns whether it did."""
    assert bits == 4, "the GEMV serves int4 only"
    if biased is None:
        biased = x.dtype in (torch.bfloat16, torch.float16)
    rows = cfg.rows if m > 1 else 1
    reduce = split > 1 and rows == 1 and out is not None and counters is not None
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
        HAS_BIAS=bias is not None and (split == 1 or reduce),
        PARTIAL=split > 1,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if rows == 1:
        _weight_gemv_kernel[grid](
            *common,
            out if reduce else y,
            counters if reduce else y,
            n,
            *strides,
            0xF << 8,
            0xF << 12,
            0xF << 16,
            **flags,
            BIASED=biased,
            ASM=x.device.type == "cuda",
            REDUCE=reduce,
            SPLIT=split if reduce else 1,
            **launch_options(x.device),
        )
    else:
        _weight_gemv_rows_kernel[grid](*common, m, n, *strides, ROWS=rows, **flags)
    return reduce
