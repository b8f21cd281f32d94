"""Frontend ``openai``: the HTTP server (uvicorn, run inside the caller's event loop).

Constructed as ``OpenAIFrontend(config, engine, tokenizer, ready=None)``; ``ready``
(the engine-core's ``Ready``) supplies the model length, EOS ids and model name,
else they come from the config and the tokenizer. The metrics and the admission count
are those of the engine client (``for_engine``), shared with the other frontends. ``serve()`` returns when
cancelled, after a graceful stop: no new connections, in-flight requests get up to
``config.shutdown_grace_s`` to finish, then are cancelled (which aborts them).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from tokenloom.config import EngineConfig
from tokenloom.logging import get_logger
from tokenloom.plugins.frontends.admission import Admission
from tokenloom.plugins.frontends.generation import LiveGenerations
from tokenloom.plugins.frontends.limits import ModelLimits
from tokenloom.plugins.frontends.metrics import ServingMetrics
from tokenloom.plugins.frontends.openai.app import OpenAIApp
from tokenloom.plugins.frontends.openai.fast_lane import ACCEPT_BATCH, widen_listen_queue
from tokenloom.protocols.components.engine import EngineClient
from tokenloom.protocols.components.frontend import Frontend
from tokenloom.protocols.control import Ready

log = get_logger(__name__)


GC_THRESHOLDS = (10_000, 10, 1_000)  # gen0 allocations, gen0 passes, gen1 passes


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process owner (``tokenloom.entrypoints.serve``)
    handles SIGINT/SIGTERM and stops the frontends by cancelling them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            widen_listen_queue(self.servers)  # accepts come in small batches (fast_lane.py)
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            log.info("openai frontend: listening on http://%s:%d", host, port)


class OpenAIFrontend(Frontend):
    name = "openai"

    def __init__(
        self, config: EngineConfig, engine: EngineClient, tokenizer: Any, ready: Ready | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = _model_name(config, ready)
        self.limits = ModelLimits.of(config, tokenizer, ready)
        if not self.limits.max_model_len:
            raise ValueError("openai frontend: the model length is unknown (no Ready, no config)")
        self.metrics = ServingMetrics.for_engine(engine)  # shared with the other frontends
        max_num_seqs = (ready.max_num_seqs if ready else 0) or config.max_num_seqs
        self.admission = Admission.for_engine(engine, max_num_seqs + config.max_waiting_requests)
        self.live = LiveGenerations(
            engine, tokenizer, self.limits.eos_token_ids, config.request_timeout_s, self.metrics,
            self.admission,
        )  # fmt: skip
        self.app = OpenAIApp(self)
        self.server: uvicorn.Server | None = None

    @property
    def port(self) -> int | None:
        """The bound port once listening (useful with ``port = 0``)."""
        if self.server is None or not self.server.started:
            return None
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    async def serve(self) -> None:
        # Start-up's objects (torch, the tokenizer, ...) leave the cyclic GC's view: a
        # full collection under load scanned them all, 130 ms of the event loop's time
        gc.freeze()
        # A full collection also scans every object created since: with 500 requests in
        # flight that was 25-80 ms of the event loop, several times per burst (measured
        # with gc.callbacks). Young collections stay frequent and cheap (they scan only
        # young objects, at most ~100k here); full ones become rare (every 1,000th
        # middle-generation pass instead of every 10th).
        gc.set_threshold(*GC_THRESHOLDS)
        config = uvicorn.Config(
            self.app.starlette,
            http=self.app.http_protocol,  # /health before any parsing (fast_lane.py)
            backlog=ACCEPT_BATCH,
            host=self.config.host,
            port=self.config.port,
            lifespan="off",
            log_level="warning",
            access_log=False,
            # uvicorn cancels the requests still running after this; cancelling one
            # aborts it in the engine
            timeout_graceful_shutdown=self.config.shutdown_grace_s,  # type: ignore[arg-type]
        )
        self.server = server = _EmbeddedServer(config)
        serving = asyncio.create_task(self._run(server))
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            server.should_exit = True  # stop accepting; let in-flight requests finish
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(serving, self.config.shutdown_grace_s + 5.0)
            raise

    async def _run(self, server: uvicorn.Server) -> None:
        try:
            await server.serve()
        except SystemExit as exc:  # uvicorn exits when it cannot bind
            raise OSError(
                f"openai frontend: cannot listen on {self.config.host}:{self.config.port}"
            ) from exc


def _model_name(config: EngineConfig, ready: Ready | None) -> str:
    if config.model:
        return Path(config.model).name or config.model
    return (ready.model_name if ready else "") or "tokenloom"
