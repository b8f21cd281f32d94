"""Reading a request body safely: media type, size and JSON nesting, before decoding.

``read_json_body`` refuses, naming the reason, before the body costs memory or time:
415 for a Content-Type that is not JSON (``application/json``, any parameters, or a
``+json`` type; a missing header is taken as JSON, as curl and most clients send it),
413 for a Content-Length over the limit and again while streaming (a chunked body, or
one that lies about its length), 400 for JSON nested deeper than ``MAX_JSON_DEPTH``.

The depth check runs in linear, C-speed passes: escape pairs are cut out, then
strings (which then hold no quote), then every byte but brackets; the depth is the
running sum of the brackets left (+1 opening, -1 closing), maximised by numpy.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from tokenloom.plugins.frontends.openai.schemas import RequestError

MAX_JSON_DEPTH = 32  # the request schemas nest 4 deep; no client needs 32
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)  # byte -> nesting change
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


async def read_json_body(request: Any, max_bytes: int) -> bytes:
    """The body of a JSON request, at most ``max_bytes`` long; ``RequestError`` (415,
    413) otherwise. Reads chunk by chunk and stops at the first byte over the limit."""
    media_type = request.headers.get("content-type", "application/json")
    if not is_json_media_type(media_type):
        raise RequestError(
            f"Content-Type {media_type[:100]!r} is not supported; send application/json",
            "Content-Type",
            415,
        )
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise RequestError("Content-Length: not a number", "Content-Length")
        if int(length) > max_bytes:
            raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise ``RequestError`` (400) if ``body`` nests arrays/objects deeper than ``limit``."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return  # cannot nest deeper than it has brackets
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", body)).translate(None, _NOT_BRACKET)
    if len(brackets) <= limit:
        return
    steps = _STEP[np.frombuffer(brackets, dtype=np.uint8)]
    if int(np.cumsum(steps, dtype=np.int32).max()) > limit:
        raise RequestError(f"body: JSON nested deeper than {limit} levels", "body")


def _too_large(max_bytes: int) -> RequestError:
    return RequestError(f"body: larger than {max_bytes} bytes", "body", 413)
