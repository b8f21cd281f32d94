"""Fused elementwise kernels for the decoder layers (Triton, used on CUDA).

Decode steps at small batch are bound by kernel count, not bytes: unfused, one
layer is ~50 tiny kernels (casts, pow, mean, rsqrt, cat, silu, mul). These three
kernels replace them: residual-add + RMSNorm, SiLU-and-mul, and per-head RMSNorm +
rotary embedding applied in place. Each rounds to the model dtype at the same
points as the unfused torch code (and transformers), so bf16 results agree. The
rope kernel can also write the rotated keys and the values into the paged KV cache,
quantizing them for an fp8 / int8 cache (``plugins.attention.kv_quant``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.triton_kernels.kv_write import quantize_with, scale_of
from tokenloom.plugins.models.pdl import launch_options, release, release_early, wait
from tokenloom.plugins.quant.kernels.fp8_quant import ROW_BLOCK_MAX
from tokenloom.protocols.components.quant import Fp8Rows

FP8_E4M3 = torch.float8_e4m3fn
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# PTX on NVIDIA's CUDA; the interpreter runs no inline assembly (and its numpy never
# contracts); a ROCm build of torch (whose GPUs are "cuda" devices too) takes no PTX
_CUDA_RN = tl.constexpr(
    os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.version.cuda is not None
)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    n_cols,
    eps,
    s_ptr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr,
    FP8: tl.constexpr = False,
):
    # The next kernel (a projection: it reads only its weights before its wait) may start
    # at once: at batch 1 its weight tiles then stream during the tail of the GEMV before
    # this kernel, instead of only during this kernel (pdl.release_early).
    if EARLY:
        release_early(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait(USE_PDL)
    if not EARLY:
        release(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(res_out_ptr.dtype.element_ty).to(tl.float32)
    y = (normed * w).to(res_out_ptr.dtype.element_ty)
    if FP8:  # the next projection's per-token e4m3 rows (out_ptr e4m3, s_ptr a scale a row)
        _store_fp8_row(y, out_ptr + row * n_cols, s_ptr + row, offs, mask)
    else:
        tl.store(out_ptr + row * n_cols + offs, y, mask=mask)


@triton.jit
def _store_fp8_row(y, q_row, s_row, offs, mask):
    """A row's per-token e4m3 quantization, stored: ``kernels/fp8_quant.py``'s arithmetic
    on the same 16-bit values (scale ``max|y| / 448``, IEEE divisions), so the same bits
    as that kernel run on this row (masked lanes hold 0)."""
    yf = y.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(yf), axis=0), 1e-12), 448.0)
    tl.store(s_row, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(yf, scale), -448.0), 448.0)
    tl.store(q_row + offs, q.to(q_row.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
    fp8: bool = False,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; without a residual, ``(norm(x), x)``.
    With ``fp8`` the norm comes as ``Fp8Rows``: the 16-bit result quantized per token in
    the same kernel, bit for bit what ``per_token_fp8`` makes of it (for an fp8
    projection next, ``LinearKernel.takes_fp8_rows``).
    Under PDL the kernel lets the next one start at once (``pdl.release_early``);
    ``TOKENLOOM_NORM_EARLY_RELEASE=0`` (read at each call) releases after the wait."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=FP8_E4M3 if fp8 else x.dtype, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if fp8 else out
    summed = (
        torch.empty((rows, cols), dtype=x.dtype, device=x.device) if residual is not None else x
    )
    if rows:
        block = triton.next_power_of_2(cols)
        _add_rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            summed,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            cols,
            eps,
            scales,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            EARLY=os.environ.get("TOKENLOOM_NORM_EARLY_RELEASE", "1") == "1",
            FP8=fp8,
            **launch_options(x.device),
        )
    return (Fp8Rows(out, scales, x.dtype) if fp8 else out), summed


@triton.jit
def _silu_and_mul_kernel(
    in_ptr, out_ptr, stride_in, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait(USE_PDL)
    release(USE_PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(in_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * stride_in + n_cols + offs, mask=mask, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * n_cols + offs,
        (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(cols))
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up,
            out,
            gate_up.stride(0),
            cols,
            BLOCK=block,
            num_warps=4,
            **launch_options(gate_up.device),
        )
    return out


@triton.jit
def _silu_and_mul_fp8_kernel(
    in_ptr, q_ptr, s_ptr, stride_in, n_cols, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """``_silu_and_mul_kernel``'s row (the same 16-bit rounding), quantized per token: one
    program a whole row (``BLOCK >= n_cols``), as the one-pass ``per_token_fp8``."""
    wait(USE_PDL)
    release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(in_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * stride_in + n_cols + offs, mask=mask, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(OUT_DTYPE).to(tl.float32)
    y = (act * up.to(tl.float32)).to(OUT_DTYPE)
    _store_fp8_row(y, q_ptr + row * n_cols, s_ptr + row, offs, mask)


FP8_ROW_MAX = ROW_BLOCK_MAX  # the widest row one program quantizes (per_token_fp8's one pass)


def silu_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Rows:  # [T, 2I] -> [T, I] e4m3 rows
    """``silu_and_mul`` quantized per token in the same kernel (``Fp8Rows``; rows of at
    most ``FP8_ROW_MAX``): what ``per_token_fp8`` makes of ``silu_and_mul``'s result."""
    rows, width = gate_up.shape
    cols = width // 2
    assert cols <= FP8_ROW_MAX, cols
    q = torch.empty((rows, cols), dtype=FP8_E4M3, device=gate_up.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _silu_and_mul_fp8_kernel[(rows,)](
            gate_up, q, scales, gate_up.stride(0), cols, OUT_DTYPE=_TL_DTYPES[gate_up.dtype],
            BLOCK=block, num_warps=max(4, min(16, block // 1024)),
            **launch_options(gate_up.device),
        )  # fmt: skip
    return Fp8Rows(q, scales, gate_up.dtype)


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
    dst_scale = block * stride_scale_block + offset * NUM_K + heads
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
