"""The rows a program of a one-row GEMV over row-major weights takes, and its epilogues:
shared by ``int4_gemv_nk`` and ``int8_gemv_nk`` (session 27; int4 alone had them before).

A program takes ``BLOCK_N`` rows of the weight and, with an epilogue, ``HALF = BLOCK_N / 2``
outputs' worth of them:

- ``SILU`` (a merged gate/up projection, ``[2 NH, K]``): rows ``j`` and ``NH + j``, the
  gate and up of output ``j``; the program stores ``silu(gate) * up``.
- ``ROPE`` (a merged q/k/v projection): rows ``j`` and ``D / 2 + j`` of one head, the pairs
  rotate-half rotates together; the program stores q and k rotated and k and v in the
  cache (``int4_qkv_rope._rope_epilogue``).
- neither: ``BLOCK_N`` consecutive rows, stored as they are.

Folding the activation or the rotation into the GEMV removes a kernel from the decode
step's critical path (int4: SiLU in session 23, the rope in session 25).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenloom.plugins.quant.kernels.int4_qkv_rope import _rope_epilogue
from tokenloom.protocols.components.quant import QkvRope


@triton.jit
def program_rows(pid, N, KW, BLOCK_N: tl.constexpr, SILU: tl.constexpr, NH: tl.constexpr,
                 ROPE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """``(base, offs_n, mask_n, row_off)``: the program's first row (pair with ``ROPE``,
    output with ``SILU``), its ``BLOCK_N`` weight rows and their mask, and their offsets
    from row ``base`` in units of ``KW`` elements (32-bit: constants when ``KW`` is, so
    that the loads take them as immediates)."""
    HALF: tl.constexpr = BLOCK_N // 2 if (SILU or ROPE) else BLOCK_N
    i = tl.arange(0, BLOCK_N)
    base = pid * HALF
    if SILU:  # rows j and HALF + j: gate and up of output j (the halves NH rows apart)
        offs_o = base + i % HALF
        mask_n = offs_o < NH
        offs_n = offs_o + (i // HALF) * NH
        row_off = (i % HALF) * KW + (i // HALF) * (NH * KW)
    elif ROPE:  # rows j and D / 2 + j of one head: the pairs rotate-half rotates together
        D2: tl.constexpr = HEAD_DIM // 2
        base = (base // D2) * HEAD_DIM + base % D2  # HALF divides D / 2: one head a program
        offs_n = base + i % HALF + (i // HALF) * D2
        # runs of HALF rows, each from a multiple of HALF: the scale loads' layout (and the
        # accumulator's, so the sums' order) stays the plain mapping's
        offs_n = tl.max_contiguous(tl.multiple_of(offs_n, HALF), HALF)
        mask_n = offs_n < N
        row_off = ((i % HALF) + (i // HALF) * D2) * KW
    else:
        offs_n = pid * BLOCK_N + i
        mask_n = offs_n < N
        row_off = i * KW
    return base, offs_n, mask_n, row_off


@triton.jit
def store_outputs(y, y_ptr, pid, base, offs_n, mask_n, BLOCK_N: tl.constexpr,
                  SILU: tl.constexpr, NH: tl.constexpr, ROPE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
                  cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr):  # fmt: skip
    """Store the program's fp32 outputs ``y [BLOCK_N]`` (rows ``program_rows``) through
    its epilogue."""
    HALF: tl.constexpr = BLOCK_N // 2 if (SILU or ROPE) else BLOCK_N
    if SILU:
        gate, up = tl.split(tl.permute(tl.reshape(y, [2, HALF]), (1, 0)))
        offs_h = pid * HALF + tl.arange(0, HALF)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(y_ptr + offs_h, act.to(y_ptr.dtype.element_ty), mask=offs_h < NH)
    elif ROPE:
        _rope_epilogue(y, y_ptr, offs_n, base, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                       slot_ptr, HALF, HEAD_DIM, NUM_Q, NUM_KV)  # fmt: skip
    else:
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def epilogue_args(n: int, block_n: int, silu: bool, rope: QkvRope | None) -> dict[str, object]:
    """The kernels' epilogue arguments for a layer of ``n`` rows: ``SILU`` / ``NH``, or
    ``ROPE`` with the heads and the cache's tensors (none: the plain store)."""
    assert not (silu and rope is not None)
    assert not silu or (n % 2 == 0 and block_n >= 2), (n, block_n)
    if rope is not None:
        return dict(
            ROPE=True, HEAD_DIM=rope.head_dim, NUM_Q=rope.num_q_heads, NUM_KV=rope.num_kv_heads,
            cos_ptr=rope.cos, sin_ptr=rope.sin, k_cache_ptr=rope.k_cache,
            v_cache_ptr=rope.v_cache, slot_ptr=rope.slot_mapping,
        )  # fmt: skip
    return {"SILU": silu, "NH": n // 2 if silu else 0}


def outputs_and_programs(n: int, block_n: int, silu: bool) -> tuple[int, int]:
    """The outputs of a layer of ``n`` rows and the grid's size over it (``program_rows``:
    with ``SILU`` a program's ``block_n`` rows make ``block_n / 2`` outputs; with ``ROPE``
    ``block_n`` rows, half of them in each half of a head)."""
    if silu:
        return n // 2, triton.cdiv(n // 2, block_n // 2)
    return n, triton.cdiv(n, block_n)
