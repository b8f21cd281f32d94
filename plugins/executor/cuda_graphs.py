"""CUDA graphs for decode steps at bucketed batch sizes.

Captured once at start-up, largest first, sharing one memory pool. A decode step
of B sequences replays the smallest bucket >= B: its inputs are copied into static
buffers, padding rows write nowhere (slot -1) and read one KV token, and the
logits are computed outside the graph on the first B rows. ``run_pack`` fills the
inputs from one side-stream upload and one kernel (``graph_inputs``); ``run``, from a
built batch's device tensors (the draft proposer's). Buckets of at least
``micro_batch_min`` requests (``[plugin.model]``, off by default) are captured as two
half-batches on two streams (``micro_batches``); with ``micro_batch_sms`` the streams sit
on two green contexts, and such buckets run eagerly (``_make_streams``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tokenloom.plugins.executor.batch import DecodePack
from tokenloom.plugins.executor.graph_inputs import SideUploads, scatter_decode_inputs
from tokenloom.plugins.executor.micro_batches import MIN_HALF, forward_halves, half_metas
from tokenloom.protocols.components.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
)

log = logging.getLogger("tokenloom.executor")


def graph_batch_sizes(top: int) -> list[int]:
    """Bucketed batch sizes up to ``top``: 1, 2, 4, 8, then every 16, and ``top``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        micro_batch_min: int = 0,
        micro_batch_turns: bool = True,
        micro_batch_sms: int = 0,
    ) -> None:
        self.model = model
        self.attn = attn
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch)
        self.max_bs = self.sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.token_slots = torch.zeros(n, dtype=torch.int32, device=device)  # run_pack's rows
        self.uploads: SideUploads | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # None: run eagerly
        self.metas: dict[int, AttentionMetadata] = {}
        # two micro-batches from this many requests (0: never), where the backend and
        # the model can (``micro_batches``); their metadata by bucket, and the side stream
        micro = attn.supports_micro_batches and hasattr(model, "forward_steps")
        if micro_batch_min and not micro:
            log.warning(
                "micro_batch_min: attention %r or the model cannot split a decode step; off",
                attn.name,
            )
        self.micro_min = max(micro_batch_min, 2 * MIN_HALF) if micro and micro_batch_min else 0
        self.micro_turns = micro_batch_turns
        self.halves: dict[int, tuple[AttentionMetadata, AttentionMetadata]] = {}
        # the halves' streams (half A's None: the capture stream) and, with micro_batch_sms,
        # the attention's stream on a green context of that many SMs
        self.micro_sms = micro_batch_sms
        self.half_streams: tuple[torch.cuda.Stream | None, torch.cuda.Stream | None] = (None, None)
        self.attention_stream: torch.cuda.Stream | None = None
        self.attention_sms = 0
        self.micro_eager = False
        self.capture_seconds = 0.0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            decode_only=True,
        )

    def _plan(self, bs: int) -> None:
        """Bucket ``bs``'s metadata, and its halves' where it runs two micro-batches, each
        prepared (the backend sizes its decode scratch here, outside any capture)."""
        meta = self.metas[bs] = self._meta(bs)
        if self.micro_min and bs >= self.micro_min:
            self.halves[bs] = half_metas(meta, bs // 2)
            for half in self.halves[bs]:
                self.attn.prepare(half)
        else:
            self.attn.prepare(meta)

    def _make_streams(self) -> None:
        """The halves' streams: with ``micro_sms``, two green contexts (the attention's N
        SMs and the rest, each half a stream there); else the capture stream and a side
        stream."""
        plain = (None, torch.cuda.Stream(self.input_ids.device))
        if not self.micro_sms:
            self.half_streams = plain
            return
        from tokenloom.plugins.executor.green_contexts import split

        try:
            attention, projections = split(self.micro_sms, self.input_ids.device.index)
            streams = (projections.stream(), projections.stream())
            self.attention_stream = attention.stream()
        except (OSError, AttributeError, RuntimeError) as e:  # no driver support, bad count
            log.warning("micro_batch_sms: no green contexts (%s); plain streams", e)
            self.half_streams = plain
            return
        self.attention_sms = attention.sms
        self.half_streams = streams
        # Eagerly, never captured: whether a graph's kernel nodes keep the green context
        # they were captured from is not documented, and a failed capture over forked
        # streams can leave torch's allocator mid-capture. Measured since (session 41, an
        # H100): a captured pair does keep the split (overlap_probe --green), and eager
        # steps cost the engine 62% on the default workload (128-256 rows: the host's
        # launches bound them). Capturing is the fix, if the split ever pays (it did not).
        self.micro_eager = True
        log.info(
            "micro-batches: the attention on a green context of %d SMs, the projections "
            "on the other %d (eager steps)",
            attention.sms,
            projections.sms,
        )

    def _run(self, bs: int) -> None:
        meta = self.metas[bs]
        halves = self.halves.get(bs)
        if halves is not None:
            # on green contexts, cuBLAS sizes its persistent GEMM grids for the projections'
            # SMs (the carveout: the attention's), not the whole GPU's
            # (cuBLASLt's paths: fp8 ``_scaled_mm``; plain cuBLAS and Triton ignore it)
            carve = self.attention_sms if self.attention_stream is not None else 0
            before = torch._C._get_sm_carveout_experimental() if carve else None
            if carve:
                torch._C._set_sm_carveout_experimental(carve)
            try:
                forward_halves(
                    self.model, self.input_ids[:bs], self.positions[:bs], halves, self.attn,
                    self.kv_caches, self.hidden[:bs], self.half_streams, self.micro_turns,
                    self.attention_stream,
                )  # fmt: skip
            finally:
                if carve:
                    torch._C._set_sm_carveout_experimental(before)
            return
        ctx = ForwardContext(attn=self.attn, meta=meta, kv_caches=self.kv_caches)
        self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        pool: Any = None
        for bs in reversed(self.sizes):
            self._plan(bs)
            if bs in self.halves and self.half_streams == (None, None):
                self._make_streams()
            # warm-up: Triton compiles and autotunes outside capture (and cuBLAS makes
            # the side stream's workspace)
            self._run(bs)
            torch.cuda.synchronize()
            if bs in self.halves and self.micro_eager:
                self.graphs[bs] = None
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(bs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        # The uploads' buffers and pinned memory now, not on the serving path (they were
        # made at the first decode step until session 28; their first copy waits for the
        # compute stream either way: graph_inputs.SideUploads).
        self.uploads = SideUploads(self.input_ids.device)
        # Compile the inputs' scatter now (a padding-only batch: it writes what padding
        # rows hold anyway), not on the first decode step.
        packed = torch.zeros(5 + 1, dtype=torch.int32, device=self.input_ids.device)
        scatter_decode_inputs(
            packed, 0, 1, packed, self.input_ids, self.positions, self.seq_lens,
            self.slot_mapping, self.token_slots, self.block_tables, 1,
        )  # fmt: skip
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        micro = f", two micro-batches from batch {min(self.halves)}" if self.halves else ""
        if self.micro_eager:
            micro += " (eager)"
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d%s) in %.1fs",
            len(self.graphs),
            self.max_bs,
            micro,
            self.capture_seconds,
        )

    def can_run(self, num_seqs: int, decode_only: bool) -> bool:
        return decode_only and num_seqs <= self.max_bs and bool(self.graphs)

    def run_pack(
        self, pack: DecodePack, last_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step of ``pack``: ``(hidden [num], token slots [num] int32)``; the
        slots stay valid until the next replay's inputs are written."""
        num = pack.num
        bs = next(s for s in self.sizes if s >= num)
        packed = self._upload(pack.host)
        scatter_decode_inputs(
            packed, num, pack.width, last_tokens, self.input_ids, self.positions,
            self.seq_lens, self.slot_mapping, self.token_slots, self.block_tables, bs,
        )  # fmt: skip
        if self.uploads is not None:
            self.uploads.consumed()
        self._replay(bs)
        return self.hidden[:num], self.token_slots[:num]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if self.uploads is None:
            self.uploads = SideUploads(self.input_ids.device)
        return self.uploads.upload(host)

    def _replay(self, bs: int) -> None:
        graph = self.graphs[bs]
        if graph is None:
            with torch.inference_mode():
                self._run(bs)
        else:
            graph.replay()

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= num)
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slot_mapping[:num].copy_(meta.slot_mapping)
        self.seq_lens[:num].copy_(meta.seq_lens)
        if bs > num:
            self.slot_mapping[num:bs].fill_(-1)
            self.seq_lens[num:bs].fill_(1)
        cols = meta.block_tables.shape[1]
        self.block_tables[:num, :cols].copy_(meta.block_tables)
        self._replay(bs)
        return self.hidden[:num]
