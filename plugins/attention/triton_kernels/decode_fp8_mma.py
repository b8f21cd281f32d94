"""Paged decode attention over an fp8 e4m3 KV cache with both products as fp8 MMAs
(session 28; off by default: ``decode_fp8_mma``, not yet run on a GPU).

The shipped decode kernel (``decode.py``) converts every fp8 key and value to f16 for the
tensor cores: 3.4 instructions per KV byte on sm_90, where the bf16 cache takes 2.4, and
the fp8 cache's decode attention bounds the fp8 + fp8-KV throughput (57% of its KV floor
at 512 rows; docs/quantization.md). Hopper multiplies fp8 directly (wgmma, ``QGMMA``), but
only with 64 rows on the M side and both operands K-major. A group's query heads (4 for
Llama-3-8B) are far from 64 rows, so here the tile's **tokens are M** and the heads,
padded to 16, are N:

    S^T [N, H] = K [N, D] . q^T [D, H]        (K as stored: D contiguous, K-major)
    O^T [D, H] += V^T [D, N] . P'^T [N, H]

- q enters as e4m3, each head's row scaled by its own absmax (``s_q``), undone on the
  scores with the keys' per-token scales.
- ``P' = p * v_scale`` per token, as the values' scales require, rounded to e4m3 with a
  scale per head and tile (its largest at 448), undone on the tile's product.
- V as stored is not K-major for the second product, so Triton transposes the tile in
  shared memory (``scripts/fp8_mma_tile.py``: 2.30 instructions per KV byte at 128
  tokens a tile without paging and scales, against 1.45 with a V cache stored transposed,
  which would change the cache's layout everywhere; not done).

The rounding of q and P to e4m3 costs about 0.07 points of perplexity on the built-in
model against the same arithmetic without it (``scripts/emu_fp8_mma``, session 28). The
grid, the slices and the split merge are the shipped kernel's (``decode_tile``); no PDL
prefetch of the first tile, no rope.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.triton_kernels.decode_tile import (
    finish_split,
    kv_slice,
    kv_tokens,
)
from tokenloom.plugins.models.pdl import launch_options, release, wait

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _e4m3_columns(x):
    """``x [R, C]`` as e4m3 with one scale per column (its largest at 448): (values,
    scales [C]); an all-zero column gets scale 1."""
    amax = tl.max(tl.abs(x), 0)
    scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x / scale[None, :]).to(tl.float8e4nv), scale


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_fp8_mma_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, counters_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt, stride_cache_block,
    stride_cache_tok, stride_cache_head, stride_scale_block, scale_log2, num_splits,
    min_split,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEADS_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_hd = mask_h[:, None] & mask_d[None, :]
    out_offs = seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    wait(USE_PDL)  # the query, lengths and cache come from the kernels before
    release(USE_PDL)

    seq_len, num_active, kv_start, kv_end = kv_slice(
        seq_lens_ptr, seq, split, num_splits, min_split, BLOCK_N
    )
    if kv_start >= kv_end:
        if seq_len == 0 and split == 0:  # a padding row: zeros, not garbage
            zeros = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            tl.store(out_ptr + out_offs, zeros.to(out_ptr.dtype.element_ty), mask=mask_hd)
        return

    # q^T [D, H] in e4m3, a scale per head (column)
    qt_offs = seq * stride_q_tok + heads[None, :] * stride_q_head + offs_d[:, None]
    qt = tl.load(q_ptr + qt_offs, mask=mask_d[:, None] & mask_h[None, :], other=0.0)
    qt8, q_scale = _e4m3_columns(qt.to(tl.float32))
    col_scale = q_scale * scale_log2  # [H]

    table = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_cache_head
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)  # O^T
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        tok, s_off = kv_tokens(
            table, offs_n, mask_n, head_off, kv_head, stride_cache_block, stride_cache_tok,
            stride_scale_block, PAGE_SIZE, NUM_KV_HEADS,
        )  # fmt: skip
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + tok[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        k_scale = tl.load(k_scale_ptr + s_off, mask=mask_n, other=0.0)
        st = tl.dot(k, qt8) * k_scale[:, None] * col_scale[None, :]  # [N, H], base 2
        st = tl.where(mask_n[:, None], st, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, 0))
        alpha = tl.exp2(m_i - m_new)
        pt = tl.exp2(st - m_new[None, :])
        l_i = l_i * alpha + tl.sum(pt, 0)
        v_scale = tl.load(v_scale_ptr + s_off, mask=mask_n, other=0.0)
        p8, p_scale = _e4m3_columns(pt * v_scale[:, None])
        v = tl.load(v_cache_ptr + tok[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p8) * p_scale[None, :]
        m_i = m_new
    finish_split(tl.trans(acc), m_i, l_i, seq, kv_head, split, num_active, num_splits, heads,
                 mask_h, offs_d, mask_hd, out_ptr, out_offs, part_out_ptr, part_lse_ptr,
                 counters_ptr, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D)  # fmt: skip


def decode_fp8_mma(
    q: torch.Tensor,  # [B, num_heads, head_dim] 16-bit, last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim] fp8 (kv_quant)
    v_cache: torch.Tensor,
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
) -> None:
    """Launch the kernel (the arguments as ``decode.decode_attention``'s). No host sync;
    CUDA-graph capturable."""
    assert k_cache.dtype == torch.float8_e4m3fn, "an fp8 e4m3 cache"
    assert q.dtype in (torch.bfloat16, torch.float16), "16-bit queries"
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_scales, v_scales = kv_quant.scales_of(k_cache), kv_quant.scales_of(v_cache)
    grid = (num_kv_heads, batch, num_splits) if heads_first else (batch, num_kv_heads, num_splits)
    _decode_fp8_mma_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, counters,
        k_scales, v_scales, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scales.stride(0), scale * 1.4426950408889634, num_splits,
        triton.cdiv(min_split_tokens, block_n) * block_n,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, PAGE_SIZE=k_cache.shape[1], HEADS_FIRST=heads_first,
        num_warps=num_warps, num_stages=num_stages, **launch_options(q.device),
    )  # fmt: skip
