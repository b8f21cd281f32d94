"""The PTX of ``int4_gemv_nk``'s f16x2 path (session 17; the path the tuner takes where
``DP4A`` is not chosen): x per 32 values as f16 pairs scaled by a power of two
(``_X_ASM``: the largest in [128, 256), so a chain of 16 products stays below 2^15), and
the products of four words of one row with them in packed ``fma.rn.f16x2`` chains
(``_CHAIN_ASM``, ~1.8 instructions a weight). ``int4_gemv_nk``'s docstring says how the
group epilogue uses them; its GPU tests (``test_int4_gemv_nk.py``, ``dp4a`` False) run
this PTX against the dequantized reference."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenloom.plugins.quant.kernels.int4_dp4a_asm import ABSMAX_EXPONENT, _row_args, _x_words

# x: 16 bf16x2 words ($18..$33: x0..x31 in pairs) -> 16 f16x2 pairs ($0..$15: word w's
# (x_j, x_{j+4}) at $4w+j), $16 = 2^e the scale undoes (f32), $17 = the scaled sum (f32)
_X_LINES = [
    "{ .reg .b32 m, t, e, sc, p, q, sum; .reg .b16 lo, hi; .reg .f32 a, b, c, d, fl, fh;",
    *ABSMAX_EXPONENT,
    # the scale 2^(134 - e) as bf16 exponent b = 261 - e in [1, 253] (all-zero x: b = 253;
    # up = 2^(127 - b) stays normal)
    " sub.s32 e, 261, e; min.s32 e, e, 253; max.s32 e, e, 1;",
    " shl.b32 sc, e, 7; shl.b32 t, sc, 16; or.b32 sc, sc, t;",
    " sub.s32 t, 254, e; shl.b32 $16, t, 23;",
    " mov.b32 sum, 0;",
]
for w in range(4):  # word w: bf16 pairs $18+4w .. +3 = (x0,x1) (x2,x3) (x4,x5) (x6,x7)
    r = [f"${18 + 4 * w + i}" for i in range(4)]
    o = [f"${4 * w + j}" for j in range(4)]
    _X_LINES += [
        f" mul.rn.bf16x2 p, {r[0]}, sc; mul.rn.bf16x2 q, {r[2]}, sc;",
        " shl.b32 a, p, 16; and.b32 b, p, 0xFFFF0000; shl.b32 c, q, 16; and.b32 d, q, 0xFFFF0000;",
        f" cvt.rn.f16x2.f32 {o[0]}, c, a; cvt.rn.f16x2.f32 {o[1]}, d, b;",
        f" mul.rn.bf16x2 p, {r[1]}, sc; mul.rn.bf16x2 q, {r[3]}, sc;",
        " shl.b32 a, p, 16; and.b32 b, p, 0xFFFF0000; shl.b32 c, q, 16; and.b32 d, q, 0xFFFF0000;",
        f" cvt.rn.f16x2.f32 {o[2]}, c, a; cvt.rn.f16x2.f32 {o[3]}, d, b;",
        f" add.f16x2 sum, sum, {o[0]}; add.f16x2 sum, sum, {o[1]};",
        f" add.f16x2 sum, sum, {o[2]}; add.f16x2 sum, sum, {o[3]};",
    ]
_X_LINES += [
    " mov.b32 {lo, hi}, sum; cvt.f32.f16 fl, lo; cvt.f32.f16 fh, hi; add.f32 $17, fl, fh; }"
]
_X_ASM = tl.constexpr("\n".join(_X_LINES))

# four words ($1..$4) of one row against x's pairs ($5..$20, word w's at $5+4w..) -> $0,
# the sum of the 32 products (q - 8) x_scaled: two f16 chains of 16, flushed to f32 once
_C_LINES = [
    "{ .reg .b32 t, a, b, c, d, acc, k1032, k16, km72; .reg .b16 lo, hi; .reg .f32 fl, fh;",
    " mov.b32 k1032, 0x64086408; mov.b32 k16, 0x2C002C00; mov.b32 km72, 0xD480D480;",
]
for w in range(4):
    wd, xs = f"${1 + w}", [f"${5 + 4 * w + j}" for j in range(4)]
    _C_LINES += [
        f" shr.u32 t, {wd}, 8;",
        f" lop3.b32 a, {wd}, 0x000F000F, 0x64006400, 0xEA;",  # (q0, q4) + 1024
        f" lop3.b32 b, {wd}, 0x00F000F0, 0x64006400, 0xEA;",  # 16 (q1, q5) + 1024
        " lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;",  # (q2, q6) + 1024
        " lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;",  # 16 (q3, q7) + 1024
        " sub.f16x2 a, a, k1032; fma.rn.f16x2 b, b, k16, km72;",
        " sub.f16x2 c, c, k1032; fma.rn.f16x2 d, d, k16, km72;",
        (f" mul.f16x2 acc, a, {xs[0]};" if w == 0 else f" fma.rn.f16x2 acc, a, {xs[0]}, acc;"),
        f" fma.rn.f16x2 acc, b, {xs[1]}, acc;",
        f" fma.rn.f16x2 acc, c, {xs[2]}, acc; fma.rn.f16x2 acc, d, {xs[3]}, acc;",
    ]
_C_LINES += [
    " mov.b32 {lo, hi}, acc; cvt.f32.f16 fl, lo; cvt.f32.f16 fh, hi; add.f32 $0, fl, fh; }"
]
_CHAIN_ASM = tl.constexpr("\n".join(_C_LINES))


_X_CONSTRAINTS = tl.constexpr("=r," * 16 + "=f,=f," + ",".join(["r"] * 16))
_CHAIN_CONSTRAINTS = tl.constexpr("=f," + ",".join(["r"] * 20))


@triton.jit
def _x_pairs(x32, kw, mask):
    """x's 32 values from word ``kw`` (a multiple of 4) of each element: 16 f16x2 pairs,
    the scale's inverse ``up`` and the scaled sum (``_X_ASM``)."""
    return tl.inline_asm_elementwise(
        asm=_X_ASM,
        constraints=_X_CONSTRAINTS,
        args=_x_words(x32, kw, mask),
        dtype=(tl.int32,) * 16 + (tl.float32, tl.float32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _chain(w0, w1, w2, w3, xo):
    """``_CHAIN_ASM`` over ``[BLOCK_N, P]`` elements with ``_x_pairs``' ``xo`` (``[P]``)."""
    return tl.inline_asm_elementwise(
        asm=_CHAIN_ASM,
        constraints=_CHAIN_CONSTRAINTS,
        args=_row_args(w0, w1, w2, w3, xo),
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )
