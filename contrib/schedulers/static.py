"""Scheduler plugin ``static`` (contrib): the baseline that batches the old way.

Fill a batch (up to ``max_num_seqs`` requests, in (priority, arrival) order, while
the KV pool holds their whole prompts), run it until every request of the batch has
finished, and only then form the next batch. Prefill still respects the token
budget (a batch's prompts may take several steps), and a member preempted when the
pool runs dry resumes inside the same batch. Step messages and stopping rules are
those of ``continuous`` (shared ``BatchScheduler``), so both produce the same tokens
for the same executor; only throughput and latency differ.
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Callable
from operator import attrgetter

from tokenloom.config import EngineConfig
from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.plugins.scheduler.request_state import RequestState
from tokenloom.protocols.components.kv_cache import KVCacheManager
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl
from tokenloom.protocols.step import NewRequestData, ScheduledChunk

_by_sort_key = attrgetter("sort_key")


class StaticScheduler(BatchScheduler):
    def __init__(
        self,
        config: EngineConfig,
        kv_cache: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, kv_cache, clock)
        self._batch_preempted: list[RequestState] = []  # members waiting to resume

    def _admit(self, chunks: list[ScheduledChunk], new: list[NewRequestData], budget: int) -> int:
        preempted = self._batch_preempted
        if preempted:
            while preempted:
                used = self._start(preempted[0], budget, chunks, new, reserve_all=True)
                if used < 0:
                    break
                preempted.pop(0)
                budget -= used
            return budget
        if self._running:
            return budget  # the batch is still running: no admissions
        waiting = self._waiting
        while len(self._running) < self._max_num_seqs:
            state = waiting.peek()
            if state is None:
                break
            used = self._start(state, budget, chunks, new, reserve_all=True)
            if used < 0:
                break
            waiting.pop()
            budget -= used
        return budget

    def _requeue(self, state: RequestState) -> None:
        insort(self._batch_preempted, state, key=_by_sort_key)

    def _unqueue(self, state: RequestState) -> None:
        if state in self._batch_preempted:
            self._batch_preempted.remove(state)
        else:
            self._waiting.discard(state)

    def _num_queued(self) -> int:
        return len(self._waiting) + len(self._batch_preempted)


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "scheduler", "static", StaticScheduler, "baseline: whole batches run to completion"
        )
    ]
