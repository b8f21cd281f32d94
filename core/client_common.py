"""What the job clients (``client.JobClient``, ``async_client.AsyncJobClient``) share:
the result and error types, building and size-checking a ``SubmitJob``, folding a
job's outputs into its result, job ids, and which inbox a reply belongs to."""

from __future__ import annotations

import itertools
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, TypedDict

import msgspec

from tokenloom.protocols.jobs import (
    MAX_JOB_MESSAGE_BYTES,
    JobDone,
    JobMetrics,
    JobOutput,
    JobPong,
    JobWelcome,
    SubmitJob,
)
from tokenloom.protocols.sampling import SamplingParams

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
Prompt = str | list[int]


class JobFailed(RuntimeError):
    """The server answered a job (or a message) with a ``JobError``."""

    def __init__(self, job_id: str | None, code: int, message: str) -> None:
        super().__init__(f"job {job_id}: {code}: {message}")
        self.job_id = job_id
        self.code = code
        self.message = message


@dataclass
class JobResult:
    """A finished job: per choice, its text, token ids and finish reason; the job's
    metrics when the submit asked for them (``include_metrics``) and the engine sent
    them."""

    job_id: str
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    outputs: list[JobOutput] = field(default_factory=list)
    metrics: JobMetrics | None = None

    @property
    def text(self) -> str:
        return self.texts[0]


def submit_message(
    job_id: str,
    prompt: Prompt,
    params: SamplingParams | None,
    priority: int = 0,
    *,
    tenant: str = "",
    metadata: dict[str, str] | None = None,
    include_metrics: bool = False,
) -> SubmitJob:
    """The ``SubmitJob`` of one prompt (text, or token ids)."""
    text = prompt if isinstance(prompt, str) else None
    return SubmitJob(
        job_id,
        prompt=text,
        prompt_token_ids=None if text is not None else list(prompt),
        params=params or SamplingParams(),
        priority=priority,
        tenant=tenant,
        metadata=dict(metadata or {}),
        include_metrics=include_metrics,
    )


class JobOptions(TypedDict, total=False):
    """``submit`` / ``generate`` keywords, the ``SubmitJob`` fields past the prompt."""

    priority: int  # lower runs first
    tenant: str  # who submits (scheduling policies may group by it)
    metadata: dict[str, str]  # free-form, passed to the scheduler with the request
    include_metrics: bool  # the JobDone (JobResult.metrics) carries the job's JobMetrics


class _Collector:
    """Folds a job's outputs into a JobResult."""

    def __init__(self, job_id: str) -> None:
        self.result = JobResult(job_id, [], [], [])

    def add(self, output: JobOutput) -> None:
        result = self.result
        while len(result.texts) <= output.index:
            result.texts.append("")
            result.token_ids.append([])
            result.finish_reasons.append(None)
        result.texts[output.index] += output.text
        result.token_ids[output.index].extend(output.token_ids)
        if output.finish_reason is not None:
            result.finish_reasons[output.index] = output.finish_reason
        result.outputs.append(output)

    def done(self, done: JobDone) -> JobResult:
        self.result.num_prompt_tokens = done.num_prompt_tokens
        self.result.num_generated_tokens = done.num_generated_tokens
        self.result.metrics = done.metrics
        return self.result


class _JobIds:
    def __init__(self) -> None:
        self._ids = itertools.count()
        # random, not id(self): a client built where a closed one lived reused its
        # address, so its job ids (and the engine's request ids) repeated the old ones
        self._prefix = f"{os.getpid():x}-{secrets.token_hex(6)}"

    def next(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"


def _reply_key(msg: Any) -> str | None:
    """The inbox a reply belongs to: its job's, or None for pongs, welcomes and errors
    that name no job (sizes are checked before sending, so such an error answers a
    hello or a ping, or a peer's bug)."""
    return None if isinstance(msg, JobPong | JobWelcome) else msg.job_id


def _heartbeat_interval(heartbeat_s: float | None, welcome: JobWelcome | None) -> float:
    if heartbeat_s is not None:
        return heartbeat_s
    return (welcome.heartbeat_timeout_s if welcome else 30.0) / 3


def _encode_submit(encoder: msgspec.msgpack.Encoder, msg: SubmitJob) -> bytes:
    """Encode a SubmitJob, refusing one the frontend would refuse for its size."""
    body = encoder.encode(msg)
    if len(body) > MAX_JOB_MESSAGE_BYTES:
        raise JobFailed(msg.job_id, 413, f"job message over {MAX_JOB_MESSAGE_BYTES} bytes")
    return body
