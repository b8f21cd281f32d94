"""Per-head RMSNorm + rotary embedding of q and k, in place (Triton, used on CUDA), and
the store of the rotated keys and the values into the paged KV cache, quantized for an
fp8 / int8 cache (``plugins.attention.kv_quant``). ``norm_rope`` and ``rotate_half`` are
also called inside other kernels (the decode attention's rope, the int4 q/k/v GEMV's
epilogue), so that all of them round alike: to the model dtype where transformers'
eager ops round.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.triton_kernels.kv_write import quantize_with, scale_of
from tokenloom.plugins.models.pdl import launch_options, release, wait

# PTX on NVIDIA's CUDA; the interpreter runs no inline assembly (and its numpy never
# contracts); a ROCm build of torch (whose GPUs are "cuda" devices too) takes no PTX
_CUDA_RN = tl.constexpr(
    os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.version.cuda is not None
)


@triton.jit
def _norm_rope_heads(
    ptr,
    w_ptr,
    stride_t,
    stride_h,
    token,
    cos,
    sin,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    heads = tl.arange(0, HEADS_P2)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    base = ptr + token * stride_t + heads * stride_h + cols
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    x1, x2 = norm_rope(x1, x2, w_ptr, cos, sin, eps, HALF, HAS_NORM)
    tl.store(base, x1, mask=mask)
    tl.store(base + HALF, x2, mask=mask)
    return x1, x2


@triton.jit
def norm_rope(x1, x2, w_ptr, cos, sin, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads ``[H, D]`` as their halves ``x1, x2`` (each ``[H, HALF]``, model dtype):
    per-head RMSNorm with weight ``w_ptr`` (``HAS_NORM``), then the rotate-half rotary
    embedding by ``cos``/``sin`` (``[1, HALF]`` fp32), rounded to the model dtype where
    transformers rounds. Also used inside the decode attention kernel."""
    cols = tl.arange(0, HALF)[None, :]
    dtype = x1.dtype
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + cols).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols).to(tl.float32)
        x1 = ((f1 * inv[:, None]).to(dtype).to(tl.float32) * w1).to(dtype)
        x2 = ((f2 * inv[:, None]).to(dtype).to(tl.float32) * w2).to(dtype)
    return rotate_half(x1, x2, cos, sin)


@triton.jit
def _mul_once(a, b):
    """``a * b`` (fp32) rounded once and never contracted into an FMA with a later add:
    PTX's ``mul.rn.f32``, opaque to LLVM (libdevice's ``mul_rn`` flushes subnormals)."""
    if _CUDA_RN:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def rotate_half(x1, x2, cos, sin):
    """The rotate-half rotary embedding of a head's halves ``x1, x2`` (model dtype) by
    ``cos``/``sin`` (fp32): ``(x1 cos - x2 sin, x2 cos + x1 sin)``, each product rounded
    to the model dtype, then the sum, as transformers' eager ops round. Without
    ``_mul_once``, LLVM folded a product and the add into one ``fma.rn.bf16`` (skipping
    that product's rounding), and which product it folded depended on the kernel: the
    int4 q/k/v GEMV's epilogue and the rope kernel differed in the last bit (session 25,
    read in the sm_90 PTX)."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    a = _mul_once(f1, cos).to(dtype).to(tl.float32)
    b = _mul_once(f2, sin).to(dtype).to(tl.float32)
    c = _mul_once(f2, cos).to(dtype).to(tl.float32)
    d = _mul_once(f1, sin).to(dtype).to(tl.float32)
    return (a - b).to(dtype), (c + d).to(dtype)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_vt,
    stride_vh,
    k_scale_ptr,  # KV_QUANT: [num_blocks, PAGE_SIZE, NUM_K] fp32 views
    v_scale_ptr,
    stride_cache_block,
    stride_scale_block,
    eps,
    NUM_Q: tl.constexpr,
    NUM_K: tl.constexpr,
    Q_P2: tl.constexpr,
    K_P2: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    KV_QUANT: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT8: tl.constexpr,
    USE_PDL: tl.constexpr,
    V_T: tl.constexpr = False,
):
    wait(USE_PDL)
    release(USE_PDL)
    token = tl.program_id(0)
    cols = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + cols).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + cols).to(tl.float32)
    if tl.program_id(1) == 0:
        _norm_rope_heads(
            q_ptr, qw_ptr, stride_qt, stride_qh, token, cos, sin, eps, NUM_Q, Q_P2, HALF, HAS_NORM
        )
    else:
        k1, k2 = _norm_rope_heads(
            k_ptr, kw_ptr, stride_kt, stride_kh, token, cos, sin, eps, NUM_K, K_P2, HALF, HAS_NORM
        )
        if WRITE_KV:  # the rotated key and the value into the paged cache
            slot = tl.load(slot_ptr + token).to(tl.int64)
            if slot >= 0:
                if KV_QUANT:
                    _write_quantized_kv(
                        k1, k2, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                        token, slot, stride_vt, stride_vh, stride_cache_block,
                        stride_scale_block, NUM_K, K_P2, HALF, PAGE_SIZE, QMAX, IS_INT8, V_T,
                    )  # fmt: skip
                else:  # contiguous cache
                    heads = tl.arange(0, K_P2)[:, None]
                    mask = heads < NUM_K
                    dst = slot * (NUM_K * 2 * HALF) + heads * (2 * HALF) + cols
                    cache_dtype = k_cache_ptr.dtype.element_ty
                    tl.store(k_cache_ptr + dst, k1.to(cache_dtype), mask=mask)
                    tl.store(k_cache_ptr + dst + HALF, k2.to(cache_dtype), mask=mask)
                    src = v_ptr + token * stride_vt + heads * stride_vh + cols
                    v1 = tl.load(src, mask=mask, other=0.0)
                    v2 = tl.load(src + HALF, mask=mask, other=0.0)
                    cache_dtype = v_cache_ptr.dtype.element_ty
                    tl.store(v_cache_ptr + dst, v1.to(cache_dtype), mask=mask)
                    tl.store(v_cache_ptr + dst + HALF, v2.to(cache_dtype), mask=mask)


@triton.jit
def _store_quantized_halves(
    x1, x2, cache_ptr, scale_ptr, dst, dst_scale, mask, mask_scale,
    HALF: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr, HALF_OFF: tl.constexpr,
):  # fmt: skip
    # One head's two halves [K_P2, HALF] over one absmax scale per head; the second
    # half's offset is HALF_OFF (HALF * PAGE_SIZE in a transposed value page).
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    scale = scale_of(tl.maximum(tl.max(tl.abs(f1), axis=1), tl.max(tl.abs(f2), axis=1)), QMAX)
    cache_dtype = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, quantize_with(f1, scale, QMAX, IS_INT8).to(cache_dtype), mask=mask)
    y2 = quantize_with(f2, scale, QMAX, IS_INT8).to(cache_dtype)
    tl.store(cache_ptr + dst + HALF_OFF, y2, mask=mask)
    tl.store(scale_ptr + dst_scale, scale, mask=mask_scale)


@triton.jit
def _write_quantized_kv(
    k1, k2, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, token, slot,
    stride_vt, stride_vh, stride_cache_block, stride_scale_block,
    NUM_K: tl.constexpr, K_P2: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, V_T: tl.constexpr,
):  # fmt: skip
    # The rotated key (as rounded to the model dtype) and the value, per head over its
    # absmax; the data view is strided by block and its scales follow the data.
    heads = tl.arange(0, K_P2)
    cols = tl.arange(0, HALF)[None, :]
    mask = heads[:, None] < NUM_K
    block, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    dst = block * stride_cache_block + (offset * NUM_K + heads[:, None]) * (2 * HALF) + cols
    dst_scale = block * stride_scale_block + heads * PAGE_SIZE + offset  # [heads, tokens]
    src = v_ptr + token * stride_vt + heads[:, None] * stride_vh + cols
    v1 = tl.load(src, mask=mask, other=0.0)
    v2 = tl.load(src + HALF, mask=mask, other=0.0)
    _store_quantized_halves(k1, k2, k_cache_ptr, k_scale_ptr, dst, dst_scale, mask,
                            heads < NUM_K, HALF, QMAX, IS_INT8, HALF)  # fmt: skip
    if V_T:  # values stored [heads, D, tokens] per page (kv_quant.v_transposed)
        dst = block * stride_cache_block + (heads[:, None] * (2 * HALF) + cols) * PAGE_SIZE + offset
    _store_quantized_halves(v1, v2, v_cache_ptr, v_scale_ptr, dst, dst_scale, mask,
                            heads < NUM_K, HALF, QMAX, IS_INT8, HALF * PAGE_SIZE if V_T else HALF)  # fmt: skip


def qk_norm_rope_(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous; rotated in place
    k: torch.Tensor,  # [T, Hkv, D], last dim contiguous; rotated in place
    cos: torch.Tensor,  # [T, 1, D/2] (or [T, D/2]), rows contiguous
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,  # [D] per-head RMSNorm weights (Qwen3)
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Per-head RMSNorm (when weights are given) and rotary embedding of q and k, in
    place. ``kv_write = (v, k_cache, v_cache, slot_mapping)`` also stores the rotated
    keys and the values in the paged cache (``[blocks, block_size, Hkv, D]``,
    contiguous, or a quantized cache from ``kv_quant.allocate``) at ``slot_mapping``
    (slots < 0 are skipped), saving the attention backend its KV-write kernel."""
    tokens, num_q, head_dim = q.shape
    if not tokens:
        return
    if kv_write is not None:
        v, k_cache, v_cache, slot_mapping = kv_write
    else:
        v, k_cache, v_cache, slot_mapping = k, k, k, k
    quantized = kv_write is not None and kv_quant.is_quantized(k_cache.dtype)
    if quantized:
        k_scales, v_scales = kv_quant.scales_of(k_cache), kv_quant.scales_of(v_cache)
    else:
        assert kv_write is None or (k_cache.is_contiguous() and v_cache.is_contiguous())
        k_scales, v_scales = k_cache, v_cache
    cos2, sin2 = cos.reshape(tokens, head_dim // 2), sin.reshape(tokens, head_dim // 2)
    has_norm = q_weight is not None and k_weight is not None
    _qk_norm_rope_kernel[(tokens, 2)](
        q,
        k,
        q_weight if has_norm else q,
        k_weight if has_norm else k,
        cos2,
        sin2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos2.stride(0),
        v,
        k_cache,
        v_cache,
        slot_mapping,
        v.stride(0),
        v.stride(1),
        k_scales,
        v_scales,
        k_cache.stride(0) if quantized else 0,
        k_scales.stride(0) if quantized else 0,
        eps,
        NUM_Q=num_q,
        NUM_K=k.shape[1],
        Q_P2=triton.next_power_of_2(num_q),
        K_P2=triton.next_power_of_2(k.shape[1]),
        HALF=head_dim // 2,
        HAS_NORM=has_norm,
        WRITE_KV=kv_write is not None,
        KV_QUANT=quantized,
        PAGE_SIZE=k_cache.shape[1] if quantized else 1,
        QMAX=kv_quant.QMAX[k_cache.dtype] if quantized else 1.0,
        IS_INT8=quantized and k_cache.dtype == torch.int8,
        V_T=quantized and kv_quant.v_transposed(v_cache),
        num_warps=4,
        **launch_options(q.device),
    )
