"""What every batching scheduler shares: intake, step building, preemption, update.

A subclass decides only its admission policy (``_admit``) and, if it wants, where
preempted requests wait (``_requeue`` / ``_unqueue`` / ``_num_queued``). Everything
that touches the step messages, the KV manager and the stopping rules lives here, so
two schedulers fed the same executor produce the same tokens.

Invariants kept between calls:
- ``_running`` is sorted by ``sort_key`` (priority, arrival): the last entry is the
  one to preempt first, and scheduling walks it from the front.
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
from abc import abstractmethod
from bisect import insort
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

from tokenloom.plugins.scheduler.request_state import RequestState, Status, max_total_len
from tokenloom.plugins.scheduler.waiting_queue import WaitingQueue
from tokenloom.protocols.components import KVCacheManager, QueueFullError, Scheduler
from tokenloom.protocols.outputs import EngineStats, FinishReason, TokenDelta
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.step import (
    PLACEHOLDER_TOKEN,
    NewRequestData,
    ScheduledChunk,
    StepInput,
    StepOutput,
)

_by_sort_key = attrgetter("sort_key")


class BatchScheduler(Scheduler):
    """Shared machinery of the ``continuous`` and ``static`` schedulers.

    ``clock`` returns seconds on the same scale as ``GenerateRequest.arrival_time``
    (``time.monotonic``); tests pass a fake one. Requests found past their deadline
    in ``schedule`` are finished there and listed in that step's
    ``finished_request_ids`` (even one the executor never saw, so the step is not
    empty); their deltas come out of that step's ``update``, and
    ``has_unfinished_requests`` stays True until they are out.
    """

    def __init__(
        self,
        config: Any,
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
        self._lookahead = int(getattr(config, "num_speculative_tokens", 0))
        self._pool_tokens = kv_cache.num_blocks * kv_cache.block_size - self._lookahead
        self._requests: dict[str, RequestState] = {}
        self._waiting = WaitingQueue()
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
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0

    # ----------------------------------------------------------------- policy hooks

    @abstractmethod
    def _admit(self, chunks: list[ScheduledChunk], new: list[NewRequestData], budget: int) -> int:
        """Start queued requests (through ``_start``) within ``budget`` tokens; returns
        the budget left. Called after the running requests were scheduled, and not
        in a step that preempted."""

    def _requeue(self, state: RequestState) -> None:
        """Queue a request that was just preempted."""
        self._waiting.push(state)

    def _unqueue(self, state: RequestState) -> None:
        """Forget a queued request that finishes (abort, timeout)."""
        self._waiting.discard(state)

    def _num_queued(self) -> int:
        return len(self._waiting)

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
        if self._num_queued() >= self._max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self._max_waiting} requests, "
                "max_waiting_requests); retry later"
            )
        self._num_arrivals += 1
        deadline_at = None
        if request.deadline is not None:
            deadline_at = (request.arrival_time or self._clock()) + request.deadline
        max_len = max_total_len(request, self._max_model_len, self._pool_tokens)
        state = RequestState(request, self._num_arrivals, max_len, deadline_at)
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

    def schedule(self) -> StepInput:
        if self._deadlines and self._deadlines[0][0] <= self._clock():
            self._expire_deadlines()
        self._step_id += 1
        self._preempted_this_step = False
        chunks: list[ScheduledChunk] = []
        new: list[NewRequestData] = []
        budget = self._schedule_running(chunks, new, self._max_batched_tokens)
        if not self._preempted_this_step:
            budget = self._admit(chunks, new, budget)
        finished = self._finished_ids
        self._finished_ids = []
        if chunks:
            self.num_steps += 1
            _decodes_first(chunks)
            requests = self._requests
            self._step_states[self._step_id] = [requests[c.request_id] for c in chunks]
        return StepInput(self._step_id, chunks, new, finished, self._max_batched_tokens - budget)

    def update(self, step: StepInput, output: StepOutput) -> list[TokenDelta]:
        deltas = self._pending_deltas
        self._pending_deltas = []
        requests = self._requests
        commit = self.kv_cache.commit if self._prefix_caching else None
        block_size = self._block_size
        running_status = Status.RUNNING
        sampled_ids = output.request_ids
        sampled_tokens = output.token_ids
        num_sampled = len(sampled_ids)
        sample_index = -1
        num_generated = 0
        any_finished = False
        states = self._step_states.pop(step.step_id, None)
        finished = Status.FINISHED
        for index, chunk in enumerate(step.chunks):
            if chunk.sample:
                sample_index += 1
            request_id = chunk.request_id
            state = states[index] if states is not None else requests.get(request_id)
            if state is None or state.status == finished:
                continue  # finished (stopped, aborted, timed out) after this step was built
            start = chunk.start_pos
            end = start + len(chunk.token_ids)
            if start < state.num_prompt_tokens:
                self.prompt_tokens_total += min(end, state.num_prompt_tokens) - start
            running = state.status == running_status  # else preempted since it was built
            # Only a chunk that fills a block gives the prefix cache something new.
            if running and commit is not None and end // block_size != start // block_size:
                commit(request_id, state.all_token_ids, end)
                if state.holds_first_block:
                    self._release_first_block(state)
            if not chunk.sample:
                continue
            state.num_pending -= 1
            if sample_index >= num_sampled:
                continue
            if sampled_ids[sample_index] != request_id:
                raise RuntimeError("StepOutput.request_ids must list the sampled chunks in order")
            new_ids = sampled_tokens[sample_index]
            kept = state.append_tokens(new_ids)
            if kept != len(new_ids):
                new_ids = new_ids[:kept]
            num_generated += kept
            if state.sent_first_delta and not state.wants_logprobs:
                deltas.append(TokenDelta(request_id, new_ids, state.finish_reason))
            else:
                logprobs = output.logprobs
                top = output.top_logprobs
                deltas.append(
                    state.delta(
                        new_ids,
                        logprobs[sample_index][:kept] if logprobs is not None else None,
                        top[sample_index][:kept] if top is not None else None,
                    )
                )
            if state.finish_reason is not None:
                if not running:
                    self._unqueue(state)
                self._release(state)
                any_finished = True
        self.generation_tokens_total += num_generated
        if any_finished:
            self._running = [state for state in self._running if state.status == running_status]
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_deltas)

    def stats(self) -> EngineStats:
        kv = self.kv_cache
        return EngineStats(
            num_waiting=self._num_queued(),
            num_running=len(self._running),
            num_blocks_total=kv.num_blocks,
            num_blocks_free=kv.num_free_blocks,
            prefix_cache_queries=getattr(kv, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(kv, "prefix_cache_hits", 0),
            num_preemptions=self.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps=self.num_steps,
        )

    # ----------------------------------------------------------------- step building

    def _schedule_running(
        self, chunks: list[ScheduledChunk], new: list[NewRequestData], budget: int
    ) -> int:
        """One chunk per running request, in order, until the budget is spent; takes
        blocks back from the tail of ``_running`` when the pool runs dry."""
        running = self._running
        kv = self.kv_cache
        tokens_per_block = self._block_size
        lookahead = self._lookahead
        add_chunk = chunks.append
        index = 0
        while index < len(running) and budget > 0:
            state = running[index]
            request_id = state.request_id
            tokens = state.all_token_ids
            num_known = len(tokens)
            num_tokens = num_known + state.num_pending
            if state.num_pending and num_tokens >= state.max_len:  # ends with "length"
                index += 1
                continue
            start = state.num_computed
            end = num_tokens if num_tokens - start <= budget else start + budget
            if end <= start:  # the executor returned no token for it last step
                index += 1
                continue
            reserve = end + lookahead if end == num_tokens else end
            table = state.block_table
            if reserve > len(table) * tokens_per_block:  # needs another block
                if not kv.append(request_id, reserve):
                    victim = None
                    while victim is not state:
                        victim = running.pop()
                        self._preempt(victim)
                        if victim is not state and kv.append(request_id, reserve):
                            break
                    if victim is state:
                        break
                table = state.block_table = kv.block_ids(request_id)
            if not state.sent_to_executor:
                self._send_new(state, new)
            if end <= num_known:
                chunk_ids = tokens[start:end]
            else:
                chunk_ids = tokens[start:] + [PLACEHOLDER_TOKEN] * (end - max(start, num_known))
            state.num_computed = end
            if end == num_tokens:
                state.num_pending += 1
            add_chunk(ScheduledChunk(request_id, chunk_ids, start, table, end == num_tokens))
            budget -= end - start
            index += 1
        return budget

    def _start(
        self,
        state: RequestState,
        budget: int,
        chunks: list[ScheduledChunk],
        new: list[NewRequestData],
        reserve_all: bool = False,
    ) -> int:
        """Give a queued request its blocks (reusing the prefix cache) and its first
        chunk of at most ``budget`` tokens (possibly none when the budget is 0). With
        ``reserve_all`` the blocks cover all its tokens, not just the chunk. Returns
        the tokens scheduled, or -1 (changing nothing) when the pool cannot hold it or
        the request still waits for a pending token."""
        if state.num_pending:
            return -1
        tokens = state.all_token_ids
        num_tokens = len(tokens)
        cached = self.kv_cache.num_cached_prefix_tokens(tokens) if self._prefix_caching else 0
        num_new = min(num_tokens - cached, budget)
        end = cached + num_new
        if reserve_all or end == num_tokens:
            reserve = num_tokens + self._lookahead
        else:
            reserve = end
        if self.kv_cache.allocate(state.request_id, tokens, reserve) is None:
            return -1
        state.block_table = self.kv_cache.block_ids(state.request_id)
        state.num_computed = cached
        if not state.sent_first_delta:
            state.num_cached_tokens = cached
        state.status = Status.RUNNING
        insort(self._running, state, key=_by_sort_key)
        key = state.first_block_key
        if key is not None and cached == 0:
            state.holds_first_block = True
            in_flight = self._first_blocks_in_flight
            in_flight[key] = in_flight.get(key, 0) + 1
        if num_new > 0:
            self._emit_chunk(state, num_new, chunks, new)
        return num_new

    def _emit_chunk(
        self,
        state: RequestState,
        num_new: int,
        chunks: list[ScheduledChunk],
        new: list[NewRequestData],
    ) -> None:
        request_id = state.request_id
        if not state.sent_to_executor:
            self._send_new(state, new)
        start = state.num_computed
        end = start + num_new
        tokens = state.all_token_ids
        sample = end == len(tokens)
        chunks.append(
            ScheduledChunk(request_id, tokens[start:end], start, state.block_table, sample)
        )
        state.num_computed = end
        if sample:
            state.num_pending += 1

    def _send_new(self, state: RequestState, new: list[NewRequestData]) -> None:
        """NewRequestData goes out once, in the first step that schedules the request."""
        state.sent_to_executor = True
        prompt = state.all_token_ids[: state.num_prompt_tokens]
        new.append(NewRequestData(state.request_id, prompt, state.params, state.eos_token_ids))

    # ----------------------------------------------------------------- state changes

    def _preempt(self, state: RequestState) -> None:
        """Take every block back; the request recomputes its tokens when it resumes."""
        self.kv_cache.free(state.request_id)
        state.block_table = []
        state.num_computed = 0
        state.status = Status.PREEMPTED
        self._release_first_block(state)
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
        return state.delta([], None, None)

    def _release(self, state: RequestState) -> None:
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


def _decodes_first(chunks: list[ScheduledChunk]) -> None:
    """Stable partition: one-token chunks lead (attention backends run the leading
    decodes on their decode kernel). No-op in the common all-decode or
    decodes-already-first case."""
    seen_long = False
    for chunk in chunks:
        if len(chunk.token_ids) != 1:
            seen_long = True
        elif seen_long:
            chunks.sort(key=lambda c: len(c.token_ids) != 1)
            return
