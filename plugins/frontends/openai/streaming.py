"""Server-sent events, and noticing at once that the client went away.

Starlette's ``StreamingResponse`` (ASGI spec 2.4) only notices a disconnect when the
next chunk fails to send, which may be long after the client left. Here the body
and the disconnect watch run side by side: a disconnect cancels the body at once,
and the body's ``finally`` aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse_event(payload: Any) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must be read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T | None:
    """Run ``work``; cancel it and return None if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or (watcher.done() and not task.done()):
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


class EventStreamResponse:
    """An ASGI response that streams ``events`` (already SSE-encoded bytes)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        self.events = events
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await unless_disconnected(self._stream(send), receive)

    async def _stream(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client left while we were sending
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
