"""Scheduler plugin ``continuous``: iteration-level batching with chunked prefill.

Each step, under ``max_num_batched_tokens`` and ``max_num_seqs``:
1. running requests first, in (priority, arrival) order: one token per decode, the
   next chunk for a request mid-prefill; when the KV pool runs dry, the
   lowest-priority, latest-arrived running request is preempted (blocks freed,
   recomputed later as a prefill of its prompt and output);
2. then waiting requests by (priority, arrival) while budget, sequences and blocks
   last; a prompt longer than the budget left gets a chunk and continues next step.

A waiting request whose first prompt block is being prefilled by another request
right now waits until that block is committed, so that n>1 siblings (identical
prompts in one batch) share the prompt's blocks instead of computing them twice.
"""

from __future__ import annotations

from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


class ContinuousScheduler(BatchScheduler):
    """``BatchScheduler``'s default policy, unchanged: (priority, arrival) order for
    admission, the tail of the running list as the victim, strict-order admission
    (``BatchScheduler.admit``)."""


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "scheduler",
            "continuous",
            ContinuousScheduler,
            "continuous batching, chunked prefill, preemption by recompute",
        )
    ]
