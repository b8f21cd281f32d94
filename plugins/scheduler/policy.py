"""The public policy API of ``BatchScheduler``: everything a scheduling policy overrides.

A policy subclasses ``BatchScheduler`` and overrides only what is here: the waiting
queue's key (``priority``, with ``reprioritize_interval`` for aging), the victim of
preemption (``choose_victim``), admission (``admit``, starting requests through
``start``) and where preempted requests wait (``requeue`` / ``unqueue`` /
``num_queued``). It reads ``now``, ``running``, ``waiting`` and each
``RequestState``. The private members below the API are the bridge to the step
machinery (``step_building``), which calls them; a policy never needs them.

A mixin of ``BatchScheduler``, which owns the state declared below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenloom.plugins.scheduler.request_state import RequestState
from tokenloom.plugins.scheduler.waiting_queue import WaitingQueue
from tokenloom.protocols.step import NewRequestData, ScheduledChunk

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenloom.protocols.components.kv_cache import KVCacheManager


class SchedulingPolicy:
    """The extension points (see the module docstring); their defaults make ``continuous``."""

    # Owned by BatchScheduler; declared here for the type checker.
    kv_cache: KVCacheManager
    now: float
    _max_num_seqs: int
    _waiting: WaitingQueue
    _running: list[RequestState]
    _first_blocks_in_flight: dict[tuple[int, ...], int]
    _step_chunks: list[ScheduledChunk]
    _step_new: list[NewRequestData]
    _awaiting_first_token: list[RequestState]
    _start: Callable[..., int]

    #: Seconds between re-keying every waiting request with ``priority`` (aging);
    #: None: a request's key is computed when it is queued and never again.
    reprioritize_interval: float | None = None

    @property
    def running(self) -> Sequence[RequestState]:
        """The running requests (they hold blocks), in (priority, arrival) order.
        Read-only: change it only through ``start`` and preemption."""
        return self._running

    @property
    def waiting(self) -> WaitingQueue:
        """The queued requests, by ``priority``: ``peek`` / ``pop`` to admit,
        ``update(state)`` after changing what a request's key depends on."""
        return self._waiting

    def priority(self, state: RequestState, now: float) -> Any:
        """The waiting queue's key of ``state`` at time ``now`` (engine clock); lower
        runs sooner, ties by queueing order. Default: (priority, arrival order).
        Called when a request is queued (or requeued) and, with
        ``reprioritize_interval``, for every waiting request that often: keep it cheap
        (no scan of other requests)."""
        return state.sort_key

    def choose_victim(self, candidates: Sequence[RequestState]) -> RequestState:
        """The request to preempt when the KV pool runs dry; one of ``candidates``:
        the running requests not yet scheduled in this step, the one asking for a
        block first (choosing it preempts the asker itself). Default: the last
        (lowest priority, latest arrival)."""
        return candidates[-1]

    def admit(self, budget: int) -> int:
        """Start queued requests within ``budget`` tokens and ``max_num_seqs``;
        returns the budget left. Called once per step after the running requests
        were scheduled, and not in a step that preempted. Default: in queue order,
        strictly (nothing jumps ahead of a head that does not fit). A waiting
        request whose first prompt block another request is prefilling right now
        waits for that block, so that identical prompts share it."""
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
            used = self.start(state, budget)
            if used < 0:
                break
            waiting.pop()
            budget -= used
        for state in deferred:
            waiting.push(state)
        return budget

    def start(self, state: RequestState, budget: int, reserve_all: bool = False) -> int:
        """Start (or resume) queued ``state`` in the step being built: its blocks,
        reusing the prefix cache, and its first chunk of at most ``budget`` tokens.
        With ``reserve_all`` the blocks cover all its tokens, not just the chunk.
        Returns the tokens scheduled, or -1 (nothing changed) when the pool cannot
        hold it or it still waits for a token of a step in flight. The caller
        removes it from wherever it queued it (``waiting.pop()``). Only from
        ``admit``."""
        used = self._start(state, budget, self._step_chunks, self._step_new, reserve_all)
        if used >= 0 and not state.first_scheduled_time:
            state.first_scheduled_time = self.now
            self._awaiting_first_token.append(state)
        return used

    def requeue(self, state: RequestState) -> None:
        """Queue a request that was just preempted. Default: the waiting queue."""
        self._waiting.push(state)

    def unqueue(self, state: RequestState) -> None:
        """Forget a queued (or preempted) request that finishes (abort, timeout)."""
        self._waiting.discard(state)

    def num_queued(self) -> int:
        """Requests waiting, wherever they wait (for the queue limit and stats)."""
        return len(self._waiting)

    def _priority_key(self, state: RequestState) -> Any:
        return self.priority(state, self.now)

    def _admit(self, chunks: list[ScheduledChunk], new: list[NewRequestData], budget: int) -> int:
        self._step_chunks, self._step_new = chunks, new
        try:
            return self.admit(budget)
        finally:
            self._step_chunks, self._step_new = [], []

    def _take_victim(self, states: list[RequestState], first: int) -> RequestState:
        """Remove and return the victim among ``states[first:]`` (``choose_victim``)."""
        if first >= len(states) - 1:
            return states.pop()
        victim = self.choose_victim(states[first:])
        states.pop(states.index(victim, first))  # ValueError: not a candidate
        return victim

    def _requeue(self, state: RequestState) -> None:
        self.requeue(state)

    def _unqueue(self, state: RequestState) -> None:
        self.unqueue(state)
