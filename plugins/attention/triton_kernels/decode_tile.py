"""The decode kernel's pieces (``decode.py``): a program's slice of the KV, the 8-bit
cache's conversion to f16 dot operands, and the steps of one KV tile (scores, the online
softmax, the weighted values), shared by the loop and by the first tile that
``PREFETCH`` reads before the PDL wait.

``PREFETCH`` (session 20): at small batches the decode kernel is a chain of dependent
reads (the request's length, its block table, then its keys and values), each a DRAM or
L2 round trip after the wait. Under PDL every kernel releases its successor only after
its own wait (``pdl.py``), so when this kernel starts, every kernel but the one before it
has finished: the length and block table (written before the step) and the cache of
every earlier token are final, and only the new token's key and value (which the kernel
before writes) are not. The first tile is therefore read before the wait without that
token, which is read after it.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value


@triton.jit
def _split_length(seq_len, num_splits, min_split, BLOCK_N: tl.constexpr):
    # Splits are whole BLOCK_N tiles so that no tile straddles two programs, and at
    # least ``min_split`` tokens (a multiple of BLOCK_N): a short KV stays in fewer
    # programs, which skips the partials and the merge.
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_split)


@triton.jit
def kv_slice(seq_lens_ptr, seq, split, num_splits, min_split, BLOCK_N: tl.constexpr):
    """(length, active splits, first token, end) of program ``split``'s slice of ``seq``."""
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_length(seq_len, num_splits, min_split, BLOCK_N)
    num_active = tl.cdiv(seq_len, tl.maximum(split_len, 1))
    kv_start = split * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)
    return seq_len, num_active, kv_start, kv_end


@triton.jit
def kv_tokens(table, offs_n, mask_n, head_off, kv_head, stride_cache_block, stride_cache_tok,
              stride_scale_block, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
              HEAD_DIM: tl.constexpr, V_T: tl.constexpr):  # fmt: skip
    """Where a tile's tokens sit: their offsets in the key cache (this KV head's rows), in
    the value cache (the same, or with ``V_T`` in pages stored ``[heads, D, tokens]``,
    whose d stride is ``PAGE_SIZE``: ``kv_quant.v_transposed``) and in the scales."""
    block = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    tok = block * stride_cache_block + (offs_n % PAGE_SIZE) * stride_cache_tok + head_off
    s_off = block * stride_scale_block + kv_head * PAGE_SIZE + offs_n % PAGE_SIZE
    if V_T:
        v_tok = block * stride_cache_block + (offs_n % PAGE_SIZE) + kv_head * (HEAD_DIM * PAGE_SIZE)
    else:
        v_tok = tok
    return tok, v_tok, s_off


# fp8 e4m3 -> f16, four values: two hardware conversions of two values each.
_FP8X4_TO_F16 = tl.constexpr(
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
    "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
)
# int8 -> f16, four values: each byte, offset by 128, becomes the low byte of the f16
# 1024 + (b + 128) (a byte permute with 0x64 as high byte), then 1,152 is subtracted
# from both halves at once. Exact: f16 holds every integer below 2,048.
_INT8X4_TO_F16 = tl.constexpr(
    "{ .reg .b32 t, lo, hi, c; xor.b32 t, $2, 0x80808080; "
    "prmt.b32 lo, t, 0x64646464, 0x4140; prmt.b32 hi, t, 0x64646464, 0x4342; "
    "mov.b32 c, 0x64806480; sub.f16x2 $0, lo, c; sub.f16x2 $1, hi, c; }"
)


# Four 8-bit values (one 32-bit register) to four f16 (two registers) through ``ASM``.
# Not marked pure on purpose: Triton moves a layout change above a pure elementwise op
# to the narrower type, which for an 8-bit tile means one 1-byte shared-memory load per
# value (``LDS.U8``). Opaque, the tile is converted in the layout it was loaded in and
# reaches the dot as f16, through 16-byte stores and ``ldmatrix`` like a 16-bit cache.
@triton.jit
def _x4_to_f16(x, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm=ASM, constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4
    )


@triton.jit
def _kv_to_f16(x, KV_ASM: tl.constexpr):
    """An 8-bit KV tile as f16 dot operands (exact for e4m3 and int8 values)."""
    if KV_ASM:
        if x.dtype == tl.int8:
            return _x4_to_f16(x, _INT8X4_TO_F16)
        return _x4_to_f16(x.to(tl.uint8, bitcast=True), _FP8X4_TO_F16)
    return x.to(tl.float16)


@triton.jit
def tile_scores(q, k, row_scale, scale_log2, KV_F16: tl.constexpr, KV_ASM: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """``q [H, D]`` against a key tile ``[D, N]``: scores ``[H, N]`` in base 2."""
    if KV_F16:
        return tl.dot(q, _kv_to_f16(k, KV_ASM)) * row_scale[:, None]
    return tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2


@triton.jit
def softmax_step(qk, mask_n, m_i, l_i):
    """The online softmax over one tile's scores: (probabilities, the rescale of what came
    before, the running max, the running sum)."""
    qk = tl.where(mask_n[None, :], qk, float("-inf"))  # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def value_step(acc, p, alpha, v, v_scale, dtype: tl.constexpr, KV_QUANT: tl.constexpr,
               KV_F16: tl.constexpr, P_LIFT: tl.constexpr, KV_ASM: tl.constexpr,
               DOT_PRECISION: tl.constexpr):  # fmt: skip
    """``acc`` rescaled plus ``p`` times a value tile ``[N, D]`` (``v_scale`` per token with
    an 8-bit cache; with f16 operands ``p * v_scale`` lifted by ``P_LIFT``, undone after
    the loop)."""
    if KV_QUANT:
        if KV_F16:  # p * scale in f16, lifted into its normal range
            p = p * (v_scale * P_LIFT)[None, :]
        else:
            p = p * v_scale[None, :]
    if KV_F16:
        pv = tl.dot(p.to(tl.float16), _kv_to_f16(v, KV_ASM))
    else:
        pv = tl.dot(p.to(dtype), v.to(dtype), input_precision=DOT_PRECISION)
    return acc * alpha[:, None] + pv


@triton.jit
def finish_split(acc, m_i, l_i, seq, kv_head, split, num_active, num_splits, heads, mask_h,
                 offs_d, mask_hd, out_ptr, out_offs, part_out_ptr, part_lse_ptr, counters_ptr,
                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """A program's end: its output ``acc [BLOCK_H, D] / l_i`` where it holds the whole KV,
    else its partial and log-sum-exp (base 2), then a count of the splits done (an
    acquire-release atomic); the last to arrive merges the splits by log-sum-exp, writes
    the output and resets the counter to zero for the next launch."""
    if num_active == 1:  # the whole KV in this program: no partials to merge
        tl.store(
            out_ptr + out_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_hd
        )
        return

    row0 = (seq * NUM_HEADS + heads) * num_splits  # [BLOCK_H]
    row = row0 + split
    tl.store(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=mask_hd
    )
    tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=mask_h)
    # Release our partials, acquire everyone else's: the last to arrive merges. The
    # barrier makes every thread's stores precede the (one-thread) release.
    tl.debug_barrier()
    counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived != num_active - 1:
        return
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    merged = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for other in range(0, num_active):
        lse = tl.load(part_lse_ptr + row0 + other, mask=mask_h, other=0.0)
        part = tl.load(
            part_out_ptr + (row0 + other)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask_hd,
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        merged = merged * alpha[:, None] + weight[:, None] * part
        denom = denom * alpha + weight
        m = m_new
    result = merged / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=mask_hd)
    tl.atomic_xchg(counter, 0, sem="relaxed")
