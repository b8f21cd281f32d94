"""The interfaces of every pluggable component kind, with their contracts.

A component kind is chosen by name in the config (``scheduler = "continuous"``).
A plugin provides implementations through the ``tokenloom_register_components``
hook as ``ComponentSpec`` entries. torch is imported only for type checking, so the
frontend and the CLI can import this module without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tokenloom.protocols.outputs import EngineStats, TokenDelta
    from tokenloom.protocols.requests import GenerateRequest
    from tokenloom.protocols.step import StepInput, StepOutput

KINDS = (
    "scheduler",
    "kv_cache",
    "attention",
    "quant",
    "executor",
    "proposer",
    "frontend",
    "model",
)


@dataclass(frozen=True)
class ComponentSpec:
    """One implementation of one component kind.

    ``factory`` builds the component; its signature is the kind's constructor
    contract below (e.g. a scheduler factory takes ``(config, kv_cache)``). For kind
    ``model`` the name is the Hugging Face architecture (``LlamaForCausalLM``).
    """

    kind: str
    name: str
    factory: Callable[..., Any]
    description: str = ""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


# --------------------------------------------------------------------------- KV cache


class KVCacheManager(ABC):
    """Owns the block pool: which physical blocks each request holds.

    Constructed as ``factory(config, num_blocks, block_size)``. Pure bookkeeping on
    the CPU: it never touches tensors. Block ids index the executor's KV tensors.
    Calls come from the scheduler only, in the engine-core process.
    """

    block_size: int
    num_blocks: int

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached and unused)."""

    @abstractmethod
    def num_cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` are in the prefix cache (whole
        blocks only). Does not change any state. It is what ``allocate`` would reuse
        right now, so it may stop short of the cache (e.g. to leave the last token to
        compute): a scheduler sizes a request's first chunk with it."""

    @abstractmethod
    def allocate(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> int | None:
        """Give a request that holds no blocks enough blocks for its first ``num_tokens``
        tokens, reusing cached prefix blocks. Returns the number of leading tokens already
        computed (from the cache; always less than ``len(token_ids)``), or None when the
        pool cannot cover it (then nothing changed)."""

    @abstractmethod
    def append(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's blocks cover ``num_tokens`` tokens in total. Returns
        False, changing nothing, when the pool cannot cover it."""

    @abstractmethod
    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that the first ``num_computed`` tokens (``token_ids[:num_computed]``)
        are in the KV cache, so that their full blocks can be shared by prefix."""

    @abstractmethod
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. The returned list may be the live one: callers
        must not mutate it."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release every block the request holds. Idempotent."""


# --------------------------------------------------------------------------- scheduler


class Scheduler(ABC):
    """Decides, each step, which requests compute which tokens.

    Constructed as ``factory(config, kv_cache)``. Lives in the engine-core process;
    its methods are called by the kernel loop only, never concurrently. It must not
    block, touch the GPU, or allocate per token beyond the lists it returns. It owns
    stopping on token ids (EOS, stop_token_ids, max_tokens, model length); stop
    strings are matched by the frontend, which then aborts the request.
    """

    @abstractmethod
    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request. Raises QueueFullError when the waiting queue is full, and
        ValueError when it can never fit (prompt longer than the model length)."""

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        """Finish these requests now (unknown ids are ignored) and free their blocks.
        Returns one delta with finish_reason "abort" per request that was live."""

    @abstractmethod
    def schedule(self) -> StepInput:
        """Build the next step. Returns a StepInput with no chunks when idle."""

    @abstractmethod
    def update(self, step: StepInput, output: StepOutput) -> list[TokenDelta]:
        """Fold the executor's output into the requests: append tokens, finish those
        that stop, free their blocks. Returns the deltas to emit."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Counters for /metrics (cheap: called at most a few times a second)."""


# --------------------------------------------------------------------------- attention


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

    Constructed as ``factory(config, model_info)`` where model_info carries
    num_heads, num_kv_heads, head_dim, dtype and device. Called by every attention
    layer of the model, in the engine-core (or worker) process. ``forward`` must not
    sync the host, allocate host memory, or read tensor values on the host: it runs
    inside CUDA graphs on decode steps.
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


# --------------------------------------------------------------------------- quantization


class QuantMethod(ABC):
    """Weight and KV-cache quantization. Constructed as ``factory(config)``.

    Applied by the executor once, after the weights are loaded, in every process
    that holds a model shard.
    """

    name: str

    @abstractmethod
    def quantize_model(self, model: torch.nn.Module) -> None:
        """Replace or convert the model's linear weights in place."""

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the KV cache; the model's own by default."""
        return model_dtype


# --------------------------------------------------------------------------- executor


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


class PendingStep(ABC):
    """A step an executor has launched; ``result`` waits for its output."""

    @abstractmethod
    def result(self) -> StepOutput:
        """Block until the step is done; call once."""


class DoneStep(PendingStep):
    """A step that is already done (executors without pipelining)."""

    def __init__(self, output: StepOutput) -> None:
        self.output = output

    def result(self) -> StepOutput:
        return self.output


class Executor(ABC):
    """Runs steps on the model. Constructed as ``factory(config, registry)``, where
    the registry builds the attention backend and quant method named in config.

    Lives in the engine-core process (rank 0). ``execute`` may sync the host only to
    read the sampled token ids.

    Pipelining: ``submit`` launches a step and returns without waiting for it. An
    executor that sets ``supports_pipelining`` lets the engine build and submit step
    N+1 while step N runs (async scheduling): it must accept ``PLACEHOLDER_TOKEN``
    inputs (see ``protocols.step``) and run submitted steps in order.
    """

    supports_pipelining: bool = False

    @abstractmethod
    def load_model(self) -> ModelInfo:
        """Load weights onto the device; returns the model's shape and limits."""

    @abstractmethod
    def num_kv_blocks(self, block_size: int) -> int:
        """How many KV blocks fit in the memory budget (profiles a forward pass on GPU)."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV cache (and capture CUDA graphs where enabled)."""

    @abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step: forward pass over the flat batch, then sampling."""

    def submit(self, step: StepInput) -> PendingStep:
        """Launch one step; the default runs it to completion."""
        return DoneStep(self.execute(step))

    def shutdown(self) -> None:  # noqa: B027
        """Release devices and worker processes."""


# --------------------------------------------------------------------------- proposer


class Proposer(ABC):
    """Speculative-decoding proposer. Constructed as ``factory(config)``.

    Called by the executor each decode step, before the target forward pass.
    """

    name: str

    @abstractmethod
    def propose(self, token_histories: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Up to ``k`` draft tokens per request (possibly none) given each request's
        full token history (prompt + output)."""


# --------------------------------------------------------------------------- frontend


class EngineClient(ABC):
    """The frontend's handle on the engine-core: async, one per frontend process."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Submit a request and yield its deltas until one has a finish_reason.
        Leaving the iterator early aborts the request in the engine. Raises
        ``EngineError(code, message)`` when the engine refuses it and
        ``EngineDeadError`` as soon as the engine-core process is found dead."""

    @abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests; their blocks are freed at the engine's next step."""

    @abstractmethod
    async def stats(self) -> EngineStats:
        """Current engine counters."""

    @property
    @abstractmethod
    def is_alive(self) -> bool:
        """False once the engine-core process is gone."""


class Frontend(ABC):
    """Translates an external protocol to the engine protocol.

    Constructed as ``factory(config, engine, tokenizer)`` in the frontend process.
    """

    name: str

    @abstractmethod
    async def serve(self) -> None:
        """Serve until cancelled; cancellation must stop accepting work and return."""


@dataclass
class ForwardContext:
    """What a model's forward pass needs beyond token ids and positions."""

    attn: AttentionBackend
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
