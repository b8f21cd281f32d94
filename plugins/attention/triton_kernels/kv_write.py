"""Store each token's key and value into the paged KV cache at its slot; a quantized
cache (fp8 / int8, ``kv_quant``) gets the quantized row and its per-head scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.attention import kv_quant


@triton.jit
def scale_of(absmax, QMAX: tl.constexpr):
    """A row's scale from its fp32 absmax: times the fp32 reciprocal of QMAX, exactly
    ``kv_quant.quantize`` (see ``kv_quant.INV_QMAX``), not Triton's approximate ``/``."""
    return absmax * (1.0 / QMAX)


@triton.jit
def quantize_rows(x, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """``x [rows, cols]`` fp32 -> (values to store, scale per row): absmax over the
    row / QMAX."""
    scale = scale_of(tl.max(tl.abs(x), axis=1), QMAX)
    return quantize_with(x, scale, QMAX, IS_INT8), scale


@triton.jit
def quantize_with(x, scale, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    """``x [rows, cols]`` fp32 over its row ``scale`` (0: a zero row); int8 rounds half
    away from zero, as ``kv_quant.quantize``. The caller casts to the cache dtype.
    ``div_rn`` is the IEEE-rounded division torch does: Triton's ``/`` (div.full.f32 on
    the GPU) may be an ulp off, which near a .5 tie flips the int8 step."""
    y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
    if IS_INT8:
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    return tl.minimum(tl.maximum(y, -QMAX), QMAX)


@triton.jit
def _kv_write_quant_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_block,  # elements (bytes) between blocks; scales follow each block's data
    stride_scale_block,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
    V_T: tl.constexpr,  # values stored [heads, D, tokens] per page (kv_quant.v_transposed)
):
    # One program per token: [num_kv_heads, head_dim] as a 2D tile, a scale per head.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    block, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    dst = block * stride_cache_block + (offset * NUM_KV_HEADS + heads) * HEAD_DIM + dims
    # scales [heads, tokens] per block (kv_quant.scales_of)
    dst_scale = block * stride_scale_block + tl.arange(0, HEADS_P2) * PAGE_SIZE + offset
    mask_scale = tl.arange(0, HEADS_P2) < NUM_KV_HEADS
    row = token.to(tl.int64)
    key = tl.load(k_ptr + row * stride_k_tok + heads * stride_k_head + dims, mask=mask, other=0.0)
    y, scale = quantize_rows(key.to(tl.float32), QMAX, IS_INT8)
    tl.store(k_cache_ptr + dst, y.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_scale_ptr + dst_scale, scale, mask=mask_scale)
    value = tl.load(v_ptr + row * stride_v_tok + heads * stride_v_head + dims, mask=mask, other=0.0)
    y, scale = quantize_rows(value.to(tl.float32), QMAX, IS_INT8)
    if V_T:
        dst = block * stride_cache_block + (heads * HEAD_DIM + dims) * PAGE_SIZE + offset
    tl.store(v_cache_ptr + dst, y.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_scale_ptr + dst_scale, scale, mask=mask_scale)


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
    skipped. Values are cast to the cache dtype, or quantized for a quantized cache
    (whose data view is strided by block; see ``kv_quant``)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if kv_quant.is_quantized(k_cache.dtype):
        k_scales, v_scales = kv_quant.scales_of(k_cache), kv_quant.scales_of(v_cache)
        _kv_write_quant_kernel[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            k_scales,
            v_scales,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_scales.stride(0),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_P2=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            PAGE_SIZE=k_cache.shape[1],
            QMAX=kv_quant.QMAX[k_cache.dtype],
            IS_INT8=k_cache.dtype == torch.int8,
            V_T=kv_quant.v_transposed(v_cache),
            num_warps=4,
        )
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
