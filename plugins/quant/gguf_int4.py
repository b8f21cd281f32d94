"""llama.cpp's 4-bit blocks (Q4_0, Q4_1) read into the ``int4`` layout as they are.

A GGUF file stores each output row of a linear in blocks of 32 inputs. Q4_0 keeps a
scale ``d`` per block and ``w = d (q - 8)``; Q4_1 keeps ``d`` and a minimum ``m`` and
``w = d q + m``. Both are the int4 kernels' ``w = (q - z) s`` in groups of 32, with
``s = d`` and ``z = 8`` or ``z = -m / d`` (a fractional zero point, which the kernels
take in the model dtype like any other). So with ``--quant int4`` such a file needs
no second rounding: the loader's dense copy (dequantized by ``gguf``) is dropped and
the layer's kernel gets the file's own nibbles. Rounding those dense weights again
into groups of 128 (RTN) costs the built-in model +25.6% perplexity; the blocks cost
nothing in fp32 (docs/quantization.md, Quality).

A block with ``d = 0`` holds one value, ``m`` (``z = -1``, ``s = m``, ``q = 0``). Layers
of other types (Q8_0, K-quants, 16-bit) in the same file are quantized by RTN as usual.
The rows follow the dense load exactly: llama's Q/K rope permutation is undone, merged
layers (qkv, gate_up) take their parts at their slots' rows, and a rank reads its
shard (a row-parallel shard that splits a block falls back to RTN). In fp16, a block
whose zero point would overflow is kept as its middle value (``fit_zeros``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenloom.plugins.models.layers import Linear, WeightSlot
from tokenloom.plugins.quant.common import quantizable_linears

log = logging.getLogger(__name__)

BLOCK = 32  # inputs per block (the group size of the layers read from blocks)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # fp16 d (and fp16 m), then 16 bytes of nibbles


def block_tensors(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``raw`` uint8 ``[N, K / 32 * bytes]`` (one GGUF tensor's data) -> ``(q [N, K] uint8
    in 0..15, scales [N, K / 32] fp32, zeros [N, K / 32] fp32)`` with
    ``(q - zeros) * scales`` equal to ``gguf``'s dequantization."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 2 if kind == "Q4_0" else 4 :]
    # byte i holds input i (low nibble) and input i + 16 (high nibble) of its block
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, -1)
    scales = torch.from_numpy(d)
    if kind == "Q4_0":
        return torch.from_numpy(q), scales, torch.full_like(scales, 8.0)
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    flat = scales == 0
    zeros = torch.where(flat, -1.0, -m / torch.where(flat, 1.0, scales))
    scales = torch.where(flat, m, scales)
    q_t = torch.from_numpy(q).view(n, -1, BLOCK)
    q_t = torch.where(flat[..., None], 0, q_t).view(n, -1).to(torch.uint8)
    return q_t, scales, zeros


def fit_zeros(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks whose zero point ``-m / d`` would overflow ``dtype`` (fp16: a nearly
    constant block, ``d`` below ``|m| / 32,000``) become one value, their middle
    ``m + 7.5 d`` (``s``, with ``z = -1`` and ``q = 0``): off by at most ``7.5 d``,
    below fp16's own rounding of ``m``."""
    limit = torch.finfo(dtype).max / 2
    huge = zeros.abs() > limit
    if not bool(huge.any()):
        return q, scales, zeros
    middle = torch.where(huge, zeros.neg() * scales + 7.5 * scales, scales)  # m + 7.5 d
    groups = huge.repeat_interleave(BLOCK, dim=1)
    return (
        torch.where(groups, 0, q).to(torch.uint8),
        middle,
        torch.where(huge, -1.0, zeros),
    )


LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def block_group(model: str) -> int | None:
    """``BLOCK`` when ``model`` is a GGUF file (or a directory holding one) whose
    decoder linears are all Q4_0 or Q4_1, else None (``tokenloom plan`` counts a file
    that mixes types as RTN's groups)."""
    from gguf import GGUFReader

    from tokenloom.plugins.models.gguf import find_gguf

    path = find_gguf(model)
    if path is None:
        return None
    kinds = {
        t.tensor_type.name
        for t in GGUFReader(path).tensors
        if t.name.startswith("blk.") and t.name.split(".")[2] in LINEARS
    }
    return BLOCK if kinds and kinds <= set(BLOCK_BYTES) else None


class GGUFBlocks:
    """The Q4_0/Q4_1 linears of one GGUF file, for the layers of one model."""

    def __init__(self, path: str | Path, hf_config: dict[str, Any], model: nn.Module) -> None:
        from gguf import GGUFReader

        from tokenloom.plugins.models.gguf.tensors import hf_name

        reader = GGUFReader(path)
        self.tensors = {
            hf_name(t.name): t for t in reader.tensors if t.tensor_type.name in BLOCK_BYTES
        }
        self.permuted = hf_config["model_type"] == "llama"
        self.heads = {
            "q_proj": hf_config["num_attention_heads"],
            "k_proj": hf_config["num_key_value_heads"],
        }
        # per layer, its parts (checkpoint name, slot): the layers all of whose parts
        # are blocks (a merged layer is read one way, whole)
        by_weight = {id(layer.weight): layer for _, layer in quantizable_linears(model)}
        parts: dict[int, list[tuple[str, WeightSlot]]] = {}
        for key, slot in model.checkpoint_slots().items():
            layer = by_weight.get(id(slot.param))
            if layer is not None and key.endswith(".weight"):
                parts.setdefault(id(layer), []).append((key, slot))
        self.parts = {
            layer_id: found
            for layer_id, found in parts.items()
            if all(key in self.tensors for key, _ in found)
        }

    def __len__(self) -> int:
        return len(self.parts)

    def convert(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(qweight [K / 8, N] int32, scales [G, N], zeros [G, N])`` of ``layer`` in
        the model dtype on its device, from the file's blocks; None when the layer's
        weights are of another type."""
        from tokenloom.plugins.models.gguf.tensors import unpermute_rope
        from tokenloom.plugins.quant.int4_pack import pack_int4

        found = self.parts.get(id(layer))
        if found is None:
            return None
        n, k = layer.out_features, layer.in_features
        q = torch.zeros(n, k, dtype=torch.uint8)
        scales = torch.zeros(n, k // BLOCK, dtype=torch.float32)
        zeros = torch.zeros(n, k // BLOCK, dtype=torch.float32)
        for key, slot in found:
            tensor = self.tensors[key]
            parts = block_tensors(tensor.data, tensor.tensor_type.name)
            proj = key.split(".")[-2]
            if self.permuted and proj in self.heads:
                parts = tuple(unpermute_rope(p, self.heads[proj]) for p in parts)
            if slot.source is not None:
                dim, begin, end = slot.source
                if dim == 1 and (begin % BLOCK or end % BLOCK):
                    log.warning(
                        "%s: this rank's inputs %d..%d split %d-input blocks: RTN instead",
                        key,
                        begin,
                        end,
                        BLOCK,
                    )
                    return None
                div = (1, BLOCK, BLOCK) if dim == 1 else (1, 1, 1)
                parts = tuple(
                    p.narrow(dim, begin // d, (end - begin) // d)
                    for p, d in zip(parts, div, strict=True)
                )
            if parts[0].shape != (slot.stop - slot.start, k):
                raise ValueError(
                    f"{key}: blocks of shape {tuple(parts[0].shape)}, the layer expects "
                    f"{(slot.stop - slot.start, k)}"
                )
            for target, part in zip((q, scales, zeros), parts, strict=True):
                target[slot.start : slot.stop] = part
        dtype, device = layer.weight.dtype, layer.weight.device
        q, scales, zeros = fit_zeros(q, scales, zeros, dtype)
        return (
            pack_int4(q.t().contiguous()).to(device),
            scales.t().contiguous().to(device, dtype),
            zeros.t().contiguous().to(device, dtype),
        )


__all__ = ["BLOCK", "BLOCK_BYTES", "GGUFBlocks", "block_tensors", "block_group", "fit_zeros"]
