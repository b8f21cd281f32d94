"""Fused elementwise kernels for the decoder layers (Triton, used on CUDA): the
residual-add + RMSNorm and SiLU-and-mul, each optionally storing its rows quantized to
fp8 for the projection after it (``Fp8Rows``). The per-head norm and rotary embedding are
``rope_ops``'.

Decode steps at small batch are bound by kernel count, not bytes: unfused, one
layer is ~50 tiny kernels (casts, pow, mean, rsqrt, cat, silu, mul). These kernels
and ``rope_ops``' replace them. Each rounds to the model dtype at the same points as
the unfused torch code (and transformers), so bf16 results agree.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import launch_options, release, release_early, wait
from tokenloom.plugins.quant.kernels.fp8_quant import ROW_BLOCK_MAX
from tokenloom.protocols.components.quant import Fp8Rows

FP8_E4M3 = torch.float8_e4m3fn
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
    order_ptr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr,
    FP8: tl.constexpr = False,
    ORDER: tl.constexpr = False,
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
    if ORDER:  # the output in the next projection's input order: column j is offs[j]'s
        at = tl.load(order_ptr + offs, mask=mask, other=0)
        w_at = tl.load(w_ptr + at, mask=mask, other=0.0).to(tl.float32)
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
    if ORDER:  # the same sums at the gathered columns (the same bits as gathering y)
        x = tl.load(x_ptr + row * stride_x + at, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + at, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        xf = x.to(tl.float32)
        w = w_at
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
    order: torch.Tensor | None = None,  # [N] int64
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; without a residual, ``(norm(x), x)``.
    With ``fp8`` the norm comes as ``Fp8Rows``: the 16-bit result quantized per token in
    the same kernel, bit for bit what ``per_token_fp8`` makes of it (for an fp8
    projection next, ``LinearKernel.takes_fp8_rows``). With ``order`` the norm's columns
    come gathered, ``norm(...)[:, order]`` bit for bit (for a projection whose weights
    keep their inputs in that order, ``LinearKernel.input_order``; not with ``fp8``).
    Under PDL the kernel lets the next one start at once (``pdl.release_early``);
    ``TOKENLOOM_NORM_EARLY_RELEASE=0`` (read at each call) releases after the wait."""
    assert not (fp8 and order is not None), "fp8 rows come in order"
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
            order if order is not None else x,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            EARLY=os.environ.get("TOKENLOOM_NORM_EARLY_RELEASE", "1") == "1",
            FP8=fp8,
            ORDER=order is not None,
            **launch_options(x.device),
        )
    return (Fp8Rows(out, scales, x.dtype) if fp8 else out), summed


@triton.jit
def _silu_and_mul_kernel(
    in_ptr,
    out_ptr,
    order_ptr,
    stride_in,
    n_cols,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    ORDER: tl.constexpr = False,
):
    if ORDER:  # column j of the output is column order[j]'s (read before the wait)
        first = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        at = tl.load(order_ptr + first, mask=first < n_cols, other=0)
    wait(USE_PDL)
    release(USE_PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    if not ORDER:
        at = offs
    gate = tl.load(in_ptr + row * stride_in + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * stride_in + n_cols + at, mask=mask, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * n_cols + offs,
        (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2I]
    order: torch.Tensor | None = None,  # [I] int64
) -> torch.Tensor:
    """``silu(gate) * up`` ``[T, I]``; with ``order`` its columns gathered,
    ``(silu(gate) * up)[:, order]`` (for a projection whose weights keep their inputs in
    that order, ``LinearKernel.input_order``)."""
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(cols))
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up,
            out,
            order if order is not None else gate_up,
            gate_up.stride(0),
            cols,
            BLOCK=block,
            num_warps=4,
            ORDER=order is not None,
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
def _gather_columns_kernel(
    in_ptr, order_ptr, out_ptr, stride_in, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    # The successor is a projection, which reads only weights before its wait: it may
    # start at once and stream its first weight tiles during this gather (as after the
    # norm; pdl.release_early)
    release_early(USE_PDL)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    at = tl.load(order_ptr + offs, mask=mask, other=0)  # the order: no kernel writes it
    wait(USE_PDL)
    row = tl.program_id(0)
    x = tl.load(in_ptr + row * stride_in + at, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + offs, x, mask=mask)


def gather_columns(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x[:, order]`` (``[T, K]``, ``order`` ``[K]`` int64) for the projection after it
    (an act-order layer whose input no kernel of ours produces in its order: o_proj's,
    after the attention). A PDL kernel, unlike ``index_select``: the projection's weight
    loads start during it."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(cols))
        _gather_columns_kernel[(rows, triton.cdiv(cols, block))](
            x, order, out, x.stride(0), cols, BLOCK=block, num_warps=4, **launch_options(x.device)
        )
    return out
