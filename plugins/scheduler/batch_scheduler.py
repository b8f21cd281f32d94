"""``BatchScheduler``: what every batching scheduler shares, and its public policy API.

A policy is a subclass that overrides only the extension points below, never a
private member (``protocols/README.md`` documents them with the request lifecycle):
- ``priority(state, now)``: the waiting queue's key (lower runs sooner); with
  ``reprioritize_interval`` set, every waiting request is re-keyed that often
  (aging), and ``waiting.update(state)`` re-keys one request at any time;
- ``choose_victim(candidates)``: which running request to preempt when the KV pool
  runs dry;
- ``admit(budget)``: which queued requests start this step, through ``start``;
- ``requeue`` / ``unqueue`` / ``num_queued``: where preempted requests wait.
It reads ``now`` (the engine clock at this step), ``running``, ``waiting`` and each
``RequestState`` (arrival, tenant, metadata, tokens, ``policy_data``).

Everything that touches the step messages, the KV manager and the stopping rules
lives in this class and its two halves, so two schedulers fed the same executor
produce the same tokens:
- ``step_building.StepBuilding``: ``schedule``, building a step;
- ``result_folding.ResultFolding``: ``update``, folding a step's output back in;
- here: the state they share, intake (``add_request``, ``abort_requests``), the
  state changes both call (preempt, finish, release, deadlines) and the per-request
  metrics on each last delta.

Invariants kept between calls:
- ``_running`` is sorted by ``sort_key`` (priority, arrival): scheduling walks it
  from the front, and by default the last entry is the one to preempt first.
- A request holds blocks if and only if its status is RUNNING; ``block_table`` is
  the KV manager's table for it, fetched again whenever ``append`` grows it.
- ``num_computed`` advances when a chunk is scheduled. A chunk that reaches a
  request's last token samples, and the request then has one more pending token
  (``num_pending``) until that step's ``update``. Pending tokens enter later chunks
  as ``PLACEHOLDER_TOKEN``, so ``schedule`` may run again before the previous
  step's ``update`` (async scheduling: the engine builds step N+1 while step N
  runs); called alternately, there is never a pending token at ``schedule``.
- A request is never started or resumed while it has pending tokens.
- A request that is aborted or times out while a step of it is in flight loses the
  token that step sampled (the synchronous engine would have delivered it).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.plugins.scheduler.request_state import RequestState, Status, max_total_len
from tokenloom.plugins.scheduler.result_folding import ResultFolding
from tokenloom.plugins.scheduler.step_building import StepBuilding
from tokenloom.plugins.scheduler.waiting_queue import WaitingQueue, by_sort_key
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.components.kv_cache import KVCacheManager
from tokenloom.protocols.components.scheduler import Scheduler
from tokenloom.protocols.outputs import EngineStats, FinishReason, RequestMetrics, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.step import NewRequestData, ScheduledChunk, StepInput, StepOutput


class BatchScheduler(StepBuilding, ResultFolding, Scheduler):
    """Shared machinery of the ``continuous`` and ``static`` schedulers, and the base
    of a third-party policy (see the module docstring); used as is, it is
    ``continuous``.

    ``clock`` returns seconds on the same scale as ``GenerateRequest.arrival_time``
    (``time.monotonic``); the engine passes its clock, tests pass a fake one. Requests found past their deadline
    in ``schedule`` are finished there and listed in that step's
    ``finished_request_ids`` (even one the executor never saw, so the step is not
    empty); their deltas come out of that step's ``update``, and
    ``has_unfinished_requests`` stays True until they are out.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("max_model_len: must be resolved to an int before the scheduler")
        self.config = config
        self.kv_cache = kv_cache
        self._clock = clock
        self._block_size = kv_cache.block_size
        self._max_model_len = int(config.max_model_len)
        self._max_batched_tokens = int(config.max_num_batched_tokens)
        self._max_num_seqs = int(config.max_num_seqs)
        self._max_waiting = int(config.max_waiting_requests)
        self._prefix_caching = bool(config.enable_prefix_caching)
        # Speculative decoding writes draft KV past the last token: reserve slots for it.
        self._lookahead = config.num_speculative_tokens
        self._pool_tokens = kv_cache.num_blocks * kv_cache.block_size - self._lookahead
        self.now = clock()
        self._requests: dict[str, RequestState] = {}
        own_priority = type(self).priority is not BatchScheduler.priority
        self._waiting = WaitingQueue(self._priority_key if own_priority else by_sort_key)
        self._last_reprioritized = self.now
        self._running: list[RequestState] = []
        self._deadlines: list[tuple[float, int, RequestState]] = []
        self._first_blocks_in_flight: dict[tuple[int, ...], int] = {}
        self._finished_ids: list[str] = []
        # The states a built step's chunks belong to, until its update: a request id
        # can be reused (abort, then resubmit) while an old step of it is in flight.
        self._step_states: dict[int, list[RequestState]] = {}
        self._pending_deltas: list[TokenDelta] = []
        self._num_arrivals = 0
        self._step_id = 0
        self._preempted_this_step = False
        self._step_chunks: list[ScheduledChunk] = []  # the step being built, for ``start``
        self._step_new: list[NewRequestData] = []
        self._awaiting_first_token: list[RequestState] = []
        self._finished_metrics: dict[str, RequestMetrics] = {}
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0

    # ----------------------------------------------------------------- policy API

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

    # ----------------------------------------------------------------- step hooks

    def schedule(self) -> StepInput:
        now = self.now = self._clock()
        interval = self.reprioritize_interval
        if interval is not None and now - self._last_reprioritized >= interval:
            self._last_reprioritized = now
            self._waiting.reprioritize()
        return StepBuilding.schedule(self)

    def update(self, step: StepInput, output: StepOutput) -> list[TokenDelta]:
        deltas = ResultFolding.update(self, step, output)
        if self._awaiting_first_token:
            self._note_first_tokens()
        metrics = self._finished_metrics
        if metrics:
            for delta in deltas:
                if delta.finish_reason is not None and delta.metrics is None:
                    delta.metrics = metrics.pop(delta.request_id, None)
            metrics.clear()
        return deltas

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

    def _note_first_tokens(self) -> None:
        now = self._clock()
        still: list[RequestState] = []
        for state in self._awaiting_first_token:
            if state.status == Status.FINISHED:
                continue
            if state.sent_first_delta:
                state.first_token_time = now
            else:
                still.append(state)
        self._awaiting_first_token = still

    def _requeue(self, state: RequestState) -> None:
        self.requeue(state)

    def _unqueue(self, state: RequestState) -> None:
        self.unqueue(state)

    # ----------------------------------------------------------------- Scheduler API

    def add_request(self, request: GenerateRequest) -> None:
        request_id = request.request_id
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already queued or running")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if num_prompt > self._max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {num_prompt} tokens, more than "
                f"max_model_len={self._max_model_len}"
            )
        if num_prompt > self._pool_tokens:
            raise ValueError(
                f"request {request_id!r}: the prompt has {num_prompt} tokens, more than the KV "
                f"pool can ever hold ({self.kv_cache.num_blocks} blocks of {self._block_size})"
            )
        if self.num_queued() >= self._max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self._max_waiting} requests, "
                "max_waiting_requests); retry later"
            )
        self._num_arrivals += 1
        arrival = request.arrival_time or self._clock()
        deadline_at = None if request.deadline is None else arrival + request.deadline
        max_len = max_total_len(request, self._max_model_len, self._pool_tokens)
        state = RequestState(request, self._num_arrivals, max_len, deadline_at, arrival)
        if self._prefix_caching and num_prompt > self._block_size:
            state.first_block_key = tuple(request.prompt_token_ids[: self._block_size])
        self._requests[request_id] = state
        self._waiting.push(state)
        if deadline_at is not None:
            deadlines = self._deadlines
            if len(deadlines) > 2 * len(self._requests) + 64:  # drop finished ones
                deadlines[:] = [item for item in deadlines if not item[2].is_finished]
                heapq.heapify(deadlines)
            heapq.heappush(deadlines, (deadline_at, self._num_arrivals, state))

    def abort_requests(self, request_ids: Iterable[str]) -> list[TokenDelta]:
        deltas = []
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is not None:
                deltas.append(self._finish_early(state, FinishReason.ABORT))
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_deltas)

    def stats(self) -> EngineStats:
        kv = self.kv_cache
        return EngineStats(
            num_waiting=self.num_queued(),
            num_running=len(self._running),
            num_blocks_total=kv.num_blocks,
            num_blocks_free=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps=self.num_steps,
        )

    # ----------------------------------------------------------------- state changes

    def _preempt(self, state: RequestState) -> None:
        """Take every block back; the request recomputes its tokens when it resumes."""
        self.kv_cache.free(state.request_id)
        state.block_table = []
        state.num_computed = 0
        state.status = Status.PREEMPTED
        self._release_first_block(state)
        state.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step = True
        self._requeue(state)

    def _finish_early(self, state: RequestState, reason: str) -> TokenDelta:
        """Finish a request that did not stop by itself (abort, timeout)."""
        if state.status == Status.RUNNING:
            self._running.remove(state)
        else:
            self._unqueue(state)
        state.finish_reason = reason
        self._release(state)
        delta = state.delta([], None, None)
        delta.metrics = self._finished_metrics.pop(state.request_id, None)
        return delta

    def _release(self, state: RequestState) -> None:
        now = self._clock()
        if state.sent_first_delta and not state.first_token_time:
            state.first_token_time = now  # its first tokens came in this very update
        self._finished_metrics[state.request_id] = RequestMetrics(
            state.arrival_time,
            state.first_scheduled_time,
            state.first_token_time,
            now,
            state.num_preemptions,
            state.num_cached_tokens,
        )
        state.status = Status.FINISHED
        del self._requests[state.request_id]
        self.kv_cache.free(state.request_id)
        state.block_table = []
        self._release_first_block(state)
        if state.sent_to_executor:
            self._finished_ids.append(state.request_id)

    def _release_first_block(self, state: RequestState) -> None:
        if not state.holds_first_block:
            return
        state.holds_first_block = False
        key = state.first_block_key
        assert key is not None
        in_flight = self._first_blocks_in_flight
        if in_flight[key] <= 1:
            del in_flight[key]
        else:
            in_flight[key] -= 1

    def _expire_deadlines(self) -> None:
        now = self._clock()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            state = heapq.heappop(deadlines)[2]
            if state.status != Status.FINISHED:
                self._pending_deltas.append(self._finish_early(state, FinishReason.TIMEOUT))
                if not state.sent_to_executor:
                    # Named anyway, so that the step is not empty and its update runs.
                    self._finished_ids.append(state.request_id)
