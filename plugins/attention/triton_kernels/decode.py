"""Paged decode attention with split-KV (flash-decoding), one query token per request.

Stage 1, grid ``(batch, num_kv_heads, num_splits)``: a program takes every query head
that shares one KV head as a ``[BLOCK_H, D]`` tile (heads padded to at least 16 so that
``tl.dot`` runs on the tensor cores), walks its slice of the request's KV through the
block table, and writes the normalised partial output and its log-sum-exp (base 2).
Stage 2, grid ``(batch, num_heads)``: merges the splits by log-sum-exp.

Each request's split length is derived on the device from ``seq_lens``; programs
whose slice is empty exit at once, so the launch depends only on tensor shapes and the
path is CUDA-graph capturable. Padding rows (seq_len 0) produce zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_length(seq_len, num_splits, BLOCK_N: tl.constexpr):
    # Splits are whole BLOCK_N tiles so that no tile straddles two programs.
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,  # [B, H, num_splits, HEAD_DIM] fp32
    part_lse_ptr,  # [B, H, num_splits] fp32
    stride_q_tok,
    stride_q_head,
    stride_bt,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    scale_log2,  # softmax scale * log2(e)
    num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_length(seq_len, num_splits, BLOCK_N)
    kv_start = split * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)
    if kv_start >= kv_end:
        return

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    q_offs = seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_cache_head
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        block = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        tok = block * stride_cache_block + (offs_n % PAGE_SIZE) * stride_cache_tok + head_off
        k = tl.load(
            k_cache_ptr + tok[None, :] + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
        qk = tl.where(mask_n[None, :], qk, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + tok[:, None] + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    row = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H]
    out_offs = row[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(part_out_ptr + out_offs, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
    tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    stride_o_tok,
    stride_o_head,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_length(seq_len, num_splits, BLOCK_N)
    num_active = tl.cdiv(seq_len, tl.maximum(split_len, 1))
    # m and l are kept as vectors (all lanes equal) to keep loop-carried types simple.
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    row0 = (seq * NUM_HEADS + head) * num_splits
    for split in range(0, num_active):
        lse = tl.load(part_lse_ptr + row0 + split)
        part = tl.load(part_out_ptr + (row0 + split) * HEAD_DIM + offs_d, mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + weight * part
        denom = denom * alpha + weight
        m = m_new
    result = tl.where(denom > 0, acc / tl.maximum(denom, 1e-30), 0.0)
    out_offs = seq * stride_o_tok + head * stride_o_head + offs_d
    tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=mask_d)


def decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [B, num_heads, head_dim], written
    part_out: torch.Tensor,  # flat fp32 scratch, >= B * num_heads * num_splits * head_dim
    part_lse: torch.Tensor,  # flat fp32 scratch, >= B * num_heads * num_splits
    scale: float,
    num_splits: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Launch both stages. No host sync; the grid depends only on shapes and
    ``num_splits``, so a captured graph replays with new values in the same tensors."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * 1.4426950408889634,
        num_splits,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        PAGE_SIZE=k_cache.shape[1],
        DOT_PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _decode_merge_kernel[(batch, num_heads)](
        out,
        part_out,
        part_lse,
        seq_lens,
        out.stride(0),
        out.stride(1),
        num_splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        num_warps=2,
    )
