"""The engine-core process: ``python -m tokenloom.engine.process``.

The supervisor starts it with a ``LaunchSpec`` on stdin. ``engine_core_main`` builds
the engine, reports ``Ready`` (or ``Failed``) on the control socket, runs the engine
loop (``tokenloom.engine.loop``), and shuts down cleanly on ``Shutdown``, SIGTERM or
SIGINT; a watchdog stops it when its parent dies.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio

from tokenloom.config import EngineConfig
from tokenloom.engine.loop import request_id_limit, run_engine_loop
from tokenloom.logging import get_logger
from tokenloom.protocols.components.engine import EngineCore
from tokenloom.protocols.control import Failed
from tokenloom.transport.serde import Encoder
from tokenloom.transport.sockets import EngineEndpoints, make_socket, remove_ipc_file

log = get_logger(__name__)

EngineFactory = Callable[[EngineConfig, Any], EngineCore]  # (config, plugin_manager) -> engine


class LaunchSpec(msgspec.Struct, kw_only=True):
    """What the supervisor hands a new engine-core process on its stdin (msgpack).

    ``engine_factory`` is ``"module:qualname"`` of a ``(config, plugin_manager) ->
    engine`` callable (None: ``tokenloom.engine.engine_core.Engine.from_config``); ``sys_path``
    is the parent's, so that the factory imports in the child as in the parent."""

    config: EngineConfig
    endpoints: EngineEndpoints
    engine_factory: str | None = None
    parent_pid: int | None = None
    sys_path: list[str] = []


def main() -> int:
    """``python -m tokenloom.engine.process``: read a LaunchSpec from stdin, then serve."""
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=LaunchSpec)
    sys.path[:0] = [p for p in spec.sys_path if p not in sys.path]
    return engine_core_main(spec.config, spec.endpoints, spec.engine_factory, spec.parent_pid)


def engine_core_main(
    config: EngineConfig,
    endpoints: EngineEndpoints,
    engine_factory: EngineFactory | str | None = None,
    parent_pid: int | None = None,
) -> int:
    """The engine-core process: build the engine with ``engine_factory`` (a callable or
    ``"module:qualname"``), send Ready or Failed on the control socket, serve until
    Shutdown/SIGTERM/SIGINT. With ``parent_pid``, it stops itself when that parent
    dies. Returns the exit code: 0 after a clean shutdown, 1 if start-up failed."""
    if parent_pid is not None:
        _watch_parent(parent_pid, config.shutdown_grace_s + 5.0)
    return asyncio.run(_serve(config, endpoints, engine_factory))


async def _serve(
    config: EngineConfig, endpoints: EngineEndpoints, factory: EngineFactory | str | None
) -> int:
    ctx = zmq.asyncio.Context()
    control = make_socket(ctx, "control", endpoints.control, bind=False)
    encoder = Encoder()
    sockets: list[zmq.asyncio.Socket] = [control]
    try:
        try:
            from tokenloom.plugin_manager import PluginManager

            input_sock = make_socket(ctx, "engine-input", endpoints.input, bind=True)
            sockets.append(input_sock)
            output_sock = make_socket(ctx, "engine-output", endpoints.output, bind=True)
            sockets.append(output_sock)
            build = _resolve_factory(factory)
            pm = PluginManager.default()
            engine = build(config, pm)
        except BaseException:
            tb = traceback.format_exc()
            log.error("engine-core failed to start:\n%s", tb)
            await control.send_multipart(encoder.encode(Failed(tb)))
            return 1
        await control.send_multipart(encoder.encode(engine.ready_info()))
        log.info("engine-core %d serving", os.getpid())
        try:
            await run_engine_loop(
                engine,
                input_sock,
                output_sock,
                control_sock=control,
                grace_s=config.shutdown_grace_s,
                handle_signals=True,
                max_request_id_bytes=request_id_limit(config),
            )
        finally:  # also after a failed step: plugins and devices are released
            pm.hook.tokenloom_shutdown(process="engine-core")
            engine.shutdown()
        return 0
    finally:
        for sock in sockets:
            sock.close()
        ctx.term()
        remove_ipc_file(endpoints.input)
        remove_ipc_file(endpoints.output)


def _resolve_factory(factory: EngineFactory | str | None) -> EngineFactory:
    if factory is None:
        return _default_engine_factory
    if isinstance(factory, str):
        module_name, _, qualname = factory.partition(":")
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        return cast(EngineFactory, target)
    return factory


def _default_engine_factory(config: EngineConfig, pm: Any) -> EngineCore:
    from tokenloom.engine.engine_core import Engine

    return Engine.from_config(config, pm)


def _watch_parent(parent_pid: int, hard_exit_after_s: float) -> None:
    """No orphans: when the parent dies, stop cleanly, and exit hard if that hangs."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        log.warning("parent %d died; shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(hard_exit_after_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
