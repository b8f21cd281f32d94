"""The engine-core loop: between the sockets and the engine, one step at a time.

``run_engine_loop`` serves one engine over two ``zmq.asyncio`` sockets
(``engine-input``, ``engine-output``) and, optionally, the ``control`` socket. The
process around it (building the engine, ``Ready``/``Failed``, signals) is
``tokenloom.engine.process``.

The engine is any ``EngineCore`` (``protocols.components.engine``; the default is
``tokenloom.engine.engine_core.Engine``): ``add_request``, ``abort``, ``step``
(blocking), ``has_unfinished``, ``stats``, ``ready_info``, ``shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import zmq
import zmq.asyncio

from tokenloom.config import EngineConfig
from tokenloom.logging import get_logger
from tokenloom.protocols.components.engine import EngineCore
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.control import ControlMessage, Shutdown
from tokenloom.protocols.outputs import (
    EngineOutputs,
    ErrorReply,
    HealthReply,
    StatsReply,
    TokenDelta,
)
from tokenloom.protocols.requests import (
    AbortRequest,
    EngineInput,
    GenerateRequest,
    HealthRequest,
    StatsRequest,
)
from tokenloom.transport.serde import DecodeError, Decoder, Encoder
from tokenloom.transport.sockets import SOCKETS

log = get_logger(__name__)

IDLE_POLL_MS = 250  # an idle loop wakes this often to notice a stop request
# The served engine's cyclic GC: gen-0 allocations, gen-0 passes, gen-1 passes (see
# ``engine_gc``). Python's default is (700, 10, 10).
ENGINE_GC_THRESHOLDS = (10_000, 10, 1_000)
# Room for the prefixes a frontend puts before a client's id (its connection's
# identity, the choice index of an n-way request).
REQUEST_ID_MARGIN = 1024


class EngineLoop:
    """The loop state of one engine-core. Not thread-safe: everything runs on the
    event loop thread (signal handlers included, through ``loop.add_signal_handler``).
    The per-request observation hooks are the engine's to call, not the loop's: the
    engine also runs in-process (offline ``LLM``) without this loop."""

    def __init__(
        self,
        engine: EngineCore,
        input_sock: zmq.asyncio.Socket,
        output_sock: zmq.asyncio.Socket,
        *,
        control_sock: zmq.asyncio.Socket | None = None,
        max_message_bytes: int | None = None,
        max_output_bytes: int | None = None,
        max_request_id_bytes: int | None = None,
    ) -> None:
        self.engine = engine
        self.input = input_sock
        self.output = output_sock
        self.control = control_sock
        limit = max_message_bytes or SOCKETS["engine-input"].max_message_bytes
        self.decoder: Decoder[Any] = Decoder(EngineInput, limit)
        self.max_output_bytes = max_output_bytes or SOCKETS["engine-output"].max_message_bytes
        self.max_request_id_bytes = max_request_id_bytes or request_id_limit(EngineConfig())
        self.control_decoder: Decoder[Any] = Decoder(
            ControlMessage, SOCKETS["control"].max_message_bytes
        )
        self.encoder = Encoder()
        self.handlers: dict[type, Callable[[Any], Any]] = {
            GenerateRequest: self._on_generate,
            AbortRequest: self._on_abort,
            HealthRequest: self._on_health,
            StatsRequest: self._on_stats,
        }
        self.live: set[str] = set()  # accepted and not finished: aborted at shutdown
        self.pending: list[TokenDelta] = []  # deltas made between steps (aborts)
        self.stop_deadline: float | None = None  # monotonic; set once shutdown begins
        self.poller = zmq.asyncio.Poller()
        self.poller.register(input_sock, zmq.POLLIN)
        if control_sock is not None:
            self.poller.register(control_sock, zmq.POLLIN)

    def request_stop(self, grace_s: float) -> None:
        """Stop taking new requests; in-flight ones get ``grace_s`` to finish."""
        deadline = time.monotonic() + grace_s
        if self.stop_deadline is None or deadline < self.stop_deadline:
            self.stop_deadline = deadline

    async def run(self) -> None:
        """Serve until a requested stop completes."""
        engine = self.engine
        while True:
            # 1. Drain every waiting input and control message, without blocking.
            await self._drain_inputs()
            # 2. Past the stop deadline, abort what is left; with nothing left, stop.
            if self.stop_deadline is not None:
                if not engine.has_unfinished():
                    await self._emit([])
                    return
                if time.monotonic() >= self.stop_deadline:
                    self.pending.extend(engine.abort(list(self.live)))
                    await self._emit([])
                    return
            # 3. Run one engine step when there is work.
            deltas = await self._step() if engine.has_unfinished() else []
            # 4. Emit one EngineOutputs with this step's deltas (and any abort deltas).
            await self._emit(deltas)
            # 5. Idle: sleep until a message arrives (or a stop is due), never spin.
            #    Busy: still yield once, so signal handlers and other tasks run.
            if engine.has_unfinished():
                await asyncio.sleep(0)
            else:
                await self.poller.poll(IDLE_POLL_MS)

    async def _drain_inputs(self) -> None:
        while _readable(self.input):
            frames = await self.input.recv_multipart(copy=False)
            reply = self._dispatch(frames)
            if reply is not None:
                await self._send(reply)
        control = self.control
        while control is not None and _readable(control):
            frames = await control.recv_multipart(copy=False)
            try:
                msg = self.control_decoder.decode(frames)
            except DecodeError as exc:
                log.warning("dropped a bad control message: %s", exc.reason)
                continue
            if isinstance(msg, Shutdown):
                log.info("shutdown requested (grace %.1fs)", msg.grace_s)
                self.request_stop(msg.grace_s)

    def _dispatch(self, frames: list[Any]) -> Any:
        try:
            msg = self.decoder.decode(frames)
        except DecodeError as exc:
            log.warning("refused a message: %s", exc)
            return ErrorReply(exc.code, exc.reason)
        return self.handlers[type(msg)](msg)

    def _on_generate(self, req: GenerateRequest) -> ErrorReply | None:
        rid = req.request_id
        if len(rid.encode()) > self.max_request_id_bytes:
            # Refused before it can be echoed in every step's output. The one reply
            # carries the id: the engine client routes by it (and refuses such ids
            # itself before sending them).
            return ErrorReply(
                400, f"request_id: longer than {self.max_request_id_bytes} bytes", rid
            )
        if self.stop_deadline is not None:
            return ErrorReply(503, "engine is shutting down", rid)
        try:
            self.engine.add_request(req)
        except QueueFullError as exc:
            return ErrorReply(503, f"queue full: {exc}", rid)
        except ValueError as exc:
            return ErrorReply(400, str(exc), rid)
        except Exception as exc:
            log.exception("add_request failed for %s", rid)
            return ErrorReply(500, f"internal error: {exc!r}", rid)
        self.live.add(rid)
        return None

    def _on_abort(self, req: AbortRequest) -> None:
        self.pending.extend(self.engine.abort(req.request_ids))

    def _on_health(self, req: HealthRequest) -> HealthReply:
        return HealthReply(req.nonce, True)

    def _on_stats(self, req: StatsRequest) -> StatsReply:
        return StatsReply(req.nonce, self.engine.stats())

    async def _step(self) -> list[TokenDelta]:
        try:
            return self.engine.step()
        except Exception as exc:
            # The engine's state is unknown now: fail every request, then die so
            # that the supervisor sees it. The reason goes along (e.g. which
            # tensor-parallel worker died).
            log.exception("engine step failed")
            for rid in self.live:
                await self._send(ErrorReply(500, f"engine step failed: {exc}", rid))
            raise

    async def _emit(self, deltas: list[TokenDelta]) -> None:
        if self.pending:
            deltas = self.pending + deltas
            self.pending = []
        if not deltas:
            return
        live = self.live
        for delta in deltas:
            if delta.finish_reason is not None:
                live.discard(delta.request_id)
        await self._send_outputs(deltas)

    async def _send_outputs(self, deltas: list[TokenDelta]) -> None:
        """Send ``deltas`` in as few ``EngineOutputs`` as keep each under the channel's
        limit (one, unless a step's output is huge). A single delta over the limit
        cannot be sent: its request gets a 500 error reply and is aborted."""
        frames = self.encoder.encode(EngineOutputs(deltas, time.monotonic()))
        size = sum(len(frame) for frame in frames)
        if size <= self.max_output_bytes:
            await self.output.send_multipart(frames, copy=len(frames) == 1)
        elif len(deltas) > 1:
            half = len(deltas) // 2
            await self._send_outputs(deltas[:half])
            await self._send_outputs(deltas[half:])
        else:
            rid = deltas[0].request_id
            log.error("output of request %.80r: %d bytes over the channel's limit", rid, size)
            await self._send(ErrorReply(500, f"engine output of {size} bytes too large", rid))
            if deltas[0].finish_reason is None:
                self.engine.abort([rid])  # its abort delta would go nowhere
            self.live.discard(rid)

    async def _send(self, msg: Any) -> None:
        frames = self.encoder.encode(msg)
        await self.output.send_multipart(frames, copy=len(frames) == 1)


def request_id_limit(config: EngineConfig) -> int:
    """The longest request id, in UTF-8 bytes, the engine accepts: a client's own id
    (``config.max_request_id_bytes``, which the frontends enforce) plus the frontend's
    prefixes. Every id is echoed in each of its request's outputs, so this bounds a
    step's output size."""
    return config.max_request_id_bytes + REQUEST_ID_MARGIN


async def run_engine_loop(
    engine: EngineCore,
    input_sock: zmq.asyncio.Socket,
    output_sock: zmq.asyncio.Socket,
    *,
    control_sock: zmq.asyncio.Socket | None = None,
    grace_s: float = 5.0,
    handle_signals: bool = False,
    max_message_bytes: int | None = None,
    max_request_id_bytes: int | None = None,
) -> None:
    """Serve ``engine`` until stopped (``Shutdown`` on the control socket, or SIGTERM /
    SIGINT with ``handle_signals``). On stop: new requests get 503, in-flight ones get
    their grace period, the rest are aborted (their abort deltas are sent)."""
    engine_loop = EngineLoop(
        engine,
        input_sock,
        output_sock,
        control_sock=control_sock,
        max_message_bytes=max_message_bytes,
        max_request_id_bytes=max_request_id_bytes,
    )
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, engine_loop.request_stop, grace_s)
    try:
        with engine_gc():
            await engine_loop.run()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def engine_gc() -> Iterator[None]:
    """Rare full collections while the engine serves; restored on exit.

    Each step allocates thousands of short-lived containers, so with Python's default
    thresholds a young collection ran about once per decode step at 512 running
    sequences, and a full one every ~100 steps: it scans every request's token lists
    and the model's objects (117 ms at 512 x 1,500 tokens in ``bench host``, whose
    process also holds the frontend's copies), and the GPU idles meanwhile. Start-up's
    objects leave the collector's view (``freeze``); young collections become rarer
    (every 10,000 net allocations) and full ones every 1,000th middle pass instead of
    every 10th. Garbage without cycles is freed by reference counting regardless;
    only cyclic garbage waits longer.
    """
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*ENGINE_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def _readable(sock: zmq.asyncio.Socket) -> bool:
    """A message waits on ``sock`` (checked without blocking or yielding)."""
    return bool(cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN)
