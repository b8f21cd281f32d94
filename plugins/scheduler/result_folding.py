"""Folding a step's output back in: new tokens, stops, prefix-cache commits, deltas.

``update`` walks the step's chunks in order next to the states they were built for
(a request id may be reused while an old step of it is in flight), appends each
sampled token, applies the stopping rules (``RequestState.append_tokens``), commits
newly filled blocks to the prefix cache, and releases the requests that finished.

A mixin of ``BatchScheduler``, which owns the state named below and the state
changes (``_release``, ``_release_first_block``, ``_unqueue``) this module calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenloom.plugins.scheduler.request_state import RequestState, Status
from tokenloom.protocols.outputs import TokenDelta
from tokenloom.protocols.step import StepInput, StepOutput

if TYPE_CHECKING:
    from tokenloom.protocols.components.kv_cache import KVCacheManager


class ResultFolding:
    """``update`` (see the module docstring)."""

    # Owned by BatchScheduler; declared here for the type checker.
    kv_cache: KVCacheManager
    prompt_tokens_total: int
    generation_tokens_total: int
    _block_size: int
    _prefix_caching: bool
    _requests: dict[str, RequestState]
    _running: list[RequestState]
    _step_states: dict[int, list[RequestState]]
    _pending_deltas: list[TokenDelta]
    _release: Callable[[RequestState], None]
    _release_first_block: Callable[[RequestState], None]
    _unqueue: Callable[[RequestState], None]

    def update(self, step: StepInput, output: StepOutput) -> list[TokenDelta]:
        deltas = self._pending_deltas
        self._pending_deltas = []
        # Runs once per chunk per step: loop invariants are read once (the locals below
        # measurably pay in ``tokenloom bench scheduler``).
        commit = self.kv_cache.commit if self._prefix_caching else None
        block_size = self._block_size
        running_status, finished = Status.RUNNING, Status.FINISHED
        sampled_ids = output.request_ids
        sampled_tokens = output.token_ids
        num_sampled = len(sampled_ids)
        sample_index = -1
        num_generated = 0
        any_finished = False
        states = self._step_states.pop(step.step_id, None)
        for index, chunk in enumerate(step.chunks):
            if chunk.sample:
                sample_index += 1
            request_id = chunk.request_id
            state = states[index] if states is not None else self._requests.get(request_id)
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
                deltas.append(_first_or_logprob_delta(state, output, sample_index, new_ids))
            if state.finish_reason is not None:
                if not running:
                    self._unqueue(state)
                self._release(state)
                any_finished = True
        self.generation_tokens_total += num_generated
        if any_finished:
            self._running = [state for state in self._running if state.status == Status.RUNNING]
        return deltas


def _first_or_logprob_delta(
    state: RequestState, output: StepOutput, sample_index: int, new_ids: list[int]
) -> TokenDelta:
    """The delta of a request's first tokens or of one that asked for logprobs: the
    rare path, apart from the plain one ``update`` builds inline."""
    kept = len(new_ids)
    logprobs = output.logprobs
    top = output.top_logprobs
    delta = state.delta(
        new_ids,
        logprobs[sample_index][:kept] if logprobs is not None else None,
        top[sample_index][:kept] if top is not None else None,
    )
    if output.prompt_logprobs is not None:
        delta.prompt_logprobs = output.prompt_logprobs[sample_index]
    return delta
