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
not by the scale gathers either (docs/quantization.md, session 19). Nor by bytes in
flight: the tiles through a shared-memory ring, and a persistent grid with the next tile
in flight across row blocks, measured no faster and went (session 20, ``gemm_config``).

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

from tokenloom.plugins.models.pdl import release, wait
from tokenloom.plugins.quant.kernels.int4_gemv_nk import (
    _emu_word,
    _emu_xsum,
    _split4,
    int4_nk_fits,
    launch_int4_rows,
)
from tokenloom.plugins.quant.kernels.int4_mma_asm import _mma_pair, _x_b


@triton.jit
def _emu_chain(w, x_ptr, k, mask):
    """Interpreter: an element's four words, ``sum (q - 8) x`` (``int4_gemv_nk``'s)."""
    w0, w1, w2, w3 = w
    chain = _emu_word(w0, x_ptr, k, mask) + _emu_word(w1, x_ptr, k + 8, mask)
    return chain + _emu_word(w2, x_ptr, k + 16, mask) + _emu_word(w3, x_ptr, k + 24, mask)


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
          GROUP: tl.constexpr, H: tl.constexpr, P: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """One tile of ``BLOCK_KW`` words of the program's rows: the products and the group
    epilogue."""
    kw = k0 + tl.arange(0, P) * 4  # each element's first word
    mask_p = kw < KW
    g = tl.minimum((kw * 8) // GROUP, (KW * 8 - 1) // GROUP)
    lo = _split4(w_lo, H, P)
    hi = _split4(w_hi, H, P)
    if ASM:
        xb = _x_b(x_ptr.to(tl.pointer_type(tl.int32)), kw, mask_p)
        xs = xb[16]
        chain_lo, chain_hi = _mma_pair(lo, hi, xb)
    else:
        k = kw * 8  # each element's own chain of (128 + q) x: sum (q - 8) x + 136 sum x
        xs = _emu_xsum(x_ptr, k, mask_p)
        chain_lo = _emu_chain(lo, x_ptr, k, mask_p) + 136.0 * xs[None, :]
        chain_hi = _emu_chain(hi, x_ptr, k, mask_p) + 136.0 * xs[None, :]
    acc_lo = _group_epilogue(acc_lo, chain_lo, xs, s_ptr, z_ptr, g, rows_s_lo, N)
    acc_hi = _group_epilogue(acc_hi, chain_hi, xs, s_ptr, z_ptr, g, rows_s_hi, N)
    return acc_lo, acc_hi


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
    # the next tile in flight in registers
    w_lo = _load_rows(rows_lo, offs_w, 0, mask_lo, KW)
    w_hi = _load_rows(rows_hi, offs_w, 0, mask_hi, KW)
    wait(USE_PDL)  # the first tiles are in flight; x comes from the kernel before
    release(USE_PDL)
    for k0 in range(0, KW, BLOCK_KW):
        next_lo = _load_rows(rows_lo, offs_w, k0 + BLOCK_KW, mask_lo, KW)
        next_hi = _load_rows(rows_hi, offs_w, k0 + BLOCK_KW, mask_hi, KW)
        acc_lo, acc_hi = _step(acc_lo, acc_hi, w_lo, w_hi, k0, x_ptr, s_ptr, z_ptr,
                               rows_s_lo, rows_s_hi, N, KW, GROUP, H, P, ASM)  # fmt: skip
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
) -> torch.Tensor:
    """``x [1, K] @ dequant(qweight)^T (+ bias) -> [1, N]`` in ``x``'s dtype
    (``int4_mma_fits``); ``block_n`` rows a program (even), ``block_k`` K a tile row."""
    assert int4_mma_fits(x, qweight, group, zeros is not None), (tuple(x.shape), group)
    assert block_n % 2 == 0 and block_k % 128 == 0, (block_n, block_k)
    block_kw = max(16, min(block_k // 8, triton.next_power_of_2(qweight.shape[0])))
    return launch_int4_rows(
        _int4_gemv_mma_kernel, x, qweight, scales, zeros, bias, block_n, block_kw, num_warps,
        1, GROUP=group,
    )  # fmt: skip
