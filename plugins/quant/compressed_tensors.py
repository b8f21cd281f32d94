"""Checkpoints in the compressed-tensors format (``quant_method: compressed-tensors``,
what llm-compressor writes, and the format of most quantized checkpoints vLLM serves),
read into the layouts of this package's methods.

One format name covers many schemes; ``config_groups`` says which. Each group names
the modules it ``targets`` and the quantization of their ``weights`` and
``input_activations``; ``ignore`` lists the modules left 16-bit (names, or ``re:``
patterns). The schemes read here, each by the method that serves it:

- ``fp8``: float 8-bit weights (``float-quantized`` / ``naive-quantized``), one scale
  per tensor, per output channel or per block; activations dynamic per token, static
  (their ``input_scale`` read, not used: dynamic per-token scales are at least as
  fine), or 16-bit (served W8A8 all the same, said at start-up). Tensors: ``weight``
  (e4m3 ``[N, K]``) and ``weight_scale`` (``[1]``, ``[N, 1]`` or ``[N / bn, K / bk]``).
- ``int4``: int 4-bit weights in groups (``pack-quantized``), 16-bit activations,
  symmetric or with zero points; read by ``int4_checkpoints.PackedInt4Checkpoint``,
  beside int4's other readers (its words load as they are).
- ``int8``: int 8-bit weights, one symmetric scale per output channel, activations
  16-bit or quantized (served W8A16: the activations stay 16-bit, said at start-up);
  read by ``Int8Checkpoint`` below (int8 has no other checkpoint format):
  ``weight_packed [N, K / 4]`` (``pack-quantized``, four bytes a word, each plus 128)
  or ``weight`` int8 ``[N, K]`` (``int-quantized`` / ``naive-quantized``), and
  ``weight_scale [N, 1]``.

Activation-ordered groups (``actorder: group``: a ``weight_g_idx`` that scatters each
group over the inputs) load as act-order GPTQ does (``int4_checkpoints.act_order``).
Refused by name: several schemes in one checkpoint, targets other than ``Linear``,
sparsity, online transforms, a quantized LM head, checkpoints not stored
``compressed``, and every other scheme. Static
KV-cache scales (``kv_cache_scheme``) are skipped: ``--kv-cache-dtype fp8`` scales each
head as it writes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenloom.plugins.models.layers import Linear, Slots, WeightSlot
from tokenloom.plugins.quant.common import (
    ParamShapes,
    block_slot,
    is_skipped,
    prepare_checkpoint_layers,
    row_slot,
    weight_parts,
)

log = logging.getLogger(__name__)

FORMAT = "compressed-tensors"
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
INT8_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# the tensors of a kv_cache_scheme: per-layer static scales this engine does not use
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", "k_proj.output_scale", "v_proj.output_scale")


def is_compressed_tensors(qc: dict[str, Any]) -> bool:
    return str(qc.get("quant_method", "")).lower() == FORMAT


@dataclass(frozen=True)
class Scheme:
    """The one scheme a compressed-tensors checkpoint applies to its linear layers."""

    format: str
    type: str  # of the weights: "float" | "int"
    bits: int
    strategy: str  # "tensor" | "channel" | "group" | "block"
    group: int | None
    block: tuple[int, int] | None
    symmetric: bool
    activations: dict[str, Any] | None  # input_activations; None: 16-bit
    ignore: tuple[str, ...]
    kv_scales: bool  # a kv_cache_scheme: the checkpoint holds static KV scales
    act_order: bool = False  # groups scattered over the inputs: weight_g_idx [K] a part

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> Scheme:
        """Raises ValueError for a config this module cannot read (see the module)."""
        status = str(qc.get("quantization_status", "compressed"))
        if status != "compressed":
            raise ValueError(
                f"{FORMAT}: quantization_status {status!r}; only 'compressed' checkpoints "
                "(the weights stored quantized) load"
            )
        sparsity = qc.get("sparsity_config") or {}
        if str(sparsity.get("format", "dense")) != "dense":
            raise ValueError(f"{FORMAT}: sparse weights ({sparsity.get('format')}) do not load")
        if qc.get("transform_config"):
            raise ValueError(f"{FORMAT}: online transforms (transform_config) do not load")
        groups = qc.get("config_groups") or {}
        found: set[tuple[Any, ...]] = set()
        for name, group in groups.items():
            targets = list(group.get("targets") or [])
            if targets != ["Linear"]:
                raise ValueError(
                    f"{FORMAT}: config group {name!r} targets {targets}; only ['Linear'] "
                    "(one scheme for every linear layer) loads"
                )
            if group.get("output_activations"):
                raise ValueError(f"{FORMAT}: config group {name!r} quantizes outputs")
            weights = group.get("weights")
            if not weights:
                raise ValueError(f"{FORMAT}: config group {name!r} leaves the weights 16-bit")
            acts = group.get("input_activations") or None
            fmt = str(group.get("format") or qc.get("format") or "")
            found.add((fmt, _frozen(weights), _frozen(acts)))
        if len(found) != 1:
            raise ValueError(
                f"{FORMAT}: {len(found)} quantization schemes; one for every linear layer "
                "is what loads"
            )
        fmt, weights_items, acts_items = found.pop()
        weights, acts = dict(weights_items), dict(acts_items) if acts_items else None
        # actorder "group" (also "dynamic", true) stores a weight_g_idx that scatters the
        # groups over the inputs; "weight" / "static" reorder only while quantizing
        act_order = str(weights.get("actorder")).lower() in ("group", "dynamic", "true")
        group = int(weights.get("group_size") or 0)
        strategy = weights.get("strategy") or (  # as the format infers a missing one
            "tensor" if not group else "channel" if group == -1 else "group"
        )
        block = weights.get("block_structure")
        if isinstance(block, str):  # the older "NxM" form
            block = block.lower().split("x")
        return cls(
            format=fmt,
            type=str(weights.get("type", "int")),
            bits=int(weights.get("num_bits", 8)),
            strategy=str(strategy),
            group=group if group > 0 else None,
            block=(int(block[0]), int(block[1])) if block else None,
            symmetric=bool(weights.get("symmetric", True)),
            activations=acts,
            ignore=tuple(str(i) for i in qc.get("ignore") or ()),
            kv_scales=bool(qc.get("kv_cache_scheme")),
            act_order=act_order,
        )

    @property
    def method(self) -> str | None:
        """The method of this package that serves the scheme, None for none."""
        strategy, w = self.strategy, (self.type, self.bits)
        fp8_strategy = strategy in ("tensor", "channel") or (strategy == "block" and self.block)
        if w == ("float", 8) and self.format in FLOAT_FORMATS and fp8_strategy:
            return "fp8"
        weight_only = self.activations is None and self.format == "pack-quantized"
        if w == ("int", 4) and weight_only and strategy == "group" and self.group:
            return "int4"
        if w == ("int", 8) and self.format in INT8_FORMATS and strategy == "channel":
            return "int8" if self.symmetric else None
        return None

    def describe(self) -> str:
        acts = self.activations
        a = "16-bit" if acts is None else f"{acts.get('type')} {acts.get('num_bits')}-bit"
        g = f" of {self.group}" if self.group else ""
        return (
            f"{self.format}: {self.type} {self.bits}-bit weights per {self.strategy}{g}"
            f"{'' if self.symmetric else ' with zero points'}, {a} activations"
        )

    def ignores(self, prefixes: list[str]) -> bool:
        """Whether ``ignore`` leaves this layer (its merged parts' checkpoint names) 16-bit;
        raises ValueError where it leaves some parts of a merged layer and not others."""
        hits = [self._ignored(p) for p in prefixes]
        if any(hits) and not all(hits):
            raise ValueError(f"{FORMAT}: ignore leaves part of {prefixes} 16-bit, not all")
        return bool(hits) and all(hits)

    def _ignored(self, prefix: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], prefix):
                    return True
            elif is_skipped([prefix], [pattern]):
                return True
        return False


def _frozen(d: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """A scheme's arguments, hashable, without the ones that do not change the tensors."""
    if not d:
        return None
    skip = {"observer", "observer_kwargs"}
    return tuple(sorted((k, _hashable(v)) for k, v in d.items() if k not in skip))


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


def scheme_for(qc: dict[str, Any], method: str) -> Scheme | None:
    """The checkpoint's scheme where it is compressed-tensors and ``method`` serves it;
    None for another format. Raises ValueError, naming the scheme, where the format is
    compressed-tensors and no method here serves it (for ``reads_checkpoint``)."""
    if not is_compressed_tensors(qc):
        return None
    scheme = Scheme.from_config(qc)
    if scheme.method is None:
        raise ValueError(
            f"{FORMAT} scheme {scheme.describe()}: no method here serves it (fp8: float "
            "8-bit weights; int4: int 4-bit groups, 16-bit activations; int8: int 8-bit "
            "per channel, symmetric)"
        )
    return scheme if scheme.method == method else None


def require(qc: dict[str, Any], method: str, model: nn.Module) -> Scheme:
    """The scheme of a compressed-tensors checkpoint that ``method`` was asked to load
    into ``model`` (ValueError where it is another method's, or its LM head is
    quantized: ``check_head``); a ``kv_cache_scheme``'s static scales are passed over."""
    scheme = Scheme.from_config(qc)
    if scheme.method != method:
        served = f"--quant {scheme.method}" if scheme.method else "no method here"
        raise ValueError(f"--quant {method}: the checkpoint is {scheme.describe()} ({served})")
    if scheme.kv_scales:
        log.info("%s: the checkpoint's static KV-cache scales are not used", FORMAT)
        skip_kv_scales(model)
    check_head(scheme, model)
    return scheme


def static_inputs(scheme: Scheme) -> tuple[str, ...]:
    """The per-layer tensors of static activation quantization (read, not used: the
    methods here quantize activations per token, or not at all)."""
    acts = scheme.activations
    if acts is None or acts.get("dynamic", False):  # the format's default: static
        return ()
    return ("input_scale",) if acts.get("symmetric", True) else ("input_scale", "input_zero_point")


def check_head(scheme: Scheme, model: nn.Module) -> None:
    """Refuse, by name, a checkpoint whose untied LM head is quantized: none of the
    methods here reads a quantized head (``--quant-lm-head`` quantizes it at load)."""
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", model)
    if head is None or head is getattr(inner, "embed_tokens", None):
        return
    if not scheme._ignored("lm_head"):
        raise ValueError(
            f"{FORMAT}: the checkpoint quantizes lm_head (ignore does not list it); a "
            "quantized LM head is not read here"
        )


def skip_kv_scales(model: nn.Module) -> None:
    """Let the loader pass over a kv_cache_scheme's static scales (not used here)."""
    base = model.ignores_checkpoint_tensor

    def ignores(name: str) -> bool:
        return base(name) or name.endswith(KV_SCALE_SUFFIXES)

    model.ignores_checkpoint_tensor = ignores  # type: ignore[method-assign]


class Int8Checkpoint:
    """A compressed-tensors checkpoint of int8 weights per output channel, read into the
    ``int8`` layout: ``weight_packed [N, K / 4]`` (``pack-quantized``: four bytes a word,
    column ``4 c + j`` in byte ``j``, each plus 128) or ``weight`` int8 ``[N, K]``, and
    ``weight_scale [N, 1]``; static activation tensors read past (served W8A16)."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.packed = scheme.format == "pack-quantized"
        self.static_inputs = static_inputs(scheme)

    def prepare(self, model: nn.Module) -> set[str]:
        """Every quantized layer's checkpoint-layout parameters and slots; returns their
        module names."""
        return prepare_checkpoint_layers(model, self.scheme.ignores, self._shapes, self._slots)

    def _shapes(self, name: str, layer: Linear) -> ParamShapes:
        n, k = layer.out_features, layer.in_features
        if self.packed and k % 4:
            raise ValueError(f"{name}: {k} inputs do not pack into whole words")
        parts = len(layer.output_sizes)
        return {
            "ckpt_weight": ((n, k // 4), torch.int32) if self.packed else ((n, k), torch.int8),
            "ckpt_scales": ((n, 1), torch.float32),
            "ckpt_shape": ((2 * parts,), torch.int64),
            "ckpt_inputs": ((len(self.static_inputs) * parts,), torch.float32),
        }

    def _slots(self, layer: Linear, dense: Slots) -> Slots:
        result: Slots = {}
        for prefix, part, slot in weight_parts(dense, result):
            name = "weight_packed" if self.packed else "weight"
            units = (1, 4) if self.packed else (1, 1)
            result[f"{prefix}.{name}"] = block_slot(layer.ckpt_weight, slot, units)
            result[f"{prefix}.weight_scale"] = row_slot(layer.ckpt_scales, slot)
            if self.packed:  # the full tensor's [N, K]: read, not needed
                result[f"{prefix}.weight_shape"] = WeightSlot(
                    layer.ckpt_shape, 2 * part, 2 * part + 2
                )
            for i, tensor in enumerate(self.static_inputs):  # one value a part
                at = part * len(self.static_inputs) + i
                result[f"{prefix}.{tensor}"] = WeightSlot(layer.ckpt_inputs, at, at + 1)
        return result

    def convert(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's loaded tensors as ``int8``'s ``(q [N, K] int8, scales [1, N])``;
        frees the checkpoint-layout ones."""
        w = layer.ckpt_weight.data
        if self.packed:
            shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=w.device)
            w = (((w[:, :, None] >> shifts) & 0xFF) - 128).reshape(w.shape[0], -1)
        q = w.to(torch.int8).contiguous()
        scales = layer.ckpt_scales.data.t().contiguous()
        del layer.ckpt_weight, layer.ckpt_scales, layer.ckpt_shape, layer.ckpt_inputs
        return q, scales


__all__ = [
    "FORMAT",
    "Int8Checkpoint",
    "Scheme",
    "is_compressed_tensors",
    "require",
    "scheme_for",
    "static_inputs",
]
