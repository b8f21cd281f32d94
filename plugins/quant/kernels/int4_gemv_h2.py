"""A one-row int4 GEMV in packed f16x2 arithmetic (offered to the tuner by default since
session 14; ``TOKENLOOM_INT4_H2=0`` withholds it).

The engine's one-row GEMV (``weight_gemv``) spends ~5 SASS instructions per int4
weight on sm_90. This kernel spends ~3.3 (``scripts/lab/gemv_h2_check.py sass``): on
the H200 the kernel alone took 49.5 us per Llama-3-8B layer against the GEMV's 62.4
(session 13, ``docs/quantization.md``). Wired into the engine (below: the range guard,
PDL, the split sum in the kernel) it first measured 66.8 us per layer; the split sum
cost 16.6 of them, a loop waiting on one L2 round trip per split, until the sum's loads
were unrolled (``weight_gemv._reduce_splits``): 54.3 us (session 14, one H200,
``scripts/lab/gemv_h2_check.py ablate``). The one-row tuner measures it beside the
other GEMVs per layer and keeps the faster; ``TOKENLOOM_INT4_H2=0`` withholds it. With
both changes ``bench latency --model llama-3-8b --quant int4`` went 2.72 -> 2.39 ms per
step (same machine start, before/after/before/after).

Per program: ``BLOCK_N`` columns as two halves (``CW = BLOCK_N / 2``) that share the x
registers, and ``BLOCK_K`` rows of K as two row halves of ``RW = BLOCK_K / 16`` word
rows, so one elementwise step takes two words (16 weights) of one column:

- nibbles -> f16x2 pairs ``(q_j, q_{j+4})``: one shift per word, one ``lop3`` per pair
  (OR-ed under 0x6400 = 1,024), one ``sub``/``fma.f16x2`` per pair to get ``q - 8``
  exactly;
- ``fma.rn.f16x2`` with x pre-scaled by ``2^-shift`` (f16 pairs ``(x_j, x_{j+4})``):
  8 products per half in one f16x2 chain, then flushed to fp32;
- an fp32 epilogue per tile (one tile lies in one group): ``s (P - (z - 8) sum x)``, so
  fractional zero points stay exact.

**The range guard.** A chain sums 8 products ``(q - 8) x 2^-shift`` in f16 (largest
finite 65,504, smallest normal 2^-14). Each program first reads its split of x and
takes ``shift = e - 7`` (clamped to [-100, 126]) for ``2^e <= max |x| < 2^(e+1)``: the
scaled largest lies in [128, 256), so a chain stays below 2^14 whatever the
activations' range (Llama's massive activations reach thousands), and small
activations are scaled up rather than lost in f16's subnormals (a fixed 2^-4 gave 25%
error at |x| ~ 1e-5). Values under 2^-21 of the split's largest lose precision. An
infinite x gives NaN where the reference may give inf (``P - (z - 8) sum x``).

PDL: the first weight tiles stream before ``wait``. Split K: the last split of each
tile sums the partials in the kernel (``weight_gemv._reduce_splits``).

On the CPU (the interpreter) ``ASM=False`` emulates the arithmetic (f16 rounding after
every product, where the GPU's fused ``fma.rn.f16x2`` rounds once), so the guard and the
epilogue are tested there; the PTX path is tested on the GPU.

Layout and arguments are ``weight_gemm``'s (``qweight [K / 8, N]`` int32, ``scales`` and
``zeros [G, N]``), for one row of bf16 activations on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import launch_options, release, wait
from tokenloom.plugins.quant.kernels.h2_common import (
    _ptx,
    _range_shift,
    ptx_bf16_ok,
    store_one_row,
)


def h2_offered() -> bool:
    """Whether the tuner measures this kernel (``TOKENLOOM_INT4_H2=0``: not)."""
    return os.environ.get("TOKENLOOM_INT4_H2", "1") != "0"


def h2_fits(x: torch.Tensor, bits: int, group: int, block_k: int, has_zeros: bool) -> bool:
    """One row of activations, int4 with zero points in groups that hold whole tiles; on
    a GPU bf16 on sm_90 or later (its PTX scales bf16x2 pairs), 4-byte aligned (read as
    int32 words); in the interpreter fp16 or fp32 (the emulation)."""
    if x.shape[0] != 1 or bits != 4 or not has_zeros or group <= 0 or block_k % 16:
        return False
    if group % block_k:
        return False
    if _ptx(x):
        return ptx_bf16_ok(x)
    return x.dtype in (torch.float16, torch.float32)


# word pair ($1 row half a, $2 row half b) + x pairs ($3..$6 for a, $7..$10 for b)
# -> $0 = the sum of the 16 products (two f16 chains, flushed to f32)
H2_ASM = tl.constexpr(
    "{ .reg .b32 t, a, b, c, d, acc, k1032, k16, km72; .reg .b16 lo, hi; .reg .f32 fl, fh;"
    " mov.b32 k1032, 0x64086408; mov.b32 k16, 0x2C002C00; mov.b32 km72, 0xD480D480;"
    " shr.u32 t, $1, 8;"
    " lop3.b32 a, $1, 0x000F000F, 0x64006400, 0xEA;"
    " lop3.b32 b, $1, 0x00F000F0, 0x64006400, 0xEA;"
    " lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;"
    " lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;"
    " sub.f16x2 a, a, k1032; fma.rn.f16x2 b, b, k16, km72;"
    " sub.f16x2 c, c, k1032; fma.rn.f16x2 d, d, k16, km72;"
    " mul.f16x2 acc, a, $3; fma.rn.f16x2 acc, b, $4, acc;"
    " fma.rn.f16x2 acc, c, $5, acc; fma.rn.f16x2 acc, d, $6, acc;"
    " shr.u32 t, $2, 8;"
    " lop3.b32 a, $2, 0x000F000F, 0x64006400, 0xEA;"
    " lop3.b32 b, $2, 0x00F000F0, 0x64006400, 0xEA;"
    " lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;"
    " lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;"
    " sub.f16x2 a, a, k1032; fma.rn.f16x2 b, b, k16, km72;"
    " sub.f16x2 c, c, k1032; fma.rn.f16x2 d, d, k16, km72;"
    " fma.rn.f16x2 acc, a, $7, acc; fma.rn.f16x2 acc, b, $8, acc;"
    " fma.rn.f16x2 acc, c, $9, acc; fma.rn.f16x2 acc, d, $10, acc;"
    " mov.b32 {lo, hi}, acc; cvt.f32.f16 fl, lo; cvt.f32.f16 fh, hi; add.f32 $0, fl, fh; }"
)

# x: four bf16x2 words ($5..$8 = (x0,x1),(x2,x3),(x4,x5),(x6,x7)), $9 = bf16x2 2^-shift
# -> $0..$3 f16x2 (x_j, x_{j+4}) scaled, $4 = f32 sum of the scaled x
X_ASM = tl.constexpr(
    "{ .reg .b32 p0, p1, p2, p3; .reg .f32 f0, f1, f2, f3, f4, f5, f6, f7, s0, s1;"
    " mul.rn.bf16x2 p0, $5, $9; mul.rn.bf16x2 p1, $6, $9;"
    " mul.rn.bf16x2 p2, $7, $9; mul.rn.bf16x2 p3, $8, $9;"
    " shl.b32 f0, p0, 16; and.b32 f1, p0, 0xFFFF0000;"
    " shl.b32 f2, p1, 16; and.b32 f3, p1, 0xFFFF0000;"
    " shl.b32 f4, p2, 16; and.b32 f5, p2, 0xFFFF0000;"
    " shl.b32 f6, p3, 16; and.b32 f7, p3, 0xFFFF0000;"
    " cvt.rn.f16x2.f32 $0, f4, f0; cvt.rn.f16x2.f32 $1, f5, f1;"
    " cvt.rn.f16x2.f32 $2, f6, f2; cvt.rn.f16x2.f32 $3, f7, f3;"
    " add.f32 s0, f0, f1; add.f32 s1, f2, f3; add.f32 s0, s0, s1;"
    " add.f32 s1, f4, f5; add.f32 s0, s0, s1; add.f32 s1, f6, f7; add.f32 $4, s0, s1; }"
)


@triton.jit
def _h2_dot(wa, wb, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3):
    """``H2_ASM`` on one column half: the words of two row blocks against their x pairs."""
    return tl.inline_asm_elementwise(
        asm=H2_ASM,
        constraints="=f,r,r,r,r,r,r,r,r,r,r",
        args=[
            wa,
            wb,
            xa0[:, None],
            xa1[:, None],
            xa2[:, None],
            xa3[:, None],
            xb0[:, None],
            xb1[:, None],
            xb2[:, None],
            xb3[:, None],
        ],  # fmt: skip
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _x_words(x32_row, kw, mask_kw):
    """Word rows ``kw`` of x: four bf16x2 words each (as int32)."""
    p = x32_row + kw * 4
    p0 = tl.load(p + 0, mask=mask_kw, other=0)
    p1 = tl.load(p + 1, mask=mask_kw, other=0)
    p2 = tl.load(p + 2, mask=mask_kw, other=0)
    p3 = tl.load(p + 3, mask=mask_kw, other=0)
    return p0, p1, p2, p3


@triton.jit
def _x_pairs(p0, p1, p2, p3, xs_bits):
    """Four bf16x2 words of x -> four f16x2 (as int32) pairs scaled by ``xs_bits`` (a
    bf16x2 power of two) and their scaled sum (PTX)."""
    return tl.inline_asm_elementwise(
        asm=X_ASM,
        constraints="=r,=r,=r,=r,=f,r,r,r,r,r",
        args=[p0, p1, p2, p3, xs_bits],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.float32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _emu_chain(w, x_row, kw, mask_kw, lo, hi, down):
    """Interpreter emulation of one word in the two f16 chains (lo: nibbles j, hi: j + 4),
    rounding to f16 after the product and after the sum."""
    for j in tl.static_range(4):
        xl = (tl.load(x_row + kw * 8 + j, mask=mask_kw, other=0.0).to(tl.float32) * down).to(
            tl.float16
        )
        xh = (tl.load(x_row + kw * 8 + j + 4, mask=mask_kw, other=0.0).to(tl.float32) * down).to(
            tl.float16
        )
        ql = (((w >> (4 * j)) & 15) - 8).to(tl.float16)
        qh = (((w >> (4 * j + 16)) & 15) - 8).to(tl.float16)
        lo = (lo + ql * xl[:, None]).to(tl.float16)
        hi = (hi + qh * xh[:, None]).to(tl.float16)
    return lo, hi


@triton.jit
def _emu_dot(wa, wb, x_row, ka, kb, mka, mkb, down, RW: tl.constexpr, CW: tl.constexpr):
    h = tl.zeros([RW, CW], tl.float16)
    lo, hi = _emu_chain(wa, x_row, ka, mka, h, h, down)
    lo, hi = _emu_chain(wb, x_row, kb, mkb, lo, hi, down)
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _emu_xsum(x_row, kw, mask_kw, down):
    xs = tl.zeros([kw.shape[0]], tl.float32)
    for j in tl.static_range(8):
        xs += tl.load(x_row + kw * 8 + j, mask=mask_kw, other=0.0).to(tl.float32) * down
    return xs


@triton.jit
def _words(qw_ptr, kw, limit, cols, mask_c, N):
    return tl.load(
        qw_ptr + kw[:, None].to(tl.int64) * N + cols[None, :],
        mask=(kw < limit)[:, None] & mask_c[None, :],
        other=0,
    )


@triton.jit
def _group_params(s_ptr, z_ptr, g, c0, c1, m0, m1, N):
    """Group ``g``'s scales and zero points (less 8) of both column halves, in fp32."""
    s0 = tl.load(s_ptr + g * N + c0, mask=m0, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + g * N + c1, mask=m1, other=0.0).to(tl.float32)
    z0 = tl.load(z_ptr + g * N + c0, mask=m0, other=0.0).to(tl.float32) - 8.0
    z1 = tl.load(z_ptr + g * N + c1, mask=m1, other=0.0).to(tl.float32) - 8.0
    return s0, s1, z0, z1


@triton.jit
def _int4_gemv_h2_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,  # PARTIAL: fp32 [split, 1, N] partial sums; else the [1, N] output
    o_ptr,  # REDUCE: the [1, N] output
    cnt_ptr,  # REDUCE: the zeroed arrival counters
    N,
    K,
    K_CHUNK,  # a multiple of BLOCK_K
    stride_ysplit,
    GROUP: tl.constexpr,  # a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    REDUCE: tl.constexpr,
    ASM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    AMAX_BLOCK: tl.constexpr = 1024,
    GUARD: tl.constexpr = True,  # False: a fixed 2^-4 (unsafe; gemv_h2_check.py ablate only)
    SPLIT: tl.constexpr = 1,  # REDUCE: the number of splits
):
    CW: tl.constexpr = BLOCK_N // 2
    RW: tl.constexpr = BLOCK_K // 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    c0 = pid_n * BLOCK_N + tl.arange(0, CW)
    c1 = c0 + CW
    m0 = c0 < N
    m1 = c1 < N
    k_begin = pid_k * K_CHUNK
    k_end = tl.minimum(K, k_begin + K_CHUNK)
    lim = k_end // 8
    ka = k_begin // 8 + tl.arange(0, RW)
    kb = ka + RW
    # weights, scales and zero points before the wait (no kernel of a step writes them),
    # then all one tile ahead, and x's words too (a tile waited on a DRAM trip otherwise)
    wa0 = _words(qw_ptr, ka, lim, c0, m0, N)
    wa1 = _words(qw_ptr, ka, lim, c1, m1, N)
    wb0 = _words(qw_ptr, kb, lim, c0, m0, N)
    wb1 = _words(qw_ptr, kb, lim, c1, m1, N)
    first = c0 * 0 + k_begin < k_end  # never false from weight_gemm (no empty split)
    s0, s1, z0, z1 = _group_params(
        s_ptr, z_ptr, k_begin // GROUP, c0, c1, m0 & first, m1 & first, N
    )
    wait(USE_PDL)
    release(USE_PDL)  # after the wait, as every PDL kernel (pdl.py)
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    if ASM:  # in flight while the guard reads its split
        pa0, pa1, pa2, pa3 = _x_words(x32, ka, ka < lim)
        pb0, pb1, pb2, pb3 = _x_words(x32, kb, kb < lim)
    if GUARD:
        shift = _range_shift(x_ptr, k_begin, k_end, AMAX_BLOCK)
    else:
        shift = tl.program_id(0) * 0 + 4
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2^-shift
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    half = (127 - shift) << 7  # bf16 bits of 2^-shift
    xs_bits = (half << 16) | half
    acc0 = tl.zeros([RW, CW], tl.float32)
    acc1 = tl.zeros([RW, CW], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ka = k0 // 8 + tl.arange(0, RW)
        kb = ka + RW
        mka = ka < lim
        mkb = kb < lim
        na0 = _words(qw_ptr, ka + 2 * RW, lim, c0, m0, N)  # the next tile, in flight
        na1 = _words(qw_ptr, ka + 2 * RW, lim, c1, m1, N)
        nb0 = _words(qw_ptr, kb + 2 * RW, lim, c0, m0, N)
        nb1 = _words(qw_ptr, kb + 2 * RW, lim, c1, m1, N)
        more = c0 * 0 + k0 + BLOCK_K < k_end  # a next tile (per column, for the masks)
        ns0, ns1, nz0, nz1 = _group_params(
            s_ptr, z_ptr, (k0 + BLOCK_K) // GROUP, c0, c1, m0 & more, m1 & more, N
        )
        if ASM:
            na_x = _x_words(x32, ka + 2 * RW, ka + 2 * RW < lim)
            nb_x = _x_words(x32, kb + 2 * RW, kb + 2 * RW < lim)
            xa0, xa1, xa2, xa3, xsa = _x_pairs(pa0, pa1, pa2, pa3, xs_bits)
            xb0, xb1, xb2, xb3, xsb = _x_pairs(pb0, pb1, pb2, pb3, xs_bits)
            p0 = _h2_dot(wa0, wb0, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3)
            p1 = _h2_dot(wa1, wb1, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3)
            pa0, pa1, pa2, pa3 = na_x
            pb0, pb1, pb2, pb3 = nb_x
        else:
            xsa = _emu_xsum(x_ptr, ka, mka, down)
            xsb = _emu_xsum(x_ptr, kb, mkb, down)
            p0 = _emu_dot(wa0, wb0, x_ptr, ka, kb, mka, mkb, down, RW, CW)
            p1 = _emu_dot(wa1, wb1, x_ptr, ka, kb, mka, mkb, down, RW, CW)
        xs = (xsa + xsb)[:, None]
        acc0 += s0[None, :] * (p0 - z0[None, :] * xs)
        acc1 += s1[None, :] * (p1 - z1[None, :] * xs)
        s0, s1, z0, z1 = ns0, ns1, nz0, nz1
        wa0 = na0
        wa1 = na1
        wb0 = nb0
        wb1 = nb1
    # the two column halves side by side: [2, CW] -> BLOCK_N consecutive columns
    both = tl.join(tl.sum(acc0, axis=0), tl.sum(acc1, axis=0))  # [CW, 2]
    acc = tl.reshape(tl.permute(both, (1, 0)), [BLOCK_N]) * up
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    store_one_row(
        acc, y_ptr, o_ptr, b_ptr, cnt_ptr, pid_n, pid_k, offs_n, mask_n, N, stride_ysplit,
        HAS_BIAS, PARTIAL, REDUCE, SPLIT,
    )  # fmt: skip


def launch_h2(
    x, qweight, scales, zeros, bits, group, bias, y, m, n, k, k_chunk, split, cfg,
    out=None, counters=None, **lab,
) -> bool:  # fmt: skip
    """``launch_gemv``'s contract for this kernel (one row): into ``y`` (``[1, n]``, or
    ``[split, 1, n]`` fp32 when split); with ``out`` and ``counters`` the last split of
    each tile sums the partials into ``out``. Returns whether it did. ``lab`` overrides
    launch options (``USE_PDL``, ``launch_pdl``, ``GUARD``) for ``scripts/lab``."""
    assert m == 1 and bits == 4 and zeros is not None and group % cfg.block_k == 0
    reduce = split > 1 and out is not None and counters is not None
    grid = (triton.cdiv(n, cfg.block_n), split)
    _int4_gemv_h2_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else scales,
        y,
        out if reduce else y,
        counters if reduce else y,
        n,
        k,
        k_chunk,
        y.stride(0) if split > 1 else 0,
        GROUP=group,
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
