"""``tokenloom serve``: the engine-core process behind the configured frontends.

``main(config)`` starts the engine-core through the ``Supervisor``, waits for its
``Ready``, logs the KV capacity, then runs every frontend named in
``config.frontends`` in this process's event loop until SIGINT or SIGTERM. Stopping
is graceful: the frontends stop accepting and give in-flight requests
``config.shutdown_grace_s`` to finish (the rest are aborted), then the engine-core
is shut down; no process outlives ``main``.

Failures stay contained. A frontend whose ``serve()`` raises is logged and served
again after a backoff, while the others keep serving; one that fails
``MAX_FRONTEND_FAILURES`` times in a row is left stopped, and ``run`` returns 1 once
no frontend is left. If the engine-core dies, the ``EngineKeeper`` restarts it
(``restart_engine``, with backoff; /health answers 503 meanwhile, pending requests
fail at once), and ``run`` returns 1 once it gives up (``max_engine_restarts``).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.logging import get_logger
from tokenloom.protocols.control import Ready

if TYPE_CHECKING:
    from tokenloom.plugin_manager import PluginManager

log = get_logger(__name__)

FRONTEND_BACKOFF_S = (0.1, 5.0)  # first delay before serving a failed frontend again, cap
FRONTEND_STABLE_S = 30.0  # a frontend that served this long starts its count afresh
MAX_FRONTEND_FAILURES = 5  # failures in a row before a frontend is left stopped


@dataclass
class ServerHandle:
    """A running server, handed to ``on_started`` (tests and embedders use it)."""

    config: EngineConfig
    ready: Ready
    keeper: Any  # tokenloom.engine.keeper.EngineKeeper
    engine: Any  # tokenloom.engine.client.AsyncEngineClient (the same across restarts)
    frontends: list[Any] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def supervisor(self) -> Any:
        """The current engine-core's ``Supervisor`` (a new one after each restart)."""
        return self.keeper.supervisor

    def stop(self) -> None:
        """Begin a graceful stop; safe to call from any thread."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.stop_event.set)


def main(config: EngineConfig) -> int:
    """Serve until SIGINT/SIGTERM. Returns 0 after a clean stop, 1 if start-up failed,
    the engine-core could not be kept running, or every frontend failed."""
    return asyncio.run(run(config, handle_signals=True))


async def run(
    config: EngineConfig,
    *,
    engine_factory: Callable[..., Any] | None = None,
    on_started: Callable[[ServerHandle], None] | None = None,
    handle_signals: bool = False,
    engine_backoff_s: tuple[float, float] = (0.5, 30.0),
    plugins: PluginManager | None = None,
) -> int:
    """Serve until ``handle.stop()`` (or a signal, with ``handle_signals``).
    ``engine_factory`` replaces the engine built in the engine-core process (it
    must be importable by reference: ``(config, plugin_manager) -> engine``);
    ``engine_backoff_s`` is the engine-core's first restart delay and its cap.
    ``plugins`` checks the config and provides the frontends (default:
    ``PluginManager.default()``); the engine-core process loads its own."""
    from tokenloom.engine.keeper import EngineKeeper
    from tokenloom.engine.supervisor import EngineStartError
    from tokenloom.plugin_manager import PluginError, PluginManager
    from tokenloom.text.tokenizer import Tokenizer

    if not config.model:
        from tokenloom.checkpoints.default_model import default_model

        config = msgspec.structs.replace(config, model=default_model())
    try:
        plugins = plugins or PluginManager.default()
        # Component names and [plugin.NAME] settings, before an engine-core starts
        # (and before the trace recorder adds its internal table).
        plugins.check_config(config)
        specs = [plugins.component("frontend", name) for name in config.frontends]
    except (PluginError, ConfigError) as exc:
        log.error("%s", exc)
        return 1
    if config.record_trace:  # the engine-core wraps its engine in the trace recorder
        from tokenloom.engine.trace_recorder import with_recording

        config, engine_factory = with_recording(config, engine_factory)
    keeper = EngineKeeper(config, engine_factory=engine_factory, backoff_s=engine_backoff_s)
    try:
        ready = await keeper.start()
    except EngineStartError as exc:
        # The engine-core logged its traceback already (same stderr): say it once.
        last = str(exc).strip().splitlines()[-1]
        log.error("engine-core failed to start: %s (its traceback is above)", last)
        return 1
    config = msgspec.structs.replace(config, max_model_len=ready.max_model_len)
    log_capacity(config, ready)
    engine = keeper.client
    handle = ServerHandle(config, ready, keeper, engine, loop=asyncio.get_running_loop())
    exit_code = 0
    tasks: list[asyncio.Task[None]] = []
    try:
        tokenizer = Tokenizer.from_dir(config.model)
        plugins.configure(config)
        handle.frontends = [spec.factory(config, engine, tokenizer, ready=ready) for spec in specs]
        tasks = [
            asyncio.create_task(_keep_serving(f), name=f"frontend-{f.name}")
            for f in handle.frontends
        ]
        if handle_signals:
            _stop_on_signals(handle)
        if on_started is not None:
            on_started(handle)
        exit_code = await _serve_until_stopped(handle, tasks)
    except PluginError as exc:
        log.error("%s", exc)
        exit_code = 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        plugins.hook.tokenloom_shutdown(process="frontend")
        # The frontends drained or aborted their requests already: the engine-core
        # needs no grace of its own.
        await keeper.stop(grace_s=1.0)
        log.info("stopped")
    return exit_code


def log_capacity(config: EngineConfig, ready: Ready) -> None:
    """Log the KV cache's capacity: blocks, tokens, and how many full-length
    sequences fit at once."""
    tokens = ready.num_blocks * ready.block_size
    blocks_per_seq = -(-ready.max_model_len // max(ready.block_size, 1))
    full_length = ready.num_blocks // max(blocks_per_seq, 1)
    log.info(
        "model %s: max_model_len %d; KV cache %d blocks x %d = %d tokens; "
        "%d sequences of max_model_len fit at once (max_num_seqs %d)",
        config.model, ready.max_model_len, ready.num_blocks, ready.block_size, tokens,
        full_length, ready.max_num_seqs or config.max_num_seqs,
    )  # fmt: skip


async def _serve_until_stopped(handle: ServerHandle, tasks: list[asyncio.Task[None]]) -> int:
    """Wait for a stop, the keeper giving up on the engine-core, or no frontend left
    serving. Returns the exit code."""
    stopper = asyncio.create_task(handle.stop_event.wait())
    gave_up = asyncio.create_task(handle.keeper.gave_up.wait())
    pending = set(tasks)
    exit_code = 0
    try:
        while True:
            done, pending = await asyncio.wait(
                {stopper, gave_up, *pending}, return_when=asyncio.FIRST_COMPLETED
            )
            pending -= {stopper, gave_up}
            if stopper in done:
                break
            if gave_up in done:
                exit_code = 1
                break
            if not pending:
                log.error("no frontend left serving: stopping")
                exit_code = 1
                break
    finally:
        stopper.cancel()
        gave_up.cancel()
    log.info("stopping (grace %.1fs)", handle.config.shutdown_grace_s)
    return exit_code


async def _keep_serving(frontend: Any) -> None:
    """Run ``frontend.serve()``; when it raises, log it and serve again after a backoff
    (doubling from ``FRONTEND_BACKOFF_S``). Returns when it returns; raises after
    ``MAX_FRONTEND_FAILURES`` failures in a row (the frontend is left stopped)."""
    loop = asyncio.get_running_loop()
    failures = 0
    while True:
        started = loop.time()
        try:
            await frontend.serve()
            return
        except Exception:
            if loop.time() - started >= FRONTEND_STABLE_S:
                failures = 0
            failures += 1
            if failures >= MAX_FRONTEND_FAILURES:
                log.exception("frontend %s failed %d times in a row: left stopped",
                              frontend.name, failures)  # fmt: skip
                raise
            first, cap = FRONTEND_BACKOFF_S
            delay = min(first * 2 ** (failures - 1), cap)
            log.exception("frontend %s failed; serving it again in %.1fs", frontend.name, delay)
        await asyncio.sleep(delay)


def _stop_on_signals(handle: ServerHandle) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle.stop_event.set)
