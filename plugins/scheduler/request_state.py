"""One request as a scheduler sees it, and the rules that stop it.

Shared by every scheduler (``continuous``, contrib ``static``) so that they stop
requests identically: same tokens in, same tokens and finish reasons out.
"""

from __future__ import annotations

from tokenloom.protocols.outputs import FinishReason, TokenDelta, TopLogprobs
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams


class Status:
    WAITING = 0  # queued, never ran
    RUNNING = 1  # holds blocks and is scheduled each step
    PREEMPTED = 2  # queued again after its blocks were taken back
    FINISHED = 3


class RequestState:
    """Mutable per-request state. ``all_token_ids`` is the prompt followed by the
    known output; ``num_pending`` more tokens were sampled by steps whose output has
    not come back yet (async scheduling; 0 otherwise). Positions ``< num_computed``
    are in the KV cache or being written by a step in flight: ``num_computed``
    advances when a chunk is scheduled, not when its step returns."""

    __slots__ = (
        "request_id",
        "params",
        "wants_logprobs",
        "priority",
        "sort_key",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed",
        "num_pending",
        "block_table",
        "num_cached_tokens",
        "max_len",
        "stop_ids",
        "min_tokens",
        "eos_token_ids",
        "deadline_at",
        "status",
        "finish_reason",
        "sent_to_executor",
        "sent_first_delta",
        "first_block_key",
        "holds_first_block",
        "queue_entry",
        "arrival_seq",
        "arrival_time",
        "tenant",
        "metadata",
        "first_scheduled_time",
        "first_token_time",
        "num_preemptions",
        "policy_data",
        "draft_token_ids",
    )

    def __init__(
        self,
        request: GenerateRequest,
        arrival_seq: int,
        max_len: int,
        deadline_at: float | None,
        arrival_time: float = 0.0,
    ) -> None:
        params = request.params
        self.request_id = request.request_id
        self.params: SamplingParams = params
        self.wants_logprobs = params.logprobs is not None
        self.priority = request.priority
        self.sort_key = (request.priority, arrival_seq)  # lower runs sooner
        self.all_token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed = 0
        self.num_pending = 0  # sampled in steps in flight, not yet in all_token_ids
        self.block_table: list[int] = []  # the KV manager's table while RUNNING
        self.num_cached_tokens = 0  # from the prefix cache at the first admission
        self.max_len = max_len  # stop with "length" once this many tokens exist
        self.eos_token_ids: list[int] = [] if params.ignore_eos else list(request.eos_token_ids)
        self.stop_ids = frozenset(self.eos_token_ids) | frozenset(params.stop_token_ids)
        self.min_tokens = params.min_tokens
        self.deadline_at = deadline_at
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.sent_to_executor = False  # NewRequestData goes out once, ever
        self.sent_first_delta = False
        self.first_block_key: tuple[int, ...] | None = None  # first full prompt block, if cached
        self.holds_first_block = False  # its first block is being prefilled right now
        self.queue_entry = 0  # id of its live waiting-queue entry; 0 = not queued
        # Speculative decoding: the proposer's drafts for the next chunk (from the last
        # StepOutput); consumed by the next schedule, used only if it reaches the end.
        self.draft_token_ids: list[int] = []
        # For scheduling policies and per-request metrics (times on the scheduler's clock).
        self.arrival_seq = arrival_seq  # 1, 2, ... in the order the scheduler received them
        self.arrival_time = arrival_time or request.arrival_time
        self.tenant = request.tenant
        self.metadata = request.metadata
        self.first_scheduled_time = 0.0  # 0.0 until a step first gives it a chunk
        self.first_token_time = 0.0  # 0.0 until its first sampled token is folded in
        self.num_preemptions = 0
        self.policy_data: object = None  # free for the scheduling policy's own use

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append_tokens(self, token_ids: list[int]) -> int:
        """Append sampled tokens up to the first that stops the request; returns how
        many were kept and sets ``finish_reason`` when one stops it.

        A stop id (EOS unless ignore_eos, or ``stop_token_ids``) stops only once the
        output holds at least ``min_tokens`` tokens; it stays in the output.
        """
        tokens = self.all_token_ids
        stop_ids = self.stop_ids
        if len(token_ids) == 1:  # the common case, without speculation
            token = token_ids[0]
            tokens.append(token)
            if token in stop_ids and len(tokens) - self.num_prompt_tokens >= self.min_tokens:
                self.finish_reason = FinishReason.STOP
            elif len(tokens) >= self.max_len:
                self.finish_reason = FinishReason.LENGTH
            return 1
        kept = 0
        for token in token_ids:
            tokens.append(token)
            kept += 1
            if token in stop_ids and len(tokens) - self.num_prompt_tokens >= self.min_tokens:
                self.finish_reason = FinishReason.STOP
                break
            if len(tokens) >= self.max_len:
                self.finish_reason = FinishReason.LENGTH
                break
        return kept

    def delta(
        self,
        new_ids: list[int],
        logprobs: list[float] | None,
        top_logprobs: list[TopLogprobs] | None,
    ) -> TokenDelta:
        """The delta to emit for ``new_ids``; the first one also carries the prompt
        and cached-prefix sizes. Logprobs go only to requests that asked for them."""
        if not self.wants_logprobs:
            logprobs = top_logprobs = None
        if self.sent_first_delta:
            return TokenDelta(self.request_id, new_ids, self.finish_reason, logprobs, top_logprobs)
        self.sent_first_delta = True
        return TokenDelta(
            self.request_id,
            new_ids,
            self.finish_reason,
            logprobs,
            top_logprobs,
            self.num_prompt_tokens,
            self.num_cached_tokens,
        )


def max_total_len(request: GenerateRequest, max_model_len: int, pool_tokens: int) -> int:
    """The total length (prompt + output) at which a request stops with "length":
    ``max_tokens``, the model length, or what the whole KV pool can hold."""
    limit = min(max_model_len, pool_tokens)
    max_tokens = request.params.max_tokens
    if max_tokens is not None:
        limit = min(limit, len(request.prompt_token_ids) + max_tokens)
    return limit
