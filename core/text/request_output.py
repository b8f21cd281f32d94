"""The user-facing results of generation: ``RequestOutput`` holding ``CompletionOutput``s.

Produced by ``tokenloom.text.output_processor.OutputProcessor`` for the offline ``LLM``
and the HTTP frontend alike. Each carries both the whole result so far (``text``,
``token_ids``) and what changed since the previous output of the same request
(``text_delta``, ``token_ids_delta``, ``logprobs_delta``), which is what a
streaming response sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.protocols.outputs import RequestMetrics

# Per generated token: the sampled token's logprob and the top alternatives'.
TokenLogprobs = dict[int, float]


@dataclass(slots=True)
class CompletionOutput:
    """One completion (one of the ``n`` choices) of a request.

    ``token_ids`` and ``logprobs`` are the processor's live lists: they keep growing
    with later outputs of an unfinished request, so copy them to keep a snapshot.
    ``text`` stops short of the last few characters while streaming with stop strings
    (they could be the start of one); a finished output has all of it.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # see protocols.outputs.FinishReason
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None  # one per token, when requested
    cumulative_logprob: float | None = None  # sum of the sampled logprobs, when requested
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprobs] | None = None
    # The engine's timings and counters of this completion, once it finished (None
    # before, and for one cut short by a stop string: the frontend stopped it).
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a processed batch: all its ``n`` completions, in index
    order. ``finished`` once every completion has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: the logprob of each prompt token after the
    # first, given the tokens before it (len(prompt_token_ids) - 1 values).
    prompt_logprobs: list[float] | None = None
    # Once finished: the request's timings and counters (like vLLM's RequestMetrics),
    # merged over its completions (earliest arrival, schedule and first token, latest
    # finish, preemptions summed). Times are on the engine clock (time.monotonic).
    metrics: RequestMetrics | None = None


def merge_metrics(parts: list[RequestMetrics]) -> RequestMetrics | None:
    """One request's metrics from its completions' (None when none reported any)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]

    def earliest(values: list[float]) -> float:
        return min((v for v in values if v), default=0.0)

    return RequestMetrics(
        arrival_time=earliest([m.arrival_time for m in parts]),
        first_scheduled_time=earliest([m.first_scheduled_time for m in parts]),
        first_token_time=earliest([m.first_token_time for m in parts]),
        finished_time=max(m.finished_time for m in parts),
        num_preemptions=sum(m.num_preemptions for m in parts),
        num_cached_tokens=max(m.num_cached_tokens for m in parts),
    )
