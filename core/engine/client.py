"""The frontend's async handle on the engine-core, over ``engine-input``/``-output``.

One background task reads the output socket and routes each message by a table:
deltas go to their request's queue, error replies with a request id raise from that
request's iterator, health and stats replies resolve the future of their nonce.
Once the engine is known dead (``mark_dead``, called by the supervisor's watcher),
every waiting iterator and future fails with EngineDeadError; ``reconnect`` points the
same client at a restarted engine-core. An output message that cannot be decoded is
never dropped silently: the requests it names (or, when none can be read from it,
every request in flight) fail with a 500 EngineError.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenloom.logging import get_logger
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.components.errors import EngineDeadError, EngineError
from tokenloom.protocols.outputs import (
    EngineOutput,
    EngineOutputs,
    EngineStats,
    ErrorReply,
    HealthReply,
    StatsReply,
    TokenDelta,
)
from tokenloom.protocols.requests import (
    AbortRequest,
    GenerateRequest,
    HealthRequest,
    StatsRequest,
)
from tokenloom.transport.serde import DecodeError, Decoder, Encoder
from tokenloom.transport.sockets import SOCKETS, make_socket

log = get_logger(__name__)


class AsyncEngineClient(EngineClient):
    """Connects to an engine-core's input and output sockets. Use from one event
    loop; ``mark_dead`` alone may be called from any thread. Only one client may be
    connected to an engine at a time (the output socket is PUSH/PULL)."""

    def __init__(
        self,
        input_endpoint: str,
        output_endpoint: str,
        *,
        ctx: zmq.asyncio.Context | None = None,
        reply_timeout_s: float = 10.0,
        max_request_bytes: int | None = None,
        max_request_id_bytes: int | None = None,
    ) -> None:
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._input = make_socket(self._ctx, "engine-input", input_endpoint, bind=False)
        self._output = make_socket(self._ctx, "engine-output", output_endpoint, bind=False)
        self.max_request_id_bytes = max_request_id_bytes  # None: the engine's check alone
        self._encoder = Encoder()
        self._decoder: Decoder[Any] = Decoder(
            EngineOutput, SOCKETS["engine-output"].max_message_bytes
        )
        self.reply_timeout_s = reply_timeout_s
        limit = max_request_bytes or SOCKETS["engine-input"].max_message_bytes
        self._max_request_bytes = limit  # the engine's decoder refuses anything larger
        self._queues: dict[str, asyncio.Queue[TokenDelta | BaseException]] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._nonces = itertools.count(1)
        self._routes: dict[type, Callable[[Any], None]] = {
            EngineOutputs: self._on_outputs,
            ErrorReply: self._on_error,
            HealthReply: self._on_reply,
            StatsReply: self._on_reply,
        }
        self._reader: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_reason: str | None = None

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas until one has a finish_reason. Raises EngineError
        for an error reply and EngineDeadError if the engine dies. Leaving early
        (break, cancellation) aborts the request in the engine."""
        self._ensure_started()
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in flight")
        limit = self.max_request_id_bytes
        if limit is not None and len(rid.encode()) > limit:
            raise EngineError(400, f"request_id: longer than {limit} bytes")
        frames = self._encoder.encode(request)
        size = sum(len(frame) for frame in frames)
        if size > self._max_request_bytes:
            # The engine could only answer with an anonymous 413: refuse it here.
            raise EngineError(413, f"request of {size} bytes exceeds {self._max_request_bytes}")
        queue: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            await self._input.send_multipart(frames)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished and self._dead_reason is None:
                await self._send(AbortRequest([rid]))

    async def abort(self, request_ids: Sequence[str]) -> None:
        self._ensure_started()
        await self._send(AbortRequest(list(request_ids)))

    async def stats(self) -> EngineStats:
        reply = await self._ask(StatsRequest)
        return reply.stats  # type: ignore[no-any-return]

    async def health(self) -> bool:
        """True if the engine answers a health request within the reply timeout."""
        try:
            reply = await self._ask(HealthRequest)
        except (TimeoutError, EngineDeadError):
            return False
        return bool(reply.ok)

    async def _ask(self, request_type: type) -> Any:
        self._ensure_started()
        assert self._loop is not None
        nonce = next(self._nonces)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._replies[nonce] = future
        try:
            await self._send(request_type(nonce))
            return await asyncio.wait_for(future, self.reply_timeout_s)
        finally:
            self._replies.pop(nonce, None)

    async def _send(self, msg: Any) -> None:
        frames = self._encoder.encode(msg)
        await self._input.send_multipart(frames, copy=len(frames) == 1)

    # ------------------------------------------------------------------ outputs

    def _ensure_started(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = self._loop.create_task(self._read_outputs(), name="engine-outputs")

    async def _read_outputs(self) -> None:
        while True:
            frames = await self._output.recv_multipart(copy=False)
            try:
                msg = self._decoder.decode(frames)
            except DecodeError as exc:
                self._on_undecodable(frames, exc)
                continue
            self._routes[type(msg)](msg)

    def _on_undecodable(self, frames: list[Any], exc: DecodeError) -> None:
        """Fail the requests an undecodable output was for: their deltas are lost."""
        ids = _salvage_request_ids(memoryview(frames[0])) if frames else None
        targets = list(self._queues) if ids is None else [i for i in ids if i in self._queues]
        log.error(
            "engine output could not be decoded (%s); failing %d request(s)", exc, len(targets)
        )
        error = EngineError(500, f"engine output lost: {exc.reason}")
        for rid in targets:
            self._queues[rid].put_nowait(error)

    def _on_outputs(self, msg: EngineOutputs) -> None:
        queues = self._queues
        for delta in msg.outputs:
            queue = queues.get(delta.request_id)
            if queue is not None:  # None: the caller left early; the abort is on its way
                queue.put_nowait(delta)

    def _on_error(self, msg: ErrorReply) -> None:
        queue = self._queues.get(msg.request_id) if msg.request_id is not None else None
        if queue is None:
            log.warning("engine error reply %d: %s", msg.code, msg.message)
            return
        queue.put_nowait(EngineError(msg.code, msg.message))

    def _on_reply(self, msg: HealthReply | StatsReply) -> None:
        future = self._replies.get(msg.nonce)
        if future is not None and not future.done():
            future.set_result(msg)

    # ------------------------------------------------------------------ death and close

    def mark_dead(self, reason: str = "engine-core process died") -> None:
        """Fail every pending request now and every later call. Thread-safe."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._dead_reason = reason
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._fail_all(reason)
        else:
            loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        self._dead_reason = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in self._replies.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def reconnect(self, input_endpoint: str, output_endpoint: str) -> None:
        """Serve from a restarted engine-core at these endpoints: fresh sockets, and the
        client is alive again. Requests of the dead engine have failed already (with
        EngineDeadError); frontends keep holding this same object."""
        if self._dead_reason is None:
            self._fail_all("engine-core replaced")
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._input = make_socket(self._ctx, "engine-input", input_endpoint, bind=False)
        self._output = make_socket(self._ctx, "engine-output", output_endpoint, bind=False)
        self._dead_reason = None

    async def close(self) -> None:
        """Stop reading and close the sockets (requests in flight are not aborted; their
        iterators raise EngineDeadError instead of waiting forever)."""
        self._fail_all("engine client closed")
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._input.close(linger=0)
        self._output.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])
_raw_str = msgspec.msgpack.Decoder(str)


def _salvage_request_ids(body: Any) -> list[str] | None:
    """The request ids of an ``EngineOutputs`` or ``ErrorReply`` body that failed to
    decode, read one array level at a time (no deep recursion); None if unreadable."""
    try:
        fields = _raw_list.decode(body)
        tag = _raw_str.decode(fields[0])
        if tag == "outputs":
            return [_raw_str.decode(_raw_list.decode(d)[0]) for d in _raw_list.decode(fields[1])]
        if tag == "error" and len(fields) > 3:
            return [_raw_str.decode(fields[3])]
    except (msgspec.MsgspecError, IndexError):
        return None
    return None
