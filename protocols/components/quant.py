"""The quantization interface: weight and KV-cache formats.

Weights are quantized per linear layer: a quant method gives each
``plugins.models.layers.Linear`` a ``LinearKernel`` that holds that layer's weight
(this rank's shard, already sharded by tensor parallelism) in its own format and
computes the layer's matmul. Sharding happens first and quantization second, so the
two compose without knowing each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The micro-batch lane of the launches being issued: 0, or 1 while the executor issues a
# decode step's second half on its own stream (``plugins.executor.micro_batches``). A
# kernel that reuses one scratch buffer across calls keeps one per lane, since the two
# halves' launches may run at once.
MICRO_BATCH_LANE: ContextVar[int] = ContextVar("tokenloom_micro_batch_lane", default=0)


@dataclass(frozen=True)
class QkvRope:
    """What a merged q/k/v projection's kernel needs to finish one decode token's q, k and
    v itself (``LinearKernel.apply_qkv_rope``): rotate q and k (rotate-half, no per-head
    norm), rounded to the model dtype where transformers rounds, and store the rotated k
    and v in a 16-bit paged cache at ``slot_mapping``. The rows are this rank's ``[q | k |
    v]``: ``num_q_heads``, then ``num_kv_heads`` twice, of ``head_dim`` each."""

    cos: torch.Tensor  # [1, D / 2]: the token's position (any row stride)
    sin: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    k_cache: torch.Tensor  # [blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [1] int64; < 0: store nothing


@dataclass(frozen=True)
class Fp8Rows:
    """A projection's input already quantized per token to float8 e4m3 by the kernel that
    produced it (the norm, SiLU-and-mul: ``plugins.models.fused_ops``), for a kernel that
    takes it (``LinearKernel.takes_fp8_rows``): ``x ~= q * scales`` row by row, with
    ``scales = max|x_row| / 448`` of the 16-bit ``x`` the producer would have stored."""

    q: torch.Tensor  # [T, K] float8_e4m3fn
    scales: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype  # the 16-bit dtype x had, the projection's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass(frozen=True)
class PermutedRows:
    """A projection's input already gathered into its kernel's input order
    (``LinearKernel.input_order``) by the kernel that produced it (the norm, SiLU-and-mul:
    ``plugins.models.fused_ops``), for ``LinearKernel.apply_permuted``: ``x`` holds the
    rows the model computes, ``rows[..., input_order]``."""

    x: torch.Tensor  # [T, K]

    @property
    def shape(self) -> torch.Size:
        return self.x.shape


class LinearKernel(ABC):
    """One linear layer's quantized weight and the matmul that reads it."""

    # None, or ``[K]`` int64: the order in which this kernel's weights hold their input
    # channels (an act-order checkpoint's groups gathered together). ``apply`` then
    # gathers its input itself, one launch more; the kernel before may instead store its
    # rows in this order (``PermutedRows``) and the layer calls ``apply_permuted``.
    input_order: torch.Tensor | None = None

    @abstractmethod
    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in] -> x W^T (+ bias) [T, out]`` in ``x``'s dtype."""

    def apply_silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """For a merged gate/up projection (two equal halves of rows; the model declares
        it, ``Linear.fusable == "norm+silu"``): ``silu(gate) * up [T, out / 2]``, with the
        activation computed inside this kernel's matmul. None (the default): not fused
        for this ``x``; the caller then runs ``apply`` and SiLU-and-mul apart."""
        return None

    @property
    def offers_qkv_rope(self) -> bool:
        """Whether ``apply_qkv_rope`` may do the work for some call: callers build no
        ``QkvRope`` otherwise (a step's host work in eager mode). False by default."""
        return False

    def apply_qkv_rope(
        self, x: torch.Tensor, bias: torch.Tensor | None, rope: QkvRope
    ) -> torch.Tensor | None:
        """For a merged q/k/v projection at one decode token: ``x W^T (+ bias)`` with q and
        k rotated and k and v stored in the cache, all inside this kernel (``QkvRope``).
        None (the default): not done for this call; the caller projects with ``apply``
        and rotates and stores apart."""
        return None

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether ``apply_fp8_rows`` would serve an input like ``x`` (its rows, dtype,
        device): the kernel before may then hand over ``Fp8Rows`` instead of ``x``, its
        quantization folded in (one kernel and one 16-bit round trip fewer a
        projection). Yes only where those Triton kernels run: on CUDA (or under
        ``TRITON_INTERPRET=1``). False by default."""
        return False

    def apply_fp8_rows(self, x: Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        """``apply`` on rows quantized per token (``Fp8Rows``), wherever ``takes_fp8_rows``
        said yes for such an input: the same result as ``apply`` on the 16-bit rows."""
        raise NotImplementedError(f"{type(self).__name__} takes no Fp8Rows")

    def apply_permuted(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``apply`` on rows already in ``input_order`` (``x = rows[..., input_order]``):
        the same result as ``apply`` on the rows themselves."""
        raise NotImplementedError(f"{type(self).__name__} keeps its inputs in order")

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The weight's rows ``ids`` (output channels) dequantized, ``[*ids.shape, in]``
        in ``dtype``: the lookups of an embedding tied to a quantized LM head, which then
        needs no 16-bit table. None (the default): this format does not serve them."""
        return None


class QuantMethod(ABC):
    """Weight and KV-cache quantization. Constructed as ``factory(config: EngineConfig)``.

    Called by the executor in every process that holds a model shard: ``prepare_model``
    after the model is built and before its weights load (a pre-quantized checkpoint's
    tensors need their own slots), then ``quantize_model`` once the weights are loaded.
    """

    name: str
    # The LM head's format when the config leaves ``quant_lm_head`` unset (None): False
    # keeps it 16-bit, True quantizes it with this method, a weight method's name with
    # that one. A method sets it where the head's rounding measured within its quality
    # bound (int8: True; int4: "int8"; docs/quantization.md, "The LM head").
    lm_head_default: bool | str = False

    # True: this method's kernels implement ``LinearKernel.rows``, so an embedding tied to
    # the LM head it quantizes reads its lookups there and keeps no 16-bit table (what
    # ``tokenloom plan`` counts; a test holds every method to it).
    serves_rows: bool = False

    # True: the executor loads the model with ``layer_loaded`` as the loader's callback,
    # each linear layer's dense weight allocated only when its tensors load.
    streams_layers: bool = False

    # The PluginManager that built this method (``PluginManager.build`` sets it): where a
    # method finds another one by name (int4's LM head in int8). None: built directly.
    plugins: Any = None

    # The ``quant_method`` values of a checkpoint's ``quantization_config`` (config.json)
    # that this method loads as stored. The engine serves such a checkpoint with this
    # method when the config leaves ``quant`` at "none" (``checkpoint_quant``), as vLLM
    # reads the format from the checkpoint.
    checkpoint_formats: tuple[str, ...] = ()

    @classmethod
    def reads_checkpoint(cls, quantization_config: dict[str, Any]) -> bool:
        """Whether this method loads the checkpoint whose config.json holds this
        ``quantization_config``. Default: its ``quant_method`` is one of
        ``checkpoint_formats``. A format that carries several schemes under one name
        (``compressed-tensors``) is read by the method whose scheme it holds: such a
        method overrides this to look inside, and may raise ValueError to say why a
        checkpoint of its format cannot load (``checkpoint_quant`` then asks the others)."""
        return str(quantization_config.get("quant_method", "")).lower() in cls.checkpoint_formats

    def prepare_model(self, model: torch.nn.Module, hf_config: dict[str, Any]) -> None:  # noqa: B027
        """Before loading: adapt the model to the checkpoint's format (default: nothing)."""

    def layer_loaded(self, name: str, layer: torch.nn.Module) -> None:  # noqa: B027
        """With ``streams_layers``: every checkpoint tensor of the linear layer ``name``
        is in place, the layers after it not yet loaded. Quantizing it here keeps the
        dense model from ever being whole; ``quantize_model`` still runs after loading."""

    @abstractmethod
    def quantize_model(self, model: torch.nn.Module) -> None:
        """Give the model's linear layers their kernels (``Linear.kernel``), in place."""

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the KV cache; the model's own by default."""
        return model_dtype


def lm_head_method(config: Any, method: type[QuantMethod] | QuantMethod | Any) -> str | None:
    """The weight method that quantizes the LM head under ``config`` (an ``EngineConfig``
    whose ``quant`` is ``method``), None for a 16-bit head: ``quant_lm_head`` where set
    (True: ``method`` itself), else the method's ``lm_head_default``."""
    if config.quant == "none":
        return None
    if config.quant_lm_head is not None:
        return config.quant if config.quant_lm_head else None
    default = getattr(method, "lm_head_default", False)
    if isinstance(default, str):
        return default
    return config.quant if default else None


def quantizes_lm_head(config: Any, method: type[QuantMethod] | QuantMethod | Any) -> bool:
    """Whether ``config`` quantizes the LM head at all (``lm_head_method``)."""
    return lm_head_method(config, method) is not None


def checkpoint_quant(hf_config: dict[str, Any], plugins: Any) -> str | None:
    """The registered quant method (of ``plugins``, a PluginManager) that loads the
    checkpoint whose config.json is ``hf_config`` (``QuantMethod.reads_checkpoint``:
    its ``quantization_config``'s ``quant_method``, and for a format of several
    schemes the scheme; a factory without that method: ``checkpoint_formats``); None
    for a 16-bit checkpoint. Two readers of one checkpoint: the first by name. A
    reader that raises ValueError (a scheme of its format it cannot serve) passes the
    question on; where none reads the checkpoint, the first such reason is raised,
    else a ValueError that names the format and the formats the methods load."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    fmt = str(qc.get("quant_method", "")).lower()
    methods = [c for c in plugins.components() if c.kind == "quant"]  # sorted by name
    reason: ValueError | None = None
    for c in methods:
        factory = c.spec.factory
        reads = getattr(factory, "reads_checkpoint", None)
        try:
            if (
                reads(qc)
                if reads is not None
                else fmt in getattr(factory, "checkpoint_formats", ())
            ):
                return str(c.name)
        except ValueError as exc:
            reason = reason or exc
    if reason is not None:
        raise reason
    known = ", ".join(
        f"{f} ({c.name})"
        for c in methods
        for f in getattr(c.spec.factory, "checkpoint_formats", ())
    )
    raise ValueError(
        f"the checkpoint is quantized as {fmt!r} (config.json's quantization_config), "
        f"a format or scheme no registered quant method loads; loaded: {known or 'none'}"
    )
