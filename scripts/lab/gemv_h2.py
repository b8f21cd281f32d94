"""Lab kernel (not wired into the engine): a one-row int4 GEMV with packed f16x2 math.

Written in session 11 (a helper) as the next step for issue 12's int4 batch-1 target,
measured offline only: 3.33 SASS instructions per weight on sm_90 (128 x 128, 4 warps;
56 registers, no spills) against the engine's GEMV's 5.08; arithmetic error ~4e-4
relative, below the bf16 output rounding (1.6e-3). Not timed: the next GPU session
must measure it (``scripts/lab/gemv_h2_check.py`` says how). Limits: GROUP % BLOCK_K
== 0; |x| above ~16k overflows f16 (needs a guard); no PDL, no in-kernel split sum.


Per program: BLOCK_N columns as two column halves (CW = BLOCK_N/2) that share the x
registers, and BLOCK_K rows of K as two row halves (RW = BLOCK_K/16 word rows each),
so one elementwise step takes two words (16 weights) of one column:
  - nibbles -> f16x2 pairs (q_j, q_{j+4}): one shift per word, one lop3 per pair
    (OR under 0x6400 = 1024), one sub/fma.f16x2 per pair to get q - 8 exactly;
  - fma.rn.f16x2 with x (pre-scaled by 2^-XSHIFT, as f16 pairs (x_j, x_{j+4}));
    8 products per half in one f16x2 chain, then flushed to fp32 (two cvt + add);
  - fp32 epilogue per element: acc += s' (P - (z - 8) xs) (one tile = one group).
x side once per word row per thread: bf16x2 scale (exact), unpack, cvt to f16x2, xs.
"""

from __future__ import annotations

import triton
import triton.language as tl

# word pair ($1 row-half a, $2 row-half b) + x pairs ($3..$6 for a, $7..$10 for b)
# -> $0 = sum over the 16 products (f16 chains, flushed to f32)
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

# x: four bf16x2 words ($5..$8 = (x0,x1),(x2,x3),(x4,x5),(x6,x7)), $9 = bf16x2 2^-S
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
def _x_pairs(x32_row, kw, mask_kw, xs_bits, XSHIFT: tl.constexpr, ASM: tl.constexpr):
    """Word rows ``kw`` of x: four f16x2 (as int32) pairs and the scaled sum."""
    if ASM:
        p = x32_row + kw * 4
        p0 = tl.load(p + 0, mask=mask_kw, other=0)
        p1 = tl.load(p + 1, mask=mask_kw, other=0)
        p2 = tl.load(p + 2, mask=mask_kw, other=0)
        p3 = tl.load(p + 3, mask=mask_kw, other=0)
        x0, x1, x2, x3, xs = tl.inline_asm_elementwise(
            asm=X_ASM,
            constraints="=r,=r,=r,=r,=f,r,r,r,r,r",
            args=[p0, p1, p2, p3, xs_bits],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.float32),
            is_pure=True,
            pack=1,
        )
        return x0, x1, x2, x3, xs
    else:
        return kw, kw, kw, kw, kw.to(tl.float32)


@triton.jit
def _emu_pair(w, x_row, kw, mask_kw, acc, XSHIFT: tl.constexpr):
    """Interpreter emulation of one word's f16 chain (unfused: two roundings per FMA;
    the GPU's fma.rn.f16x2 rounds once). Halves: lo (j) and hi (j + 4)."""
    lo = acc[0]
    hi = acc[1]
    for j in tl.static_range(4):
        xl = (
            tl.load(x_row + kw * 8 + j, mask=mask_kw, other=0.0).to(tl.float32) * (2.0**-XSHIFT)
        ).to(tl.float16)
        xh = (
            tl.load(x_row + kw * 8 + j + 4, mask=mask_kw, other=0.0).to(tl.float32) * (2.0**-XSHIFT)
        ).to(tl.float16)
        ql = (((w >> (4 * j)) & 15) - 8).to(tl.float16)
        qh = (((w >> (4 * j + 16)) & 15) - 8).to(tl.float16)
        lo = (lo + ql * xl[:, None]).to(tl.float16)
        hi = (hi + qh * xh[:, None]).to(tl.float16)
    return lo, hi


@triton.jit
def _xsum_emu(x_row, kw, mask_kw, XSHIFT: tl.constexpr):
    xs = tl.zeros([kw.shape[0]], tl.float32)
    for j in tl.static_range(8):
        xs += tl.load(x_row + kw * 8 + j, mask=mask_kw, other=0.0).to(tl.float32) * (2.0**-XSHIFT)
    return xs


@triton.jit
def _load_words(qw_ptr, kw, limit, cols, mask_c, N):
    return tl.load(
        qw_ptr + kw[:, None].to(tl.int64) * N + cols[None, :],
        mask=(kw < limit)[:, None] & mask_c[None, :],
        other=0,
    )


@triton.jit
def _weight_gemv_h2_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    K,
    K_CHUNK,
    xs_bits,  # bf16x2 bits of 2^-XSHIFT in both halves (ASM path)
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    XSHIFT: tl.constexpr = 4,
    ASM: tl.constexpr = True,
):
    """y[pid_k, n] (fp32 partial per K split) = sum_k x[k] (q[k, n] - z) s for one row."""
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
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    acc0 = tl.zeros([RW, CW], tl.float32)
    acc1 = tl.zeros([RW, CW], tl.float32)
    ka = k_begin // 8 + tl.arange(0, RW)
    kb = ka + RW
    wa0 = _load_words(qw_ptr, ka, lim, c0, m0, N)
    wa1 = _load_words(qw_ptr, ka, lim, c1, m1, N)
    wb0 = _load_words(qw_ptr, kb, lim, c0, m0, N)
    wb1 = _load_words(qw_ptr, kb, lim, c1, m1, N)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ka = k0 // 8 + tl.arange(0, RW)
        kb = ka + RW
        mka = ka < lim
        mkb = kb < lim
        na0 = _load_words(qw_ptr, ka + 2 * RW, lim, c0, m0, N)
        na1 = _load_words(qw_ptr, ka + 2 * RW, lim, c1, m1, N)
        nb0 = _load_words(qw_ptr, kb + 2 * RW, lim, c0, m0, N)
        nb1 = _load_words(qw_ptr, kb + 2 * RW, lim, c1, m1, N)
        g = k0 // GROUP
        s0 = tl.load(s_ptr + g * N + c0, mask=m0, other=0.0).to(tl.float32)
        s1 = tl.load(s_ptr + g * N + c1, mask=m1, other=0.0).to(tl.float32)
        z0 = tl.load(z_ptr + g * N + c0, mask=m0, other=0.0).to(tl.float32) - 8.0
        z1 = tl.load(z_ptr + g * N + c1, mask=m1, other=0.0).to(tl.float32) - 8.0
        if ASM:
            xa0, xa1, xa2, xa3, xsa = _x_pairs(x32, ka, mka, xs_bits, XSHIFT, ASM)
            xb0, xb1, xb2, xb3, xsb = _x_pairs(x32, kb, mkb, xs_bits, XSHIFT, ASM)
            p0 = _h2_dot(wa0, wb0, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3)
            p1 = _h2_dot(wa1, wb1, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3)
        else:
            xsa = _xsum_emu(x_row=x_ptr, kw=ka, mask_kw=mka, XSHIFT=XSHIFT)
            xsb = _xsum_emu(x_row=x_ptr, kw=kb, mask_kw=mkb, XSHIFT=XSHIFT)
            h = tl.zeros([RW, CW], tl.float16)
            lo, hi = _emu_pair(wa0, x_ptr, ka, mka, (h, h), XSHIFT)
            lo, hi = _emu_pair(wb0, x_ptr, kb, mkb, (lo, hi), XSHIFT)
            p0 = lo.to(tl.float32) + hi.to(tl.float32)
            lo, hi = _emu_pair(wa1, x_ptr, ka, mka, (h, h), XSHIFT)
            lo, hi = _emu_pair(wb1, x_ptr, kb, mkb, (lo, hi), XSHIFT)
            p1 = lo.to(tl.float32) + hi.to(tl.float32)
        xs = (xsa + xsb)[:, None]
        acc0 += s0[None, :] * (p0 - z0[None, :] * xs)
        acc1 += s1[None, :] * (p1 - z1[None, :] * xs)
        wa0 = na0
        wa1 = na1
        wb0 = nb0
        wb1 = nb1
    tl.store(y_ptr + pid_k * N + c0, tl.sum(acc0, axis=0) * (2.0**XSHIFT), mask=m0)
    tl.store(y_ptr + pid_k * N + c1, tl.sum(acc1, axis=0) * (2.0**XSHIFT), mask=m1)
