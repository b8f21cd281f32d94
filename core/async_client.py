"""``AsyncJobClient``: the asyncio client of the ``zmq`` frontend's job protocol (see
``tokenloom.client`` for the protocol and the blocking ``JobClient``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any, Unpack

import msgspec
import zmq
import zmq.asyncio

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
