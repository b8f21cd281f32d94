"""Store each token's key and value into the paged KV cache at its slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HD: tl.constexpr,  # next power of two of NUM_KV_HEADS * HEAD_DIM
):
    # One program per token: the whole [num_kv_heads, head_dim] row in one tile.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_HD)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    src_k = token.to(tl.int64) * stride_k_tok + head * stride_k_head + dim
    src_v = token.to(tl.int64) * stride_v_tok + head * stride_v_head + dim
    key = tl.load(k_ptr + src_k, mask=mask)
    value = tl.load(v_ptr + src_v, mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs  # caches are contiguous
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], last dim contiguous
    v: torch.Tensor,  # [T, num_kv_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Launch the KV write: no host sync, graph-capturable; rows with slot < 0 are
    skipped. Values are cast to the cache dtype."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HD=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=4,
    )
