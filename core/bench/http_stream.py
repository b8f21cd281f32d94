"""A minimal asyncio HTTP/1.1 client for the serving benchmark: the standard library only.

The GPU hosts the benchmarks run on have neither httpx nor aiohttp, so ``bench
serve`` speaks HTTP itself: one connection per request (``Connection: close``, as
a load generator of independent users would), a JSON body out, the response read
as lines (chunked or not), which is all a Server-Sent-Events stream needs. The
surface mirrors the subset of httpx that ``bench serve`` uses (``stream``,
``get``, ``status_code``, ``aiter_lines``, ``aread``, ``json``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit


class Response:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        status: int,
        headers: dict[str, str],
    ):
        self._reader = reader
        self._writer = writer
        self.status_code = status
        self.headers = headers
        self._chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        length = headers.get("content-length")
        self._remaining = int(length) if length is not None and not self._chunked else None

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if self._chunked:
            while True:
                size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readline()
                    return
                data = await reader.readexactly(size)
                await reader.readexactly(2)  # CRLF after each chunk
                yield data
        elif self._remaining is not None:
            if self._remaining:
                yield await reader.readexactly(self._remaining)
        else:
            while data := await reader.read(65536):
                yield data

    async def aiter_lines(self) -> AsyncIterator[str]:
        buffer = b""
        async for piece in self._pieces():
            buffer += piece
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if buffer:
            yield buffer.rstrip(b"\r").decode()

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])

    def close(self) -> None:
        self._writer.close()


class AsyncClient:
    """``AsyncClient(base_url, headers, timeout)``; use as an async context manager."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 600):
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, got {base_url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout = timeout

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    @asynccontextmanager
    async def stream(
        self, method: str, path: str, json: Any | None = None
    ) -> AsyncIterator[Response]:
        response = await asyncio.wait_for(self._send(method, path, json), self.timeout)
        try:
            yield response
        finally:
            response.close()

    async def get(self, path: str) -> _Loaded:
        async with self.stream("GET", path) as response:
            return _Loaded(response.status_code, await response.aread())

    async def _send(self, method: str, path: str, body: Any | None) -> Response:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        payload = b"" if body is None else json.dumps(body).encode()
        head = [
            f"{method} {self.prefix}{path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Connection: close",
            "Accept: */*",
            f"Content-Length: {len(payload)}",
        ]
        if body is not None:
            head.append("Content-Type: application/json")
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            writer.close()
            raise ConnectionError("the server closed the connection without a response")
        status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        return Response(reader, writer, status, headers)


class _Loaded:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code = status
        self.content = body

    def json(self) -> Any:
        return json.loads(self.content)
