"""The residual add and RMSNorm before a projection, inside the one-row int4 GEMV
(``int4_gemv_nk`` with ``NORM``): the kernel reads the residual stream's update ``x``,
the residual and the norm's weight, and its input is ``norm(x + residual) * weight``.

Why (session 26). At batch 1 a Llama-3-8B layer ran two add+RMSNorm kernels on the
int4 step's critical path, before the q/k/v and the gate/up GEMVs: about 3 us a layer
(session 24's profile), ~95 us of a 1.70 ms step, and the largest lever left against
int4's 2.5x target. Their work is tiny (8 KB rows); what costs is a kernel boundary
each: after the GEMV before it ends, the norm waits, loads, reduces, stores and
finishes, and only then may the next GEMV's wait return. Here each program of the next
GEMV does the norm itself, under its first weight tile, after the same wait.

What a program does, only where the row is one tile (``ONE_TILE``: q/k/v and gate/up
at 4096 columns, the tuner's 16 x 4096 tiling on the H200):

- ``_norm_inv``: loads ``x`` and the residual, sums them in fp32 and rounds to the
  model dtype (the stored residual, as ``fused_ops.add_rms_norm`` rounds it), stores
  that sum into a new buffer in program 0 (the next layer's residual: never in place,
  the other programs still read the old one) and returns ``rsqrt(mean(h^2) + eps)``.
- ``_normed_words`` (PTX paths): the row's 16 bf16x2 words of each element, computed
  as ``((h * inv) rounded * weight) rounded``, where the norm kernel rounds: the GEMV's
  x preparations take them in place of the words they load.
- ``_emu_x`` (the interpreter's fp32 path): the same values one K index at a time.

The sum of squares runs in another order than the norm kernel's, so ``inv`` can differ
from it in its last bit, and a normed value then by one ulp of the model dtype where
it sits on a rounding boundary: equal to the unfused path up to that, not bit for bit.

``TOKENLOOM_INT4_FUSED_NORM=0`` (read at each call) keeps the norm kernel; ``qkv`` or
``gate_up`` folds only the norm before that projection.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.quant.kernels.int4_dp4a_asm import _x_words
from tokenloom.protocols.components.quant import AddNorm


def add_norm_on(layer: str | None = None) -> bool:
    """Whether the norm before ``layer`` ("qkv" or "gate_up"; None: either) folds in:
    ``TOKENLOOM_INT4_FUSED_NORM`` = 1 (both), qkv, gate_up or 0, read at each call."""
    on = os.environ.get("TOKENLOOM_INT4_FUSED_NORM", "1")
    return on != "0" and (on == "1" or layer is None or on == layer)


def add_norm_fits(x: torch.Tensor, norm: AddNorm, one_tile: bool) -> bool:
    """The one-row GEMV can take the norm: the row is one tile, and the residual, the
    sum's buffer and the weight are contiguous rows of x's width in x's dtype."""
    k = x.shape[1]
    rows = (norm.residual, norm.summed)
    return (
        one_tile
        and all(t.shape == (1, k) and t.stride(1) == 1 and t.dtype == x.dtype for t in rows)
        and norm.weight.shape == (k,)
        and norm.weight.stride(0) == 1
        and norm.weight.dtype == x.dtype
        and norm.summed.data_ptr() not in (x.data_ptr(), norm.residual.data_ptr())
    )


@triton.jit
def _norm_inv(x_ptr, r_ptr, sum_ptr, eps, K: tl.constexpr, KB: tl.constexpr):
    """``rsqrt(mean(h^2) + eps)`` of ``h = x + r`` rounded to x's dtype (the whole row,
    ``K`` values, ``KB`` its power of two); program 0 stores ``h`` into ``sum_ptr``."""
    offs = tl.arange(0, KB)
    mask = offs < K
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (h + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
    if tl.program_id(0) == 0:
        tl.store(sum_ptr + offs, h, mask=mask)
    hf = h.to(tl.float32)
    return tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)


@triton.jit
def _normed(h, w, inv):
    """One normed value as fp32, rounded where the norm kernel rounds (bf16)."""
    return ((h * inv).to(tl.bfloat16).to(tl.float32) * w).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _norm_word(d, r, w, inv):
    """A bf16x2 word of the normed row from the words of x, the residual and the weight."""
    lo = (d << 16).to(tl.float32, bitcast=True) + (r << 16).to(tl.float32, bitcast=True)
    hi = (d & -65536).to(tl.float32, bitcast=True) + (r & -65536).to(tl.float32, bitcast=True)
    lo = _normed(lo.to(tl.bfloat16).to(tl.float32), (w << 16).to(tl.float32, bitcast=True), inv)
    hi = _normed(hi.to(tl.bfloat16).to(tl.float32), (w & -65536).to(tl.float32, bitcast=True), inv)
    # bf16 values in fp32 have 16 zero low bits: the halves' bits are their high ones
    return ((lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (
        hi.to(tl.int32, bitcast=True) & -65536
    )


@triton.jit
def _normed_words(d, r, w, inv):
    """The 16 words of an element of the normed row (``_x_words``' order) from those of
    x (``d``), the residual and the weight."""
    return [_norm_word(d[0], r[0], w[0], inv), _norm_word(d[1], r[1], w[1], inv),
            _norm_word(d[2], r[2], w[2], inv), _norm_word(d[3], r[3], w[3], inv),
            _norm_word(d[4], r[4], w[4], inv), _norm_word(d[5], r[5], w[5], inv),
            _norm_word(d[6], r[6], w[6], inv), _norm_word(d[7], r[7], w[7], inv),
            _norm_word(d[8], r[8], w[8], inv), _norm_word(d[9], r[9], w[9], inv),
            _norm_word(d[10], r[10], w[10], inv), _norm_word(d[11], r[11], w[11], inv),
            _norm_word(d[12], r[12], w[12], inv), _norm_word(d[13], r[13], w[13], inv),
            _norm_word(d[14], r[14], w[14], inv), _norm_word(d[15], r[15], w[15], inv)]  # fmt: skip


@triton.jit
def _emu_x(x_ptr, idx, mask, r_ptr, nw_ptr, inv, NORM: tl.constexpr):
    """The interpreter: x at ``idx`` as fp32, with ``NORM`` normed (rounded to x's dtype
    where the norm kernel rounds)."""
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        dt = x_ptr.dtype.element_ty
        h = (x + tl.load(r_ptr + idx, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        w = tl.load(nw_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        x = ((h * inv).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
    return x


@triton.jit
def _emu_word(w, x_ptr, k, mask, r_ptr, nw_ptr, inv, NORM: tl.constexpr):
    """Interpreter: one word's 8 products ``(q - 8) x`` at K offset ``k`` (fp32)."""
    part = tl.zeros(w.shape, tl.float32)
    for j in tl.static_range(8):
        xj = _emu_x(x_ptr, k + j, mask, r_ptr, nw_ptr, inv, NORM)
        part += (((w >> (4 * j)) & 0xF) - 8).to(tl.float32) * xj[None, :]
    return part


@triton.jit
def _emu_xsum(x_ptr, k, mask, r_ptr, nw_ptr, inv, NORM: tl.constexpr):
    xs = tl.zeros(k.shape, tl.float32)
    for j in tl.static_range(32):
        xs += _emu_x(x_ptr, k + j, mask, r_ptr, nw_ptr, inv, NORM)
    return xs


@triton.jit
def _x_in(x32, kw, mask, r_ptr, nw_ptr, inv, NORM: tl.constexpr):
    """The PTX paths' 16 words of x from word ``kw`` of each element; with ``NORM`` of
    the normed row (``int4_add_norm``)."""
    words = _x_words(x32, kw, mask)
    if NORM:
        r32 = r_ptr.to(tl.pointer_type(tl.int32))
        w32 = nw_ptr.to(tl.pointer_type(tl.int32))
        words = _normed_words(words, _x_words(r32, kw, mask), _x_words(w32, kw, mask), inv)
    return words
