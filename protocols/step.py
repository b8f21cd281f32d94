"""Scheduler <-> executor messages: one engine step.

The scheduler produces a ``StepInput``; the executor runs it and returns a
``StepOutput``; the scheduler folds that back into its requests. The same structs
are used in-process (direct calls) and across processes (tensor-parallel workers,
recorded traces), so a scheduler can be driven by a trace on the CPU.
"""

from __future__ import annotations

import msgspec

from tokenloom.protocols.outputs import TopLogprobs
from tokenloom.protocols.sampling import SamplingParams

PLACEHOLDER_TOKEN = -1
"""A token id not known yet when the step was built. With pipelined (async)
scheduling the scheduler builds step N+1 before step N's sampled tokens reach it, so
a decode chunk's input can be this placeholder; the executor replaces it with the
token it sampled for that request in the most recent step that sampled it. Only a
chunk's trailing tokens can be placeholders, and only for requests whose previous
step sampled."""


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sent once, in the first step that schedules a request (the executor keeps
    per-request sampling state: params, generator, generated tokens for penalties)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = []  # masked until min_tokens; empty with ignore_eos


class ScheduledChunk(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The tokens one request computes in this step.

    ``token_ids`` sit at positions ``start_pos .. start_pos + len(token_ids) - 1``
    (drafts included);
    positions ``< start_pos`` are already in the KV cache (or written by an earlier
    step still in flight). Trailing ids may be ``PLACEHOLDER_TOKEN``. ``block_ids`` is the
    request's whole block table and covers every position up to the chunk's end.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool = True  # the chunk ends at the last known token: sample the next one
    # Speculative decoding: the last ``num_draft_tokens`` ids are a proposer's drafts
    # that follow the request's last known token. The executor verifies them in this
    # forward (see ``StepOutput.token_ids``); their KV slots are reserved like any
    # other, and those of rejected drafts are rewritten by later steps.
    num_draft_tokens: int = 0


class StepInput(msgspec.Struct, tag="step", array_like=True, omit_defaults=True, gc=False):
    """One step's work. One-token (decode) chunks come first, in a stable order; the
    executor may rely on it (attention runs leading decodes on its decode kernel).
    ``block_ids`` lists may alias the KV manager's live tables: a consumer that keeps
    a StepInput past the step (a trace recorder) must copy it (``msgspec`` encode)."""

    step_id: int
    chunks: list[ScheduledChunk]
    new_requests: list[NewRequestData] = []
    finished_request_ids: list[str] = []  # the executor drops their state before this step
    num_tokens: int = 0  # sum of len(chunk.token_ids)


class StepOutput(msgspec.Struct, tag="step_output", array_like=True, omit_defaults=True, gc=False):
    """``request_ids`` lists the chunks with ``sample=True``, in chunk order.

    Speculative decoding: for a chunk with ``num_draft_tokens = k`` the request's
    ``token_ids`` are the ``a`` accepted drafts (a prefix of the chunk's drafts)
    followed by one token the target sampled (the correction, or the bonus token
    when ``a == k``): ``1 .. k + 1`` ids. Positions past ``start_pos + a`` hold
    rejected KV. ``draft_token_ids`` carries the proposer's drafts for each sampled
    request's next step (empty lists when it proposed none).
    """

    step_id: int
    request_ids: list[str]
    token_ids: list[list[int]]  # sampled ids per request (more than one with speculation)
    logprobs: list[list[float]] | None = None  # per sampled token, when any request asked
    top_logprobs: list[list[TopLogprobs]] | None = None
    # Per sampled request: its prompt tokens' logprobs (len(prompt) - 1 values, see
    # SamplingParams.prompt_logprobs), once, in the step that samples its first token.
    prompt_logprobs: list[list[float] | None] | None = None
    # Per sampled request: the drafts to verify in its next step; None: no proposer ran.
    draft_token_ids: list[list[int]] | None = None


StepMessage = StepInput | StepOutput
