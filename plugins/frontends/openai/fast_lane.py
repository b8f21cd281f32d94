"""The HTTP server's fast lane: /health answered as its bytes arrive, and the parsing of
every other request metered, so that no burst of requests can queue /health behind it.

Why: asyncio runs ready callbacks first in, first out. When hundreds of requests
arrive at once, uvicorn parses each one as its bytes come in and starts its ASGI task,
so a single pass of the event loop holds the parsing, routing and response of the
whole burst (0.5-1 ms each on a 2-core CPU), and a /health that arrives behind them
waits for all of it: p99 105 ms and 336 ms at worst during a 500-request burst, over
1 s during 2,000. What bounds that wait:

- ``fast_lane_protocol(base, answers)`` subclasses uvicorn's HTTP protocol (h11, or
  httptools where it is installed) so that a complete ``GET`` of a path in ``answers``
  (a bodiless request, alone in its read) is answered from ``data_received``: no HTTP
  parser, no task, no framework; ``answers[path]()`` gives the status and the JSON body.
- Refusals at once: while the queue is full (no room for even one sequence), a
  complete ``POST`` to a generation path gets its 503 + Retry-After from
  ``data_received`` as well (``refusals[path](authorization)``), before any parser,
  task or JSON: a burst of 2,000 requests on keep-alive connections was refused at
  p50 524 ms, p99 721 ms through the parser and the route (it queues in the meter
  like any request); the refusal itself is decided in microseconds.
- ``Meter``: the bytes of every other request wait in one FIFO queue, and once per loop
  iteration the meter hands them to the real parser while the iteration stays short
  (``TARGET_S``); a connection with bytes queued stops being read, so it holds one
  chunk. Handlers take a ``turn`` before a costly step (a finished response), so many
  requests finishing at once are spread too. A burst then takes many short iterations,
  and a /health read in any of them is answered within it. Nothing is dropped or
  reordered within a connection, and the total work is the same.
- Accepts in batches: asyncio accepts up to its ``backlog`` connections per readiness
  of the listening socket, and sets each one up in the next iterations (about 0.2 ms
  each here), so 2,000 connections arriving at once would make iterations of hundreds
  of ms. The server is started with ``backlog=ACCEPT_BATCH``, and
  ``widen_listen_queue`` then sets the kernel's queue back to ``LISTEN_QUEUE`` (Linux
  takes a second ``listen``), so that no connection is refused or delayed by the
  kernel while the loop accepts 64 at a time.
- ``Pacer``: fast-lane answers (and /metrics, in ``info.py``) are paced per
  connection, so a client looping on an open endpoint waits instead of taking the CPU
  the engine-core needs.

The frontend also freezes start-up's heap out of the cyclic GC before serving (a full
collection scanned it: 130 ms of CPU in one iteration under load).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

Answer = Callable[[], tuple[int, bytes]]  # -> (status, JSON body)
Refusal = Callable[[bytes | None], bytes | None]  # Authorization value -> 503 JSON body or None
TARGET_S = 0.015  # the event-loop iteration the meter aims at, under any burst
BUDGET_S = 0.005  # the most the meter's own deliveries take in one iteration
MAX_ALLOWANCE = 256  # items admitted in one iteration, at most
ACCEPT_BATCH = 64  # connections asyncio accepts per readiness of the listening socket
LISTEN_QUEUE = 2048  # connections the kernel holds for us meanwhile (uvicorn's default)
FAST_RATE = 500.0  # fast-lane answers per second per connection: ~7% of a core, looped
SLOW_RATE = 20.0  # /metrics per second per connection (a render and engine stats each)
MAX_CLIENTS = 10_000  # pacing buckets kept
_REASONS = {200: b"OK", 503: b"Service Unavailable"}
_STREAMED = (b"transfer-encoding", b"upgrade", b"expect")  # bodies the fast lane never takes


class Meter:
    """Work admitted once per event-loop iteration, a bounded amount each time.

    Two kinds of work queue here, first in, first out: request bytes for a protocol's
    parser (``put``) and tasks waiting for their ``turn`` before a costly step (such
    as building and sending a finished response). The pump runs once per iteration and
    admits up to ``allowance`` items, within ``max_budget_s`` of its own time. What an
    item sets off (a request's handler, the response) runs in the next iteration, so
    the pump steers by the time between its runs (``gap``: the rest of the loop's work
    for one iteration): over ``target_s`` it halves the allowance, under it the
    allowance grows by a quarter (at least one; always one item at least).
    """

    def __init__(self, target_s: float = TARGET_S, max_budget_s: float = BUDGET_S) -> None:
        self.target_s = target_s
        self.max_budget_s = max_budget_s
        self.allowance = 8  # items admitted per iteration, steered by the gap
        self.queue: deque[tuple[Any, bytes] | asyncio.Future[None]] = deque()
        self.scheduled = False
        self.last_pump = 0.0  # when the previous pump ended
        self.max_queued = 0  # the deepest the queue got (for tests and tuning)

    def put(self, protocol: Any, data: bytes) -> None:
        """Hand ``data`` to ``protocol.deliver`` in its turn."""
        self._append((protocol, data))

    async def turn(self) -> None:
        """Wait for this task's turn: it then runs in the next iteration. (No shortcut
        when nothing waits: the many tasks one engine step wakes would all take it.)"""
        future = asyncio.get_running_loop().create_future()
        self._append(future)
        await future

    def _append(self, item: tuple[Any, bytes] | asyncio.Future[None]) -> None:
        self.queue.append(item)
        self.max_queued = max(self.max_queued, len(self.queue))
        if not self.scheduled:
            self.scheduled = True
            self.last_pump = time.perf_counter()
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        start = time.perf_counter()
        if start - self.last_pump > self.target_s:
            self.allowance = max(1, self.allowance // 2)
        else:
            self.allowance = min(MAX_ALLOWANCE, self.allowance + max(1, self.allowance // 4))
        deadline = start + self.max_budget_s
        queue = self.queue
        for _ in range(self.allowance):
            if not queue:
                break
            item = queue.popleft()
            if isinstance(item, asyncio.Future):
                if not item.done():
                    item.set_result(None)
            else:
                item[0].deliver(item[1])
            if time.perf_counter() >= deadline:
                break
        self.last_pump = time.perf_counter()
        if queue:  # the rest in the next iteration, after what became ready meanwhile
            asyncio.get_running_loop().call_soon(self._pump)
        else:
            self.scheduled = False


class Pacer:
    """Per-connection pacing of the open endpoints: a token bucket per client address
    and port (one connection; not per address, which every client behind a proxy, or
    on loopback, shares).

    A connection within ``rate`` requests per second (``burst`` at once) is answered at
    once; beyond that, ``delay`` says how long to hold its answer. A client hammering
    /health or /metrics in a loop then waits instead of spinning, and takes a bounded
    share of the CPU the engine-core needs (on a 2-core machine, an unpaced loop
    slowed generation several times over). Monitors probe far below the rates.
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = rate if burst is None else burst
        self.buckets: dict[Any, tuple[float, float]] = {}  # client -> (tokens, at)

    def delay(self, client: Any) -> float:
        """Seconds to hold this request of ``client`` (0: answer now); takes its token."""
        now = time.monotonic()
        tokens, at = self.buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate) - 1.0
        if len(self.buckets) >= MAX_CLIENTS and client not in self.buckets:
            self.buckets.clear()  # forget everyone rather than grow without bound
        self.buckets[client] = (tokens, now)
        return 0.0 if tokens >= 0 else -tokens / self.rate


def widen_listen_queue(servers: list[Any], size: int = LISTEN_QUEUE) -> None:
    """Let the kernel queue ``size`` connections on the listening sockets of ``servers``
    (asyncio ``Server``s started with a small ``backlog``, its accept batch)."""
    for server in servers:
        for sock in server.sockets:  # asyncio's TransportSocket has no listen(): a dup does
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
                dup.listen(size)


def fast_lane_protocol(
    base: type,
    answers: Mapping[str, Answer],
    meter: Meter,
    pacer: Pacer | None = None,
    refusals: Mapping[str, Refusal] | None = None,
) -> type:
    """A subclass of uvicorn's HTTP protocol class ``base`` with the fast lane (answers
    paced per client by ``pacer``; 503s from ``refusals``, not paced) and ``meter``."""
    paths = {path.encode(): answer for path, answer in answers.items()}
    refusing = {path.encode(): refuse for path, refuse in (refusals or {}).items()}

    class FastLaneProtocol(base):  # type: ignore[misc, valid-type]
        _queued = 0  # chunks of this connection in the meter's queue
        _paused = False  # reading paused by us while chunks wait

        def data_received(self, data: bytes) -> None:
            if not self._queued and self._idle():
                answer = _fast_answer(data, paths)
                if answer is not None:
                    self._unset_keepalive_if_required()
                    delay = pacer.delay(self.client) if pacer else 0.0
                    if delay <= 0:
                        self._answer(*answer)
                    else:  # held: a hammering client waits instead of spinning
                        self.transport.pause_reading()
                        self.loop.call_later(delay, self._answer, *answer)
                    return
                refusal = _fast_refusal(data, refusing) if refusing else None
                if refusal is not None:
                    self._unset_keepalive_if_required()
                    self._answer(*refusal)
                    return
            self._queued += 1
            if not self._paused and self.transport.is_reading():
                self._paused = True
                self.transport.pause_reading()
            meter.put(self, data)

        def _answer(self, response: bytes, close: bool) -> None:
            if self.transport.is_closing():
                return
            self.transport.write(response)
            if close:
                self.transport.close()
                return
            if not self._paused and not (self.flow is not None and self.flow.read_paused):
                self.transport.resume_reading()  # after a held answer
            # the idle timeout uvicorn arms after any response
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

        def deliver(self, data: bytes) -> None:
            """The meter's turn for ``data``: the real parser's ``data_received``."""
            self._queued -= 1
            if self.transport.is_closing():
                return
            super().data_received(data)
            if not self._queued and self._paused:
                self._paused = False
                flow = getattr(self, "flow", None)
                if not (flow is not None and flow.read_paused):  # uvicorn's own pause stays
                    self.transport.resume_reading()

        def _idle(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or bool(cycle.response_complete)

    FastLaneProtocol.__name__ = FastLaneProtocol.__qualname__ = f"FastLane{base.__name__}"
    return FastLaneProtocol


def _fast_refusal(data: bytes, paths: Mapping[bytes, Refusal]) -> tuple[bytes, bool] | None:
    """The 503 for ``data`` and whether to close after it, if ``data`` is exactly one
    whole ``POST`` of a refusing path (its headers and a ``Content-Length`` body, read
    whole: the connection stays in step) and the path's refusal says no; else None."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0 or not data.startswith(b"POST /"):
        return None
    parsed = _head(data[:head_end], paths)
    if parsed is None:
        return None
    refuse, close, headers = parsed
    length = headers.get(b"content-length")
    if length is None or not length.isdigit() or int(length) != len(data) - head_end - 4:
        return None
    body = refuse(headers.get(b"authorization"))
    if body is None:
        return None
    return _response(503, body, close, b"retry-after: 1\r\n"), close


def _head(head: bytes, paths: Mapping[bytes, Any]) -> tuple[Any, bool, dict[bytes, bytes]] | None:
    """(``paths``' entry for the target, close after the response, the other headers
    by lower-case name) of a request head without its blank line; None when the
    target is not in ``paths``, the head is malformed, a header repeats, or a request
    body comes in chunks, as an upgrade, or after ``Expect``."""
    lines = head.split(b"\r\n")
    method_target_version = lines[0].split(b" ")
    if len(method_target_version) != 3:
        return None
    _, target, version = method_target_version
    entry = paths.get(target.partition(b"?")[0])
    if entry is None or version not in (b"HTTP/1.1", b"HTTP/1.0"):
        return None
    close = version == b"HTTP/1.0"
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        name = name.strip().lower()
        if not colon or not name or name in _STREAMED or name in headers:
            return None  # malformed or more than a plain request: the parser decides
        if name == b"connection":
            tokens = {token.strip() for token in value.lower().split(b",")}
            close = b"close" in tokens or (close and b"keep-alive" not in tokens)
        headers[name] = value.strip()
    return entry, close, headers


def _response(status: int, body: bytes, close: bool, extra: bytes = b"") -> bytes:
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
        status,
        _REASONS.get(status, b""),
        len(body),
    )
    return head + extra + (b"connection: close\r\n" if close else b"") + b"\r\n" + body


def _fast_answer(data: bytes, paths: Mapping[bytes, Answer]) -> tuple[bytes, bool] | None:
    """The response to ``data`` and whether to close after it, if ``data`` is exactly one
    bodiless ``GET`` of a fast path; None sends it the normal way."""
    if not data.startswith(b"GET /") or not data.endswith(b"\r\n\r\n"):
        return None
    parsed = _head(data[:-4], paths)
    if parsed is None:
        return None
    answer, close, headers = parsed
    if b"content-length" in headers:
        return None  # a GET with a body: the parser decides
    status, body = answer()
    return _response(status, body, close), close
