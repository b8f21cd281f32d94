"""The prefill kernel's pieces (``prefill.py``): a program's request, one KV tile's
attention (scores, the online softmax, the weighted values, in 16-bit, f16 or fp8
products), and the blocks and scales of the tile ahead that ``AHEAD`` carries.

``AHEAD`` (``prefill_meta_ahead``, session 52): Triton's pipeliner copies a tile's
block numbers a stage ahead, but an 8-bit cache's per-token scales feed no dot, so
they stay plain loads the tile waits on. With ``GIVEN`` the caller loads them
(``tile_meta``) a tile early, in registers the loop carries; the arithmetic is the same.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenloom.plugins.attention.triton_kernels.decode_tile import FP8_MAX


@triton.jit
def find_sequence(query_start_loc_ptr, base, num_seqs, tile, BLOCK_M: tl.constexpr):
    # The last b with (query_start_loc[b] - base) // BLOCK_M + b <= tile.
    lo = base * 0  # an int32 tensor, as the loop needs
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = (tl.load(query_start_loc_ptr + mid) - base) // BLOCK_M + mid
        take = first_tile <= tile
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    return lo


@triton.jit
def attend_tile(
    q,
    acc,
    m_i,
    l_i,
    n0,
    k_cache_ptr,
    v_cache_ptr,
    table,
    head_off,
    stride_cache_block,
    stride_cache_tok,
    query_pos,
    seq_len,
    scale_log2,
    row_scale,  # [BLOCK_M] scale_log2 over a KV_F16 query's shrink (else unused)
    offs_d,
    mask_d,
    k_scale_ptr,
    v_scale_ptr,
    kv_head,  # scales are [heads, PAGE_SIZE] per block (kv_quant.scales_of)
    stride_scale_block,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_T: tl.constexpr,  # values stored [heads, D, tokens] per page (kv_quant.v_transposed)
    KV_F16: tl.constexpr,  # an fp8 cache's values enter both dots as f16 (q too)
    P_LIFT: tl.constexpr,
    KV_MMA8: tl.constexpr = False,  # both dots in fp8 (q e4m3 already; needs V_T)
    GIVEN: tl.constexpr = False,  # the tile's blocks and scales loaded by the caller
    block_in=None,  # (tile_meta, a tile ahead)
    k_s_in=None,
    v_s_in=None,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < seq_len
    # With V_T, page-wide masks keep V^T's 16-token rows whole (no byte gathers); the
    # tiles before the causal ones hold only tokens of the sequence: no mask at all.
    if GIVEN:
        block = block_in
    elif V_T and not CAUSAL:
        block = tl.load(table + offs_n // PAGE_SIZE).to(tl.int64)
    elif V_T:
        page_ok = offs_n // PAGE_SIZE < tl.cdiv(seq_len, PAGE_SIZE)
        block = tl.load(table + offs_n // PAGE_SIZE, mask=page_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    tok = block * stride_cache_block + (offs_n % PAGE_SIZE) * stride_cache_tok + head_off
    k = tl.load(
        k_cache_ptr + tok[None, :] + offs_d[:, None],
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )  # [BLOCK_D, BLOCK_N]
    if KV_MMA8:
        qk = tl.dot(q, k) * row_scale[:, None]
    elif KV_F16:
        qk = tl.dot(q, k.to(tl.float16)) * row_scale[:, None]
    else:
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
    if KV_QUANT and GIVEN:
        qk = qk * k_s_in[None, :]
    elif KV_QUANT:
        s_off = block * stride_scale_block + kv_head * PAGE_SIZE + offs_n % PAGE_SIZE
        qk = qk * tl.load(k_scale_ptr + s_off, mask=mask_n, other=0.0)[None, :]
    if CAUSAL:
        visible = (offs_n[None, :] <= query_pos[:, None]) & mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))  # [BLOCK_M, BLOCK_N]
    m_tile = tl.max(qk, 1)
    m_new = tl.maximum(m_i, m_tile)
    alpha = tl.exp2(m_i - m_new)
    if KV_MMA8:  # p relative to the tile's own row maximum (a row all masked: zeros)
        m_tile = tl.where(m_tile == float("-inf"), m_new, m_tile)
        p = tl.exp2(qk - m_tile[:, None])
        p_scale = tl.exp2(m_tile - m_new)  # [BLOCK_M]: the tile's p back to m_new's
        l_i = l_i * alpha + tl.sum(p, 1) * p_scale
    else:
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
    if V_T:
        v_tok = block * stride_cache_block + (offs_n % PAGE_SIZE)
        v_ptrs = v_cache_ptr + (v_tok + kv_head * (HEAD_DIM * PAGE_SIZE))[:, None]
        v_ptrs += offs_d[None, :] * PAGE_SIZE
    else:
        v_ptrs = v_cache_ptr + tok[:, None] + offs_d[None, :]
    if V_T:  # [BLOCK_N, BLOCK_D]; in a causal tile, slots past the end zeroed (0 * NaN)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
        if CAUSAL:
            v = tl.where(mask_n[:, None], v.to(tl.uint8, bitcast=True), 0)
            v = v.to(v_cache_ptr.dtype.element_ty, bitcast=True)
    else:
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    if KV_QUANT:
        if GIVEN:
            v_scale = v_s_in
        else:
            s_off = block * stride_scale_block + kv_head * PAGE_SIZE + offs_n % PAGE_SIZE
            v_scale = tl.load(v_scale_ptr + s_off, mask=mask_n, other=0.0)
        if KV_MMA8:  # the values' scales over the tile's largest, times e4m3's largest
            v_max = tl.maximum(tl.max(v_scale, 0), 1e-30)
            v_scale = v_scale * (FP8_MAX / v_max)
            p_scale = p_scale * (v_max / FP8_MAX)
        if KV_F16:  # p * scale in f16, lifted into its normal range (undone at the end)
            v_scale = v_scale * P_LIFT
        p = p * v_scale[None, :]
    if KV_MMA8:
        pv = tl.dot(p.to(tl.float8e4nv), v) * p_scale[:, None]
    elif KV_F16:
        pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def tile_meta(
    table, n0, k_scale_ptr, v_scale_ptr, kv_head, stride_scale_block, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_QUANT: tl.constexpr, SCALE_RUN: tl.constexpr,
):  # fmt: skip
    """The blocks and (``KV_QUANT``) the keys' and values' scales of the tile at ``n0``, a
    tile of the sequence's own tokens (no mask), for ``attend_tile(GIVEN=True)``. A
    ``SCALE_RUN`` over 1: each head's scales run that many tokens from a multiple of it
    (pages and block strides in whole runs), which lets Triton load them as vectors."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    block = tl.load(table + offs_n // PAGE_SIZE).to(tl.int64)
    if KV_QUANT:
        s_off = block * stride_scale_block + kv_head * PAGE_SIZE + offs_n % PAGE_SIZE
        if SCALE_RUN > 1:
            s_off = tl.max_contiguous(tl.multiple_of(s_off, SCALE_RUN), SCALE_RUN)
        k_s = tl.load(k_scale_ptr + s_off)
        v_s = tl.load(v_scale_ptr + s_off)
    else:
        k_s = tl.zeros([BLOCK_N], tl.float32)
        v_s = tl.zeros([BLOCK_N], tl.float32)
    return block, k_s, v_s
