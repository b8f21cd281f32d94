"""Paged decode attention with split-KV (flash-decoding), one query token per request.

One kernel, grid ``(num_kv_heads, batch, num_splits)`` (``heads_first``, the CUDA
default: the programs launched together read every head of the same tokens) or
``(batch, num_kv_heads, num_splits)``: a program takes every query
head that shares one KV head as a ``[BLOCK_H, D]`` tile (heads padded to at least 16
so that ``tl.dot`` runs on the tensor cores), walks its slice of the request's KV
through the block table, and writes the normalised partial output and its
log-sum-exp (base 2). It then counts itself done on a per-(request, KV head)
counter (an acquire-release atomic); the program that finishes last merges the
splits by log-sum-exp, writes the output and resets the counter to zero for the
next launch. A request whose KV fits one split skips the partials. Merging in the
kernel instead of a second launch saves a kernel per layer, which at small batches
costs about as much as the merge itself.

Each request's split length is derived on the device from ``seq_lens``; programs
whose slice is empty exit at once, so the launch depends only on tensor shapes and the
path is CUDA-graph capturable. Padding rows (seq_len 0) produce zeros.

At small batches (``PREFETCH``) each program reads its first KV tile before the PDL
wait, all but this step's token, which it reads after (``decode_tile.py`` says why
that is safe): the length, block-table and cache reads no longer follow the wait.

A quantized cache (``KV_QUANT``, a compile-time switch: the unquantized kernel is
unchanged) is dequantized on the fly with its per-token-head scales: the raw fp8 /
int8 values enter both dots as f16 (exact; ``KV_F16``, for 16-bit queries; an fp32
model keeps fp32 dots), the scores are scaled per key, and the probabilities per value
before the second dot. On CUDA the tile is converted by PTX helpers in the layout it
was loaded in (``KV_ASM``; see ``_x4_to_f16``): Triton's own cast lets the layout
change happen first, at one shared-memory load per byte, which doubled the kernel's
instructions (docs/quantization.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.triton_kernels.decode_rope import (
    DecodeRope,
    check_supported,
    rope_query_store_kv,
)
from tokenloom.plugins.attention.triton_kernels.decode_tile import (
    finish_split,
    kv_slice,
    kv_tokens,
    softmax_step,
    tile_scores,
    value_step,
)
from tokenloom.plugins.models.pdl import launch_options, release, wait

# p * v_scale enters the second dot in f16, multiplied by this (undone after the loop):
# small probabilities stay out of f16's subnormals, and the product overflows only for a
# value row whose absolute maximum is above 448 * 65504 / 512 = 57k (fp8) or
# 127 * 65504 / 128 = 65k (int8).
P_LIFT = {torch.float8_e4m3fn: 512.0, torch.int8: 128.0}


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,  # [B, H, num_splits, HEAD_DIM] fp32
    part_lse_ptr,  # [B, H, num_splits] fp32
    counters_ptr,  # [B, num_kv_heads] int32, zero between launches
    k_scale_ptr,  # [num_blocks, PAGE_SIZE, NUM_KV_HEADS] fp32 view (KV_QUANT only)
    v_scale_ptr,
    k_new_ptr,  # ROPE: this step's keys and values [B, NUM_KV_HEADS, HEAD_DIM] (views)
    v_new_ptr,
    cos_ptr,  # ROPE: [B, HEAD_DIM / 2] at each request's position
    sin_ptr,
    q_norm_ptr,  # ROPE and HAS_NORM: per-head RMSNorm weights [HEAD_DIM]
    k_norm_ptr,
    slot_ptr,  # ROPE: [B] the new token's cache slot
    stride_kn_tok,
    stride_kn_head,
    stride_vn_tok,
    stride_vn_head,
    stride_cos,
    eps,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    stride_scale_block,
    scale_log2,  # softmax scale * log2(e)
    num_splits,
    min_split,  # tokens, a multiple of BLOCK_N (0: splits as even as the tiles allow)
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_F16: tl.constexpr,
    P_LIFT: tl.constexpr,
    KV_ASM: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # the first tile before the wait (decode_tile.py)
    V_T: tl.constexpr = False,  # values stored [heads, D, tokens] per page (kv_quant)
    V_STRIDE_D: tl.constexpr = 1,  # PAGE_SIZE with V_T
):
    if HEADS_FIRST:  # a request's KV heads run side by side: whole token rows from DRAM
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    table = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_cache_head
    if PREFETCH:  # every token's key and value but the new one's: final before the wait
        seq_len, num_active, kv_start, kv_end = kv_slice(
            seq_lens_ptr, seq, split, num_splits, min_split, BLOCK_N
        )
        offs_n0 = kv_start + tl.arange(0, BLOCK_N)
        mask_n0 = offs_n0 < kv_end
        old0 = offs_n0 < tl.minimum(kv_end, seq_len - 1)
        tok0, v_tok0, s_off0 = kv_tokens(
            table, offs_n0, mask_n0, head_off, kv_head, stride_cache_block, stride_cache_tok,
            stride_scale_block, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, V_T,
        )  # fmt: skip
        kp0 = k_cache_ptr + tok0[None, :] + offs_d[:, None]
        vp0 = v_cache_ptr + v_tok0[:, None] + offs_d[None, :] * V_STRIDE_D
        ksp0 = k_scale_ptr + s_off0
        vsp0 = v_scale_ptr + s_off0
        k0 = tl.load(kp0, mask=old0[None, :] & mask_d[:, None], other=0.0)
        v0 = tl.load(vp0, mask=old0[:, None] & mask_d[None, :], other=0.0)
        ks0 = tl.load(ksp0, mask=old0, other=0.0) if KV_QUANT else seq_len
        vs0 = tl.load(vsp0, mask=old0, other=0.0) if KV_QUANT else seq_len
    wait(USE_PDL)  # the query, lengths and cache come from the kernels before
    release(USE_PDL)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_hd = mask_h[:, None] & mask_d[None, :]
    out_offs = seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]

    if not PREFETCH:
        seq_len, num_active, kv_start, kv_end = kv_slice(
            seq_lens_ptr, seq, split, num_splits, min_split, BLOCK_N
        )
    if kv_start >= kv_end:
        if seq_len == 0 and split == 0:  # a padding row: zeros, not garbage
            zeros = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            tl.store(out_ptr + out_offs, zeros.to(out_ptr.dtype.element_ty), mask=mask_hd)
        return

    if ROPE:  # the query's halves rotated here; the last split stores the new key/value
        offs_half = tl.arange(0, HALF)
        q1, q2 = rope_query_store_kv(
            q_ptr, k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, slot_ptr,
            k_cache_ptr, v_cache_ptr, seq, kv_head, heads, mask_h, split == num_active - 1,
            stride_q_tok, stride_q_head, stride_kn_tok, stride_kn_head, stride_vn_tok,
            stride_vn_head, stride_cos, stride_cache_block, stride_cache_tok, head_off, eps,
            HALF, PAGE_SIZE, HAS_NORM,
        )  # fmt: skip
    else:
        q_offs = seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=mask_hd, other=0.0)
    row_scale = tl.full([BLOCK_H], scale_log2, tl.float32)
    if KV_F16:  # rows beyond f16's range are shrunk first; the scores undo it
        qf = q.to(tl.float32)
        q_shrink = tl.minimum(32768.0 / tl.maximum(tl.max(tl.abs(qf), 1), 1e-30), 1.0)
        q = (qf * q_shrink[:, None]).to(tl.float16)
        row_scale = row_scale / q_shrink

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    dtype = q_ptr.dtype.element_ty
    first = kv_start
    if PREFETCH:  # the new token's key and value, written by the kernel before
        new0 = offs_n0 == seq_len - 1
        k_new = tl.load(kp0, mask=new0[None, :] & mask_d[:, None], other=0.0)
        v_new = tl.load(vp0, mask=new0[:, None] & mask_d[None, :], other=0.0)
        k0 = tl.where(new0[None, :], k_new, k0)  # a padded head dim stays 0
        v0 = tl.where(new0[:, None], v_new, v0)
        qk = tile_scores(q, k0, row_scale, scale_log2, KV_F16, KV_ASM, DOT_PRECISION)
        if KV_QUANT:
            qk = qk * tl.where(new0, tl.load(ksp0, mask=new0), ks0)[None, :]
            vs0 = tl.where(new0, tl.load(vsp0, mask=new0), vs0)
        p, alpha, m_i, l_i = softmax_step(qk, mask_n0, m_i, l_i)
        acc = value_step(acc, p, alpha, v0, vs0, dtype, KV_QUANT, KV_F16, P_LIFT, KV_ASM,
                         DOT_PRECISION)  # fmt: skip
        first = kv_start + BLOCK_N
    for n0 in range(first, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        tok, v_tok, s_off = kv_tokens(
            table, offs_n, mask_n, head_off, kv_head, stride_cache_block, stride_cache_tok,
            stride_scale_block, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, V_T,
        )  # fmt: skip
        if ROPE:  # the two halves of the head, each against its half of the keys
            k_half = k_cache_ptr + tok[None, :] + offs_half[:, None]
            k1 = tl.load(k_half, mask=mask_n[None, :], other=0.0)  # [HALF, BLOCK_N]
            k2 = tl.load(k_half + HALF, mask=mask_n[None, :], other=0.0)
            qk = tl.dot(q1, k1.to(q1.dtype), input_precision=DOT_PRECISION)
            qk = (qk + tl.dot(q2, k2.to(q2.dtype), input_precision=DOT_PRECISION)) * scale_log2
        else:
            k = tl.load(
                k_cache_ptr + tok[None, :] + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]
            qk = tile_scores(q, k, row_scale, scale_log2, KV_F16, KV_ASM, DOT_PRECISION)
        if KV_QUANT:
            qk = qk * tl.load(k_scale_ptr + s_off, mask=mask_n, other=0.0)[None, :]
        p, alpha, m_i, l_i = softmax_step(qk, mask_n, m_i, l_i)
        v = tl.load(
            v_cache_ptr + v_tok[:, None] + offs_d[None, :] * V_STRIDE_D,
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v_scale = l_i  # unread without KV_QUANT
        if KV_QUANT:
            v_scale = tl.load(v_scale_ptr + s_off, mask=mask_n, other=0.0)
        acc = value_step(acc, p, alpha, v, v_scale, dtype, KV_QUANT, KV_F16, P_LIFT, KV_ASM,
                         DOT_PRECISION)  # fmt: skip
    if KV_F16:
        acc = acc * (1.0 / P_LIFT)

    finish_split(acc, m_i, l_i, seq, kv_head, split, num_active, num_splits, heads, mask_h,
                 offs_d, mask_hd, out_ptr, out_offs, part_out_ptr, part_lse_ptr, counters_ptr,
                 NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D)  # fmt: skip


def decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [B, num_heads, head_dim], written
    part_out: torch.Tensor,  # flat fp32 scratch, >= B * num_heads * num_splits * head_dim
    part_lse: torch.Tensor,  # flat fp32 scratch, >= B * num_heads * num_splits
    counters: torch.Tensor,  # int32 scratch, >= B * num_kv_heads, zero (and left zero)
    scale: float,
    num_splits: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
    min_split_tokens: int = 0,
    kv_asm: bool = False,
    heads_first: bool = False,
    maxnreg: int = 0,
    rope: DecodeRope | None = None,
    prefetch: bool = False,
) -> None:
    """Launch the kernel. No host sync; the grid depends only on shapes and
    ``num_splits``, so a captured graph replays with new values in the same tensors.
    ``min_split_tokens``: no split shorter than this (rounded up to whole tiles).
    ``kv_asm``: convert an 8-bit cache with the PTX helpers (CUDA only).
    ``heads_first``: grid ``(num_kv_heads, batch, num_splits)``, so that programs
    launched together read every head of the same tokens. ``maxnreg``: a register cap
    per thread (more programs per SM, at the price of spills; 0: none). ``rope``: the
    query and this step's keys arrive un-rotated; the kernel applies the per-head norm
    and rotary embedding and stores the new keys and values in the cache (a 16-bit or
    fp32 cache, head size a power of two: ``DecodeRope``). ``prefetch``: each program reads
    its first tile before the PDL wait, all but the new token (``decode_tile.py``; not
    with ``rope``, whose kernel writes that token itself)."""
    assert not (prefetch and rope is not None), "prefetch reads the cache the rope kernel writes"
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    quantized = kv_quant.is_quantized(k_cache.dtype)
    k_scales = kv_quant.scales_of(k_cache) if quantized else k_cache
    v_scales = kv_quant.scales_of(v_cache) if quantized else v_cache
    grid = (num_kv_heads, batch, num_splits) if heads_first else (batch, num_kv_heads, num_splits)
    if rope is not None:
        check_supported(head_dim, quantized, (k_cache, v_cache))
        rope_args = rope.kernel_args(head_dim)
    else:
        rope_args = DecodeRope.unused_args(q)
    _decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        counters,
        k_scales,
        v_scales,
        *rope_args,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scales.stride(0) if quantized else 0,
        scale * 1.4426950408889634,
        num_splits,
        triton.cdiv(min_split_tokens, block_n) * block_n,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        PAGE_SIZE=k_cache.shape[1],
        DOT_PRECISION=precision,
        KV_QUANT=quantized,
        KV_F16=quantized and q.dtype != torch.float32,
        P_LIFT=P_LIFT.get(k_cache.dtype, 1.0),
        KV_ASM=quantized and kv_asm,
        HEADS_FIRST=heads_first,
        ROPE=rope is not None,
        HAS_NORM=rope is not None and rope.has_norm,
        HALF=head_dim // 2,
        PREFETCH=prefetch,
        V_T=kv_quant.v_transposed(v_cache),
        V_STRIDE_D=v_cache.stride(3),
        num_warps=num_warps,
        num_stages=num_stages,
        **({"maxnreg": maxnreg} if maxnreg else {}),
        **launch_options(q.device),
    )
