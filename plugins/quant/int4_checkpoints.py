"""4-bit checkpoints, read into the ``int4`` layout: AWQ and GPTQ (``Int4Checkpoint``),
and compressed-tensors' W4A16 (``PackedInt4Checkpoint``).

Both store, per projection, ``qweight`` (int32 words of eight 4-bit values),
``qzeros`` (the zero points, packed the same way along the outputs) and ``scales``
(``[K / group, N]`` fp16); GPTQ adds ``g_idx`` (the group of each input row). They
differ in where the packing runs:

- GPTQ: ``qweight [K / 8, N]``, packed along the inputs in order (our layout);
  ``qzeros [K / group, N / 8]`` packed along the outputs in order, stored minus one
  (the format's historical offset; ``checkpoint_format: gptq_v2`` stores them as is).
- AWQ (the GEMM variant): ``qweight [K, N / 8]`` and ``qzeros`` packed along the
  outputs in the order ``0 2 4 6 1 3 5 7``; zeros stored as they are.

The checkpoint tensors load as they are stored (output columns are this rank's
range of the full tensor, so tensor parallelism composes), then ``convert`` repacks
one layer at a time and frees the originals. Act-order GPTQ (``desc_act``: a
``g_idx`` that is not ``k // group``) loads with each group's rows gathered together
and the layer's inputs gathered the same way at every call (``act_order``); it is
refused on a shard of the inputs (tensor-parallel row-parallel layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenloom.plugins.models.layers import Linear, Slots, WeightSlot
from tokenloom.plugins.quant.common import (
    ParamShapes,
    block_slot,
    group_order,
    input_slot,
    is_skipped,
    prepare_checkpoint_layers,
    weight_parts,
)
from tokenloom.plugins.quant.int4_pack import PACK, pack_int4, unpack_int4

if TYPE_CHECKING:
    from tokenloom.plugins.quant.compressed_tensors import Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble j holds output column AWQ_ORDER[j]


@dataclass(frozen=True)
class ColumnSlot(WeightSlot):
    """Columns ``[start, stop)`` of ``param`` (these formats store outputs second)."""

    def target(self) -> torch.Tensor:
        return self.param.data.narrow(1, self.start, self.stop - self.start)


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``[R, N / 8]`` int32 packed along the columns -> ``[R, N]`` int32 in 0..15,
    nibble ``j`` of word ``c`` being column ``8 c + order[j]``."""
    rows, words = packed.shape
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, N / 8, 8] by nibble
    columns = torch.empty_like(nibbles)
    columns[:, :, list(order)] = nibbles
    return columns.reshape(rows, words * PACK)


@dataclass(frozen=True)
class Int4Checkpoint:
    """One AWQ or GPTQ ``quantization_config``, and how its tensors become ours."""

    method: str  # "awq" | "gptq"
    group: int
    zero_offset: int  # added to the stored zeros (GPTQ v1: 1)
    skipped: tuple[str, ...]

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> Int4Checkpoint:
        method = str(qc.get("quant_method", "")).lower()
        if method not in ("awq", "gptq"):
            raise ValueError(f"--quant int4 reads AWQ or GPTQ checkpoints, not {method!r}")
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"--quant int4: the checkpoint has {bits}-bit weights")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"--quant int4: AWQ version {qc.get('version')!r}; only 'gemm'")
        if method == "awq" and qc.get("zero_point") is False:
            raise ValueError("--quant int4: AWQ without zero points is not supported")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if group <= 0 or group % PACK:
            raise ValueError(f"--quant int4: group size {group} (a multiple of 8 is needed)")
        v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        offset = 1 if method == "gptq" and not v2 else 0
        skipped = tuple(qc.get("modules_to_not_convert") or ())
        return cls(method, group, offset, skipped)

    def prepare(self, model: nn.Module) -> set[str]:
        """Give every quantized layer its checkpoint-layout parameters and slots;
        returns their module names."""
        return prepare_checkpoint_layers(model, self._skips, self._shapes, self._slots)

    def _skips(self, prefixes: list[str]) -> bool:
        return is_skipped(prefixes, list(self.skipped))

    def _shapes(self, name: str, layer: Linear) -> ParamShapes:
        n, k = layer.out_features, layer.in_features
        groups, i32 = -(-k // self.group), torch.int32
        if self.method == "gptq":
            shapes: ParamShapes = {
                "ckpt_qweight": ((k // PACK, n), i32),
                "ckpt_g_idx": ((len(layer.output_sizes) * k,), i32),
            }
        else:
            shapes = {"ckpt_qweight": ((k, n // PACK), i32)}
        shapes["ckpt_qzeros"] = ((groups, n // PACK), i32)
        shapes["ckpt_scales"] = ((groups, n), torch.float16)
        return shapes

    def _slots(self, layer: Linear, dense: Slots) -> Slots:
        result: Slots = {}
        for prefix, part, slot in weight_parts(dense, result):
            start, stop = slot.start, slot.stop
            if start % PACK or stop % PACK:
                raise ValueError(f"{prefix}: output rows {start}..{stop} are not whole words")
            packed_n = self.method == "awq"
            result[f"{prefix}.qweight"] = self._slot(
                layer.ckpt_qweight, slot, PACK if packed_n else 1, 1 if packed_n else PACK
            )
            result[f"{prefix}.qzeros"] = self._slot(layer.ckpt_qzeros, slot, PACK, self.group)
            result[f"{prefix}.scales"] = self._slot(layer.ckpt_scales, slot, 1, self.group)
            if self.method == "gptq":  # one group index an input
                result[f"{prefix}.g_idx"] = input_slot(
                    layer.ckpt_g_idx, slot, part, layer.in_features
                )
        return result

    @staticmethod
    def _slot(param: nn.Parameter, dense: WeightSlot, n_div: int, k_div: int) -> ColumnSlot:
        """The columns of ``param`` for a dense slot's rows; the source range (a
        rank's shard, along N = checkpoint dim 1 or K = dim 0) in stored units."""
        source = size = None
        if dense.source is not None:
            dim, begin, end = dense.source
            div = n_div if dim == 0 else k_div
            if begin % div or end % div or (dense.source_size or 0) % div:
                raise ValueError(f"a shard {begin}..{end} does not align with {div}-row units")
            source = (1 - dim, begin // div, end // div)  # dense dim 0 (N) is stored dim 1
            size = (dense.source_size or 0) // div
        return ColumnSlot(param, dense.start // n_div, dense.stop // n_div, source, size)

    def convert(
        self, layer: Linear
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer's loaded tensors in the int4 layout ``(qweight, scales, zeros,
        perm)``; frees the checkpoint-layout ones. ``perm``: None, or for act-order GPTQ
        the input order that gathers each group (``group_order``), the words' rows
        already in that order (the kernel gathers its inputs: ``PermutedInputKernel``)."""
        perm = None
        if self.method == "gptq":
            g_idx = layer.ckpt_g_idx.data.view(-1, layer.in_features)
            perm = act_order(g_idx, self.group, layer)
            qweight = layer.ckpt_qweight.data
            if perm is not None:
                qweight = pack_int4(unpack_int4(qweight).index_select(0, perm))
            zeros = unpack_columns(layer.ckpt_qzeros.data, tuple(range(PACK)))
            del layer.ckpt_g_idx
        else:
            qweight = pack_int4(unpack_columns(layer.ckpt_qweight.data, AWQ_ORDER))
            zeros = unpack_columns(layer.ckpt_qzeros.data, AWQ_ORDER)
        zeros = (zeros + self.zero_offset) & 0xF
        scales = layer.ckpt_scales.data
        del layer.ckpt_qweight, layer.ckpt_qzeros, layer.ckpt_scales
        return qweight.contiguous(), scales, zeros, perm


class PackedInt4Checkpoint:
    """A compressed-tensors W4A16 checkpoint (``pack-quantized`` int 4-bit groups; the
    scheme parsed by ``compressed_tensors.Scheme``), read into the ``int4`` layout; the
    interface of ``Int4Checkpoint`` (``group``, ``prepare``, ``convert``).

    ``weight_packed [N, K / 8]`` int32 holds eight values a word, column ``8 c + j`` in
    nibble ``j``, each stored plus 8: exactly the transpose of ``int4``'s ``[K / 8, N]``
    words, so the words load as they are into its row-major ``[N, K / 8]`` storage.
    ``weight_scale [N, K / g]``; ``weight_zero_point`` (asymmetric only) ``[N / 8, K / g]``,
    packed along the outputs the same way and plus 8; symmetric means a zero point of 8."""

    def __init__(self, scheme: Scheme) -> None:
        assert scheme.group is not None
        if scheme.group % PACK:
            raise ValueError(f"--quant int4: group size {scheme.group} (a multiple of 8)")
        self.scheme = scheme
        self.group = scheme.group

    def prepare(self, model: nn.Module) -> set[str]:
        """Every quantized layer's checkpoint-layout parameters and slots; returns their
        module names."""
        return prepare_checkpoint_layers(model, self.scheme.ignores, self._shapes, self._slots)

    def _shapes(self, name: str, layer: Linear) -> ParamShapes:
        n, k = layer.out_features, layer.in_features
        if k % PACK or any(size % PACK for size in layer.output_sizes):
            raise ValueError(f"{name}: {n} x {k} does not pack into whole words")
        groups, parts = -(-k // self.group), len(layer.output_sizes)
        shapes = {
            "ckpt_packed": ((n, k // PACK), torch.int32),
            "ckpt_scales": ((n, groups), torch.float32),
            "ckpt_shape": ((2 * parts,), torch.int64),
        }
        if not self.scheme.symmetric:
            shapes["ckpt_zeros"] = ((n // PACK, groups), torch.int32)
        if self.scheme.act_order:
            shapes["ckpt_g_idx"] = ((parts * k,), torch.int32)
        return shapes

    def _slots(self, layer: Linear, dense: Slots) -> Slots:
        result: Slots = {}
        for prefix, part, slot in weight_parts(dense, result):
            result[f"{prefix}.weight_packed"] = block_slot(layer.ckpt_packed, slot, (1, PACK))
            result[f"{prefix}.weight_scale"] = block_slot(layer.ckpt_scales, slot, (1, self.group))
            if not self.scheme.symmetric:
                result[f"{prefix}.weight_zero_point"] = block_slot(
                    layer.ckpt_zeros, slot, (PACK, self.group)
                )
            if self.scheme.act_order:  # one group index an input
                g_idx = input_slot(layer.ckpt_g_idx, slot, part, layer.in_features)
                result[f"{prefix}.weight_g_idx"] = g_idx
            # the full tensor's [N, K], whatever this rank's shard: read, not needed
            result[f"{prefix}.weight_shape"] = WeightSlot(layer.ckpt_shape, 2 * part, 2 * part + 2)
        return result

    def convert(
        self, layer: Linear
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer's loaded tensors as ``int4``'s ``(qweight [K / 8, N], scales [G, N],
        zeros [G, N])``; frees the checkpoint-layout ones. ``qweight`` is the transposed
        view of the stored ``[N, K / 8]`` words (``int4_kernel`` keeps or copies it)."""
        qweight = layer.ckpt_packed.data.t()
        scales = layer.ckpt_scales.data.t().contiguous()
        if self.scheme.symmetric:
            zeros = torch.full_like(scales, 8)
        else:
            zeros = unpack_int4(layer.ckpt_zeros.data).t().float().contiguous()  # [G, N]
            del layer.ckpt_zeros
        perm = None
        if self.scheme.act_order:
            g_idx = layer.ckpt_g_idx.data.view(-1, layer.in_features)
            perm = act_order(g_idx, self.group, layer)
            if perm is not None:  # the words' columns in the gathered order
                q = unpack_int4(qweight.contiguous()).index_select(0, perm)
                qweight = pack_int4(q).t().contiguous().t()  # [N, K / 8] storage again
            del layer.ckpt_g_idx
        del layer.ckpt_packed, layer.ckpt_scales, layer.ckpt_shape
        return qweight, scales, zeros, perm


def act_order(g_idx: torch.Tensor, group: int, layer: Linear) -> torch.Tensor | None:
    """The input order of an act-order layer (``g_idx [parts, K]``, one row per merged
    part, which must agree: the parts share their input), None for groups in order. A
    rank's shard of the inputs (row parallel) must start and end with whole groups in
    order: act-order scatters a group over every shard, so it is refused there."""
    first = layer.in_range[0]
    natural = (torch.arange(g_idx.shape[1], device=g_idx.device) + first) // group
    if bool((g_idx == natural).all()):  # a row-parallel shard: its own range of groups
        return None
    if layer.in_features != layer.full_in_features:
        raise ValueError(
            "--quant int4: an act-order g_idx on a shard of the inputs (tensor parallel, "
            "row-parallel layers): a group is spread over every rank"
        )
    if not bool((g_idx == g_idx[0]).all()):
        raise ValueError("--quant int4: the merged parts of a layer have different g_idx")
    return group_order(g_idx[0], group, "--quant int4")


__all__ = [
    "AWQ_ORDER",
    "ColumnSlot",
    "Int4Checkpoint",
    "PackedInt4Checkpoint",
    "unpack_columns",
    "unpack_int4",
]
