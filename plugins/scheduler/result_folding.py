"""Folding a step's output back in: new tokens, stops, prefix-cache commits, deltas.

``update`` walks the step's chunks in order next to the states they were built for
(a request id may be reused while an old step of it is in flight), appends each
sampled token, applies the stopping rules (``RequestState.append_tokens``), commits
newly filled blocks to the prefix cache, and releases the requests that finished.
A chunk with drafts (speculative decoding) gets back the accepted drafts plus one
token: the rejected drafts' positions are taken back from ``num_computed``, and only
accepted tokens reach the prefix cache. The output's next drafts are kept on the
request for the next ``schedule``.

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
    # Speculative decoding, for /metrics: drafts verified, of which accepted, and the
    # verifying chunks (accepted + verify steps = tokens those chunks produced).
    spec_proposed_total: int = 0
    spec_accepted_total: int = 0
    spec_verify_steps: int = 0
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
        drafts = output.draft_token_ids
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
            num_drafts = chunk.num_draft_tokens
            end = start + len(chunk.token_ids) - num_drafts  # drafts are not known tokens
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
                if num_drafts and running:
                    state.num_computed -= num_drafts
                continue
            if sampled_ids[sample_index] != request_id:
                raise RuntimeError("StepOutput.request_ids must list the sampled chunks in order")
            new_ids = sampled_tokens[sample_index]
            if drafts is not None:
                state.draft_token_ids = drafts[sample_index]
            if num_drafts:
                self._fold_verified(state, running, end, num_drafts, len(new_ids) - 1)
            kept = state.append_tokens(new_ids)
            if num_drafts and running and commit is not None:
                accepted_end = min(end + len(new_ids) - 1, len(state.all_token_ids))
                if accepted_end // block_size != end // block_size:
                    commit(request_id, state.all_token_ids, accepted_end)
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

    def _fold_verified(
        self, state: RequestState, running: bool, end: int, num_drafts: int, num_accepted: int
    ) -> None:
        """A verified chunk: count its drafts, and give back the KV positions of the
        rejected ones (``end`` is the chunk's end before its drafts). Their slots
        stay in the block table and are rewritten by the next chunk."""
        if not 0 <= num_accepted <= num_drafts:
            raise RuntimeError(
                f"{state.request_id}: {num_accepted + 1} tokens for {num_drafts} drafts"
            )
        self.spec_proposed_total += num_drafts
        self.spec_accepted_total += num_accepted
        self.spec_verify_steps += 1
        if running:
            state.num_computed = end + num_accepted


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
