"""The rotary embedding inside the decode kernel (``decode_attention(rope=...)``).

Each program rotates its query heads (with Qwen3's per-head RMSNorm first); the
program whose KV slice ends at the new token also norms and rotates the new key and
stores it and the value in the cache, then waits at a barrier so that its own loop
reads them back. The other splits of the request never read that slot. The
arithmetic is the rope kernel's (``rope_ops.norm_rope``): bit-equal in the interpreter;
on the GPU the q/k norm's sum may reduce in another order. 16-bit or fp32 contiguous caches, head sizes that are powers of two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenloom.plugins.models.rope_ops import norm_rope


@dataclass(frozen=True)
class DecodeRope:
    """This step's keys and values ``[B, Hkv, D]`` (views of the projection are fine),
    cos/sin ``[B, D/2]`` (or ``[B, 1, D/2]``) at each request's position, the per-head
    RMSNorm weights (Qwen3) or None, and each request's cache slot (``< 0``: none)."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    slot_mapping: torch.Tensor

    def kernel_args(self, head_dim: int) -> tuple[object, ...]:
        """The decode kernel's rope arguments, ``k_new_ptr`` to ``eps``."""
        cos = self.cos.reshape(self.cos.shape[0], head_dim // 2)
        sin = self.sin.reshape(self.sin.shape[0], head_dim // 2)
        q_norm, k_norm = (self.q_weight, self.k_weight) if self.has_norm else (cos, cos)
        return (
            self.k, self.v, cos, sin, q_norm, k_norm, self.slot_mapping,
            self.k.stride(0), self.k.stride(1), self.v.stride(0), self.v.stride(1),
            cos.stride(0), self.eps,
        )  # fmt: skip

    @property
    def has_norm(self) -> bool:
        return self.q_weight is not None and self.k_weight is not None

    @staticmethod
    def unused_args(q: torch.Tensor) -> tuple[object, ...]:
        """Placeholders for a launch without rope."""
        return (q,) * 7 + (0,) * 5 + (0.0,)


@triton.jit
def rope_query_store_kv(
    q_ptr, k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, seq, kv_head, heads, mask_h, ends_at_new_token,
    stride_q_tok, stride_q_head, stride_kn_tok, stride_kn_head, stride_vn_tok,
    stride_vn_head, stride_cos, stride_cache_block, stride_cache_tok, head_off, eps,
    HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """The program's query heads rotated, as halves ``[BLOCK_H, HALF]``; with
    ``ends_at_new_token``, the new key (rotated) and value stored in the cache first."""
    cols = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + seq * stride_cos + cols).to(tl.float32)
    sin = tl.load(sin_ptr + seq * stride_cos + cols).to(tl.float32)
    q_base = q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + cols
    q1 = tl.load(q_base, mask=mask_h[:, None], other=0.0)
    q2 = tl.load(q_base + HALF, mask=mask_h[:, None], other=0.0)
    q1, q2 = norm_rope(q1, q2, q_norm_ptr, cos, sin, eps, HALF, HAS_NORM)
    if ends_at_new_token:
        slot = tl.load(slot_ptr + seq)
        if slot >= 0:
            k_base = k_new_ptr + seq * stride_kn_tok + kv_head * stride_kn_head + cols
            k1, k2 = norm_rope(
                tl.load(k_base), tl.load(k_base + HALF), k_norm_ptr, cos, sin, eps, HALF, HAS_NORM
            )
            v_base = v_new_ptr + seq * stride_vn_tok + kv_head * stride_vn_head + cols
            page = (slot // PAGE_SIZE).to(tl.int64)
            dst = page * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_tok + head_off
            dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + dst + cols, k1.to(dtype))
            tl.store(k_cache_ptr + dst + HALF + cols, k2.to(dtype))
            tl.store(v_cache_ptr + dst + cols, tl.load(v_base).to(dtype))
            tl.store(v_cache_ptr + dst + HALF + cols, tl.load(v_base + HALF).to(dtype))
            tl.debug_barrier()  # the stores before this program's own loads of them
    return q1, q2


def check_supported(head_dim: int, quantized: bool, caches: tuple[torch.Tensor, ...]) -> None:
    if quantized or head_dim != triton.next_power_of_2(head_dim):
        raise ValueError("rope in the decode kernel: a 16-bit or fp32 cache, head size 2^n")
    if not all(c.is_contiguous() for c in caches):
        raise ValueError("rope in the decode kernel: contiguous caches only")
