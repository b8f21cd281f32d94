"""Paged prefill/extend attention over variable-length queries, no padding.

Runs after the KV write, so every key of every request (cached prefix and new
tokens alike) is read from the paged cache through the block table, with a causal
mask aligned to the end of the sequence. (The backend's ``prefill_fresh_16bit`` also
passes the step's own 16-bit keys and values as a "cache" of one-token pages, with a
table of each request's rows, for requests with no cached prefix.) Grid ``(num_heads, T // BLOCK_M + B)``: the
second axis is an upper bound on the query tiles of the whole batch; request ``b``
owns tiles ``(query_start_loc[b] - query_start_loc[0]) // BLOCK_M + b`` onwards (always
enough of them), and each program finds its request by binary search over
``query_start_loc`` on the device, so nothing is read on the host. Unused tiles exit
at once. ``first_seq`` skips a batch's leading one-token requests (decodes, which go
to the decode kernel); it is an offset into the whole batch's metadata rather than
sliced tensors, and the batch-dependent integers are not specialised on, so one
compiled kernel serves every batch (a sliced pointer's alignment or a count's
divisibility would otherwise compile a new variant mid-run, about a second each).

A quantized cache (``KV_QUANT``, a compile-time switch: the unquantized kernel is
unchanged) is dequantized as in the decode kernel: scores scaled per key after the
first dot, probabilities per value before the second. With 16-bit queries an fp8
cache's values enter both dots as f16 (``KV_F16``, as in the decode kernel): e4m3
converts to f16 exactly in one step, where bf16 operands cost a second conversion per
element (``F2F.BF16.F16`` on sm_90, 128 a thread a 64 x 64 tile, session 37). The query
rows are shrunk below f16's range first and ``p * v_scale`` lifted by ``P_LIFT`` (so a
value row's absolute maximum may reach 448 * 65504 / 512, 57k, as in the decode). An int8
cache keeps the queries' dtype: Triton converts int8 to bf16 with integer tricks, and its
f16 conversion (``I2F.F16.S16``) compiled to more instructions (929 against 829 a tile,
offline) and spilled.

``KV_MMA8`` (``prefill_fp8_mma``, session 52): an fp8 cache whose values are stored
transposed (``V_T``) is multiplied in fp8 on the tensor cores, with no conversion of the
cache at all, as the fp8-MMA decode does (``decode_fp8_mma.py``) and as FlashAttention-3's
fp8 forward does. Here the query rows are the MMA's M side (64 a tile), as Hopper's fp8
MMA wants, and both operands are K-major as stored: K ``[N, D]`` (D contiguous) for
``q . K^T``, V^T ``[D, N]`` (tokens contiguous) for ``P . V``.
- Each query row enters as e4m3 scaled by its own absolute maximum (to 448); the
  scores undo it with the keys' per-token scales.
- ``P`` is taken relative to the tile's own row maximum (its largest is 1 in every
  tile, so a far larger earlier score, an attention sink, does not push a later tile's
  probabilities into e4m3's subnormals) and times each value's scale over the tile's
  largest (times 448), rounded to e4m3; both are undone on the tile's product. The
  softmax sums use the unrounded probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.attention import kv_quant
from tokenloom.plugins.attention.triton_kernels.decode import P_LIFT
from tokenloom.plugins.attention.triton_kernels.decode_tile import FP8_MAX
from tokenloom.plugins.attention.triton_kernels.prefill_tile import (
    attend_tile,
    find_sequence,
    tile_meta,
)


@triton.jit(do_not_specialize=["num_seqs", "first_seq", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    first_seq,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    k_scale_ptr,
    v_scale_ptr,
    stride_scale_block,
    scale_log2,  # softmax scale * log2(e)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    V_T: tl.constexpr = False,
    KV_F16: tl.constexpr = False,
    P_LIFT: tl.constexpr = 1.0,
    KV_MMA8: tl.constexpr = False,
    AHEAD: tl.constexpr = False,
    SCALE_RUN: tl.constexpr = 1,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    query_start_loc_ptr += first_seq
    seq_lens_ptr += first_seq
    block_tables_ptr += first_seq.to(tl.int64) * stride_bt
    num_seqs -= first_seq
    base = tl.load(query_start_loc_ptr)
    seq = find_sequence(query_start_loc_ptr, base, num_seqs, tile, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    row0 = (tile - ((q_start - base) // BLOCK_M + seq)) * BLOCK_M  # request-local first row
    if row0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    query_pos = prefix + offs_m  # [BLOCK_M] absolute positions
    row_scale = tl.full([BLOCK_M], scale_log2, tl.float32)
    if KV_F16:  # rows beyond f16's range are shrunk first; the scores undo it
        qf = q.to(tl.float32)
        q_shrink = tl.minimum(32768.0 / tl.maximum(tl.max(tl.abs(qf), 1), 1e-30), 1.0)
        q = (qf * q_shrink[:, None]).to(tl.float16)
        row_scale = row_scale / q_shrink
    if KV_MMA8:  # each row as e4m3 over its own absolute maximum; the scores undo it
        qf = q.to(tl.float32)
        q_max = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30)
        q_lift = FP8_MAX / q_max
        q = (qf * q_lift[:, None]).to(tl.float8e4nv)
        row_scale = row_scale * (q_max / FP8_MAX)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    head_off = (head // GROUP) * stride_cache_head
    # Keys before the tile's first query position are visible to every row: no mask.
    unmasked_end = ((prefix + row0) // BLOCK_N) * BLOCK_N
    causal_end = tl.minimum(prefix + row0 + BLOCK_M, seq_len)
    if AHEAD:  # each unmasked tile's blocks and scales loaded a tile ahead, carried; the
        # last one's look-ahead loads it again (dropped). The loads are unmasked, so they
        # read only the sequence's own pages: none at all with no unmasked tile (the table
        # past a short prompt's pages is another row's, or past the table's end)
        if unmasked_end > 0:
            last = unmasked_end - BLOCK_N
            block, k_s, v_s = tile_meta(
                table, 0, k_scale_ptr, v_scale_ptr, head // GROUP, stride_scale_block, BLOCK_N,
                PAGE_SIZE, KV_QUANT, SCALE_RUN,
            )  # fmt: skip
            for n0 in range(0, unmasked_end, BLOCK_N):
                block_next, k_s_next, v_s_next = tile_meta(
                    table, tl.minimum(n0 + BLOCK_N, last), k_scale_ptr, v_scale_ptr,
                    head // GROUP, stride_scale_block, BLOCK_N, PAGE_SIZE, KV_QUANT, SCALE_RUN,
                )  # fmt: skip
                acc, m_i, l_i = attend_tile(
                    q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, table, head_off,
                    stride_cache_block, stride_cache_tok, query_pos, seq_len, scale_log2,
                    row_scale, offs_d, mask_d, k_scale_ptr, v_scale_ptr, head // GROUP,
                    stride_scale_block, BLOCK_N, PAGE_SIZE, False, DOT_PRECISION,
                    KV_QUANT, HEAD_DIM, V_T, KV_F16, P_LIFT, KV_MMA8, AHEAD, block, k_s, v_s,
                )  # fmt: skip
                block, k_s, v_s = block_next, k_s_next, v_s_next
    else:
        for n0 in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, table, head_off,
                stride_cache_block, stride_cache_tok, query_pos, seq_len, scale_log2,
                row_scale, offs_d, mask_d, k_scale_ptr, v_scale_ptr, head // GROUP,
                stride_scale_block, BLOCK_N, PAGE_SIZE, False, DOT_PRECISION,
                KV_QUANT, HEAD_DIM, V_T, KV_F16, P_LIFT, KV_MMA8,
            )  # fmt: skip
    for n0 in range(unmasked_end, causal_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, n0, k_cache_ptr, v_cache_ptr, table, head_off,
            stride_cache_block, stride_cache_tok, query_pos, seq_len, scale_log2,
            row_scale, offs_d, mask_d, k_scale_ptr, v_scale_ptr, head // GROUP, stride_scale_block,
            BLOCK_N, PAGE_SIZE, True, DOT_PRECISION, KV_QUANT, HEAD_DIM,
            V_T, KV_F16, P_LIFT, KV_MMA8,
        )  # fmt: skip

    # Padding rows (seq_len 0) saw no key: write zeros, not NaN.
    if KV_F16:
        acc = acc * (1.0 / P_LIFT)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, rows of q
    out: torch.Tensor,  # [T, num_heads, head_dim], rows of requests first_seq: written
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
    first_seq: int = 0,
    kv_f16: bool = True,
    fp8_mma: bool = False,
    meta_ahead: bool = False,
) -> None:
    """Launch the prefill kernel for requests ``first_seq:`` of these tables (their
    rows of ``q`` from ``query_start_loc``). The grid counts ``q``'s rows from
    ``first_seq`` on, exact when the requests before them have one query token each;
    where they have more, or rows of ``q`` follow the last request, the surplus tiles
    exit at once. No host sync: the grid comes from shapes and ``first_seq`` only. ``kv_f16``: an fp8 cache's products in f16 where the queries are
    16-bit (else in the queries' dtype). ``fp8_mma``: an fp8 cache's products in fp8
    (``KV_MMA8``) where its values are stored transposed, the queries are 16-bit and
    ``block_n`` and the head size are 32 or more (it then takes precedence over
    ``kv_f16``). ``meta_ahead``: an 8-bit cache's unmasked tiles' blocks and scales loaded
    a tile ahead, in registers (a 16-bit cache has no scales: never)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_tokens = q.shape[0] - first_seq
    num_seqs = seq_lens.shape[0] - first_seq
    if num_tokens <= 0 or num_seqs <= 0:
        return
    num_kv_heads = k_cache.shape[2]
    quantized = kv_quant.is_quantized(k_cache.dtype)
    k_scales = kv_quant.scales_of(k_cache) if quantized else k_cache
    v_scales = kv_quant.scales_of(v_cache) if quantized else v_cache
    grid = (num_heads, num_tokens // block_m + num_seqs)
    # a head's scales in runs of 16 tokens from a multiple of 16 (kv_quant.scales_of): the
    # look-ahead loads them as vectors where pages and the blocks' stride are whole runs
    page_size = k_cache.shape[1]
    runs = quantized and page_size % 16 == 0 and block_n % 16 == 0
    scale_run = 16 if runs and k_scales.stride(0) % 16 == 0 else 1
    fp8 = k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32
    # Triton's fp8 dots take K >= 32: head_dim for q . K^T, the KV tile for P . V
    mma8 = fp8 and fp8_mma and kv_quant.v_transposed(v_cache) and min(block_n, head_dim) >= 32
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        seq_lens.shape[0],
        first_seq,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scales,
        v_scales,
        k_scales.stride(0) if quantized else 0,
        scale * 1.4426950408889634,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE_SIZE=k_cache.shape[1],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_QUANT=quantized,
        V_T=kv_quant.v_transposed(v_cache),
        KV_F16=fp8 and kv_f16 and not mma8,
        P_LIFT=P_LIFT.get(k_cache.dtype, 1.0),
        KV_MMA8=mma8,
        AHEAD=meta_ahead and quantized,
        SCALE_RUN=scale_run,
        num_warps=num_warps,
        num_stages=num_stages,
    )
