"""The int8 GEMV over weights stored row-major, ``[N, K]`` (each output channel's K
weights contiguous): one to four rows of ``x`` (decode), no K split.

Why a second layout (session 16). The profile's critical path at batch 1 (one H200,
Llama-3-8B, PDL: what each kernel added to the step) put the bf16 one-row GEMV
(``skinny_gemm.gemv``, ``[N, K]``) at 91-100% of the copy bandwidth in the engine, and the
int8 GEMVs over the transposed ``[K, N]`` storage at 58-59% (qkv, o) and 75-84% (down,
gate_up). Over ``[K, N]`` a program's columns are a short run of every row, so a narrow
layer needs a K split for enough programs, and with it a second pass: the partial sums,
an arrival counter and the last split's sum, on the critical path of every GEMV. Over
``[N, K]`` a program owns ``BLOCK_N`` whole rows, streams them with the next tile in
flight (a register double buffer) and reduces once, at the end: the bf16 kernel's
structure, which needs no split (4,096 rows make 512 programs of 8).

The weights are read as int32 words of four consecutive K values, two words a load;
each weight becomes a float by one ``prmt`` into the mantissa of 2^23 and one
subtraction (``int8_word_floats``), or with ``B15`` as ``2^15 + 128 + q`` with the bias
taken off once per word (the tuner's tilings since session 17: 59.4 against 62.9 us a
Llama-3-8B layer on the H200, for ~1e-4 of the output). A 16-bit x is read as int64 words (its four values for a weight
word), two a load: with a tile row of 256 K per warp, that load takes the layout the
FMAs need, so x never goes through shared memory (offline sm_90). The per-channel scale
multiplies the sum once. With ``ROWS`` > 1 a program computes that many rows of ``x``
from one read of its weights (decode batches of 2-16). The other int8 kernels (``weight_gemm``'s tiles, the
whole-weight dequantization) read the same storage through its strides, as the
transposed view ``[K, N]`` (``qweight.t()``) that ``quantize_int8`` returns.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import (
    early_release,
    launch_options,
    release,
    release_early,
    wait,
)
from tokenloom.plugins.quant.kernels.gemm_config import GemmConfig
from tokenloom.plugins.quant.kernels.gemv_weights import four_floats, int8_word_floats
from tokenloom.plugins.quant.kernels.int4_qkv_rope import rope_fits
from tokenloom.plugins.quant.kernels.one_row_epilogue import (
    epilogue_args,
    outputs_and_programs,
    program_rows,
    store_outputs,
)
from tokenloom.protocols.components.quant import QkvRope


def row_major(qweight: torch.Tensor) -> bool:
    """Whether an int8 ``qweight`` (the logical ``[K, N]``) is stored ``[N, K]``: the
    transposed view of a contiguous ``[N, K]`` tensor."""
    k, n = qweight.shape
    return (
        qweight.dtype == torch.int8
        and qweight.stride(0) == 1
        and (qweight.stride(1) == k or n == 1)
        and (k > 1 or qweight.is_contiguous())
    )


@triton.jit
def _x_row(x_ptr, x64_ptr, m, M, KW, stride_xm, stride_x64):
    """Row ``m`` of x: its start (16-bit and int64 views) and the words it has (0 past M)."""
    return x_ptr + m * stride_xm, x64_ptr + m * stride_x64, tl.where(m < M, KW, 0)


@triton.jit
def _x_floats(x_row, x64_row, lim, kw, X64: tl.constexpr):
    """A row of x (``_x_row``) at ``4 kw + i``, i = 0..3, as four fp32 vectors (zeros from
    word ``lim`` on). ``X64``: 16-bit x read as one int64 per word (four values, 8 bytes a
    load), its halves widened by bit moves (bf16) or a cast (f16); else four strided loads."""
    if X64:
        v = tl.load(x64_row + kw, mask=kw < lim, other=0)
        if x_row.dtype.element_ty == tl.bfloat16:  # bf16 bits << 16 are the fp32 bits
            x0 = ((v & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
            x1 = (v & 0xFFFF0000).to(tl.int32).to(tl.float32, bitcast=True)
            x2 = ((v >> 16) & 0xFFFF0000).to(tl.int32).to(tl.float32, bitcast=True)
            x3 = ((v >> 32) & 0xFFFF0000).to(tl.int32).to(tl.float32, bitcast=True)
        else:
            x0 = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x1 = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x2 = (v >> 32).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x3 = (v >> 48).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        row = x_row + 4 * kw
        x0 = tl.load(row, mask=kw < lim, other=0.0).to(tl.float32)
        x1 = tl.load(row + 1, mask=kw < lim, other=0.0).to(tl.float32)
        x2 = tl.load(row + 2, mask=kw < lim, other=0.0).to(tl.float32)
        x3 = tl.load(row + 3, mask=kw < lim, other=0.0).to(tl.float32)
    return x0, x1, x2, x3


# PTX for four int8 weights in one register ($4) -> the floats 2^15 + (q + 128) ($0..$3):
# the byte, offset binary after the xor, under the exponent of 2^15 at mantissa bits 8-15
# (the ulp of 2^15 is 2^-8, so the byte's unit is 1 there: 2^15 + b exactly).
_B15_ASM = tl.constexpr(
    "{ .reg .b32 t; xor.b32 t, $4, 0x80808080; "
    "prmt.b32 $0, t, 0x47000000, 0x7404; prmt.b32 $1, t, 0x47000000, 0x7414; "
    "prmt.b32 $2, t, 0x47000000, 0x7424; prmt.b32 $3, t, 0x47000000, 0x7434; }"
)


@triton.jit
def _word_floats(w, ASM: tl.constexpr, B15: tl.constexpr):
    """The four weights of each word: ``q`` exactly (``int8_word_floats``), or with ``B15``
    ``2^15 + 128 + q`` (no subtraction per weight: ``_row_fma`` takes the bias off per
    word)."""
    if not B15:
        return int8_word_floats(w, ASM)
    if ASM:
        return four_floats(w, _B15_ASM)
    t = w ^ -0x7F7F7F80  # 0x80808080 as an int32: offset binary
    f0 = (((t & 0xFF) << 8) | 0x47000000).to(tl.float32, bitcast=True)
    f1 = ((t & 0xFF00) | 0x47000000).to(tl.float32, bitcast=True)
    f2 = (((t >> 8) & 0xFF00) | 0x47000000).to(tl.float32, bitcast=True)
    f3 = (((t >> 16) & 0xFF00) | 0x47000000).to(tl.float32, bitcast=True)
    return f0, f1, f2, f3


@triton.jit
def _row_fma(acc, f0, f1, f2, f3, x_row, x64_row, lim, kw, X64, B15):
    """``acc + sum_i q_i x_i``: a word's four weights chain into one accumulator. With
    ``B15`` the chain starts at ``-(2^15 + 128) sum_i x_i`` (per word column, shared by
    the tile's rows) and is added to ``acc`` once: the bias goes per word, so the chain's
    rounding stays ~2^-9 of |x| per term whatever the sum of x over K."""
    x0, x1, x2, x3 = _x_floats(x_row, x64_row, lim, kw, X64)
    if B15:
        chain = f0 * x0[None, :] + (((x0 + x1) + (x2 + x3)) * -32896.0)[None, :]
        chain += f1 * x1[None, :]
        chain += f2 * x2[None, :]
        chain += f3 * x3[None, :]
        acc += chain
    else:
        acc += f0 * x0[None, :]
        acc += f1 * x1[None, :]
        acc += f2 * x2[None, :]
        acc += f3 * x3[None, :]
    return acc


@triton.jit
def _store_row(acc, y_ptr, m, M, offs_n, N, scale, bias, stride_ym, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, axis=1) * scale
    if HAS_BIAS:
        y += bias
    lim = tl.where(m < M, N, 0)  # a row past M writes nothing
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < lim)


@triton.jit
def _int8_gemv_nk_kernel(
    x_ptr,
    x64_ptr,  # X64: x as int64 words [M, K / 4]
    qw_ptr,  # int32 words [N, K / 4]: four consecutive K weights of one channel each
    s_ptr,  # fp32 [N]
    b_ptr,
    y_ptr,  # [M, N]
    M,
    N,
    KW,  # K / 4
    stride_xm,
    stride_x64,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,  # rows of x per program: 1, 2 or 4
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # words of a tile row (4 weights each)
    X64: tl.constexpr,
    ASM: tl.constexpr,  # int8_word_floats' PTX (a CUDA GPU)
    USE_PDL: tl.constexpr = False,
    B15: tl.constexpr = False,  # weights as 2^15 + 128 + q, the bias off per word
    EARLY: tl.constexpr = False,  # release before the wait (pdl.next_reads_weights_first)
    # one row of x: the epilogues of one_row_epilogue (SILU: merged gate/up [2 NH, K] ->
    # silu(gate) * up [NH]; ROPE: merged q/k/v, q and k rotated, k and v into the cache)
    SILU: tl.constexpr = False,
    NH: tl.constexpr = 0,
    ROPE: tl.constexpr = False,
    HEAD_DIM: tl.constexpr = 0,
    NUM_Q: tl.constexpr = 0,
    NUM_KV: tl.constexpr = 0,
    cos_ptr=None,
    sin_ptr=None,
    k_cache_ptr=None,
    v_cache_ptr=None,
    slot_ptr=None,
):
    if EARLY:
        release_early(USE_PDL)
    m0 = tl.program_id(1) * ROWS
    base, offs_n, mask_n, row_off = program_rows(tl.program_id(0), N, KW, BLOCK_N, SILU, NH,
                                                 ROPE, HEAD_DIM)  # fmt: skip
    # two words (8 weights) a load: then the slice of this layout that x needs is the
    # layout x's own load of two int64 (16 bytes) takes, and x needs no shared memory
    offs_w = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_KW), 2), 2)
    w_rows = qw_ptr + offs_n[:, None].to(tl.int64) * KW
    w = tl.load(w_rows + offs_w[None, :], mask=mask_n[:, None] & (offs_w < KW)[None, :], other=0)
    wait(USE_PDL)  # the first tile is in flight; x comes from the kernel before
    if not EARLY:
        release(USE_PDL)
    acc0 = tl.zeros([BLOCK_N, BLOCK_KW], tl.float32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    xr0, xr64_0, lim0 = _x_row(x_ptr, x64_ptr, m0, M, KW, stride_xm, stride_x64)
    xr1, xr64_1, lim1 = _x_row(x_ptr, x64_ptr, m0 + 1, M, KW, stride_xm, stride_x64)
    xr2, xr64_2, lim2 = _x_row(x_ptr, x64_ptr, m0 + 2, M, KW, stride_xm, stride_x64)
    xr3, xr64_3, lim3 = _x_row(x_ptr, x64_ptr, m0 + 3, M, KW, stride_xm, stride_x64)
    for k0 in range(0, KW, BLOCK_KW):
        kw = k0 + offs_w
        nxt = kw + BLOCK_KW
        w_next = tl.load(w_rows + nxt[None, :], mask=mask_n[:, None] & (nxt < KW)[None, :], other=0)
        f0, f1, f2, f3 = _word_floats(w, ASM, B15)
        acc0 = _row_fma(acc0, f0, f1, f2, f3, xr0, xr64_0, lim0, kw, X64, B15)
        if ROWS > 1:
            acc1 = _row_fma(acc1, f0, f1, f2, f3, xr1, xr64_1, lim1, kw, X64, B15)
        if ROWS > 2:
            acc2 = _row_fma(acc2, f0, f1, f2, f3, xr2, xr64_2, lim2, kw, X64, B15)
            acc3 = _row_fma(acc3, f0, f1, f2, f3, xr3, xr64_3, lim3, kw, X64, B15)
        w = w_next
    scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    bias = tl.zeros_like(scale)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SILU or ROPE:  # one row (launch_int8_nk)
        y = tl.sum(acc0, axis=1) * scale
        if HAS_BIAS:
            y += bias
        store_outputs(y, y_ptr, tl.program_id(0), base, offs_n, mask_n, BLOCK_N, SILU, NH,
                      ROPE, HEAD_DIM, NUM_Q, NUM_KV, cos_ptr, sin_ptr, k_cache_ptr,
                      v_cache_ptr, slot_ptr)  # fmt: skip
        return
    _store_row(acc0, y_ptr, m0, M, offs_n, N, scale, bias, stride_ym, HAS_BIAS)
    if ROWS > 1:
        _store_row(acc1, y_ptr, m0 + 1, M, offs_n, N, scale, bias, stride_ym, HAS_BIAS)
    if ROWS > 2:
        _store_row(acc2, y_ptr, m0 + 2, M, offs_n, N, scale, bias, stride_ym, HAS_BIAS)
        _store_row(acc3, y_ptr, m0 + 3, M, offs_n, N, scale, bias, stride_ym, HAS_BIAS)


def nk_fits(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether this kernel serves ``qweight`` (int8 stored ``[N, K]``, rows of whole
    int32 words) for ``x``."""
    k = qweight.shape[0]
    return (
        row_major(qweight)
        and k % 4 == 0
        and qweight.stride(1) % 4 == 0  # rows of whole words (an N of 1 may have any stride)
        and qweight.storage_offset() % 4 == 0
        and x.stride(1) == 1
    )


def launch_int8_nk(
    x: torch.Tensor,
    qweight: torch.Tensor,  # the logical [K, N]: a view of [N, K] storage (nk_fits)
    scales: torch.Tensor,  # [1, N] fp32
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    num_warps: int,
    rows: int,
    biased: bool = False,
    silu: bool = False,
    rope: QkvRope | None = None,
) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight)^T (+ bias) -> [M, N]`` in ``x``'s dtype; ``biased``: the weights
    as ``2^15 + 128 + q`` (``_word_floats``), one subtraction per word, not per weight.
    One row only (``one_row_epilogue``): ``silu``, the rows are a merged gate/up projection
    and the result ``silu(gate) * up [1, N / 2]``; ``rope``, a merged q/k/v projection whose
    q and k come out rotated, k and v stored in the cache (``rope_fits``)."""
    m, k = x.shape
    n = qweight.shape[1]
    assert nk_fits(x, qweight) and rows in (1, 2, 4), (tuple(qweight.stride()), tuple(x.shape))
    if silu or rope is not None:
        assert m == 1 and rows == 1, (m, rows)
        assert rope is None or rope_fits(x, n, block_n, rope)
    outputs, programs = outputs_and_programs(n, block_n, silu)
    y = torch.empty(m, outputs, dtype=x.dtype, device=x.device)
    x64 = x.element_size() == 2 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0
    words = qweight.t().view(torch.int32)  # [N, K / 4]
    grid = (programs, triton.cdiv(m, rows))
    _int8_gemv_nk_kernel[grid](
        x,
        x.view(torch.int64) if x64 else x,
        words,
        scales,
        bias if bias is not None else scales,
        y,
        m,
        n,
        k // 4,
        x.stride(0),
        x.stride(0) // 4 if x64 else 0,
        y.stride(0),
        HAS_BIAS=bias is not None,
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_KW=max(1, min(block_k // 4, triton.next_power_of_2(k // 4))),
        X64=x64,
        ASM=x.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1",
        B15=biased,
        EARLY=early_release() and rows == 1,  # one row of x: as tested on the GPU
        num_warps=num_warps,
        **epilogue_args(n, block_n, silu, rope),
        **launch_options(x.device),
    )
    return y


def epilogues_on() -> bool:
    """The one-row epilogues (SiLU, rope) on unless ``TOKENLOOM_INT8_EPILOGUES=0`` (read at
    each call: fixed in a CUDA graph once captured)."""
    return os.environ.get("TOKENLOOM_INT8_EPILOGUES", "1") != "0"


def int8_nk_fused(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: GemmConfig,
    silu: bool = False,
    rope: QkvRope | None = None,
) -> torch.Tensor | None:
    """One row with an epilogue of the layer's own (``launch_int8_nk``'s ``silu`` or
    ``rope``), where ``cfg`` (the layer's tuned one-row tiling) runs this kernel and fits
    the call; None elsewhere (the caller then runs the plain GEMV and the elementwise
    kernel after it)."""
    n = qweight.shape[1]
    if not (epilogues_on() and cfg.nk and cfg.rows == 1 and cfg.fits(8, 0)):
        return None
    if x.shape[0] != 1 or not nk_fits(x, qweight):
        return None
    if silu and (n % 2 or cfg.block_n < 2):
        return None
    if rope is not None and not rope_fits(x, n, cfg.block_n, rope):
        return None
    return launch_int8_nk(
        x, qweight, scales, bias, cfg.block_n, cfg.block_k, cfg.num_warps, 1, cfg.biased,
        silu=silu, rope=rope,
    )  # fmt: skip
