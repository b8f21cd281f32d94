"""The PTX of ``int4_gemv_nk``'s integer path (``DP4A``, session 21): the products of
int4 weights and x on the integer dot-product unit, exactly.

Why. At one row the int4 GEMV spends ~3.1 instructions a weight (session 19's ncu: 0.42
instructions issued a cycle per scheduler, DRAM at ~50%), twice int8's per byte; the f16x2
chain alone is ~1.8 (a ``lop3``, a ``sub``/``fma`` and an ``fma`` per pair). ``dp4a``
multiplies four bytes by four bytes and adds to an int32 in one instruction, so a word of
eight nibbles costs three bit operations and four ``dp4a``: ~0.9 a weight.

x as 16-bit fixed point. Per 32 values (an element: four words of a row) x is scaled by a
power of two so that its largest magnitude lies in [2^14, 2^15), then rounded to an int16
``v`` (exact for every value within 2^7 of the largest: a bf16 has 8 significant bits;
smaller ones are rounded to a step of 2^-15 of the largest, so a value 2^-12 of an outlier
keeps ~3 bits and one below 2^-16 of it is lost: the error of the dot product is at most
2^-16 max|x| sum|q - z|, below the f16x2 chain's rounding), split as
``v = 256 hi + lo`` (``hi`` a signed byte, ``lo`` an unsigned one). The sum over an element
``sum_j q_j v_j = 256 dp(q, hi) + dp(q, lo)`` is then exact in int32 (at most 15 x 32,640 x
32 < 2^24, so exact in fp32 too), where the f16x2 chain rounds to f16 as it adds.

Byte order: a word holds K values ``k .. k + 7`` as nibbles 0..7, so ``w & 0x0F0F0F0F``
gives the bytes of ``q_k, q_k+2, q_k+4, q_k+6`` and ``(w >> 4) & 0x0F0F0F0F`` the odd ones;
x's bytes are packed in the same order (``_X4_ASM``).

A NaN or an infinity among the 32 values makes the scale's inverse a NaN, so that the
output is NaN, as the f16x2 path and torch propagate it (the fixed point would otherwise
turn it into a finite value). ``tests/plugins/quant/test_int4_dp4a_ptx.py`` runs this PTX
in an emulator on the CPU."""

from __future__ import annotations

import triton
import triton.language as tl

# x: 16 bf16x2 words ($18..$33: (x0, x1) .. (x30, x31)) -> for word w of an element
# ($4w..$4w+3): hi of the even values, hi of the odd ones, lo of the even, lo of the odd;
# $16 = 2^-s (the scale's inverse, f32), $17 = sum v (f32, exact)
# The 32 values' largest |x| as bf16 bits (m) and its biased exponent (e), from the 16
# bf16x2 words $18..$33; registers m and t (b32) and e; shared with int4_h2_asm.
ABSMAX_EXPONENT = (
    [" and.b32 m, $18, 0x7FFF7FFF;"]
    + [f" and.b32 t, ${18 + i}, 0x7FFF7FFF; max.u16x2 m, m, t;" for i in range(1, 16)]
    + [" shr.u32 t, m, 16; and.b32 m, m, 0xFFFF; max.u32 m, m, t; shr.u32 e, m, 7;"]
)
_X4_LINES = [
    "{ .reg .b32 m, t, e, sc, sh, sl, k, ones, r0, r1, r2, r3, r4, r5, r6, r7, u0, u1;",
    " .reg .pred bad;",
    *ABSMAX_EXPONENT,
    # e = 255 (a NaN or an infinity): the inverse NaN; else the scale 2^(141 - e) (f32
    # exponent field 268 - e, kept at most 253: all-zero x gives 253) puts the largest
    # |x| in [2^14, 2^15)
    " setp.eq.u32 bad, e, 255; sub.s32 e, 268, e; min.s32 e, e, 253;",
    " shl.b32 sc, e, 23; sub.s32 t, 254, e; shl.b32 t, t, 23; selp.b32 $16, 0x7FFFFFFF, t, bad;",
    # 1.5 x 2^23: x 2^s + k has v's two's complement in its low 16 bits (|v| < 2^22)
    " mov.b32 k, 0x4B400000; mov.b32 ones, 0x01010101; mov.b32 sh, 0; mov.b32 sl, 0;",
]
for _w in range(4):  # word w: bf16 pairs $18+4w .. +3 = (x0,x1) (x2,x3) (x4,x5) (x6,x7)
    _p = [f"${18 + 4 * _w + i}" for i in range(4)]
    for _i, _pi in enumerate(_p):  # r(2i) = x_2i (the pair's low half), r(2i+1) = x_2i+1
        _X4_LINES.append(
            f" shl.b32 t, {_pi}, 16; fma.rn.f32 r{2 * _i}, t, sc, k;"
            f" and.b32 t, {_pi}, 0xFFFF0000; fma.rn.f32 r{2 * _i + 1}, t, sc, k;"
        )
    _o = [f"${4 * _w + j}" for j in range(4)]
    _X4_LINES += [
        # (b0 of r0, b0 of r2, b1 of r0, b1 of r2), then with r4, r6: lo and hi of the evens
        " prmt.b32 u0, r0, r2, 0x5140; prmt.b32 u1, r4, r6, 0x5140;",
        f" prmt.b32 {_o[2]}, u0, u1, 0x5410; prmt.b32 {_o[0]}, u0, u1, 0x7632;",
        " prmt.b32 u0, r1, r3, 0x5140; prmt.b32 u1, r5, r7, 0x5140;",
        f" prmt.b32 {_o[3]}, u0, u1, 0x5410; prmt.b32 {_o[1]}, u0, u1, 0x7632;",
        f" dp4a.u32.s32 sh, ones, {_o[0]}, sh; dp4a.u32.s32 sh, ones, {_o[1]}, sh;",
        f" dp4a.u32.u32 sl, ones, {_o[2]}, sl; dp4a.u32.u32 sl, ones, {_o[3]}, sl;",
    ]
_X4_LINES += [" mad.lo.s32 t, sh, 256, sl; cvt.rn.f32.s32 $17, t; }"]
_X4_ASM = tl.constexpr("\n".join(_X4_LINES))
_X4_CONSTRAINTS = tl.constexpr("=r," * 16 + "=f,=f," + ",".join(["r"] * 16))

# four words ($1..$4) of one row against x's bytes ($5..$20, word w's at $5+4w..) -> $0,
# sum_j q_j v_j over the 32 values (exact, as f32)
_D_LINES = ["{ .reg .b32 e, o, ah, al;", " mov.b32 ah, 0; mov.b32 al, 0;"]
for _w in range(4):
    _wd, _xs = f"${1 + _w}", [f"${5 + 4 * _w + j}" for j in range(4)]
    _D_LINES += [
        f" and.b32 e, {_wd}, 0x0F0F0F0F; shr.u32 o, {_wd}, 4; and.b32 o, o, 0x0F0F0F0F;",
        f" dp4a.u32.s32 ah, e, {_xs[0]}, ah; dp4a.u32.s32 ah, o, {_xs[1]}, ah;",
        f" dp4a.u32.u32 al, e, {_xs[2]}, al; dp4a.u32.u32 al, o, {_xs[3]}, al;",
    ]
_D_LINES += [" mad.lo.s32 e, ah, 256, al; cvt.rn.f32.s32 $0, e; }"]
_DP4A_ASM = tl.constexpr("\n".join(_D_LINES))
_DP4A_CONSTRAINTS = tl.constexpr("=f," + ",".join(["r"] * 20))


@triton.jit
def _x_quad(x32, kw, i: tl.constexpr, mask):
    """Words ``kw + 4 i .. + 3`` of x (``[P]`` each), read as one 16-byte load a lane."""
    q = tl.load(
        x32 + (kw * 4 + 4 * i)[:, None] + tl.arange(0, 4)[None, :], mask=mask[:, None], other=0
    )
    a, b = tl.split(tl.reshape(q, [q.shape[0], 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _x_words(x32, kw, mask):
    """x's 16 words from word ``kw`` (a multiple of 4) of each element (``[P]``), in four
    16-byte loads a lane: the arguments of the one-row int4 GEMVs' x preparations."""
    a0, a1, a2, a3 = _x_quad(x32, kw, 0, mask)
    b0, b1, b2, b3 = _x_quad(x32, kw, 1, mask)
    c0, c1, c2, c3 = _x_quad(x32, kw, 2, mask)
    d0, d1, d2, d3 = _x_quad(x32, kw, 3, mask)
    return [a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3]


@triton.jit
def _x_bytes(x32, kw, mask):
    """x's 32 values from word ``kw`` (a multiple of 4) of each element as fixed-point
    bytes (``_X4_ASM``): 16 words, the scale's inverse and the sum of the integers."""
    return tl.inline_asm_elementwise(
        asm=_X4_ASM,
        constraints=_X4_CONSTRAINTS,
        args=_x_words(x32, kw, mask),
        dtype=(tl.int32,) * 16 + (tl.float32, tl.float32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _row_args(w0, w1, w2, w3, xo):
    """The arguments of a one-row int4 GEMV's product PTX: an element's four words
    (``[BLOCK_N, P]``) and x's 16 prepared words (``[P]``) broadcast over the rows."""
    return [w0, w1, w2, w3, xo[0][None, :], xo[1][None, :], xo[2][None, :], xo[3][None, :],
            xo[4][None, :], xo[5][None, :], xo[6][None, :], xo[7][None, :], xo[8][None, :],
            xo[9][None, :], xo[10][None, :], xo[11][None, :], xo[12][None, :],
            xo[13][None, :], xo[14][None, :], xo[15][None, :]]  # fmt: skip


@triton.jit
def _dp4a_chain(w0, w1, w2, w3, xo):
    """``_DP4A_ASM`` over ``[BLOCK_N, P]`` elements with ``_x_bytes``' ``xo`` (``[P]``)."""
    return tl.inline_asm_elementwise(
        asm=_DP4A_ASM,
        constraints=_DP4A_CONSTRAINTS,
        args=_row_args(w0, w1, w2, w3, xo),
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )
