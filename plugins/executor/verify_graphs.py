"""CUDA graphs for speculative verify steps: B sequences of exactly ``1 + k`` tokens.

A verify step (issue 11) runs every speculating request's ``[last, d_1 .. d_k]`` on the
attention's extend path. Eager, a 32-layer forward pays several milliseconds of Python
and launch overhead at small batch, about what the step itself costs on the GPU, which
eats the speculative speedup; so steps whose every chunk has exactly ``1 + k`` query
tokens replay a graph instead.

Per-request ``k`` (``SamplingParams.num_speculative_tokens``) may be lower than the
engine's, so the executor keeps one ``VerifyGraphs`` per ``k`` from 1 to the engine's,
sharing one memory pool. Shapes are fixed per bucket (the decode buckets, up to ``max_verify_graph_seqs``): the
token count is ``bucket * (1 + k)``, ``query_start_loc`` is the constant
``arange(bucket + 1) * (1 + k)`` and never changes, and the attention metadata's
Python fields (``max_query_len``, ``decode_only``, ``query_lens_cpu``) are constants of
the bucket, so ``AttentionBackend.prepare`` runs once, before capture. Before each
replay ``fill`` copies the step's ids, positions, slot mapping, KV lengths and block
table into static buffers; padding sequences write nowhere (slot -1) and attend over
``1 + k`` KV rows of whatever blocks their stale table rows name (read only, discarded).
The backend's prefill kernel takes its grid from shapes only (no host sync), which is
what makes it capturable.

Batches that do not fit (a prefill chunk, a request with fewer drafts, more sequences
than the largest bucket) run eagerly as before. Plain decode steps keep their own
graphs (``cuda_graphs.DecodeGraphs``), untouched. Without CUDA (tests), ``capture(False)``
prepares the same static metadata and ``run`` executes the forward eagerly on the static
buffers, so the filling and padding are checked on the CPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tokenloom.plugins.executor.cuda_graphs import graph_batch_sizes
from tokenloom.protocols.components.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
)

log = logging.getLogger("tokenloom.executor")


def verify_batch_sizes(max_num_seqs: int, max_graph_seqs: int) -> list[int]:
    """The decode buckets up to ``min(max_num_seqs, max_graph_seqs)``; empty when 0."""
    top = min(max_num_seqs, max_graph_seqs)
    return graph_batch_sizes(top) if top > 0 else []


class VerifyGraphs:
    """Graphs (or, without CUDA, eager runs) of uniform ``1 + k``-token batches."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_speculative_tokens: int,
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_speculative_tokens < 1 or not sizes:
            raise ValueError("verify graphs need num_speculative_tokens >= 1 and a bucket")
        self.model = model
        self.attn = attn
        self.kv_caches = kv_caches
        self.width = num_speculative_tokens + 1  # query tokens per sequence
        self.sizes = sizes
        self.max_bs = sizes[-1]
        self.max_model_len = max_model_len
        n, w = self.max_bs, self.width
        self.input_ids = torch.zeros(n * w, dtype=torch.int32, device=device)
        self.positions = torch.zeros(n * w, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n * w,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((n,), w, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, (n + 1) * w, w, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n * w, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.capture_seconds = 0.0
        self.replays = 0  # steps run through this class (graph replays on CUDA)

    def _meta(self, bs: int) -> AttentionMetadata:
        w = self.width
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * w],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=w,
            max_seq_len=self.max_model_len,
            decode_only=False,
            query_lens_cpu=[w] * bs,  # a constant of the bucket; prepare reads it
        )

    def _run(self, bs: int) -> None:
        meta = self.metas[bs]
        ctx = ForwardContext(attn=self.attn, meta=meta, kv_caches=self.kv_caches)
        rows = bs * self.width
        self.hidden[:rows] = self.model(self.input_ids[:rows], self.positions[:rows], ctx)

    @torch.inference_mode()
    def capture(self, use_graphs: bool = True, pool: Any = None) -> Any:
        """Prepare each bucket's metadata and, with ``use_graphs``, capture its graph
        (largest first), all in one memory pool (``pool``, else a new one); return the
        pool, for the next ``k``'s graphs (run one at a time, nothing live between)."""
        started = time.perf_counter()
        for bs in reversed(self.sizes):
            meta = self._meta(bs)
            self.attn.prepare(meta)
            self.metas[bs] = meta
            if not use_graphs:
                continue
            self.slot_mapping.fill_(-1)  # the warm-up and capture runs write nowhere
            self._run(bs)  # warm-up: Triton compiles outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(bs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        if use_graphs:
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        log.info(
            "%s %d verify %s (batch 1..%d x %d tokens) in %.1fs",
            "captured" if use_graphs else "prepared",
            len(self.metas),
            "CUDA graphs" if use_graphs else "static batches",
            self.max_bs,
            self.width,
            self.capture_seconds,
        )
        return pool

    def can_run(self, num_seqs: int, num_tokens: int, max_query_len: int) -> bool:
        """True when every sequence has exactly ``1 + k`` query tokens (the total is
        ``num_seqs * (1 + k)`` and none has more) and a bucket holds them."""
        w = self.width
        return (
            bool(self.metas)
            and 0 < num_seqs <= self.max_bs
            and max_query_len == w
            and num_tokens == num_seqs * w
        )

    def fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> int:
        """Copy a step's inputs into the static buffers; the bucket it runs in."""
        num = meta.seq_lens.shape[0]
        bs = next(s for s in self.sizes if s >= num)
        rows, bucket_rows = num * self.width, bs * self.width
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.seq_lens[:num].copy_(meta.seq_lens)
        if bs > num:
            self.slot_mapping[rows:bucket_rows].fill_(-1)
            self.seq_lens[num:bs].fill_(self.width)
        # Columns past max_model_len (lookahead blocks) are never read: seq_lens bound them.
        cols = min(meta.block_tables.shape[1], self.block_tables.shape[1])
        self.block_tables[:num, :cols].copy_(meta.block_tables[:, :cols])
        return bs

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The step's hidden states ``[num_seqs * (1 + k), hidden]`` (a view of the
        static output, valid until the next run)."""
        bs = self.fill(input_ids, positions, meta)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._run(bs)
        self.replays += 1
        return self.hidden[: input_ids.shape[0]]
