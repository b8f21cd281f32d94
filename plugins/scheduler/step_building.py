"""Building one step: which requests run, with which chunk, on which blocks.

``schedule`` walks the running requests first (one chunk each, preempting from the
tail of ``_running`` when the pool runs dry), then lets the policy's ``_admit`` start
queued ones through ``_start``. Every chunk comes from ``_schedule_chunks``, so a
running request and a newly started one are scheduled by the same rule.

A mixin of ``BatchScheduler``, which owns the state named below and the state
changes (``_preempt``, ``_expire_deadlines``) this module calls.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING

from tokenloom.plugins.scheduler.request_state import RequestState, Status
from tokenloom.protocols.step import (
    PLACEHOLDER_TOKEN,
    NewRequestData,
    ScheduledChunk,
    StepInput,
)

if TYPE_CHECKING:
    from tokenloom.protocols.components.kv_cache import KVCacheManager

_by_sort_key = attrgetter("sort_key")


class StepBuilding:
    """``schedule`` and the chunk-building it needs (see the module docstring)."""

    # Owned by BatchScheduler; declared here for the type checker.
    kv_cache: KVCacheManager
    num_steps: int
    _clock: Callable[[], float]
    _block_size: int
    _max_batched_tokens: int
    _prefix_caching: bool
    _lookahead: int
    _requests: dict[str, RequestState]
    _running: list[RequestState]
    _deadlines: list[tuple[float, int, RequestState]]
    _first_blocks_in_flight: dict[tuple[int, ...], int]
    _finished_ids: list[str]
    _step_states: dict[int, list[RequestState]]
    _step_id: int
    _preempted_this_step: bool
    _admit: Callable[[list[ScheduledChunk], list[NewRequestData], int], int]
    _preempt: Callable[[RequestState], None]
    _take_victim: Callable[[list[RequestState], int], RequestState]
    _expire_deadlines: Callable[[], None]

    def schedule(self) -> StepInput:
        if self._deadlines and self._deadlines[0][0] <= self._clock():
            self._expire_deadlines()
        self._step_id += 1
        self._preempted_this_step = False
        chunks: list[ScheduledChunk] = []
        new: list[NewRequestData] = []
        budget = self._schedule_chunks(self._running, chunks, new, self._max_batched_tokens)
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

    def _schedule_chunks(
        self,
        states: list[RequestState],
        chunks: list[ScheduledChunk],
        new: list[NewRequestData],
        budget: int,
    ) -> int:
        """The next chunk of each of ``states`` in order, until ``budget`` tokens are
        spent; returns the budget left. The one rule that turns a request holding
        blocks into a chunk: positions from ``num_computed`` up to its last token
        (pending tokens enter as ``PLACEHOLDER_TOKEN``) or the budget's end, sampling
        when it reaches the last token; such a chunk also carries the request's
        drafts (speculative decoding) as far as the budget, the lookahead and
        ``max_len`` allow. A request that needs another block gets one
        from the KV manager or, when the pool runs dry, by preempting from the tail of
        ``states`` (``_running``, lowest priority last)."""
        # Runs once per running request per step: loop invariants are read once (the
        # locals below measurably pay in ``tokenloom bench scheduler``).
        kv = self.kv_cache
        block_size = self._block_size
        lookahead = self._lookahead
        add_chunk = chunks.append
        index = 0
        while index < len(states) and budget > 0:
            state = states[index]
            index += 1
            tokens = state.all_token_ids
            num_known = len(tokens)
            num_tokens = num_known + state.num_pending
            if state.num_pending and num_tokens >= state.max_len:  # ends with "length"
                continue
            start = state.num_computed
            end = num_tokens if num_tokens - start <= budget else start + budget
            if end <= start:  # the executor returned no token for it last step
                continue
            request_id = state.request_id
            drafts = state.draft_token_ids
            num_drafts = 0
            if drafts:  # consumed now: they follow only the current last token
                state.draft_token_ids = []
                if end == num_tokens and not state.num_pending:
                    num_drafts = min(
                        len(drafts), lookahead, budget - (end - start), state.max_len - end - 1
                    )
            # With speculation the lookahead covers the drafts' KV slots too.
            reserve = end + lookahead if end == num_tokens else end
            table = state.block_table
            if reserve > len(table) * block_size:  # needs another block
                if not kv.append(request_id, reserve):
                    victim = None
                    while victim is not state:
                        victim = self._take_victim(states, index - 1)
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
            if end == num_tokens:
                state.num_pending += 1
            if num_drafts > 0:
                chunk_ids += drafts[:num_drafts]
                add_chunk(ScheduledChunk(request_id, chunk_ids, start, table, True, num_drafts))
                end += num_drafts  # ``update`` takes the rejected ones back
            else:
                add_chunk(ScheduledChunk(request_id, chunk_ids, start, table, end == num_tokens))
            state.num_computed = end
            budget -= end - start
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
        # Prompt logprobs need every prompt position computed: no prefix cache for those.
        use_cache = self._prefix_caching and not state.params.prompt_logprobs
        cached = self.kv_cache.num_cached_prefix_tokens(tokens) if use_cache else 0
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
        self._schedule_chunks([state], chunks, new, num_new)  # blocks reserved above
        return num_new

    def _send_new(self, state: RequestState, new: list[NewRequestData]) -> None:
        """NewRequestData goes out once, in the first step that schedules the request."""
        state.sent_to_executor = True
        prompt = state.all_token_ids[: state.num_prompt_tokens]
        new.append(NewRequestData(state.request_id, prompt, state.params, state.eos_token_ids))


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
