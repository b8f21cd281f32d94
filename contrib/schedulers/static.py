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

from tokenloom.config import EngineConfig
from tokenloom.plugins.scheduler.batch_scheduler import BatchScheduler
from tokenloom.plugins.scheduler.request_state import RequestState
from tokenloom.plugins.scheduler.waiting_queue import by_sort_key
from tokenloom.protocols.components.kv_cache import KVCacheManager
from tokenloom.protocols.components.registry import ComponentSpec
from tokenloom.protocols.hookspecs import hookimpl


class StaticScheduler(BatchScheduler):
    """Built on the public policy API only: ``admit``, ``start``, ``requeue``."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, kv_cache, clock)
        self._batch_preempted: list[RequestState] = []  # members waiting to resume

    def admit(self, budget: int) -> int:
        preempted = self._batch_preempted
        if preempted:
            while preempted:
                used = self.start(preempted[0], budget, reserve_all=True)
                if used < 0:
                    break
                preempted.pop(0)
                budget -= used
            return budget
        if self.running:
            return budget  # the batch is still running: no admissions
        waiting = self.waiting
        while len(self.running) < self.config.max_num_seqs:
            state = waiting.peek()
            if state is None:
                break
            used = self.start(state, budget, reserve_all=True)
            if used < 0:
                break
            waiting.pop()
            budget -= used
        return budget

    def requeue(self, state: RequestState) -> None:
        insort(self._batch_preempted, state, key=by_sort_key)

    def unqueue(self, state: RequestState) -> None:
        if state in self._batch_preempted:
            self._batch_preempted.remove(state)
        else:
            self.waiting.discard(state)

    def num_queued(self) -> int:
        return len(self.waiting) + len(self._batch_preempted)


@hookimpl
def tokenloom_register_components() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            "scheduler", "static", StaticScheduler, "baseline: whole batches run to completion"
        )
    ]
