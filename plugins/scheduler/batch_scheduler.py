"""``BatchScheduler``: what every batching scheduler shares; the base of a policy.

A policy is a subclass that overrides only the public extension points of
``policy.SchedulingPolicy`` (``priority`` with ``reprioritize_interval``,
``choose_victim``, ``admit`` with ``start``, ``requeue`` / ``unqueue`` /
``num_queued``), never a private member; ``protocols/README.md`` documents them
with the request lifecycle.

Everything that touches the step messages, the KV manager and the stopping rules
lives in this class and its two halves, so two schedulers fed the same executor
produce the same tokens:
- ``step_building.StepBuilding``: ``schedule``, building a step;
- ``result_folding.ResultFolding``: ``update``, folding a step's output back in;
- ``policy.SchedulingPolicy``: the policy API and its bridge to step building;
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
from collections.abc import Callable, Iterable

from tokenloom.config import EngineConfig
from tokenloom.plugins.scheduler.policy import SchedulingPolicy
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


class BatchScheduler(SchedulingPolicy, StepBuilding, ResultFolding, Scheduler):
    """Shared machinery of the ``continuous`` and ``static`` schedulers, and the base
    of a third-party policy (see the module docstring); used as is, it is
    ``continuous``.

    ``clock`` returns seconds on the same scale as ``GenerateRequest.arrival_time``
    (``time.monotonic``); the engine passes its clock, tests pass a fake one. ``now``
    is its reading at the latest ``schedule`` or ``add_request``. Requests found
    past their deadline in ``schedule`` are finished there and listed in that step's
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
        own_priority = type(self).priority is not SchedulingPolicy.priority
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
        self.now = self._clock()  # the queue keys the request with it
        arrival = request.arrival_time or self.now
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
            spec_draft_tokens_total=self.spec_proposed_total,
            spec_accepted_tokens_total=self.spec_accepted_total,
            spec_verify_steps_total=self.spec_verify_steps,
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
