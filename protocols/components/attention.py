"""The attention backend interface: paged attention over the KV cache, and the
per-step metadata and forward context every attention layer reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class AttentionMetadata:
    """Where each token of a flat batch reads and writes the paged KV cache.

    Built once per step by the executor, shared by all layers. Device tensors keep a
    fixed address under CUDA graphs (the executor copies into static buffers).
    """

    slot_mapping: torch.Tensor  # [T] int64 cuda/cpu: block_id * block_size + offset; -1 = skip
    query_start_loc: torch.Tensor  # [B + 1] int32: token offsets of each request's queries
    seq_lens: torch.Tensor  # [B] int32: KV length of each request after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every request has exactly one query token
    query_lens_cpu: list[int] = field(default_factory=list)  # [B] host copies, for
    seq_lens_cpu: list[int] = field(default_factory=list)  # readable reference backends
    extra: dict[str, Any] = field(default_factory=dict)  # backend-owned buffers


class AttentionBackend(ABC):
    """Paged attention: writes the new keys/values, then attends over the cache.

    Constructed as ``factory(config: EngineConfig, model_info: ModelInfo)``; the model
    info carries num_heads, num_kv_heads, head_dim, dtype and device. Called by every
    attention layer of the model, in the engine-core (or worker) process. ``forward``
    must not sync the host, allocate host memory, or read tensor values on the host:
    it runs inside CUDA graphs on decode steps.
    """

    name: str
    # True when ``forward`` on a decode batch can be captured in a CUDA graph: no host
    # syncs, no reads of ``meta.query_lens_cpu`` / ``seq_lens_cpu`` (graph metadata
    # leaves them empty), launches that depend on tensor shapes only.
    supports_cuda_graphs: bool = False
    # True when ``forward`` accepts ``kv_written=True``: the model already stored k and
    # v at ``meta.slot_mapping`` in the cache layout below (fused into its rope
    # kernel), so the backend only attends. The model passes the keyword only then.
    accepts_written_kv: bool = False
    # True when ``forward`` accepts ``rope=RopeInputs(...)``: q and k arrive as the
    # projection left them (no per-head norm, no rotary embedding), and the backend
    # applies both to q and k and stores k and v at ``meta.slot_mapping`` itself (a
    # decode kernel can do it on the way, one kernel less per layer). The model passes
    # the keyword only then, and then never ``kv_written``.
    accepts_rope: bool = False
    # True when ``forward`` reads and writes a quantized cache (``kv_cache_dtype`` fp8 /
    # int8): fp8 / int8 strided views whose blocks also hold per-token-head scales
    # (``plugins.attention.kv_quant``). The executor refuses such a cache otherwise.
    supports_quantized_kv: bool = False
    # True when the backend wants an fp8 cache's value blocks stored transposed,
    # ``[heads, D, tokens]``, behind the same ``[blocks, tokens, heads, D]`` view (its
    # strides differ: ``kv_quant.v_transposed``); the executor allocates the pool so.
    fp8_values_transposed: bool = False
    # True when two decode launches of one step may run at once on two CUDA streams,
    # each with its own metadata (two micro-batches: ``plugins.executor.micro_batches``):
    # a launch keeps whatever scratch it writes apart per ``meta.extra["lane"]`` (0 or 1,
    # absent = 0), which ``prepare`` sees first.
    supports_micro_batches: bool = False

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027
        """Called once per step before the forward pass; may fill ``meta.extra``."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store k and v at ``meta.slot_mapping``, then causal attention of each
        request's queries over its whole KV (cached prefix plus new tokens)."""


@dataclass(frozen=True)
class RopeInputs:
    """The rotary embedding a model hands an ``accepts_rope`` backend: cos/sin at each
    token's position (``[T, 1, D/2]`` or ``[T, D/2]``, rotate-half layout), and the
    per-head RMSNorm weights ``[D]`` applied before it (Qwen3) or None, with its eps.
    Results are rounded to the model dtype where transformers rounds them."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6

    def as_tuple(self) -> tuple[Any, ...]:
        return (self.cos, self.sin, self.q_weight, self.k_weight, self.eps)


@dataclass
class ForwardContext:
    """What a model's forward pass needs beyond token ids and positions: the
    attention backend, this step's metadata and every layer's KV cache. Built by the
    executor once per step (once per CUDA graph on decode)."""

    attn: AttentionBackend
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
