"""One minimal component of every kind, written from ``tokenloom.protocols`` alone.

A newcomer's first attempt at each kind: nothing here imports tokenloom outside
``tokenloom.protocols`` (``test_every_kind_from_protocols`` checks it), so every
contract these rely on is stated in ``protocols/``. Deliberately simple: the
scheduler runs one request at a time, the KV manager has no prefix cache, attention
loops over requests in Python.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tokenloom.protocols.components.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
)
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.components.executor import Executor
from tokenloom.protocols.components.frontend import Frontend
from tokenloom.protocols.components.kv_cache import KVCacheManager
from tokenloom.protocols.components.model import ModelInfo
from tokenloom.protocols.components.proposer import Proposer
from tokenloom.protocols.components.quant import LinearKernel, QuantMethod
from tokenloom.protocols.components.scheduler import Scheduler
from tokenloom.protocols.outputs import EngineStats, FinishReason, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.step import (
    PLACEHOLDER_TOKEN,
    NewRequestData,
    ScheduledChunk,
    StepInput,
    StepOutput,
)


class FreeListKV(KVCacheManager):
    """Blocks from a free list; no prefix cache."""

    def __init__(self, config: Any, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        return 0

    def allocate(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> int | None:
        self._tables[request_id] = []
        if not self.append(request_id, num_tokens):
            del self._tables[request_id]
            return None
        return 0

    def append(self, request_id: str, num_tokens: int) -> bool:
        table = self._tables[request_id]
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return True

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        pass

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        self._free.extend(self._tables.pop(request_id, []))


class OneAtATimeScheduler(Scheduler):
    """First come, first served, one request at a time, chunked under the budget."""

    def __init__(self, config: Any, kv_cache: KVCacheManager, clock: Any = time.monotonic) -> None:
        self.config, self.kv = config, kv_cache
        self.pool = kv_cache.num_blocks * kv_cache.block_size
        self.waiting: deque[dict[str, Any]] = deque()
        self.current: dict[str, Any] | None = None
        self.finished_ids: list[str] = []
        self.step_id = 0

    def add_request(self, request: GenerateRequest) -> None:
        if len(request.prompt_token_ids) > min(self.pool, self.config.max_model_len):
            raise ValueError("the prompt can never fit")
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError("the waiting queue is full")
        limit = min(self.pool, self.config.max_model_len)
        if request.params.max_tokens is not None:
            limit = min(limit, len(request.prompt_token_ids) + request.params.max_tokens)
        stops = set(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            stops.update(request.eos_token_ids)
        tokens = list(request.prompt_token_ids)
        state = {"req": request, "tokens": tokens, "computed": 0, "pending": 0, "sent": False}
        self.waiting.append({**state, "limit": limit, "stops": stops, "first": True})

    def abort_requests(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        deltas = []
        for request_id in request_ids:
            for state in [*self.waiting, self.current]:
                if state is not None and state["req"].request_id == request_id:
                    deltas.append(self._finish(state, FinishReason.ABORT))
        return deltas

    def schedule(self) -> StepInput:
        self.step_id += 1
        if self.current is None and self.waiting:
            head = self.waiting[0]
            if self.kv.allocate(head["req"].request_id, head["tokens"], 1) is not None:
                self.current = self.waiting.popleft()
        chunks, new = [], []
        state = self.current
        if state is not None and not state["pending"]:
            rid, tokens, start = state["req"].request_id, state["tokens"], state["computed"]
            end = min(len(tokens), start + self.config.max_num_batched_tokens)
            if self.kv.append(rid, end):
                if not state["sent"]:
                    state["sent"] = True
                    req = state["req"]
                    new.append(NewRequestData(rid, list(req.prompt_token_ids), req.params))
                sample = end == len(tokens)
                state["computed"], state["pending"] = end, int(sample)
                chunk = ScheduledChunk(
                    rid, tokens[start:end], start, self.kv.block_ids(rid), sample
                )
                chunks.append(chunk)
        finished, self.finished_ids = self.finished_ids, []
        return StepInput(self.step_id, chunks, new, finished, sum(len(c.token_ids) for c in chunks))

    def update(self, step: StepInput, output: StepOutput) -> list[TokenDelta]:
        state = self.current
        deltas = []
        for request_id, new_ids in zip(output.request_ids, output.token_ids, strict=True):
            if state is None or state["req"].request_id != request_id:
                continue  # aborted while the step was in flight
            state["pending"] = 0
            token = new_ids[0]
            assert token != PLACEHOLDER_TOKEN
            state["tokens"].append(token)
            num_output = len(state["tokens"]) - len(state["req"].prompt_token_ids)
            reason = None
            if token in state["stops"] and num_output >= state["req"].params.min_tokens:
                reason = FinishReason.STOP
            elif len(state["tokens"]) >= state["limit"]:
                reason = FinishReason.LENGTH
            delta = TokenDelta(request_id, [token], reason)
            if state.pop("first", False):
                delta.num_prompt_tokens = len(state["req"].prompt_token_ids)
            deltas.append(delta)
            if reason is not None:
                self._finish(state, reason)
        return deltas

    def _finish(self, state: dict[str, Any], reason: str) -> TokenDelta:
        request_id = state["req"].request_id
        if state is self.current:
            self.current = None
        else:
            self.waiting.remove(state)
        self.kv.free(request_id)
        if state["sent"]:
            self.finished_ids.append(request_id)
        return TokenDelta(request_id, [], reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or self.current is not None

    def stats(self) -> EngineStats:
        return EngineStats(num_waiting=len(self.waiting), num_running=int(bool(self.current)))


class LoopAttention(AttentionBackend):
    """Writes the step's K/V at the slots, then attends request by request."""

    name = "loop"

    def __init__(self, config: Any, model_info: ModelInfo) -> None:
        self.group = model_info.num_heads // model_info.num_kv_heads

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):  # type: ignore[no-untyped-def]
        k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping] = k
        v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping] = v
        out, start = torch.empty_like(q), 0
        for row, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):  # noqa: B905
            blocks = meta.block_tables[row].long()
            keys = k_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(self.group, 1)
            values = v_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(self.group, 1)
            scores = torch.einsum("qhd,shd->hqs", q[start : start + q_len], keys) * scale
            pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos, float("-inf"))
            out[start : start + q_len] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), values)
            start += q_len
        return out


class OneLayerModel(torch.nn.Module):
    """Embedding, one attention layer through ``ctx.attn``, LM head."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        vocab, self.heads, self.head_dim = hf_config["vocab_size"], hf_config["heads"], 8
        hidden = self.heads * self.head_dim
        self.embed = torch.nn.Embedding(vocab, hidden, dtype=dtype)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False, dtype=dtype)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, input_ids, positions, ctx: ForwardContext):  # type: ignore[no-untyped-def]
        x = self.embed(input_ids) + positions[:, None].to(self.embed.weight.dtype) * 0.01
        q, k, v = self.qkv(x).view(len(input_ids), 3, self.heads, self.head_dim).unbind(1)
        k_cache, v_cache = ctx.kv_caches[0]
        out = ctx.attn.forward(q, k, v, k_cache, v_cache, ctx.meta, self.head_dim**-0.5)
        return x + out.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def checkpoint_slots(self) -> dict[str, Any]:
        return {}

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        return True


class HashExecutor(Executor):
    """A model stand-in: each sampled token is a function of the request's history."""

    def __init__(self, config: Any, plugins: Any) -> None:
        self.histories: dict[str, list[int]] = {}

    def load_model(self) -> ModelInfo:
        return ModelInfo("hash", "none", 128, 97, 1, 1, 1, 8, 8, torch.float32, "cpu", [0])

    def num_kv_blocks(self, block_size: int) -> int:
        return 64

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def execute(self, step: StepInput) -> StepOutput:
        for request_id in step.finished_request_ids:
            self.histories.pop(request_id, None)
        for new in step.new_requests:
            self.histories[new.request_id] = []
        ids, tokens = [], []
        for chunk in step.chunks:
            history = self.histories[chunk.request_id]
            del history[chunk.start_pos :]
            history.extend(chunk.token_ids)
            if chunk.sample:
                token = 1 + sum((i + 1) * t for i, t in enumerate(history)) % 96
                history.append(token)  # a placeholder later means this one
                ids.append(chunk.request_id)
                tokens.append([token])
        return StepOutput(step.step_id, ids, tokens)


class HalfPrecisionKernel(LinearKernel):
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.half()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = x @ self.weight.to(x.dtype).t()
        return out if bias is None else out + bias


class HalfPrecisionQuant(QuantMethod):
    """Stores every layer that has a ``kernel`` slot in float16."""

    name = "half"

    def __init__(self, config: Any) -> None:
        pass

    def quantize_model(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if hasattr(module, "kernel"):
                module.kernel = HalfPrecisionKernel(module.weight.data)


class RepeatProposer(Proposer):
    """Drafts the last token again."""

    name = "repeat"

    def __init__(self, config: Any) -> None:
        pass

    def propose(self, request_ids, token_histories, num_tokens):  # type: ignore[no-untyped-def]
        return [[h[-1]] * n if h else [] for h, n in zip(token_histories, num_tokens)]  # noqa: B905


class QueueFrontend(Frontend):
    """Serves prompts put on ``inbox`` (token ids); puts each finished output on ``outbox``."""

    name = "queue"

    def __init__(
        self, config: Any, engine: EngineClient, tokenizer: Any, ready: Any = None
    ) -> None:
        self.engine, self.ready = engine, ready
        self.inbox: asyncio.Queue[list[int]] = asyncio.Queue()
        self.outbox: asyncio.Queue[tuple[list[int], str | None]] = asyncio.Queue()

    async def serve(self) -> None:
        from tokenloom.protocols.sampling import SamplingParams

        serial = 0
        while True:
            prompt = await self.inbox.get()
            serial += 1
            request = GenerateRequest(f"q{serial}", prompt, SamplingParams(max_tokens=3))
            tokens, reason = [], None
            async for delta in self.engine.generate(request):
                tokens += delta.new_token_ids
                reason = delta.finish_reason
            await self.outbox.put((tokens, reason))
