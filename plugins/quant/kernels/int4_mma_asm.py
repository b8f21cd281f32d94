"""The PTX of ``int4_gemv_mma`` (session 19): x's B registers and sum, and the MMA pair
over two weight rows (the module docstring of ``int4_gemv_mma`` says how the diagonal of
a lane quad makes ``mma.sync`` a dot product)."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenloom.plugins.quant.kernels.int4_dp4a_asm import _x_words

# x: 16 bf16x2 words ($17..$32: (x0, x1) .. (x30, x31)) -> 16 B registers ($0..$15: word
# w's (x0, x4) (x1, x5) (x2, x6) (x3, x7) at $4w..$4w+3) and $16 = the 32 values' fp32 sum
_XB_LINES = ["{ .reg .b32 a, b; .reg .f32 s;", " mov.f32 s, 0f00000000;"]
for _w in range(4):
    _x = [f"${17 + 4 * _w + i}" for i in range(4)]
    _XB_LINES += [
        f" prmt.b32 ${4 * _w}, {_x[0]}, {_x[2]}, 0x5410; prmt.b32 ${4 * _w + 1}, {_x[0]}, {_x[2]}, 0x7632;",
        f" prmt.b32 ${4 * _w + 2}, {_x[1]}, {_x[3]}, 0x5410; prmt.b32 ${4 * _w + 3}, {_x[1]}, {_x[3]}, 0x7632;",
    ]
    for xi in _x:
        _XB_LINES.append(
            f" shl.b32 a, {xi}, 16; and.b32 b, {xi}, 0xFFFF0000; add.f32 s, s, a; add.f32 s, s, b;"
        )
_XB_LINES.append(" mov.f32 $16, s; }")
_XB_ASM = tl.constexpr("\n".join(_XB_LINES))
_XB_CONSTRAINTS = tl.constexpr("=r," * 16 + "=f," + ",".join(["r"] * 16))

# rows r ($2..$5) and r' ($6..$9): four words each, K-aligned; B registers $10..$25 ->
# $0, $1: quad sums of (128 + q) x for r and r' on the diagonal lane, 0 on the others
_MMA = (
    " mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {c0, c1, c2, c3},"
    " {a0, a1, a2, a3}, {%s, %s}, {c0, c1, c2, c3};"
)
_NIB = "0x000F000F, 0x43004300, 0xEA;"  # (q_j, q_j+4) -> bf16 (128 + q_j, 128 + q_j+4)
_W_LINES = [
    "{ .reg .b32 a0, a1, a2, a3, t, u, l, g; .reg .f32 c0, c1, c2, c3, lo, hi; .reg .pred d, o;",
    " mov.u32 l, %laneid; shr.u32 g, l, 3; and.b32 t, l, 3; setp.eq.u32 d, g, t;",
    " and.b32 t, l, 4; setp.ne.u32 o, t, 0;",
    " mov.f32 c0, 0f00000000; mov.f32 c1, 0f00000000; mov.f32 c2, 0f00000000;"
    " mov.f32 c3, 0f00000000;",
]
for _w in range(4):
    r, rr, xb = f"${2 + _w}", f"${6 + _w}", [f"${10 + 4 * _w + j}" for j in range(4)]
    _W_LINES += [
        f" lop3.b32 a0, {r}, {_NIB} lop3.b32 a1, {rr}, {_NIB}",
        f" shr.u32 t, {r}, 4; shr.u32 u, {rr}, 4; lop3.b32 a2, t, {_NIB} lop3.b32 a3, u, {_NIB}",
        _MMA % (xb[0], xb[1]),
        f" shr.u32 t, {r}, 8; shr.u32 u, {rr}, 8; lop3.b32 a0, t, {_NIB} lop3.b32 a1, u, {_NIB}",
        f" shr.u32 t, {r}, 12; shr.u32 u, {rr}, 12; lop3.b32 a2, t, {_NIB} lop3.b32 a3, u, {_NIB}",
        _MMA % (xb[2], xb[3]),
    ]
_W_LINES += [
    " selp.f32 lo, c1, c0, o; selp.f32 hi, c3, c2, o;",
    " selp.f32 $0, lo, 0f00000000, d; selp.f32 $1, hi, 0f00000000, d; }",
]
_W_ASM = tl.constexpr("\n".join(_W_LINES))
_W_CONSTRAINTS = tl.constexpr("=f,=f," + ",".join(["r"] * 24))


@triton.jit
def _x_b(x32, kw, mask):
    """x's 32 values from word ``kw`` of each element: 16 B registers and their fp32 sum."""
    return tl.inline_asm_elementwise(
        asm=_XB_ASM,
        constraints=_XB_CONSTRAINTS,
        args=_x_words(x32, kw, mask),
        dtype=(tl.int32,) * 16 + (tl.float32,),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _mma_pair(lo, hi, xb):
    """``_W_ASM`` over two ``[H, P]`` element tensors (four words each: ``lo``, ``hi``).
    Not pure: Triton must neither duplicate it nor move it to another layout."""
    return tl.inline_asm_elementwise(
        asm=_W_ASM,
        constraints=_W_CONSTRAINTS,
        args=[
            lo[0],
            lo[1],
            lo[2],
            lo[3],
            hi[0],
            hi[1],
            hi[2],
            hi[3],
            xb[0][None, :],
            xb[1][None, :],
            xb[2][None, :],
            xb[3][None, :],
            xb[4][None, :],
            xb[5][None, :],
            xb[6][None, :],
            xb[7][None, :],
            xb[8][None, :],
            xb[9][None, :],
            xb[10][None, :],
            xb[11][None, :],
            xb[12][None, :],
            xb[13][None, :],
            xb[14][None, :],
            xb[15][None, :],
        ],  # fmt: skip
        dtype=(tl.float32, tl.float32),
        is_pure=False,
        pack=1,
    )
