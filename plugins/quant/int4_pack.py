"""The int4 layout's packing: eight 4-bit values to an int32 along the input axis
(``qweight [K / 8, N]``, nibble ``j`` of word ``i`` is input row ``8 i + j``), the one
layout every int4 source (round-to-nearest, AWQ / GPTQ / compressed-tensors checkpoints,
a GGUF file's blocks, ``tokenloom quantize``) ends in. A leaf, so that each of those
readers and writers imports it without importing the ``int4`` plugin."""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [K, N]`` of values 0..15 -> ``[K / 8, N]`` int32, row ``8 i + j`` in nibble ``j``."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"int4: the input size {k} is no multiple of {PACK}")
    q = q.to(torch.int32).view(k // PACK, PACK, n)
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=q.device)[None, :, None]
    return (q << shifts).sum(dim=1, dtype=torch.int32)  # bits never overlap: sum == or


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: ``[K / 8, N]`` int32 -> ``[K, N]`` int32 in 0..15."""
    rows, n = packed.shape
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=packed.device)
    return ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(rows * PACK, n)
