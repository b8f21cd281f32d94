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

import asyncio
import contextlib
import itertools
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import msgspec
import zmq
import zmq.asyncio

from tokenloom.protocols.jobs import (
    MAX_JOB_MESSAGE_BYTES,
    AbortJob,
    HelloJob,
    JobDone,
    JobError,
    JobMetrics,
    JobOutput,
    JobPong,
    JobReply,
    JobWelcome,
    PingJob,
    SubmitJob,
)
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.transport.sockets import make_socket

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
        self._prefix = f"{os.getpid():x}-{id(self):x}"

    def next(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"


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


class AsyncJobClient:
    """asyncio client: one background reader routes replies to each job's queue.
    ``api_key`` and ``heartbeat_s`` as for ``JobClient``; a background task pings
    while the client has live jobs, whatever the caller does meanwhile."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        api_key: str | None = None,
        heartbeat_s: float | None = None,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, "jobs", endpoint, bind=False)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(JobReply)
        self._queues: dict[str, asyncio.Queue[Any]] = {}  # per live job
        self._pongs: dict[int, asyncio.Future[JobPong]] = {}  # per ping in flight, by nonce
        self._hello: asyncio.Future[Any] | None = None  # JobWelcome, or the JobError
        self._reader: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._ids = _JobIds()
        self._api_key = api_key
        self._heartbeat_s = heartbeat_s
        self._welcome: JobWelcome | None = None
        self._nonces = itertools.count(1)
        self._last_send = 0.0

    async def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, **options: Unpack[JobOptions]
    ) -> str:
        """Start a job; its id. ``options``: see ``JobOptions``."""
        await self._open()
        job_id = self._ids.next()
        body = _encode_submit(self._encoder, submit_message(job_id, prompt, params, **options))
        self._queues[job_id] = asyncio.Queue()
        await self._send_bytes(body)
        return job_id

    async def stream(self, job_id: str) -> AsyncIterator[JobOutput | JobDone]:
        """The job's outputs, then its JobDone. Raises JobFailed on an error reply."""
        queue = self._queues.setdefault(job_id, asyncio.Queue())
        ended = False
        try:
            while True:
                msg = await queue.get()
                ended = isinstance(msg, JobError | JobDone)  # see JobClient.stream
                if isinstance(msg, JobError):
                    raise JobFailed(msg.job_id, msg.code, msg.message)
                yield msg
                if ended:
                    return
        finally:
            self._queues.pop(job_id, None)
            if not ended:
                with contextlib.suppress(zmq.ZMQError):
                    await self.abort(job_id)

    async def abort(self, job_id: str) -> None:
        await self._send_bytes(self._encoder.encode(AbortJob(job_id)))

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, **options: Unpack[JobOptions]
    ) -> JobResult:
        """Submit, wait, gather (``options`` as for ``submit``)."""
        job_id = await self.submit(prompt, params, **options)
        collector = _Collector(job_id)
        async for msg in self.stream(job_id):
            if isinstance(msg, JobOutput):
                collector.add(msg)
            else:
                return collector.done(msg)
        raise JobFailed(job_id, 500, "stream ended without JobDone")

    async def ping(self, timeout_s: float = 5.0) -> bool:
        self._ensure_reader()
        nonce = next(self._nonces)
        pong = self._pongs[nonce] = asyncio.get_running_loop().create_future()
        try:
            await self._send_bytes(self._encoder.encode(PingJob(nonce)))
            return (await asyncio.wait_for(pong, timeout_s)).engine_alive
        finally:
            self._pongs.pop(nonce, None)

    async def close(self) -> None:
        for task in (self._reader, self._heartbeat):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncJobClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _open(self, timeout_s: float = 60.0) -> None:
        """Open the session (``hello``) once, before the first job."""
        if self._welcome is not None:
            return
        self._ensure_reader()
        if self._hello is None:  # the first caller says hello; the others wait for it
            self._hello = asyncio.get_running_loop().create_future()
            await self._send_bytes(self._encoder.encode(HelloJob(self._api_key)))
        reply = await asyncio.wait_for(asyncio.shield(self._hello), timeout_s)
        if isinstance(reply, JobError):
            self._hello = None  # a later call may try again
            raise JobFailed(None, reply.code, reply.message)
        self._welcome = reply
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat())

    async def _send_bytes(self, body: bytes) -> None:
        await self._sock.send(body)
        self._last_send = time.monotonic()

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = self._decoder.decode(await self._sock.recv())
            key = _reply_key(msg)
            if key is not None:
                if (queue := self._queues.get(key)) is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, JobPong):
                if (pong := self._pongs.get(msg.nonce)) is not None and not pong.done():
                    pong.set_result(msg)
            elif self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)  # JobWelcome, or the JobError that answers hello

    async def _beat(self) -> None:
        """Ping while jobs are live and nothing else was sent for a heartbeat interval."""
        while True:
            interval = _heartbeat_interval(self._heartbeat_s, self._welcome)
            await asyncio.sleep(max(0.0, self._last_send + interval - time.monotonic()))
            live = bool(self._queues)
            if live and time.monotonic() - self._last_send >= interval:
                with contextlib.suppress(zmq.ZMQError):
                    await self._send_bytes(self._encoder.encode(PingJob(0)))
            elif not live:
                await asyncio.sleep(interval)


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
