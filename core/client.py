"""Python clients of the ``zmq`` frontend's job protocol: ``JobClient`` (blocking)
and ``AsyncJobClient`` (asyncio).

Both connect a DEALER socket to the frontend's ROUTER and multiplex jobs on it:
``submit`` returns a job id, ``stream(job_id)`` yields that job's ``JobOutput``s
until its ``JobDone``, ``abort(job_id)`` stops it, ``generate`` does all three for
one prompt and gathers the result. A ``JobError`` reply raises ``JobFailed``.
Each opens its session with ``hello`` (carrying ``api_key``) before its first job,
and pings in the background while it has live jobs (the server's heartbeat).
``submit`` and ``generate`` also take the job's ``priority``, ``tenant`` and
``metadata`` (passed to the scheduler with the request) and ``include_metrics`` (the
``JobDone``, and so ``JobResult.metrics``, then carries the job's ``JobMetrics``):
``JobOptions``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Unpack

import msgspec
import zmq

from tokenloom.async_client import AsyncJobClient
from tokenloom.client_common import (
    DEFAULT_ENDPOINT,
    JobFailed,
    JobResult,
    Prompt,
    _Collector,
    _encode_submit,
    _heartbeat_interval,
    _JobIds,
    _reply_key,
    submit_message,
)
from tokenloom.protocols.jobs import (
    AbortJob,
    HelloJob,
    JobDone,
    JobError,
    JobOutput,
    JobPong,
    JobReply,
    JobWelcome,
    PingJob,
)
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.transport.sockets import make_socket

# Relative: mypy resolves tokenloom.* through the editable hook as Any, and Unpack
# needs the real TypedDict.
from .client_common import JobOptions

__all__ = [
    "DEFAULT_ENDPOINT",
    "AsyncJobClient",
    "JobClient",
    "JobFailed",
    "JobOptions",
    "JobResult",
    "Prompt",
    "submit_message",
]


class JobClient:
    """Blocking client; not thread-safe (one per thread). ``timeout_s`` bounds each
    wait for a reply (None: wait forever). ``api_key`` is sent in the ``hello`` that
    opens the session (before the first message); a wrong key raises ``JobFailed``
    (401). While it waits for replies of live jobs it pings every ``heartbeat_s``
    seconds (default: a third of the server's timeout), so a caller that holds live
    jobs without calling into the client for longer than the server's
    ``zmq_heartbeat_timeout_s`` loses them (code 408)."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float | None = 60.0,
        *,
        api_key: str | None = None,
        heartbeat_s: float | None = None,
    ) -> None:
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, "jobs", endpoint, bind=False)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(JobReply)
        self._timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        self._inbox: dict[str | None, deque[Any]] = {}
        self._ids = _JobIds()
        self._api_key = api_key
        self._heartbeat_s = heartbeat_s
        self._welcome: JobWelcome | None = None
        self._nonces = itertools.count(1)
        self._last_send = 0.0

    def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, **options: Unpack[JobOptions]
    ) -> str:
        """Start a job; its id. ``options``: see ``JobOptions``."""
        self._open()
        job_id = self._ids.next()
        body = _encode_submit(self._encoder, submit_message(job_id, prompt, params, **options))
        self._inbox[job_id] = deque()
        self._send_bytes(body)
        return job_id

    def stream(self, job_id: str) -> Iterator[JobOutput | JobDone]:
        """The job's outputs, then its JobDone. Raises JobFailed on an error reply.
        Leaving the iterator before JobDone aborts the job."""
        ended = False
        try:
            while True:
                msg = self._next(job_id)
                # Ended before yielding: a consumer that stops at JobDone closes the
                # generator at this yield, and a finished job must not be aborted.
                ended = isinstance(msg, JobError | JobDone)
                if isinstance(msg, JobError):
                    raise JobFailed(msg.job_id, msg.code, msg.message)
                yield msg
                if ended:
                    return
        finally:
            self._inbox.pop(job_id, None)
            if not ended:
                with contextlib.suppress(zmq.ZMQError):
                    self.abort(job_id)

    def abort(self, job_id: str) -> None:
        self._send(AbortJob(job_id))

    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, **options: Unpack[JobOptions]
    ) -> JobResult:
        """Submit, wait, gather (``options`` as for ``submit``)."""
        job_id = self.submit(prompt, params, **options)
        collector = _Collector(job_id)
        for msg in self.stream(job_id):
            if isinstance(msg, JobOutput):
                collector.add(msg)
            else:
                return collector.done(msg)
        raise JobFailed(job_id, 500, "stream ended without JobDone")

    def ping(self) -> bool:
        """True if the frontend answers and its engine is alive."""
        nonce = next(self._nonces)
        self._send(PingJob(nonce))
        while True:
            msg = self._next(None)
            if isinstance(msg, JobPong) and msg.nonce == nonce:
                return msg.engine_alive

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        """Open the session (``hello``) once, before the first job."""
        if self._welcome is not None:
            return
        self._send(HelloJob(self._api_key))
        while self._welcome is None:
            msg = self._next(None)
            if isinstance(msg, JobError):
                raise JobFailed(None, msg.code, msg.message)
            if isinstance(msg, JobWelcome):
                self._welcome = msg

    def _send(self, msg: Any) -> None:
        self._send_bytes(self._encoder.encode(msg))

    def _send_bytes(self, body: bytes) -> None:
        self._sock.send(body)
        self._last_send = time.monotonic()

    def _next(self, job_id: str | None) -> Any:
        inbox = self._inbox.setdefault(job_id, deque())
        deadline = None if self._timeout_ms is None else time.monotonic() + self._timeout_ms / 1e3
        while not inbox:
            interval = _heartbeat_interval(self._heartbeat_s, self._welcome)
            live = any(key is not None for key in self._inbox)
            if live and time.monotonic() - self._last_send >= interval:
                self._send(PingJob(0))  # heartbeat: live jobs, nothing sent lately
            wait = interval if deadline is None else min(interval, deadline - time.monotonic())
            if not self._sock.poll(max(0, int(wait * 1000))):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no reply for job {job_id} in time")
                continue
            msg = self._decoder.decode(self._sock.recv())
            key = _reply_key(msg)
            if key in self._inbox:  # replies of abandoned jobs are dropped
                self._inbox[key].append(msg)
        return inbox.popleft()
