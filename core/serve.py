"""``tokenloom serve``: the engine-core process behind the configured frontends.

``main(config)`` starts the engine-core through the ``Supervisor``, waits for its
``Ready``, logs the KV capacity, then runs every frontend named in
``config.frontends`` in this process's event loop until SIGINT or SIGTERM. Stopping
is graceful: the frontends stop accepting and give in-flight requests
``config.shutdown_grace_s`` to finish (the rest are aborted), then the engine-core
is shut down; no process outlives ``main``. If the engine-core dies, the frontends
keep answering (503 on /health, an error to every request) until stopped.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenloom.config import EngineConfig
from tokenloom.logging import get_logger
from tokenloom.protocols.control import Ready

log = get_logger(__name__)


@dataclass
class ServerHandle:
    """A running server, handed to ``on_started`` (tests and embedders use it)."""

    config: EngineConfig
    ready: Ready
    supervisor: Any  # tokenloom.supervisor.Supervisor
    engine: Any  # tokenloom.engine_client.AsyncEngineClient
    frontends: list[Any] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        """Begin a graceful stop; safe to call from any thread."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.stop_event.set)


def main(config: EngineConfig) -> int:
    """Serve until SIGINT/SIGTERM. Returns 0 after a clean stop, 1 if start-up failed."""
    return asyncio.run(run(config, handle_signals=True))


async def run(
    config: EngineConfig,
    *,
    engine_factory: Callable[..., Any] | None = None,
    on_started: Callable[[ServerHandle], None] | None = None,
    handle_signals: bool = False,
) -> int:
    """Serve until ``handle.stop()`` (or a signal, with ``handle_signals``).
    ``engine_factory`` replaces the engine built in the engine-core process (it
    must be importable by reference: ``(config, plugin_manager) -> engine``)."""
    from tokenloom.engine_client import AsyncEngineClient
    from tokenloom.plugin_manager import PluginError, PluginManager
    from tokenloom.supervisor import EngineStartError, Supervisor
    from tokenloom.tokenizer import Tokenizer

    if not config.model:
        from tokenloom.default_model import default_model

        config = msgspec.structs.replace(config, model=default_model())
    try:
        plugins = PluginManager.default()
        specs = [plugins.component("frontend", name) for name in config.frontends]
    except PluginError as exc:
        log.error("%s", exc)
        return 1
    supervisor = Supervisor(config, engine_factory=engine_factory)
    try:
        ready = await supervisor.start_async()
    except EngineStartError as exc:
        log.error("%s", exc)
        return 1
    config = msgspec.structs.replace(config, max_model_len=ready.max_model_len)
    log_capacity(config, ready)
    engine = AsyncEngineClient(supervisor.endpoints.input, supervisor.endpoints.output)
    supervisor.watch(lambda code: engine.mark_dead(f"engine-core exited with code {code}"))
    handle = ServerHandle(config, ready, supervisor, engine, loop=asyncio.get_running_loop())
    exit_code = 0
    tasks: list[asyncio.Task[None]] = []
    try:
        tokenizer = Tokenizer.from_dir(config.model)
        plugins.configure(config)
        handle.frontends = [spec.factory(config, engine, tokenizer, ready=ready) for spec in specs]
        tasks = [
            asyncio.create_task(f.serve(), name=f"frontend-{f.name}") for f in handle.frontends
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
        await engine.close()
        # The frontends drained or aborted their requests already: the engine-core
        # needs no grace of its own.
        await supervisor.stop_async(grace_s=1.0)
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
    stopper = asyncio.create_task(handle.stop_event.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    for task in done:
        if task is not stopper and not task.cancelled() and task.exception() is not None:
            log.error("frontend %s failed: %s", task.get_name(), task.exception())
            return 1
    log.info("stopping (grace %.1fs)", handle.config.shutdown_grace_s)
    return 0


def _stop_on_signals(handle: ServerHandle) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle.stop_event.set)
