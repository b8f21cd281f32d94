"""A one-row int8 GEMV in packed f16x2 arithmetic (session 15; offered to the tuner beside
``weight_gemv``'s fp32 GEMV unless ``TOKENLOOM_INT8_H2=0``).

``weight_gemv``'s int8 loop (``gemv_weights.int8_words_gemv``) spends a prmt, an fp32
subtraction and an fp32 FMA per weight (4.36 SASS instructions per weight on sm_90 with
its addressing). Here one word of four weights (``qweight [K, N]`` int8 read as int32
words of four output channels) costs an xor, two ``prmt`` that put its bytes under the
f16 exponent of 1,024 as two f16x2 pairs, two ``sub.f16x2`` (exact: ``q``) and two
``fma.rn.f16x2`` against the pair ``(x, x)``: 1.75 per weight before the flush.

Per program a tile is four sub-tiles of ``BLOCK_K / 4`` rows (as in ``int8_words_gemv``):
each thread chains the products of its row in the four in f16 (four products per
channel), then flushes the chain to fp32 accumulators. x is read one tile ahead.

**The range guard** is ``int4_gemv_h2``'s: each program reads its split of x first and
scales it by ``2^-shift`` so that the largest lies in [32, 64). A chain of four products
``q x 2^-shift`` with ``|q| <= 128`` stays below 2^15 (f16's largest finite is 65,504),
and activations down to 2^-19 of the split's largest keep f16's 11 bits. The output
is ``s * 2^shift * sum``, in fp32 from the chains on.

Measured (session 15, one H200, ``docs/quantization.md``): alone, no faster than the fp32
GEMV (68.7 against 67.1 us per Llama-3-8B layer, cold): at one row the int8 GEMV is
bound by memory latency, not by issue. In the engine, offered beside it, the int8 step
went 3.00 -> 2.95 ms (twice, same machine start), so the tuner keeps both.

On the CPU (the interpreter) ``ASM=False`` emulates the arithmetic (f16 rounding after
every product and every sum, where the GPU's ``fma.rn.f16x2`` rounds once).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import launch_options, release, wait
from tokenloom.plugins.quant.kernels.gemv_weights import (
    _int8_sub_tiles,
    _x_rows,
    channel_sums,
    int8_word_floats,
)
from tokenloom.plugins.quant.kernels.h2_common import _ptx, _range_shift, store_one_row

HEADROOM = tl.constexpr(5)  # the split's largest |x| scaled into [2^5, 2^6)


def int8_h2_offered() -> bool:
    """Whether the tuner measures this kernel (``TOKENLOOM_INT8_H2=0``: not)."""
    return os.environ.get("TOKENLOOM_INT8_H2", "1") != "0"


def int8_h2_fits(
    x: torch.Tensor, qweight: torch.Tensor, group: int, block_k: int, has_zeros: bool = False
) -> bool:
    """One row, symmetric per-channel int8 whose rows are whole int32 words (N % 4 == 0);
    on a GPU bf16 or fp16 activations on sm_80 or later; in the interpreter fp16 or fp32."""
    n = qweight.shape[1]
    if x.shape[0] != 1 or group != 0 or has_zeros or qweight.dtype != torch.int8:
        return False
    if n % 4 or block_k % 4:
        return False
    if not (qweight.is_contiguous() and qweight.storage_offset() % 4 == 0):
        return False
    if _ptx(x):
        return (
            x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device)[0] >= 8
        )
    return x.dtype in (torch.float16, torch.float32)


# four words ($4..$7, one row each of the four sub-tiles) against their x pairs ($8..$11,
# f16x2 (x, x)) -> the four channels' chains of four products, in f32 ($0..$3)
I8H2_ASM = tl.constexpr(
    "{ .reg .b32 t, a, b, p, q, k; .reg .b16 l, h;"
    " mov.b32 k, 0x64806480;"
    " xor.b32 t, $4, 0x80808080;"
    " prmt.b32 a, t, 0x64646464, 0x4140; prmt.b32 b, t, 0x64646464, 0x4342;"
    " sub.f16x2 a, a, k; sub.f16x2 b, b, k; mul.f16x2 p, a, $8; mul.f16x2 q, b, $8;"
    " xor.b32 t, $5, 0x80808080;"
    " prmt.b32 a, t, 0x64646464, 0x4140; prmt.b32 b, t, 0x64646464, 0x4342;"
    " sub.f16x2 a, a, k; sub.f16x2 b, b, k; fma.rn.f16x2 p, a, $9, p; fma.rn.f16x2 q, b, $9, q;"
    " xor.b32 t, $6, 0x80808080;"
    " prmt.b32 a, t, 0x64646464, 0x4140; prmt.b32 b, t, 0x64646464, 0x4342;"
    " sub.f16x2 a, a, k; sub.f16x2 b, b, k; fma.rn.f16x2 p, a, $10, p; fma.rn.f16x2 q, b, $10, q;"
    " xor.b32 t, $7, 0x80808080;"
    " prmt.b32 a, t, 0x64646464, 0x4140; prmt.b32 b, t, 0x64646464, 0x4342;"
    " sub.f16x2 a, a, k; sub.f16x2 b, b, k; fma.rn.f16x2 p, a, $11, p; fma.rn.f16x2 q, b, $11, q;"
    " mov.b32 {l, h}, p; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h;"
    " mov.b32 {l, h}, q; cvt.f32.f16 $2, l; cvt.f32.f16 $3, h; }"
)
PAIR_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $1, $1;")  # fp32 x -> the f16x2 pair (x, x)


@triton.jit
def _pair(x):
    return tl.inline_asm_elementwise(
        asm=PAIR_ASM, constraints="=r,f", args=[x], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _emu_chain(words, x, p0, p1, p2, p3):
    """Interpreter emulation of one word's four products added to the f16 chains."""
    q0, q1, q2, q3 = int8_word_floats(words, False)
    x16 = x.to(tl.float16)[:, None]
    p0 = (p0 + q0.to(tl.float16) * x16).to(tl.float16)
    p1 = (p1 + q1.to(tl.float16) * x16).to(tl.float16)
    p2 = (p2 + q2.to(tl.float16) * x16).to(tl.float16)
    p3 = (p3 + q3.to(tl.float16) * x16).to(tl.float16)
    return p0, p1, p2, p3


@triton.jit
def _chains(t0, t1, t2, t3, x0, x1, x2, x3, ASM: tl.constexpr):
    """The four channels' chains over the four sub-tiles (x already scaled), in fp32."""
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            asm=I8H2_ASM,
            constraints="=f,=f,=f,=f,r,r,r,r,r,r,r,r",
            args=[
                t0,
                t1,
                t2,
                t3,
                _pair(x0)[:, None],
                _pair(x1)[:, None],
                _pair(x2)[:, None],
                _pair(x3)[:, None],
            ],  # fmt: skip
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        z = tl.zeros(t0.shape, tl.float16)
        c0, c1, c2, c3 = _emu_chain(t0, x0, z, z, z, z)
        c0, c1, c2, c3 = _emu_chain(t1, x1, c0, c1, c2, c3)
        c0, c1, c2, c3 = _emu_chain(t2, x2, c0, c1, c2, c3)
        c0, c1, c2, c3 = _emu_chain(t3, x3, c0, c1, c2, c3)
    return c0.to(tl.float32), c1.to(tl.float32), c2.to(tl.float32), c3.to(tl.float32)


@triton.jit
def _int8_gemv_h2_kernel(
    x_ptr,
    qw_ptr,  # int32 words [K, N / 4] (four output channels each)
    s_ptr,  # fp32 [1, N]
    b_ptr,
    y_ptr,  # PARTIAL: fp32 [split, 1, N] partial sums; else the [1, N] output
    o_ptr,  # REDUCE: the [1, N] output
    cnt_ptr,  # REDUCE: the zeroed arrival counters
    N,
    K,
    K_CHUNK,  # a multiple of BLOCK_K
    stride_ysplit,
    N_WORDS,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    REDUCE: tl.constexpr,
    ASM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    AMAX_BLOCK: tl.constexpr = 1024,
    SPLIT: tl.constexpr = 1,  # REDUCE: the number of splits
):
    release(USE_PDL)
    NW: tl.constexpr = BLOCK_N // 4
    RB: tl.constexpr = BLOCK_K // 4
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_begin = pid_k * K_CHUNK
    k_end = tl.minimum(K, k_begin + K_CHUNK)
    offs_w = pid_n * NW + tl.arange(0, NW)
    mask_w = offs_w < N_WORDS
    r = k_begin + tl.arange(0, RB)
    t0, t1, t2, t3 = _int8_sub_tiles(qw_ptr, r, RB, k_end, offs_w, mask_w, N_WORDS)
    wait(USE_PDL)  # the first weight tile is in flight; x comes from the kernel before
    x0, x1, x2, x3 = _x_rows(x_ptr, r, RB, k_end)  # in flight while the guard reads the split
    shift = _range_shift(x_ptr, k_begin, k_end, AMAX_BLOCK, HEADROOM)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2^-shift
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    a0 = tl.zeros([RB, NW], tl.float32)
    a1 = tl.zeros_like(a0)
    a2 = tl.zeros_like(a0)
    a3 = tl.zeros_like(a0)
    for k0 in range(k_begin, k_end, BLOCK_K):
        r = k0 + BLOCK_K + tl.arange(0, RB)  # the next tile, in flight during this one
        n0, n1, n2, n3 = _int8_sub_tiles(qw_ptr, r, RB, k_end, offs_w, mask_w, N_WORDS)
        y0, y1, y2, y3 = _x_rows(x_ptr, r, RB, k_end)
        c0, c1, c2, c3 = _chains(t0, t1, t2, t3, x0 * down, x1 * down, x2 * down, x3 * down, ASM)
        a0 += c0
        a1 += c1
        a2 += c2
        a3 += c3
        t0, t1, t2, t3 = n0, n1, n2, n3
        x0, x1, x2, x3 = y0, y1, y2, y3
    acc = channel_sums(a0, a1, a2, a3, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = acc * (tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32) * up)
    store_one_row(
        acc, y_ptr, o_ptr, b_ptr, cnt_ptr, pid_n, pid_k, offs_n, mask_n, N, stride_ysplit,
        HAS_BIAS, PARTIAL, REDUCE, SPLIT,
    )  # fmt: skip


def launch_int8_h2(
    x, qweight, scales, zeros, bits, group, bias, y, m, n, k, k_chunk, split, cfg,
    out=None, counters=None, **lab,
) -> bool:  # fmt: skip
    """``launch_gemv``'s contract for this kernel (one row of int8): into ``y`` (``[1,
    n]``, or ``[split, 1, n]`` fp32 when split); with ``out`` and ``counters`` the last
    split of each tile sums the partials into ``out``. Returns whether it did."""
    assert m == 1 and bits == 8 and zeros is None and group == 0
    reduce = split > 1 and out is not None and counters is not None
    grid = (triton.cdiv(n, cfg.block_n), split)
    _int8_gemv_h2_kernel[grid](
        x,
        qweight.view(torch.int32),
        scales,
        bias if bias is not None else scales,
        y,
        out if reduce else y,
        counters if reduce else y,
        n,
        k,
        k_chunk,
        y.stride(0) if split > 1 else 0,
        n // 4,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        HAS_BIAS=bias is not None and (split == 1 or reduce),
        PARTIAL=split > 1,
        REDUCE=reduce,
        SPLIT=split if reduce else 1,
        ASM=_ptx(x),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **{**launch_options(x.device), **lab},
    )
    return reduce
