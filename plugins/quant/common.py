"""What the weight quantization methods share: which layers they quantize, how a
quantized tensor is kept on its layer, and the loop of ``quantize_model``.

Quantized tensors are registered on their ``Linear`` as frozen parameters (integer
and fp8 ones too), so ``model.parameters()`` counts the real bytes (the benches'
rooflines read it) and ``model.to()`` moves them; the dense ``weight`` is replaced by
an empty tensor, so its memory is really freed.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tokenloom.config import EngineConfig
from tokenloom.plugins.models.layers import Embedding, Linear, Slots, WeightSlot
from tokenloom.protocols.components.quant import (
    LinearKernel,
    QkvRope,
    QuantMethod,
    lm_head_method,
)


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    """Every ``Linear`` of the model but the LM head (``compute_logits`` reads its
    dense weight; quantizing the logits' projection costs quality for little speed)."""
    lm_head = getattr(model, "lm_head", None)
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module is not lm_head:
            yield name, module


def keep(layer: Linear, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Register ``tensor`` on ``layer`` as the frozen parameter ``name``; returns it."""
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    return tensor


def release_weight(layer: Linear) -> None:
    """Free the dense weight (its shape stays readable as ``out/in_features``)."""
    layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)
    layer.deferred = False  # released: never allocated again


def flat(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as a 2-D matrix whose last dim is contiguous (the GEMMs' input)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class OneRowEpilogueKernel(LinearKernel):
    """A kernel whose one-row GEMV can finish a merged projection itself (int4's and
    int8's, ``kernels/one_row_epilogue.py``): SiLU-and-mul of a gate/up projection, the
    rotation and cache stores of a q/k/v one. Subclasses launch it (``launch_fused``)."""

    configs: tuple[Any, ...] | None  # the tuned tiling per batch-size bucket (GPU only)

    def apply_silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """One row on the GPU: SiLU-and-mul in the GEMV's epilogue, where the layer's tuned
        one-row tiling is that GEMV (one launch less a layer)."""
        return self._fused_one_row(x, bias, silu=True)

    def apply_qkv_rope(
        self, x: torch.Tensor, bias: torch.Tensor | None, rope: QkvRope
    ) -> torch.Tensor | None:
        """One row on the GPU: the rotation and the cache stores in the GEMV's epilogue,
        where the layer's tuned one-row tiling is that GEMV and fits."""
        return self._fused_one_row(x, bias, rope=rope)

    @abstractmethod
    def launch_fused(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        cfg: Any,
        silu: bool,
        rope: QkvRope | None,
    ) -> torch.Tensor | None:
        """``x [1, K]`` through the one-row GEMV with the epilogue, under ``cfg`` (the
        layer's tuned one-row tiling); None where that kernel declines the call."""

    def _fused_one_row(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        silu: bool = False,
        rope: QkvRope | None = None,
    ) -> torch.Tensor | None:
        if not (x.is_cuda and self.configs is not None) or x.numel() != x.shape[-1]:
            return None
        from tokenloom.plugins.quant.kernels.dispatch import bucket

        y = self.launch_fused(flat(x), bias, self.configs[bucket(1)], silu, rope)
        return None if y is None else y.view(*x.shape[:-1], y.shape[-1])


class WeightQuantMethod(QuantMethod):
    """A weight method: ``quantize_model`` gives each quantizable layer the kernel of
    ``make_kernel``; layers already given one (a pre-quantized checkpoint's, set up by
    ``prepare_model``) get theirs from ``finish_kernel`` instead."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.prequantized = False  # the checkpoint holds quantized tensors
        self.prepared: set[str] = set()  # layers that load them (the rest stay dense)

    @abstractmethod
    def make_kernel(self, layer: Linear) -> LinearKernel:
        """Quantize ``layer.weight`` (16- or 32-bit, this rank's shard) into a kernel."""

    def finish_kernel(self, layer: Linear) -> LinearKernel:
        """The kernel of a layer whose quantized tensors were loaded from the checkpoint."""
        raise NotImplementedError(f"{self.name}: no pre-quantized checkpoint support")

    @property
    def streams_layers(self) -> bool:  # type: ignore[override]
        """Each layer quantized as it loads (``layer_loaded``), unless a subclass's own
        ``quantize_model`` may need the whole model."""
        return type(self).quantize_model is WeightQuantMethod.quantize_model

    @torch.no_grad()
    def layer_loaded(self, name: str, layer: nn.Module) -> None:
        if name != "lm_head" and isinstance(layer, Linear):  # quantizable_linears' rule
            self._quantize_layer(name, layer)

    def _quantize_layer(self, name: str, layer: Linear) -> None:
        if layer.kernel is not None:  # streamed already
            return
        if name in self.prepared:
            layer.kernel = self.finish_kernel(layer)
        elif not self.prequantized:
            if layer.weight.shape != (layer.out_features, layer.in_features):
                raise ValueError(f"{name}: its weight was never loaded")
            layer.kernel = self.make_kernel(layer)
            release_weight(layer)

    @torch.no_grad()
    def quantize_model(self, model: nn.Module) -> None:
        for name, layer in quantizable_linears(model):
            self._quantize_layer(name, layer)
        head = lm_head_method(self.config, self)
        if head == self.name:
            quantize_lm_head(self, model)
        elif head is not None:  # another method's format (int4's head: int8)
            from tokenloom.plugin_manager import PluginManager

            plugins = self.plugins or PluginManager.default()  # the engine's, where it built us
            other = plugins.build("quant", head, self.config)
            if not isinstance(other, WeightQuantMethod):
                raise ValueError(f"{self.name}: the LM head's method {head} is no weight method")
            quantize_lm_head(other, model)


def quantize_lm_head(method: WeightQuantMethod, model: nn.Module) -> None:
    """The LM head's rows quantized at load with ``method.make_kernel`` (a
    checkpoint's quantized head is not read: none of the formats here stores one).
    The 16-bit rows go, unless the head is tied to the embedding and its format serves
    no lookups (``LinearKernel.rows``: int8 does, so int8's and int4's default heads
    free a tied model's 16-bit table)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, Embedding):
        raise ValueError(f"quant_lm_head: {type(model).__name__} has no Embedding lm_head")
    inner = getattr(model, "model", model)
    tied = head is getattr(inner, "embed_tokens", None)
    kernel = head.logits_kernel = method.make_kernel(head)  # type: ignore[arg-type]
    if tied:
        probe = torch.zeros(1, dtype=torch.long, device=head.weight.device)
        head.lookups_from_kernel = kernel.rows(probe, head.weight.dtype) is not None
    if not tied or head.lookups_from_kernel:
        head.weight.data = torch.empty(0, dtype=head.weight.dtype, device=head.weight.device)


def quantization_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` (config.json), or None for 16-bit ones."""
    qc = hf_config.get("quantization_config")
    return dict(qc) if isinstance(qc, dict) else None


def checkpoint_prefixes(model: nn.Module) -> dict[str, list[str]]:
    """Per quantizable layer (by module name), the checkpoint names of its merged parts
    (``model.layers.0.self_attn.q_proj``, ...), read from the model's own slots."""
    layers = {id(layer.weight): name for name, layer in quantizable_linears(model)}
    result: dict[str, list[str]] = {name: [] for name in layers.values()}
    for key, slot in model.checkpoint_slots().items():
        name = layers.get(id(slot.param))
        if name is not None and key.endswith(".weight"):
            result[name].append(key.removesuffix(".weight"))
    return result


def is_skipped(prefixes: list[str], skipped: list[str]) -> bool:
    """Whether a checkpoint left this layer unquantized (``ignored_layers`` /
    ``modules_to_not_convert``: full names, enclosing modules, or name parts)."""
    return any(
        s and (p == s or p.startswith(s + ".") or s in p.split(".") or p.endswith("." + s))
        for p in prefixes
        for s in skipped
    )


# a checkpoint-layout parameter's name: (shape, dtype)
ParamShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def checkpoint_params(
    layer: Linear,
    shapes: ParamShapes,
    slot_hook: Callable[[Linear, Slots], Slots],
) -> None:
    """Prepare ``layer`` for a pre-quantized checkpoint: an empty frozen parameter per
    ``name: (shape, dtype)`` on its device (the checkpoint's tensors land there), its
    dense weight freed, and ``slot_hook`` mapping its dense slots to those parameters."""
    for name, (shape, dtype) in shapes.items():
        tensor = torch.empty(shape, dtype=dtype, device=layer.weight.device)
        layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    release_weight(layer)
    layer.slot_hook = slot_hook


def prepare_checkpoint_layers(
    model: nn.Module,
    skip: Callable[[list[str]], bool],
    shapes: Callable[[str, Linear], ParamShapes],
    slot_hook: Callable[[Linear, Slots], Slots],
) -> set[str]:
    """A pre-quantized checkpoint's reader, the loop every format shares: each
    quantizable layer that the checkpoint does not ``skip`` (given its parts' checkpoint
    names) gets ``checkpoint_params(layer, shapes(name, layer), slot_hook)``; returns
    the module names of those layers."""
    prepared = set()
    prefixes = checkpoint_prefixes(model)
    for name, layer in quantizable_linears(model):
        if not skip(prefixes[name]):
            checkpoint_params(layer, shapes(name, layer), slot_hook)
            prepared.add(name)
    return prepared


def weight_parts(dense: Slots, result: Slots) -> Iterator[tuple[str, int, WeightSlot]]:
    """A merged layer's dense slots, part by part: ``(checkpoint prefix, index, slot)``
    of each part's weight; the other slots (a bias) go into ``result`` as they are."""
    part = 0
    for key, slot in dense.items():
        if not key.endswith(".weight"):
            result[key] = slot
            continue
        yield key.removesuffix(".weight"), part, slot
        part += 1


def row_slot(param: nn.Parameter, dense: WeightSlot) -> WeightSlot:
    """One value per output row (per-channel scales): the rows of ``dense``, read whole
    on a shard of the inputs."""
    rows = dense.source if dense.source is not None and dense.source[0] == 0 else None
    return WeightSlot(param, dense.start, dense.stop, rows, dense.source_size if rows else None)


def input_slot(param: nn.Parameter, dense: WeightSlot, part: int, k: int) -> WeightSlot:
    """One value per input (a ``g_idx``), part ``part`` of ``param [parts * K]``: this
    rank's range on a shard of the inputs."""
    source = dense.source if dense.source and dense.source[0] == 1 else None
    return WeightSlot(
        param,
        part * k,
        (part + 1) * k,
        None if source is None else (0, source[1], source[2]),
        dense.source_size if source else None,
    )


def block_slot(param: nn.Parameter, dense: WeightSlot, block: tuple[int, int]) -> WeightSlot:
    """A part's rows of a tensor stored in blocks of ``bn x bk`` weights (fp8 block
    scales ``[N / bn, K / bk]``; packed words ``(1, 8)``; group scales ``(1, group)``):
    this rank's shard in blocks, which must not cut one (a partial last block is
    whole)."""
    bn, bk = block
    source = size = None
    if dense.source is not None:
        dim, begin, end = dense.source
        div = bn if dim == 0 else bk
        if begin % div or (end % div and end != dense.source_size):
            raise ValueError(f"a shard {begin}..{end} cuts {div}-wide blocks")
        source, size = (dim, begin // div, -(-end // div)), -(-(dense.source_size or 0) // div)
    return WeightSlot(param, dense.start // bn, -(-dense.stop // bn), source, size)


class PermutedInputKernel(LinearKernel):
    """A kernel over weights whose input channels are stored in another order:
    ``y = inner(x[..., perm])``. Act-order GPTQ checkpoints (a ``g_idx`` that scatters
    each group over the inputs) load with each group's rows gathered together, so the
    kernels' contiguous groups hold them, and the activations are gathered the same
    way: by ``apply`` (one gather kernel more a call), or by the kernel before, which
    stores its rows in that order (``input_order``; the norm and SiLU-and-mul do:
    ``fused_gemv.norm_and_project``), then ``apply_permuted``. None of the fused
    epilogues is offered (the gather would have to run inside them): the layer runs its
    SiLU or rope apart, as for any kernel."""

    def __init__(self, inner: LinearKernel, perm: torch.Tensor) -> None:
        self.inner = inner
        self.input_order = perm  # [K] int64: stored input channel i is the model's perm[i]

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.input_order is not None
        # on the GPU a PDL kernel: the GEMV's weights stream during it
        if x.is_cuda and x.dim() == 2 and x.stride(1) == 1:
            from tokenloom.plugins.models.fused_ops import gather_columns

            return self.inner.apply(gather_columns(x, self.input_order), bias)
        return self.inner.apply(x.index_select(-1, self.input_order), bias)

    def apply_permuted(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.inner.apply(x, bias)


def group_order(g_idx: torch.Tensor, group: int, name: str) -> torch.Tensor | None:
    """The input order that gathers each group's rows (``g_idx[k]``: the group of input
    ``k``) into contiguous runs of ``group``; None where they already are. Raises
    ValueError where the groups are not runs of ``group`` once sorted."""
    k = g_idx.shape[-1]
    natural = torch.arange(k, device=g_idx.device) // group
    if bool((g_idx == natural).all()):
        return None
    perm = torch.sort(g_idx.long(), stable=True).indices
    if not bool((g_idx.long()[perm] == natural).all()):
        raise ValueError(f"{name}: its g_idx groups are not {group} inputs each")
    return perm
