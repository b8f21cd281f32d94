"""Keeps an engine-core serving the frontends: start, restart with backoff, give up.

``EngineKeeper.start()`` starts the engine-core through a ``Supervisor`` and builds
the one ``AsyncEngineClient`` the frontends hold for the server's whole life. When
the engine-core dies, the client fails every pending request at once
(EngineDeadError) and reports not alive (``/health`` answers 503); with
``config.restart_engine`` the keeper then starts a fresh engine-core after a backoff
(0.5 s, doubling, at most 30 s) and reconnects the same client to it, so that the
next request succeeds. A death or a failed start counts as a failure; an engine-core
that served for ``stable_s`` clears the count. Once the count exceeds
``config.max_engine_restarts`` (or at the first death without ``restart_engine``),
``gave_up`` is set: ``serve`` then exits non-zero, for an outer supervisor to act.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.engine.client import AsyncEngineClient
from tokenloom.engine.loop import request_id_limit
from tokenloom.engine.supervisor import EngineStartError, Supervisor
from tokenloom.logging import get_logger
from tokenloom.protocols.control import Ready

log = get_logger(__name__)


class EngineKeeper:
    """Owns the current engine-core and the engine client; use from one event loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_factory: Callable[..., Any] | None = None,
        backoff_s: tuple[float, float] = (0.5, 30.0),  # first delay, cap
        stable_s: float = 60.0,
    ) -> None:
        self.config = config
        self.engine_factory = engine_factory
        self.backoff_s = backoff_s
        self.stable_s = stable_s
        self.supervisor: Supervisor | None = None
        self.client: AsyncEngineClient | None = None
        self.ready: Ready | None = None
        self.gave_up = asyncio.Event()
        self.failures = 0  # consecutive deaths and failed starts
        self.restarts = 0  # successful restarts, in total
        self.last_restart_s: float | None = None  # death to serving again, the last time
        self._started_at = 0.0
        self._restarting: asyncio.Task[None] | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> Ready:
        """Start the first engine-core. Raises EngineStartError (nothing is restarted:
        a server that cannot start at all should say so at once)."""
        self._loop = asyncio.get_running_loop()
        supervisor = Supervisor(self.config, engine_factory=self.engine_factory)
        self.ready = await supervisor.start_async()
        self.client = AsyncEngineClient(
            supervisor.endpoints.input,
            supervisor.endpoints.output,
            max_request_id_bytes=request_id_limit(self.config),
        )
        self._adopt(supervisor)
        return self.ready

    def _adopt(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._started_at = time.monotonic()
        supervisor.watch(lambda code: self._on_death(supervisor, code))

    def _on_death(self, supervisor: Supervisor, code: int | None) -> None:
        """From the supervisor's watcher thread."""
        assert self.client is not None and self._loop is not None
        self.client.mark_dead(f"engine-core exited with code {code}")
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone
            self._loop.call_soon_threadsafe(self._schedule_restart, supervisor, time.monotonic())

    def _schedule_restart(self, dead: Supervisor, died_at: float) -> None:
        if self._stopping or dead is not self.supervisor:
            return
        if not self.config.restart_engine:
            log.error("engine-core died; restart_engine is off: stopping")
            self.gave_up.set()
            return
        if died_at - self._started_at >= self.stable_s:
            self.failures = 0
        self.failures += 1
        self._restarting = asyncio.get_running_loop().create_task(
            self._restart(dead, died_at), name="engine-restart"
        )

    async def _restart(self, dead: Supervisor, died_at: float) -> None:
        await dead.stop_async(grace_s=0.0)  # it is gone; this closes its sockets
        while True:
            if self.failures > self.config.max_engine_restarts:
                log.error(
                    "engine-core failed %d times in a row (max_engine_restarts %d): stopping",
                    self.failures, self.config.max_engine_restarts,
                )  # fmt: skip
                self.gave_up.set()
                return
            first, cap = self.backoff_s
            delay = min(first * 2 ** (self.failures - 1), cap)
            log.warning(
                "restarting the engine-core in %.1fs (failure %d of at most %d)",
                delay, self.failures, self.config.max_engine_restarts,
            )  # fmt: skip
            await asyncio.sleep(delay)
            supervisor = Supervisor(self.config, engine_factory=self.engine_factory)
            try:
                self.ready = await supervisor.start_async()
            except EngineStartError as exc:
                log.error("engine-core restart failed: %s", exc)
                self.failures += 1
                continue
            assert self.client is not None
            await self.client.reconnect(supervisor.endpoints.input, supervisor.endpoints.output)
            self._adopt(supervisor)
            self.restarts += 1
            self.last_restart_s = time.monotonic() - died_at
            log.info("engine-core restarted in %.2fs", self.last_restart_s)
            return

    async def stop(self, grace_s: float = 1.0) -> None:
        """Close the client and stop the engine-core (and any restart in progress)."""
        self._stopping = True
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restarting
        if self.client is not None:
            await self.client.close()
        if self.supervisor is not None:
            await self.supervisor.stop_async(grace_s=grace_s)
