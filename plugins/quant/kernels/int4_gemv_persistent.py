"""``int4_gemv_mma`` as a persistent kernel: a grid of a few programs an SM, each walking
its row blocks and their K tiles as one sequence, with the next tile in flight across row
blocks (session 19, unmeasured; offered with ``TOKENLOOM_INT4_EXPERIMENTAL=1``).

Why. In the one-row int4 GEMVs a program owns ``BLOCK_N`` rows. For K = 4,096 (qkv, o,
gate/up: 75% of a Llama-3-8B layer's weights) its rows are one tile, so the next-tile
prefetch has nothing to overlap: a program loads, waits, computes and exits, and an SM's
loads stop while its 2-3 programs compute. ncu (session 19): DRAM 51% on gate/up, 39% on
down; 40% fewer instructions (``int4_gemv_mma``) and 8x fewer scale sectors left the
times as they were. Here the prefetch of tile ``t + 1`` may be the next row block's first
tile, so every compute overlaps a load, and the grid has no partial last wave (ncu
estimated up to 20% of gate/up's time in its partial wave).

The products, the group epilogue and the interpreter's path are ``int4_gemv_mma``'s
(``_step``); a row block's sums are stored when its last tile is done.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.pdl import release, wait
from tokenloom.plugins.quant.kernels.int4_gemv_mma import _load_rows, _step, launch_rows


@triton.jit
def _rows(qw_ptr, rb, N, KW, BLOCK_N: tl.constexpr, H: tl.constexpr):
    offs_lo = rb * BLOCK_N + tl.arange(0, H)
    offs_hi = offs_lo + H
    rows_lo = qw_ptr + offs_lo[:, None].to(tl.int64) * KW
    rows_hi = qw_ptr + offs_hi[:, None].to(tl.int64) * KW
    return offs_lo, offs_hi, rows_lo, rows_hi


@triton.jit(do_not_specialize=["stride_sn"])
def _int4_gemv_persistent_kernel(
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
    BLOCK_N: tl.constexpr,  # rows a row block, two halves
    BLOCK_KW: tl.constexpr,  # words of a tile row, a multiple of 16
    ASM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    H: tl.constexpr = BLOCK_N // 2
    P: tl.constexpr = BLOCK_KW // 4
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n_kt = tl.cdiv(KW, BLOCK_KW)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, programs) * n_kt  # this program's tiles
    offs_w = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_KW), 4), 4)
    offs_lo, offs_hi, rows_lo, rows_hi = _rows(qw_ptr, pid, N, KW, BLOCK_N, H)
    w_lo = _load_rows(rows_lo, offs_w, 0, offs_lo < N, KW)
    w_hi = _load_rows(rows_hi, offs_w, 0, offs_hi < N, KW)
    wait(USE_PDL)  # the first tiles are in flight; x comes from the kernel before
    release(USE_PDL)
    acc_lo = tl.zeros([H, P], tl.float32)
    acc_hi = tl.zeros([H, P], tl.float32)
    for t in range(0, total):
        kt = t % n_kt
        rb = pid + (t // n_kt) * programs
        # the next tile: this row block's next, or the next row block's first
        rb1 = pid + ((t + 1) // n_kt) * programs
        k1 = ((t + 1) % n_kt) * BLOCK_KW
        lim = tl.where(t + 1 < total, N, 0)  # past this program's last tile: nothing
        n_lo, n_hi, r_lo, r_hi = _rows(qw_ptr, rb1, N, KW, BLOCK_N, H)
        next_lo = _load_rows(r_lo, offs_w, k1, n_lo < lim, KW)
        next_hi = _load_rows(r_hi, offs_w, k1, n_hi < lim, KW)
        offs_lo, offs_hi, rows_lo, rows_hi = _rows(qw_ptr, rb, N, KW, BLOCK_N, H)
        rows_s_lo = tl.minimum(offs_lo, N - 1) * stride_sn
        rows_s_hi = tl.minimum(offs_hi, N - 1) * stride_sn
        acc_lo, acc_hi = _step(acc_lo, acc_hi, w_lo, w_hi, kt * BLOCK_KW, x_ptr, s_ptr, z_ptr,
                               rows_s_lo, rows_s_hi, N, KW, GROUP, H, P, ASM, 0)  # fmt: skip
        if kt == n_kt - 1:  # the row block's last tile: its sums out, the next from zero
            y_lo = tl.sum(acc_lo, axis=1)
            y_hi = tl.sum(acc_hi, axis=1)
            if HAS_BIAS:
                y_lo += tl.load(b_ptr + offs_lo, mask=offs_lo < N, other=0.0).to(tl.float32)
                y_hi += tl.load(b_ptr + offs_hi, mask=offs_hi < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs_lo, y_lo.to(y_ptr.dtype.element_ty), mask=offs_lo < N)
            tl.store(y_ptr + offs_hi, y_hi.to(y_ptr.dtype.element_ty), mask=offs_hi < N)
            acc_lo = tl.zeros([H, P], tl.float32)
            acc_hi = tl.zeros([H, P], tl.float32)
        w_lo = next_lo
        w_hi = next_hi


def launch_int4_persistent(
    x: torch.Tensor,
    qweight: torch.Tensor,  # the logical [K / 8, N]: a view of [N, K / 8] storage
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    num_warps: int,
    per_sm: int,
) -> torch.Tensor:
    """``launch_int4_mma``'s product with ``per_sm`` programs an SM (at most one a row
    block), each walking its row blocks."""
    assert per_sm >= 1, per_sm
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    programs = min(triton.cdiv(qweight.shape[1], block_n), sms * per_sm)
    return launch_rows(
        _int4_gemv_persistent_kernel, x, qweight, scales, zeros, group, bias, block_n,
        block_k, num_warps, programs,
    )  # fmt: skip
