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
from tokenloom.plugins.scheduler.request_state import RequestState
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.step import NewRequestData, ScheduledChunk


class ContinuousScheduler(BatchScheduler):
    def _admit(self, chunks: list[ScheduledChunk], new: list[NewRequestData], budget: int) -> int:
        waiting = self._waiting
        if not len(waiting):
            return budget
        kv = self.kv_cache
        in_flight = self._first_blocks_in_flight
        running = self._running
        deferred: list[RequestState] = []
        while budget > 0 and len(running) < self._max_num_seqs and kv.num_free_blocks:
            state = waiting.peek()
            if state is None:
                break
            if in_flight and state.first_block_key in in_flight:
                waiting.pop()
                deferred.append(state)
                continue
            used = self._start(state, budget, chunks, new)
            if used < 0:
                break  # strict order: nothing behind the head jumps ahead of it
            waiting.pop()
            budget -= used
        for state in deferred:
            waiting.push(state)
        return budget


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
