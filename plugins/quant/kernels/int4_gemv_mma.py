"""The one-row int4 GEMV over row-major weights (``[N, K / 8]``) on the tensor cores: the
products of ``int4_gemv_nk`` by ``mma.sync`` instead of f16x2 FMA chains (session 19).

Why. ``int4_gemv_nk`` ran at 44-60% of the copy bandwidth on a Llama-3-8B layer (53 us a
layer against ~27 at the roofline). ncu on the H200 (session 19): 3.14 instructions a
weight, 0.42 issued a cycle per scheduler at 12 warps an SM. At the copy bandwidth an SM
receives ~33 int4 weights a cycle, so 3.14 instructions a weight would need ~80% of the
SM's issue slots; int8 (3.3 a byte, 16.5 bytes a cycle) needs 43% and is memory bound.

What it measured (session 19, one H200, ``gemv_bench.py --bits 4 --rows 1 --cold``): 40%
fewer instructions, about the same time: qkv 6.8, o 5.6, gate/up 23.5, down 16.9 us
against ``int4_gemv_nk``'s 6.6, 5.4, 24.4, 16.8. The tuner takes it for gate/up. So the
one-row int4 GEMVs are not bound by their instruction count; a variant reading the scales
packed ``[N, G]`` (one 4-byte load a row and group, 4d5a482) measured the same too, so
not by the scale gathers either (docs/quantization.md, session 19).

The idea. One ``mma.sync.m16n8k16`` (bf16 in, fp32 sums) used as a 4-lane dot product. In
its fragments lane ``4g + j`` holds ``A[g][2j..2j+1]``, ``A[g][2j+8..]`` (A's registers 0
and 2), ``A[g+8][..]`` (1 and 3) and ``B[2j..2j+1][g]``, ``B[2j+8..][g]``: so the
diagonal ``C[g][g]`` pairs each lane of quad ``g`` with its own B registers, and sums the
quad's products; ``C[g+8][g]`` does the same for A's other row. Here A's rows are two
weight rows ``r`` and ``r + BLOCK_N / 2`` (their nibbles as bf16 ``128 + q``, exact, one
``lop3`` a pair), B is the lane's own x (bf16 pairs, one ``prmt`` a pair, no range guard
and no conversion), and lane ``4g + g / 2`` reads both diagonals (the other lanes give 0).
Per eight weights: 3.5 shifts and ``lop3``s a row and one MMA for both rows, ~1.0
instruction a weight against ~1.5 in the f16x2 chain; x's preparation (16 ``prmt`` and
its fp32 sum per 32 values) is ~1/5 of ``int4_gemv_nk``'s.

What it needs from the layout. A lane's four words are one element (32 weights of a
row); the 4 lanes of a quad must hold the same two rows and 4 consecutive elements, so
that a quad covers 128 K of one group (``GROUP % 128 == 0``). Triton lays the loaded
``[BLOCK_N / 2, BLOCK_KW]`` tile with lanes along K (16-byte vectors, 32 lanes then the
warps along K, as ``int4_gemv_nk``'s; ``scripts/sass_loop.py``'s TTGIR shows it); the GPU
tests check the outputs against the reference for every tiling offered. The epilogue is
linear in the lanes: each adds ``s (chain - (128 + z) xsum_own)`` with its own x sum, the
diagonal lane's chain holding the quad's, so ``tl.sum`` gives each row exactly.

In the interpreter (``ASM`` False) each lane's chain is its own element's, in fp32, so the
indexing, masks and epilogue run on the CPU; the MMA is tested on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import launch_options, release, wait
from tokenloom.plugins.quant.kernels.h2_common import _ptx
from tokenloom.plugins.quant.kernels.int4_gemv_nk import _split4, int4_nk_fits

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
# the same, loading x itself ($17: the element's 16-byte-aligned address, $18: 0 past K):
# opaque to Triton's pipeliner, which would stage each 4-byte x word through shared memory
_XL_LINES = [
    "{ .reg .b32 x<16>; .reg .pred p; setp.ne.b32 p, $18, 0;",
    *(f" mov.b32 x{i}, 0;" for i in range(16)),
    *(
        f" @p ld.global.nc.v4.b32 {{x{4 * v}, x{4 * v + 1}, x{4 * v + 2}, x{4 * v + 3}}},"
        f" [$17+{16 * v}];"
        for v in range(4)
    ),
]
_XL_BODY = "\n".join(_XB_LINES)
for _i in reversed(range(16)):  # $17.. -> x0..; high numbers first ($27 before $17)
    _XL_BODY = _XL_BODY.replace(f"${17 + _i}", f"x{_i}")
_XL_ASM = tl.constexpr("\n".join(_XL_LINES) + "\n" + _XL_BODY + " }")
_XL_CONSTRAINTS = tl.constexpr("=r," * 16 + "=f,l,r")

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
def _x_b_loaded(x32, kw, mask):
    """``_x_b`` with x loaded by the PTX (16-byte loads; x 16-byte aligned)."""
    return tl.inline_asm_elementwise(
        asm=_XL_ASM,
        constraints=_XL_CONSTRAINTS,
        args=[x32 + kw * 4, mask.to(tl.int32)],
        dtype=(
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.float32,
        ),  # fmt: skip
        is_pure=False,
        pack=1,
    )


@triton.jit
def _x_b(x32, kw, mask):
    """x's 32 values from word ``kw`` of each element: 16 B registers and their fp32 sum."""
    p = x32 + kw * 4
    return tl.inline_asm_elementwise(
        asm=_XB_ASM,
        constraints=_XB_CONSTRAINTS,
        args=[
            tl.load(p + 0, mask=mask, other=0),
            tl.load(p + 1, mask=mask, other=0),
            tl.load(p + 2, mask=mask, other=0),
            tl.load(p + 3, mask=mask, other=0),
            tl.load(p + 4, mask=mask, other=0),
            tl.load(p + 5, mask=mask, other=0),
            tl.load(p + 6, mask=mask, other=0),
            tl.load(p + 7, mask=mask, other=0),
            tl.load(p + 8, mask=mask, other=0),
            tl.load(p + 9, mask=mask, other=0),
            tl.load(p + 10, mask=mask, other=0),
            tl.load(p + 11, mask=mask, other=0),
            tl.load(p + 12, mask=mask, other=0),
            tl.load(p + 13, mask=mask, other=0),
            tl.load(p + 14, mask=mask, other=0),
            tl.load(p + 15, mask=mask, other=0),
        ],  # fmt: skip
        dtype=(
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.int32,
            tl.float32,
        ),  # fmt: skip
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


@triton.jit
def _emu_chain(w, x_ptr, k, mask):
    """Interpreter: one element's sum of ``(128 + q) x`` over its 32 K values (fp32)."""
    w0, w1, w2, w3 = w
    part = tl.zeros(w0.shape, tl.float32)
    for j in tl.static_range(8):
        part += (((w0 >> (4 * j)) & 0xF) + 128).to(tl.float32) * tl.load(
            x_ptr + k + j, mask=mask, other=0.0
        ).to(tl.float32)[None, :]
        part += (((w1 >> (4 * j)) & 0xF) + 128).to(tl.float32) * tl.load(
            x_ptr + k + 8 + j, mask=mask, other=0.0
        ).to(tl.float32)[None, :]
        part += (((w2 >> (4 * j)) & 0xF) + 128).to(tl.float32) * tl.load(
            x_ptr + k + 16 + j, mask=mask, other=0.0
        ).to(tl.float32)[None, :]
        part += (((w3 >> (4 * j)) & 0xF) + 128).to(tl.float32) * tl.load(
            x_ptr + k + 24 + j, mask=mask, other=0.0
        ).to(tl.float32)[None, :]
    return part


@triton.jit
def _emu_xsum(x_ptr, k, mask):
    xs = tl.zeros(k.shape, tl.float32)
    for j in tl.static_range(32):
        xs += tl.load(x_ptr + k + j, mask=mask, other=0.0).to(tl.float32)
    return xs


@triton.jit
def _load_rows(w_rows, offs_w, k0, mask_n, KW):
    nxt = k0 + offs_w
    return tl.load(w_rows + nxt[None, :], mask=mask_n[:, None] & (nxt < KW)[None, :], other=0)


@triton.jit
def _group_epilogue(acc, chain, xs, s_ptr, z_ptr, g, rows, N):
    """``acc += s (chain - (128 + z) xs)`` with the element's group scale and zero point.
    ``g`` and ``rows`` are clamped into the arrays, not masked (no predicates, no zeroing):
    past K an element's chain and x sum are 0, past N a row is not stored."""
    sz = g[None, :] * N + rows[:, None]
    s = tl.load(s_ptr + sz).to(tl.float32)
    z = tl.load(z_ptr + sz).to(tl.float32) + 128.0
    return acc + s * (chain - z * xs[None, :])


@triton.jit
def _step(acc_lo, acc_hi, w_lo, w_hi, k0, x_ptr, s_ptr, z_ptr, rows_s_lo, rows_s_hi, N, KW,
          GROUP: tl.constexpr, H: tl.constexpr, P: tl.constexpr, ASM: tl.constexpr,
          RING: tl.constexpr):  # fmt: skip
    """One tile of ``BLOCK_KW`` words of the program's rows: the products and the group
    epilogue."""
    kw = k0 + tl.arange(0, P) * 4  # each element's first word
    mask_p = kw < KW
    g = tl.minimum((kw * 8) // GROUP, (KW * 8 - 1) // GROUP)
    lo = _split4(w_lo, H, P)
    hi = _split4(w_hi, H, P)
    if ASM and RING > 1:
        xb = _x_b_loaded(x_ptr.to(tl.pointer_type(tl.int32)), kw, mask_p)
        xs = xb[16]
        chain_lo, chain_hi = _mma_pair(lo, hi, xb)
    elif ASM:
        xb = _x_b(x_ptr.to(tl.pointer_type(tl.int32)), kw, mask_p)
        xs = xb[16]
        chain_lo, chain_hi = _mma_pair(lo, hi, xb)
    else:
        k = kw * 8
        xs = _emu_xsum(x_ptr, k, mask_p)
        chain_lo = _emu_chain(lo, x_ptr, k, mask_p)
        chain_hi = _emu_chain(hi, x_ptr, k, mask_p)
    acc_lo = _group_epilogue(acc_lo, chain_lo, xs, s_ptr, z_ptr, g, rows_s_lo, N)
    acc_hi = _group_epilogue(acc_hi, chain_hi, xs, s_ptr, z_ptr, g, rows_s_hi, N)
    return acc_lo, acc_hi


@triton.jit
def _l2_prefetch(ptrs):
    """Start reading ``ptrs``' lines into L2 (no registers held): before ``wait`` the
    ring's first tiles are read while the kernel before still runs, as the register
    prefetch's first tile is."""
    return tl.inline_asm_elementwise(
        asm="prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        constraints="=r,l",
        args=[ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit(do_not_specialize=["stride_sn"])
def _int4_gemv_mma_kernel(
    x_ptr,  # [1, K]
    qw_ptr,  # int32 words [N, K / 8]
    s_ptr,  # [G, N]
    z_ptr,  # [G, N]
    b_ptr,
    y_ptr,  # [1, N]
    N,
    KW,  # K / 8, a multiple of 4
    stride_sn,  # 1: a runtime value, so the scale loads keep the tile's layout
    GROUP: tl.constexpr,  # a multiple of 128
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rows a program, two halves
    BLOCK_KW: tl.constexpr,  # words of a tile row, a multiple of 16
    ASM: tl.constexpr,
    RING: tl.constexpr = 0,  # > 1: the tiles stream through a shared-memory ring this deep
    USE_PDL: tl.constexpr = False,
):
    H: tl.constexpr = BLOCK_N // 2
    P: tl.constexpr = BLOCK_KW // 4
    offs_lo = tl.program_id(0) * BLOCK_N + tl.arange(0, H)
    offs_hi = offs_lo + H
    offs_w = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_KW), 4), 4)
    mask_lo = offs_lo < N
    mask_hi = offs_hi < N
    rows_lo = qw_ptr + offs_lo[:, None].to(tl.int64) * KW
    rows_hi = qw_ptr + offs_hi[:, None].to(tl.int64) * KW
    # the scales' rows, clamped; times a runtime 1, so the scale loads keep the tile's
    # layout (Triton would lay contiguous rows across the lanes, and convert)
    rows_s_lo = tl.minimum(offs_lo, N - 1) * stride_sn
    rows_s_hi = tl.minimum(offs_hi, N - 1) * stride_sn
    acc_lo = tl.zeros([H, P], tl.float32)
    acc_hi = tl.zeros([H, P], tl.float32)
    if RING > 1:  # Triton's pipeliner: cp.async into RING stages, registers for one tile
        if USE_PDL:
            for t in tl.static_range(RING - 1):
                nxt = tl.minimum(t * BLOCK_KW + offs_w, KW - 1)[None, :]
                _l2_prefetch(tl.where(mask_lo[:, None], rows_lo, qw_ptr) + nxt)
                _l2_prefetch(tl.where(mask_hi[:, None], rows_hi, qw_ptr) + nxt)
        wait(USE_PDL)
        release(USE_PDL)
        for k0 in tl.range(0, KW, BLOCK_KW, num_stages=RING):
            w_lo = _load_rows(rows_lo, offs_w, k0, mask_lo, KW)
            w_hi = _load_rows(rows_hi, offs_w, k0, mask_hi, KW)
            acc_lo, acc_hi = _step(acc_lo, acc_hi, w_lo, w_hi, k0, x_ptr, s_ptr, z_ptr,
                                   rows_s_lo, rows_s_hi, N, KW, GROUP, H, P, ASM, RING)  # fmt: skip
    else:  # the next tile in flight in registers
        w_lo = _load_rows(rows_lo, offs_w, 0, mask_lo, KW)
        w_hi = _load_rows(rows_hi, offs_w, 0, mask_hi, KW)
        wait(USE_PDL)  # the first tiles are in flight; x comes from the kernel before
        release(USE_PDL)
        for k0 in range(0, KW, BLOCK_KW):
            next_lo = _load_rows(rows_lo, offs_w, k0 + BLOCK_KW, mask_lo, KW)
            next_hi = _load_rows(rows_hi, offs_w, k0 + BLOCK_KW, mask_hi, KW)
            acc_lo, acc_hi = _step(acc_lo, acc_hi, w_lo, w_hi, k0, x_ptr, s_ptr, z_ptr,
                                   rows_s_lo, rows_s_hi, N, KW, GROUP, H, P, ASM, RING)  # fmt: skip
            w_lo = next_lo
            w_hi = next_hi
    y_lo = tl.sum(acc_lo, axis=1)
    y_hi = tl.sum(acc_hi, axis=1)
    if HAS_BIAS:
        y_lo += tl.load(b_ptr + offs_lo, mask=mask_lo, other=0.0).to(tl.float32)
        y_hi += tl.load(b_ptr + offs_hi, mask=mask_hi, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_lo, y_lo.to(y_ptr.dtype.element_ty), mask=mask_lo)
    tl.store(y_ptr + offs_hi, y_hi.to(y_ptr.dtype.element_ty), mask=mask_hi)


def int4_mma_fits(x: torch.Tensor, qweight: torch.Tensor, group: int, has_zeros: bool) -> bool:
    """``int4_nk_fits``, with groups of a multiple of 128 (a quad of lanes, one group)."""
    return group % 128 == 0 and int4_nk_fits(x, qweight, group, has_zeros)


def launch_int4_mma(
    x: torch.Tensor,
    qweight: torch.Tensor,  # the logical [K / 8, N]: a view of [N, K / 8] storage
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    num_warps: int,
    ring: int = 0,
) -> torch.Tensor:
    """``x [1, K] @ dequant(qweight)^T (+ bias) -> [1, N]`` in ``x``'s dtype
    (``int4_mma_fits``); ``block_n`` rows a program (even), ``block_k`` K a tile row;
    ``ring`` > 1: the tiles stream through a shared-memory ring of that many stages."""
    assert int4_mma_fits(x, qweight, group, zeros is not None), (tuple(x.shape), group)
    assert block_n % 2 == 0 and block_k % 128 == 0, (block_n, block_k)
    kw, n = qweight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_kw = max(16, min(block_k // 8, triton.next_power_of_2(kw)))
    ring = ring if x.data_ptr() % 16 == 0 else 0  # the ring's PTX reads x 16 bytes at a time
    _int4_gemv_mma_kernel[(triton.cdiv(n, block_n),)](
        x,
        qweight.t(),  # [N, K / 8], contiguous
        scales,
        zeros,
        bias if bias is not None else scales,
        y,
        n,
        kw,
        1,
        GROUP=group,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_KW=block_kw,
        ASM=_ptx(x),
        RING=ring,
        num_warps=num_warps,
        **({"num_stages": ring} if ring > 1 else {}),
        **launch_options(x.device),
    )
    return y
