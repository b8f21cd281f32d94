"""External programs <-> the ``zmq`` frontend: the public job protocol.

A client connects a DEALER socket to the frontend's ROUTER (``config.zmq_endpoint``)
and sends one msgpack frame per message. Every message is a msgpack array whose
first element is its tag; the remaining elements are the fields below, in order,
with trailing defaults omitted. ``protocols/README.md`` ("Job protocol") documents
the frames and layouts for clients in other languages.

Field order is the wire format: append fields only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from tokenloom.protocols.sampling import SamplingParams

# OpenAI's limits on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512.
Tenant = Annotated[str, msgspec.Meta(max_length=256)]
Metadata = Annotated[
    dict[
        Annotated[str, msgspec.Meta(max_length=64)],
        Annotated[str, msgspec.Meta(max_length=512)],
    ],
    msgspec.Meta(max_length=16),
]

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
    tenant: Tenant = ""  # who submits (scheduling policies may group by it)
    metadata: Metadata = {}  # free-form, passed to the scheduler with the request
    include_metrics: bool = False  # JobDone carries the job's JobMetrics


class AbortJob(msgspec.Struct, tag="abort", array_like=True, omit_defaults=True, gc=False):
    """Stop a job; the server answers with its ``JobDone`` (finish reason "abort")."""

    job_id: str


class PingJob(msgspec.Struct, tag="ping", array_like=True, omit_defaults=True, gc=False):
    """Liveness probe and heartbeat; answered with ``JobPong``. Needs no API key."""

    nonce: int = 0


class HelloJob(msgspec.Struct, tag="hello", array_like=True, omit_defaults=True, gc=False):
    """Open a session on this connection: the first message a client sends. Required
    (with the server's API key) when the server has one; answered with ``JobWelcome``,
    or ``JobError`` code 401 for a wrong key."""

    api_key: str | None = None


JobRequest = SubmitJob | AbortJob | PingJob | HelloJob

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


class JobMetrics(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A job's timings (seconds) and counters, measured by the engine; over its ``n``
    choices: earliest schedule and first token, latest finish, preemptions summed."""

    arrival_time: float = 0.0  # Unix time the server received the job
    queue_time: float = 0.0  # arrival to first scheduled
    time_to_first_token: float = 0.0  # arrival to the first token (0: none came)
    e2e_time: float = 0.0  # arrival to the last choice's finish
    num_preemptions: int = 0  # times its KV blocks were taken back (recomputed)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class JobDone(msgspec.Struct, tag="done", array_like=True, omit_defaults=True, gc=False):
    """The job's last message: every choice finished. Token counts are totals;
    ``metrics`` only when the submit asked for them (``include_metrics``) and the
    engine reported them."""

    job_id: str
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    metrics: JobMetrics | None = None


class JobError(msgspec.Struct, tag="error", array_like=True, omit_defaults=True, gc=False):
    """A message or job failed. ``job_id`` is None when the message could not be
    decoded. A job that gets an error is over (no ``JobDone`` follows).
    ``code`` is HTTP-like; see ``ERROR_CODES``."""

    job_id: str | None
    code: int
    message: str


class JobPong(msgspec.Struct, tag="pong", array_like=True, omit_defaults=True, gc=False):
    nonce: int = 0
    engine_alive: bool = True


class JobWelcome(msgspec.Struct, tag="welcome", array_like=True, omit_defaults=True, gc=False):
    """Answer to ``HelloJob``: the session is open. A client with live jobs must send
    some message (a ``ping`` will do) at least every ``heartbeat_timeout_s`` seconds,
    or its jobs are ended with code 408; frames over ``max_message_bytes`` get 413."""

    heartbeat_timeout_s: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024


JobReply = JobOutput | JobDone | JobError | JobPong | JobWelcome

ERROR_CODES: dict[int, str] = {
    400: "invalid message or job (the message names the field)",
    401: "no session: send hello with the server's API key first (or the key is wrong)",
    404: "abort of a job id that is not live on this connection",
    408: "the client sent nothing for heartbeat_timeout_s while it had live jobs",
    409: "job id already live on this connection",
    413: "frame larger than the server's limit",
    500: "internal error",
    503: "engine overloaded or not running",
}
"""``JobError.code`` values. A ``JobError`` with a job id ends that job, except 404
and 409, which answer a message about a job (abort, duplicate submit) and leave any
live job of that id running."""

MAX_JOB_MESSAGE_BYTES = 16 * 1024 * 1024
"""The default frame limit (``max_request_body_mb``); the server announces its own in
``JobWelcome``. Larger client frames are refused with a JobError (code 413)."""
