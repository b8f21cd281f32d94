"""Paged decode attention over an fp8 e4m3 KV cache with both products as fp8 MMAs.

The f16 decode kernel (``decode.py``) converts every fp8 key and value to f16 for the
tensor cores: 3.3-3.4 instructions per KV byte on sm_90, where a bf16 cache takes 2.4,
and the fp8 cache's decode attention bounds the fp8 + fp8-KV throughput (57% of its KV
floor at 512 rows; docs/quantization.md). Hopper multiplies fp8 directly (wgmma,
``QGMMA``), but only with 64 rows on the M side and both operands K-major. A group's
query heads (4 for Llama-3-8B) are far from 64 rows, so here the tile's **tokens are M**
and the heads, padded to 16, are N:

    S^T [N, H] = K [N, D] . q^T [D, H]        (K as stored: D contiguous, K-major)
    O^T [D, H] += V^T [D, N] . P'^T [N, H]     (V stored transposed per page: K-major)

- An fp8 cache stores each page's values transposed (``kv_quant.allocate``: ``[heads, D,
  page]``), so that V^T's tokens are contiguous: 16 bytes per (head, d) for pages of 16,
  loaded straight into shared memory.
- q enters as e4m3, each head's row scaled by its own absmax, undone on the scores with
  the keys' per-token scales.
- ``P' = p * v_scale`` per token, as the values' scales require, rounded to e4m3: p is
  taken relative to the tile's own maximum per head (so its largest is 1 in every tile)
  and the values' scales over their largest in the tile (times 448); both are undone on
  the tile's product and sum.
- Whole tiles are read without masks (every token of a tile below the slice's end has a
  block and a written value); the slice's last, partial tile is read masked.
- ``FOLD`` (the backend's CUDA default since session 38; the launcher's ``fold``): the
  tile's tokens are the MMA's M, spread over the program's warps, so each reduction over
  them crosses warps (shared memory and two barriers). A tile had three: the scores'
  maximum, the sums, and the values' largest scale. The fold keeps only the first. The
  values' scale rides in a padding head's column of the maximum (so it needs fewer query
  heads per KV head than ``BLOCK_H``), and the sums stay per token until the last tile.
  9 -> 5 barriers a tile; on the H200 523 against 559 us a layer at 512 x 1,500 tokens.

The rounding of q and P to e4m3 costs about 0.07 points of perplexity on the built-in
model against the same arithmetic without it (``scripts/emu_fp8_mma``, session 28). The
grid, the slices and the split merge are the f16 kernel's (``decode_tile``); no PDL
prefetch of the first tile, no rope (the rope kernels take 16-bit caches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.triton_kernels.decode_tile import FP8_MAX, finish_split, kv_slice
from tokenloom.plugins.models.pdl import launch_options, release, wait


@triton.jit
def _blocks(table, offs_n, kv_end, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The cache block of each token ``offs_n`` of a tile (0 past the slice's pages if
    MASKED), and each token's slot in its block."""
    page = offs_n // PAGE_SIZE
    slot = offs_n % PAGE_SIZE
    if MASKED:  # the pages the slice reaches; their tokens past its end are zeroed later
        block = tl.load(table + page, mask=page < tl.cdiv(kv_end, PAGE_SIZE), other=0)
        block = block.to(tl.int64)
    else:
        block = tl.load(table + page).to(tl.int64)
    return block, slot


@triton.jit
def _tile(
    acc, m_i, l_i, t, kv_end, qt8, col_scale, table, k_cache_ptr, v_cache_ptr, k_scale_ptr,
    v_scale_ptr, kv_head, offs_d, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_scale_block, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """One KV tile (number ``t``) of the online softmax, on ``acc`` = O^T ``[D, H]``."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    block, slot = _blocks(table, offs_n, kv_end, PAGE_SIZE, MASKED)
    return _tile_at(
        acc, m_i, l_i, offs_n, block, slot, kv_end, qt8, col_scale, k_cache_ptr, v_cache_ptr,
        k_scale_ptr, v_scale_ptr, kv_head, offs_d, stride_cache_block, stride_cache_tok,
        stride_cache_head, stride_scale_block, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, PAGE_SIZE,
        MASKED, GROUP, BLOCK_H, FOLD,
    )  # fmt: skip


@triton.jit
def _tile_at(
    acc, m_i, l_i, offs_n, block, slot, kv_end, qt8, col_scale, k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr, kv_head, offs_d, stride_cache_block, stride_cache_tok,
    stride_cache_head, stride_scale_block, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """``_tile`` with its tokens (``offs_n``), their blocks and slots (``_blocks``) given."""
    base = block * stride_cache_block
    k_tok = base + slot * stride_cache_tok + kv_head * stride_cache_head
    v_tok = base + slot + kv_head * (HEAD_DIM * PAGE_SIZE)  # [heads, D, page] per page
    # runs of 16 tokens from a multiple of 16 (pages of 16k, blocks of 16k bytes): the
    # axis analysis cannot see it through loop-carried block numbers (META_AHEAD)
    v_tok = tl.max_contiguous(tl.multiple_of(v_tok, 16), 16)
    # the scales [heads, tokens] per block: runs of 16 from a multiple of 16 as v_tok's
    # (a block's stride and its scales' offset are multiples of 16 floats for pages of 16k)
    s_off = block * stride_scale_block + kv_head * PAGE_SIZE + slot
    s_off = tl.max_contiguous(tl.multiple_of(s_off, 16), 16)
    k_ptrs = k_cache_ptr + k_tok[:, None] + offs_d[None, :]  # [N, D]
    v_ptrs = v_cache_ptr + v_tok[None, :] + offs_d[:, None] * PAGE_SIZE  # [D, N]
    k = tl.load(k_ptrs)
    k_scale = tl.load(k_scale_ptr + s_off)
    v_scale = tl.load(v_scale_ptr + s_off)
    vt = tl.load(v_ptrs)
    if MASKED:
        # Loaded whole (16-byte rows), then zeroed: a slot past the end holds whatever
        # its block last held, which must not reach the products (0 * NaN).
        mask_n = offs_n < kv_end
        zero8 = tl.full([BLOCK_N, HEAD_DIM], 0, tl.uint8)
        k = tl.where(mask_n[:, None], k.to(tl.uint8, bitcast=True), zero8)
        k = k.to(tl.float8e4nv, bitcast=True)
        vt = tl.where(mask_n[None, :], vt.to(tl.uint8, bitcast=True), tl.trans(zero8))
        vt = vt.to(tl.float8e4nv, bitcast=True)
        k_scale = tl.where(mask_n, k_scale, 0.0)
        v_scale = tl.where(mask_n, v_scale, 0.0)
    st = tl.dot(k, qt8) * k_scale[:, None] * col_scale[None, :]  # [N, H], base 2
    if MASKED:
        st = tl.where(mask_n[:, None], st, float("-inf"))
    if FOLD:
        # One reduction across the warps a tile, not three (each costs two barriers: the
        # tile's tokens are the MMA's M, spread over the warps): the values' largest scale
        # rides in the first padding head's column of the scores' maximum (that column's
        # results are never written: finish_split masks padding heads), and the sums stay
        # per token ([N, H], ``l_i``) until the kernel sums them after its last tile.
        pad = tl.arange(0, BLOCK_H) == GROUP
        tile_max = tl.max(tl.where(pad[None, :], v_scale[:, None], st), 0)  # [H]
        v_max = tl.max(tl.where(pad, tile_max, 0.0), 0)  # within a warp
    else:
        tile_max = tl.max(st, 0)  # [H]
        v_max = tl.max(v_scale, 0)
    m_new = tl.maximum(m_i, tile_max)
    alpha = tl.exp2(m_i - m_new)
    # p relative to the tile's own maximum (each head's largest is 1), its offset to the
    # running maximum applied to the tile's sums: p' = p * v_scale keeps e4m3's precision
    # in tiles far below the maximum, with one scale for the tile's values (448 at most)
    pt = tl.exp2(st - tile_max[None, :])
    below = tl.exp2(tile_max - m_new)
    if FOLD:
        l_i = l_i * alpha[None, :] + pt * below[None, :]
    else:
        l_i = l_i * alpha + tl.sum(pt, 0) * below
    lift = FP8_MAX / tl.maximum(v_max, 1e-30)
    p8 = (pt * (v_scale * lift)[:, None]).to(tl.float8e4nv)
    acc = acc * alpha[None, :] + tl.dot(vt, p8) * (below * (1.0 / lift))[None, :]
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_fp8_mma_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, counters_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt, stride_cache_block,
    stride_cache_tok, stride_cache_head, stride_scale_block, scale_log2, num_splits,
    min_split,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEADS_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
    META_AHEAD: tl.constexpr = False, FOLD: tl.constexpr = False,
):  # fmt: skip
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tl.static_assert(not FOLD or GROUP < BLOCK_H, "FOLD needs a padding head's column")
    offs_d = tl.arange(0, HEAD_DIM)
    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_hd = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    out_offs = seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    wait(USE_PDL)  # the query, lengths and cache come from the kernels before
    release(USE_PDL)

    seq_len, num_active, kv_start, kv_end = kv_slice(
        seq_lens_ptr, seq, split, num_splits, min_split, BLOCK_N
    )
    if kv_start >= kv_end:
        if seq_len == 0 and split == 0:  # a padding row: zeros, not garbage
            zeros = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
            tl.store(out_ptr + out_offs, zeros.to(out_ptr.dtype.element_ty), mask=mask_hd)
        return

    # q^T [D, H] in e4m3, a scale per head (column); all-zero (padding) heads get 1
    qt_offs = seq * stride_q_tok + heads[None, :] * stride_q_head + offs_d[:, None]
    qt = tl.load(q_ptr + qt_offs, mask=mask_h[None, :], other=0.0).to(tl.float32)
    q_amax = tl.max(tl.abs(qt), 0)
    q_scale = tl.where(q_amax > 0, q_amax / FP8_MAX, 1.0)
    qt8 = (qt / q_scale[None, :]).to(tl.float8e4nv)
    col_scale = q_scale * scale_log2  # [H]

    table = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if FOLD:  # the sums per token until the slice's end
        l_i = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)  # O^T
    # kv_start is a multiple of BLOCK_N (kv_slice): whole tiles, then a partial one
    if META_AHEAD:  # each tile's block numbers loaded a tile ahead (loop-carried); the
        # slots stay those of the first tile (tiles of whole pages: the launcher checks)
        offs_n = kv_start + tl.arange(0, BLOCK_N)
        block, slot = _blocks(table, offs_n, kv_end, PAGE_SIZE, True)
        for t in range(kv_start // BLOCK_N, kv_end // BLOCK_N):
            offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            block_ahead, _ = _blocks(table, offs_n + BLOCK_N, kv_end, PAGE_SIZE, True)
            acc, m_i, l_i = _tile_at(
                acc, m_i, l_i, offs_n, block, slot, kv_end, qt8, col_scale, k_cache_ptr,
                v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, offs_d, stride_cache_block,
                stride_cache_tok, stride_cache_head, stride_scale_block, NUM_KV_HEADS,
                HEAD_DIM, BLOCK_N, PAGE_SIZE, False, GROUP, BLOCK_H, FOLD,
            )  # fmt: skip
            block = block_ahead
    else:
        for t in range(kv_start // BLOCK_N, kv_end // BLOCK_N):
            acc, m_i, l_i = _tile(
                acc, m_i, l_i, t, kv_end, qt8, col_scale, table, k_cache_ptr, v_cache_ptr,
                k_scale_ptr, v_scale_ptr, kv_head, offs_d, stride_cache_block,
                stride_cache_tok, stride_cache_head, stride_scale_block, NUM_KV_HEADS,
                HEAD_DIM, BLOCK_N, PAGE_SIZE, False, GROUP, BLOCK_H, FOLD,
            )  # fmt: skip
    if kv_end % BLOCK_N:
        acc, m_i, l_i = _tile(
            acc, m_i, l_i, kv_end // BLOCK_N, kv_end, qt8, col_scale, table, k_cache_ptr,
            v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, offs_d, stride_cache_block,
            stride_cache_tok, stride_cache_head, stride_scale_block, NUM_KV_HEADS, HEAD_DIM,
            BLOCK_N, PAGE_SIZE, True, GROUP, BLOCK_H, FOLD,
        )  # fmt: skip
    if FOLD:
        l_i = tl.sum(l_i, 0)
    finish_split(tl.trans(acc), m_i, l_i, seq, kv_head, split, num_active, num_splits, heads,
                 mask_h, offs_d, mask_hd, out_ptr, out_offs, part_out_ptr, part_lse_ptr,
                 counters_ptr, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_H, HEAD_DIM)  # fmt: skip


MIN_K = 32  # an 8-bit tl.dot's K on NVIDIA: head_dim (scores) and BLOCK_N (values)


def supports_shape(head_dim: int, group: int, page: int) -> bool:
    """Whether the kernel takes a model of this head size, query heads per KV head and
    page size: a head size that is a power of two from ``MIN_K`` (the first product's
    K), at most 16 heads per group (the MMA's N), pages of a multiple of 16 tokens (whole
    16-byte rows of V^T)."""
    return head_dim >= MIN_K and head_dim & (head_dim - 1) == 0 and group <= 16 and page % 16 == 0


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``decode_fp8_mma`` takes these: an fp8 cache from ``kv_quant.allocate``
    with V transposed per page, of a shape ``supports_shape`` admits, its blocks 16-byte
    aligned (``kv_quant.block_bytes`` pads them; the values' contiguity hint needs it)."""
    group = q.shape[1] // k_cache.shape[2]
    return (
        k_cache.dtype == torch.float8_e4m3fn
        and kv_quant.v_transposed(v_cache)
        and supports_shape(k_cache.shape[3], group, k_cache.shape[1])
        and k_cache.stride(0) % 16 == 0
        and v_cache.stride(0) == k_cache.stride(0)
    )


def decode_fp8_mma(
    q: torch.Tensor,  # [B, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim] fp8 (kv_quant)
    v_cache: torch.Tensor,  # the same view, V transposed per page (kv_quant.v_transposed)
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [B, num_heads, head_dim], written
    part_out: torch.Tensor,  # flat fp32 scratch, >= B * num_heads * num_splits * head_dim
    part_lse: torch.Tensor,  # flat fp32 scratch, >= B * num_heads * num_splits
    counters: torch.Tensor,  # int32 scratch, >= B * num_kv_heads, zero (and left zero)
    scale: float,
    num_splits: int,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    min_split_tokens: int = 0,
    heads_first: bool = True,
    maxnreg: int = 0,
    meta_ahead: bool = False,
    fold: bool = False,
) -> None:
    """Launch the kernel (the arguments as ``decode.decode_attention``'s; ``block_n``
    below ``MIN_K`` is raised to it). ``meta_ahead`` loads each tile's block numbers a
    tile ahead, so that Triton's pipeliner needs no stage of its own for them (session
    35: without it the K/V copies overlap the products only from 5 stages; with it from
    3), for tiles of whole pages. ``fold`` keeps one reduction across the warps a tile
    instead of three (``FOLD`` above; the backend turns it on, this launcher leaves it off
    unless asked, and off where the query heads of a KV head fill ``BLOCK_H``). No host
    sync; CUDA-graph capturable."""
    assert supports(q, k_cache, v_cache), "an fp8 cache from kv_quant.allocate (V transposed)"
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    block_n = max(block_n, MIN_K)
    assert block_n % page == 0 or page % block_n == 0
    meta_ahead = meta_ahead and block_n % page == 0  # its slots are the first tile's
    group = num_heads // num_kv_heads
    block_h = max(16, triton.next_power_of_2(group))
    fold = fold and group < block_h  # the values' scale rides in a padding head's column
    k_scales, v_scales = kv_quant.scales_of(k_cache), kv_quant.scales_of(v_cache)
    grid = (num_kv_heads, batch, num_splits) if heads_first else (batch, num_kv_heads, num_splits)
    _decode_fp8_mma_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, counters,
        k_scales, v_scales, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scales.stride(0), scale * 1.4426950408889634, num_splits,
        triton.cdiv(min_split_tokens, block_n) * block_n,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_N=block_n, PAGE_SIZE=page, HEADS_FIRST=heads_first,
        META_AHEAD=meta_ahead, FOLD=fold,
        num_warps=num_warps, num_stages=num_stages, **launch_options(q.device),
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
