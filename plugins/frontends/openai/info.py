"""The cheap routes (/health, /v1/models, /metrics, /version, /openapi.json) and the
API-key check every route shares.

These routes are open to anyone who can reach the server (``/v1/models`` and, with
``metrics_require_api_key``, ``/metrics`` and ``/version`` take the key), so each
must cost next to nothing: the bodies that do not change are encoded once, and
``/health`` awaits nothing; the HTTP server's fast lane answers /health (and, when
they need no key, /v1/models and /version) before any parsing, paced per client.
Concurrent ``/metrics`` scrapes share one request for the engine's stats, and a
connection scraping in a loop is paced (``SLOW_RATE``), so scrapers cost the engine a
bounded number of round trips.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

import tokenloom
from tokenloom.plugins.frontends.metrics import CONTENT_TYPE
from tokenloom.plugins.frontends.openai.openapi import openapi_document
from tokenloom.plugins.frontends.openai.schemas import RequestError
from tokenloom.plugins.frontends.openai.state import ServerState
from tokenloom.protocols.components.errors import EngineDeadError, EngineError
from tokenloom.protocols.outputs import EngineStats

if TYPE_CHECKING:
    from tokenloom.plugins.frontends.openai.fast_lane import Pacer

_encode = msgspec.json.Encoder().encode


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode(body), status, headers, media_type="application/json")


def _raw_json(body: bytes, status: int = 200) -> Response:
    return Response(body, status, media_type="application/json")


def key_matches(api_key: str | None, authorization: bytes | None) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (the scheme in
    any case, RFC 9110), compared in constant time; True when no key is set."""
    if not api_key:
        return True
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


def unauthorized(api_key: str | None, request: Request) -> Response | None:
    """None if ``request`` carries the key (``key_matches``) or no key is set; else the
    401 response."""
    header = request.headers.get("authorization")
    if key_matches(api_key, header.encode("latin-1") if header is not None else None):
        return None
    error = RequestError("invalid or missing API key", None, 401, "authentication_error")
    return json_response(error.body(), 401, {"WWW-Authenticate": "Bearer"})


class InfoRoutes:
    def __init__(self, frontend: ServerState) -> None:
        self.frontend = frontend
        card = {
            "id": frontend.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tokenloom",
            "root": frontend.config.model,
            "parent": None,
            "max_model_len": frontend.limits.max_model_len,
        }
        self._models = _encode({"object": "list", "data": [card]})
        self._version = _encode({"version": tokenloom.__version__})
        self._openapi = _encode(openapi_document())
        self._ok = _encode({"status": "ok"})
        self._dead = _encode({"status": "engine dead"})
        self._stats: asyncio.Future[EngineStats | None] | None = None  # the fetch in flight
        self.pacer: Pacer | None = None  # per-client pacing of /metrics (set by the app)

    def _gate(self, request: Request, always: bool = True) -> Response | None:
        config = self.frontend.config
        if always or config.metrics_require_api_key:
            return unauthorized(config.api_key, request)
        return None

    def health_answer(self) -> tuple[int, bytes]:
        """/health's status and body (also served by the HTTP server's fast lane)."""
        return (200, self._ok) if self.frontend.engine.is_alive else (503, self._dead)

    def fast_answers(self) -> dict[str, Callable[[], tuple[int, bytes]]]:
        """The routes the fast lane may answer (``fast_lane.py``): those needing no key."""
        config = self.frontend.config
        answers = {"/health": self.health_answer}
        if not config.api_key:
            answers["/v1/models"] = lambda: (200, self._models)
        if not (config.api_key and config.metrics_require_api_key):
            answers["/version"] = lambda: (200, self._version)
        return answers

    async def health(self, request: Request) -> Response:
        status, body = self.health_answer()
        return _raw_json(body, status)

    async def models(self, request: Request) -> Response:
        return self._gate(request) or _raw_json(self._models)

    async def version(self, request: Request) -> Response:
        return self._gate(request, always=False) or _raw_json(self._version)

    async def openapi(self, request: Request) -> Response:
        return _raw_json(self._openapi)

    async def metrics(self, request: Request) -> Response:
        if (denied := self._gate(request, always=False)) is not None:
            return denied
        client = (request.client.host, request.client.port) if request.client else None
        if self.pacer is not None and (delay := self.pacer.delay(client)) > 0:
            await asyncio.sleep(delay)  # a scraper in a loop waits, not the engine
        engine = self.frontend.engine
        stats = await self._engine_stats() if engine.is_alive else None
        text = self.frontend.metrics.render(stats, engine.is_alive)
        return Response(text, media_type=CONTENT_TYPE)

    async def _engine_stats(self) -> EngineStats | None:
        """The engine's stats; scrapes that come while a fetch is in flight share it.
        (Not cached past that: a scrape must see the state of its moment; a scraper
        in a loop is paced instead.)"""
        if self._stats is None or self._stats.done():
            self._stats = asyncio.ensure_future(self._fetch_stats())
        return await asyncio.shield(self._stats)

    async def _fetch_stats(self) -> EngineStats | None:
        try:
            return await asyncio.wait_for(self.frontend.engine.stats(), 2.0)
        except (TimeoutError, EngineError, EngineDeadError):
            return None
