"""The epilogue of a merged q/k/v projection's one-row int4 GEMV (``int4_gemv_nk`` with
``ROPE``): q and k rotated, k and v stored in the paged cache, where the GEMV's outputs
are still in registers.

At batch 1 a decoder layer ran a rope kernel between the q/k/v GEMV and the attention
(``rope_ops.qk_norm_rope_``: rotate q and k in place, store k and v): 1.56 us on the
critical path of a Llama-3-8B layer on an H200 (session 24's profile), 50 us a step,
nearly all of it the kernel boundary. Here a program of the GEMV takes ``BLOCK_N / 2``
rows of one head's first half and the same rows of its second half (the pairs
rotate-half rotates together), so it can finish them itself. Only heads without a
per-head norm (that needs the whole head in one program) and 16-bit caches (an 8-bit
one needs a whole head for its scale).

Status: on by default since session 25 (``TOKENLOOM_INT4_FUSED_ROPE=0`` turns it off).
Session 24's first version was not bit-exact against the unfused path: its row mapping
made Triton lay out the accumulator differently (another order of the sums); the hints
below keep the plain kernel's layout. Its second version was still off by one bf16 ulp in
the heads' second halves on the H200: LLVM had folded one product of the rotation and
the add into an ``fma.rn.bf16``, a different product here than in the rope kernel.
``rope_ops.rotate_half`` (one rotation for both) rounds every product once. Measured
(session 25, H200, Llama-3-8B, alternated twice): 1.729 -> 1.713 ms a step (-16 us); the
GPU tests pass bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.rope_ops import rotate_half
from tokenloom.protocols.components.quant import QkvRope


@triton.jit
def _rope_epilogue(y, y_ptr, offs_n, row, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                   HALF: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_Q: tl.constexpr,
                   NUM_KV: tl.constexpr):  # fmt: skip
    """``y`` = rows ``row + [0, HALF)`` then the same rows ``D / 2`` on, of one head
    (``offs_n``): stored rotated (q and k heads; rounded where ``rope_ops.norm_rope``
    rounds, so the result is the unfused GEMV-then-rope's to the bit), and a k or v head
    also into its cache. The pairs meet through the output itself (stored, a barrier,
    reloaded as two halves): a reshape of ``y`` made Triton lay the GEMV's accumulator
    out for it, which changed the sums' order (and so their last bits) and added a layout
    conversion to the loop (offline TTGIR, session 24)."""
    dtype = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, y.to(dtype))
    tl.debug_barrier()  # the program's stores visible to all its threads
    D2: tl.constexpr = HEAD_DIM // 2
    head = row // HEAD_DIM
    cols = row % HEAD_DIM + tl.arange(0, HALF)
    first = y_ptr + row + tl.arange(0, HALF)
    x1 = tl.load(first)
    x2 = tl.load(first + D2)
    if head < NUM_Q + NUM_KV:
        cos = tl.load(cos_ptr + cols).to(tl.float32)
        sin = tl.load(sin_ptr + cols).to(tl.float32)
        x1, x2 = rotate_half(x1, x2, cos, sin)
        tl.debug_barrier()  # every thread has read the unrotated pair before it is replaced
        tl.store(first, x1)
        tl.store(first + D2, x2)
    if head >= NUM_Q:
        slot = tl.load(slot_ptr).to(tl.int64)
        if slot >= 0:
            if head < NUM_Q + NUM_KV:
                dst = k_cache_ptr + slot * (NUM_KV * HEAD_DIM) + (head - NUM_Q) * HEAD_DIM
            else:
                dst = v_cache_ptr + slot * (NUM_KV * HEAD_DIM) + (head - NUM_Q - NUM_KV) * HEAD_DIM
            tl.store(dst + cols, x1)
            tl.store(dst + D2 + cols, x2)


def rope_epilogue_on() -> bool:
    """On unless ``TOKENLOOM_INT4_FUSED_ROPE=0`` (read at each call: fixed in a CUDA graph
    once captured); on by default since session 25 (bit-exact and -16 us a Llama-3-8B
    step on the H200)."""
    return os.environ.get("TOKENLOOM_INT4_FUSED_ROPE", "1") == "1"


def rope_fits(x: torch.Tensor, n: int, block_n: int, rope: QkvRope) -> bool:
    """Whether a program of ``block_n`` rows can take pairs of one head (half its rows in
    each half of the head), the layer's rows are ``rope``'s heads, and the cache and the
    cos/sin rows are as ``_rope_epilogue`` reads them."""
    d = rope.head_dim
    heads = rope.num_q_heads + 2 * rope.num_kv_heads
    caches = (rope.k_cache, rope.v_cache)
    return (
        # runs of fewer than 8 rows changed the accumulator's layout against the plain
        # kernel's at 8 rows a program (offline TTGIR, sm_90), and so the sums' order
        block_n >= 16
        and block_n % 2 == 0
        and d % 2 == 0
        and (d // 2) % (block_n // 2) == 0
        and n == heads * d
        and all(c.dtype == x.dtype and c.is_contiguous() for c in caches)
        and all(c.shape[-2:] == (rope.num_kv_heads, d) for c in caches)
        and all(t.shape == (1, d // 2) and t.stride(1) == 1 for t in (rope.cos, rope.sin))
        and rope.slot_mapping.shape == (1,)
        and rope.slot_mapping.dtype == torch.int64
    )
