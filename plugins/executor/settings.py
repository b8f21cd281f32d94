"""``[plugin.model]``: the ``model`` executor's settings table."""

from __future__ import annotations

from typing import Annotated

import msgspec


class ModelExecutorSettings(msgspec.Struct, forbid_unknown_fields=True):
    """``[plugin.model]`` (bench: ``--plugin-option model.KEY=VALUE``). The executor's
    ComponentSpec declares this Struct, so a mistyped key fails before weights load."""

    # a one-shot all-reduce through symmetric memory for decode's small messages, NCCL
    # groups only (``parallel.symmetric``)
    symm_mem_all_reduce: bool = False
    # decode CUDA graphs of at least this many requests run the step as two half-batches
    # on two streams, the attention of one beside the projections of the other
    # (``micro_batches``); 0: off. One GPU only (no tensor parallelism yet). Measured
    # 3.7% slower on an H100 (fp8, default workload, from 128): today's kernels each
    # fill the GPU, so they barely overlap (docs/quantization.md, session 40).
    micro_batch_min: Annotated[int, msgspec.Meta(ge=0)] = 0
    # with micro-batches, the two halves take turns at the attention (one half's
    # attention never runs beside the other's); False lets both streams run free
    micro_batch_turns: bool = True
    # with micro-batches, the attention's share of the SMs: the GPU is split into two
    # green contexts (``green_contexts``), every attention launch on this many SMs (the
    # driver rounds up), both halves' projections on the rest, so that neither takes the
    # other's SMs; 0: plain streams on the whole GPU. The split buckets then run eagerly,
    # not from CUDA graphs (``DecodeGraphs._make_streams`` says why; session 41). Measured
    # on an H100: the two kinds overlap 55-74% so, but the attention slows with fewer SMs
    # and the pipelined halves stay 1.6% slower than the whole step (80 SMs at best); in
    # the engine, eager, 62% slower on the default workload.
    micro_batch_sms: Annotated[int, msgspec.Meta(ge=0)] = 0
