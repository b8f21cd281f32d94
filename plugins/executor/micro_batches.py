"""Two micro-batches in one decode step: one half's attention beside the other's GEMMs.

At a few hundred requests a decode step is two kinds of work in turn, per layer: the
attention, bound by the KV cache's bytes (memory), and the projections, bound by the
tensor cores at that many rows (compute). One stream runs them one after the other. Here
the step's requests are split in two halves, each a chain of its own layers on its own
CUDA stream, issued layer by layer from the host so that the two stay in phase, and
captured into one CUDA graph: while half A attends, half B's projections can run, and
the other way round (issue 12; docs/quantization.md, sessions 39 and 40). The weights are
then read twice a step, once per half: the price. Measured on an H100 (session 40), the
price is paid and the overlap does not come: the decode attention fills every SM and the
cuBLAS GEMMs are persistent, so side by side they hide 17-20% of the shorter one, and a
600-row fp8 step ran 1.6% slower split. Session 41 confined each kind to its own SMs
(``OnStream`` over green contexts, below): they then overlap 55-74%, but the decode
attention's speed follows its SM count (88% of it on 80 of 132 SMs), so the pipelined
halves stayed 1.6% slower than the whole step on an H100. Hence off by default.

- ``half_metas``: the two halves' attention metadata, views of the step's static buffers
  (a decode step's ``query_start_loc`` is ``0..B``, so half B's is its first rows), the
  second on lane 1 (``AttentionMetadata.extra["lane"]``), whose decode scratch the
  backend keeps apart (``AttentionBackend.supports_micro_batches``).
- ``TakeTurns``: with ``turns``, the halves' attention launches alternate (A's layer l,
  B's layer l, A's layer l + 1, ...): each waits on the other half's last one, so two
  attentions never compete for the memory bandwidth, and each half's projections fill
  the other's attention.
- ``forward_halves``: the model's ``forward_steps`` generators (a decoder layer a step),
  stepped in turn, each half on its stream (None: the current stream; both None: one
  after the other, as on the CPU, which checks the arithmetic).
- ``OnStream`` (session 41, ``[plugin.model] micro_batch_sms = N``): the SMs split in two
  green contexts (``green_contexts``), every attention launch on a stream of the N SMs,
  each half's projections on its own stream of the rest, so that neither kind of kernel
  can take the other's SMs (the hardware's answer to session 40's 17-20%).

While half B's launches are issued, ``MICRO_BATCH_LANE`` is 1, so that a kernel with a
reused scratch buffer (int4 / int8's whole-weight dequantization above 256 rows:
``dequant``) takes lane 1's. One GPU only: under tensor parallelism the halves would issue
concurrent collectives on one communicator. The one-row GEMVs' split counters are shared
(``weight_gemv``), so a half must be larger than the GEMVs' rows (``MIN_HALF``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import replace
from typing import Any, cast

import torch

from tokenloom.protocols.components.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
)
from tokenloom.protocols.components.quant import MICRO_BATCH_LANE

MIN_HALF = 32  # rows a half needs at least (above every one-row GEMV path)


def half_metas(meta: AttentionMetadata, half: int) -> tuple[AttentionMetadata, AttentionMetadata]:
    """Decode metadata of rows ``[:half]`` and ``[half:]`` (views, no copies); the second
    half on lane 1."""
    if not meta.decode_only:
        raise ValueError("micro-batches split decode steps only")
    rows = int(meta.seq_lens.shape[0])
    if not 0 < half < rows:
        raise ValueError(f"a half of {half} rows out of {rows}")
    first = replace(
        meta,
        slot_mapping=meta.slot_mapping[:half],
        query_start_loc=meta.query_start_loc[: half + 1],
        seq_lens=meta.seq_lens[:half],
        block_tables=meta.block_tables[:half],
        extra={**meta.extra, "lane": 0},
    )
    second = replace(
        meta,
        slot_mapping=meta.slot_mapping[half:],
        query_start_loc=meta.query_start_loc[: rows - half + 1],  # 0..rows-half
        seq_lens=meta.seq_lens[half:],
        block_tables=meta.block_tables[half:],
        extra={**meta.extra, "lane": 1},
    )
    return first, second


class TakeTurns:
    """``backend`` with its ``forward`` launched in turns across streams: each launch
    waits on the one before it, whichever stream that ran on (an event each). Every other
    attribute is the backend's."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.last: torch.cuda.Event | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        stream = torch.cuda.current_stream()
        if self.last is not None:
            stream.wait_event(self.last)
        out = self.backend.forward(*args, **kwargs)
        self.last = torch.cuda.Event()
        self.last.record(stream)
        return out


class OnStream:
    """``backend`` with its ``forward`` launched on ``stream`` (the attention's green
    context, ``green_contexts``): the launch waits for the caller's stream, and the
    caller's stream for it. One stream for both halves' attention also takes turns. Every
    other attribute is the backend's."""

    def __init__(self, backend: AttentionBackend, stream: torch.cuda.Stream) -> None:
        self.backend = backend
        self.stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        here = torch.cuda.current_stream()
        self.stream.wait_stream(here)
        with torch.cuda.stream(self.stream):
            out = self.backend.forward(*args, **kwargs)
        here.wait_stream(self.stream)
        out.record_stream(here)  # made on the attention's stream, used (and freed) on here
        return out


def forward_halves(
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metas: tuple[AttentionMetadata, AttentionMetadata],
    attn: AttentionBackend,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    out: torch.Tensor,
    streams: tuple[torch.cuda.Stream | None, torch.cuda.Stream | None] = (None, None),
    turns: bool = True,
    attention_stream: torch.cuda.Stream | None = None,
) -> None:
    """The step's final hidden states into ``out`` (``[B, hidden]``), half A (rows
    ``metas[0]`` covers) on ``streams[0]``, half B on ``streams[1]`` (None: the current
    stream; both None: one after the other, as on the CPU, which checks the arithmetic), a
    decoder layer of each in turn; the current stream waits for both at the end. With
    ``attention_stream`` every attention launch runs there (``OnStream``: the attention's
    green context, the halves' streams in the projections'); else, with ``turns``, the
    launches take turns across the halves' streams (``TakeTurns``)."""
    half = int(metas[0].seq_lens.shape[0])
    live = [s for s in streams if s is not None]
    backend: Any = attn
    if attention_stream is not None:
        backend = OnStream(attn, attention_stream)
    elif live and turns:
        backend = TakeTurns(attn)
    current = torch.cuda.current_stream() if live or attention_stream is not None else None
    for stream in live:
        stream.wait_stream(current)
    steps = [
        model.forward_steps(
            input_ids[rows], positions[rows], ForwardContext(cast(AttentionBackend, backend), m, kv_caches)
        )
        for rows, m in ((slice(None, half), metas[0]), (slice(half, None), metas[1]))
    ]  # fmt: skip
    outs = (out[:half], out[half:])
    running = [True, True]
    while any(running):
        for lane in (0, 1):
            if running[lane]:
                running[lane] = _step(steps[lane], outs[lane], streams[lane], lane)
    for stream in live:
        assert current is not None
        current.wait_stream(stream)


def _step(
    steps: Generator[None, None, torch.Tensor],
    out: torch.Tensor,
    stream: torch.cuda.Stream | None,
    lane: int,
) -> bool:
    """Launch one step of ``steps`` on ``stream`` (None: the current one) as ``lane``;
    False once it returned its hidden states (copied into ``out``)."""
    token = MICRO_BATCH_LANE.set(lane)
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                next(steps)
            except StopIteration as done:
                out.copy_(done.value)
                return False
        return True
    finally:
        MICRO_BATCH_LANE.reset(token)
