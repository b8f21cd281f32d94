"""Engine-core -> frontend messages (socket ``engine-output``).

One ``EngineOutputs`` batch per engine step carries a ``TokenDelta`` for every
request that produced tokens or finished in that step; a step whose batch would
exceed the channel's message limit is sent as several batches. Request ids are
bounded at intake (``tokenloom.engine.loop.request_id_limit``), since each delta
echoes its id.
"""

from __future__ import annotations

import msgspec


class FinishReason:
    """The values of ``TokenDelta.finish_reason``."""

    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # aborted by the client or the frontend
    TIMEOUT = "timeout"  # past its deadline
    ERROR = "error"  # the engine failed it; see ErrorReply


class TopLogprobs(msgspec.Struct, array_like=True, gc=False):
    token_ids: list[int]
    logprobs: list[float]


class RequestMetrics(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's timings and counters, on its last delta.

    Times are seconds on the engine clock (``time.monotonic`` of the engine-core
    process unless the engine was given another clock); only differences between
    them mean anything outside that process. A time is 0.0 when the event never
    happened (a request aborted while waiting was never scheduled).
    """

    arrival_time: float = 0.0  # the request's arrival_time, or when the engine received it
    first_scheduled_time: float = 0.0  # the step that first gave it a chunk was built
    first_token_time: float = 0.0  # the step that sampled its first token was folded in
    finished_time: float = 0.0  # it stopped, hit its length, was aborted or timed out
    num_preemptions: int = 0  # times its blocks were taken back (recomputed later)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def queue_time(self) -> float:
        """Seconds from arrival to first scheduled (0.0 when never scheduled)."""
        if not self.first_scheduled_time:
            return 0.0
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def time_to_first_token(self) -> float:
        """Seconds from arrival to the first token (0.0 when none came)."""
        if not self.first_token_time:
            return 0.0
        return max(0.0, self.first_token_time - self.arrival_time)

    @property
    def e2e_time(self) -> float:
        """Seconds from arrival to finish."""
        return max(0.0, self.finished_time - self.arrival_time)


class TokenDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] | None = None  # one per new token: logprob of the sampled token
    top_logprobs: list[TopLogprobs] | None = None  # one per new token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[float] | None = None  # first delta, when asked: prompt[1:]'s logprobs
    metrics: RequestMetrics | None = None  # the last delta (finish_reason set) only


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True, gc=False):
    outputs: list[TokenDelta]
    timestamp: float = 0.0  # time.monotonic() of the engine-core when the batch was sent


class ErrorReply(msgspec.Struct, tag="error", array_like=True, omit_defaults=True, gc=False):
    code: int  # HTTP-like: 400 bad message, 413 too large, 503 overloaded, 500 internal
    message: str
    request_id: str | None = None


class EngineStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_waiting: int = 0
    num_running: int = 0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found cached
    num_preemptions: int = 0
    prompt_tokens_total: int = 0  # prompt tokens computed
    generation_tokens_total: int = 0
    num_steps: int = 0
    # Speculative decoding: drafts verified, of which accepted, and the chunks that
    # verified them (each emits accepted + 1 tokens).
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_verify_steps_total: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts per verified draft (0 without speculation)."""
        return self.spec_accepted_tokens_total / max(self.spec_draft_tokens_total, 1)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens per verify step: accepted drafts + 1 (0 without speculation)."""
        steps = self.spec_verify_steps_total
        return (self.spec_accepted_tokens_total + steps) / steps if steps else 0.0

    @property
    def kv_usage(self) -> float:
        if not self.num_blocks_total:
            return 0.0
        return 1.0 - self.num_blocks_free / self.num_blocks_total


class HealthReply(msgspec.Struct, tag="health", array_like=True, omit_defaults=True, gc=False):
    nonce: int
    ok: bool = True


class StatsReply(msgspec.Struct, tag="stats", array_like=True, omit_defaults=True, gc=False):
    nonce: int
    stats: EngineStats


EngineOutput = EngineOutputs | ErrorReply | HealthReply | StatsReply
