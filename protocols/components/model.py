"""The model interface: what the executor and the loader need of a model, and what
the rest of the engine learns about it (``ModelInfo``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from tokenloom.protocols.components.attention import ForwardContext


@dataclass
class ModelInfo:
    """What the rest of the engine needs to know about the loaded model."""

    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    eos_token_ids: list[int] = field(default_factory=list)


class CheckpointSlot(Protocol):
    """Where one checkpoint tensor goes in a model's parameters."""

    def target(self) -> torch.Tensor:
        """The parameter (or the rows of a merged one) the tensor is copied into."""
        ...


class Model(Protocol):
    """A causal language model, as the executor runs it and the loader fills it.

    Registered as component kind ``model`` under its Hugging Face architecture name
    and constructed as ``factory(hf_config: dict, dtype: torch.dtype)`` on the current
    default device (the loader builds it under ``with torch.device(device)``), with
    uninitialised parameters until the loader fills ``checkpoint_slots()``. It is also
    a ``torch.nn.Module`` (the executor calls ``eval()``, ``modules()`` and
    ``parameters()`` on it). A Protocol rather than an ABC, because models subclass
    ``nn.Module``.

    Optional: ``forward_steps(input_ids, positions, ctx)``, the same forward as a
    generator that launches one decoder layer a step, yields between them, and returns
    the final hidden states. With it (and a backend with ``supports_micro_batches``) the
    executor may run a decode step as two half-batches on two streams
    (``[plugin.model] micro_batch_min``; ``plugins.executor.micro_batches``).
    """

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int32 or int64
        positions: torch.Tensor,  # [T] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden]
        """The final hidden states of a flat batch. Reads and writes the KV cache only
        through ``ctx.attn`` at ``ctx.meta``'s slots. Must not sync the host: decode
        batches run it inside a CUDA graph."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32, for the rows that sample."""
        ...

    def checkpoint_slots(self) -> Mapping[str, CheckpointSlot]:
        """Every tensor the checkpoint must hold, by its Hugging Face name, and the
        parameter rows it fills. The loader fails when one is missing."""
        ...

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """True for tensors a checkpoint may hold that the model does not need (the
        loader skips them instead of refusing the checkpoint)."""
        ...
