"""External programs <-> the ``zmq`` frontend: the public job protocol.

A client connects a DEALER socket to the frontend's ROUTER (``config.zmq_endpoint``)
and sends one msgpack frame per message. Every message is a msgpack array whose
first element is its tag; the remaining elements are the fields below, in order,
with trailing defaults omitted. ``protocols/README.md`` ("Job protocol") documents
the frames and layouts for clients in other languages.

Field order is the wire format: append fields only.
"""

from __future__ import annotations

import msgspec

from tokenloom.protocols.sampling import SamplingParams

# ----------------------------------------------------------------- client -> frontend


class SubmitJob(msgspec.Struct, tag="submit", array_like=True, omit_defaults=True, gc=False):
    """Start a job. Exactly one of ``prompt`` (text, tokenized by the server) and
    ``prompt_token_ids`` is set. ``job_id`` is chosen by the client and must be
    unique among that client's live jobs; every reply carries it."""

    job_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first


class AbortJob(msgspec.Struct, tag="abort", array_like=True, omit_defaults=True, gc=False):
    """Stop a job; the server answers with its ``JobDone`` (finish reason "abort")."""

    job_id: str


class PingJob(msgspec.Struct, tag="ping", array_like=True, omit_defaults=True, gc=False):
    """Liveness probe; answered with ``JobPong``."""

    nonce: int = 0


JobRequest = SubmitJob | AbortJob | PingJob

# ----------------------------------------------------------------- frontend -> client


class JobOutput(msgspec.Struct, tag="output", array_like=True, omit_defaults=True, gc=False):
    """New output of one choice (``index`` < params.n). ``text`` is the newly
    decoded text, ``token_ids`` the newly sampled ids; ``finish_reason`` is set on
    the choice's last output ("stop", "length", "abort", "timeout", "error")."""

    job_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] | None = None  # one per token in token_ids, when params.logprobs


class JobDone(msgspec.Struct, tag="done", array_like=True, omit_defaults=True, gc=False):
    """The job's last message: every choice finished. Token counts are totals."""

    job_id: str
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0


class JobError(msgspec.Struct, tag="error", array_like=True, omit_defaults=True, gc=False):
    """A message or job failed. ``job_id`` is None when the message could not be
    decoded. A job that gets an error is over (no ``JobDone`` follows).
    ``code`` is HTTP-like: 400 bad message, 409 duplicate job id, 503 overloaded or
    engine down, 500 internal."""

    job_id: str | None
    code: int
    message: str


class JobPong(msgspec.Struct, tag="pong", array_like=True, omit_defaults=True, gc=False):
    nonce: int = 0
    engine_alive: bool = True


JobReply = JobOutput | JobDone | JobError | JobPong

MAX_JOB_MESSAGE_BYTES = 16 * 1024 * 1024
"""Larger client frames are refused with a JobError (code 413)."""
