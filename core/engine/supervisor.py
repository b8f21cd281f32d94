"""Process supervision of the engine-core: start, readiness handshake, watch, stop.

``Supervisor.start()`` starts the engine-core as a fresh interpreter
(``python -m tokenloom.engine.process``, its ``LaunchSpec`` on stdin: nothing of the
parent's ``__main__`` is re-imported, unlike multiprocessing's spawn), then waits
for its ``Ready`` on the ``control`` socket, which the supervisor binds.
``watch(on_death)`` calls back (from a watcher thread) as soon as the process dies
unexpectedly; ``stop()`` sends ``Shutdown`` and escalates to SIGTERM, then SIGKILL.
The child also watches its parent and stops itself when the parent dies, so no
engine-core outlives the process that started it. Each method has an ``*_async``
twin that runs it off the event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from tokenloom.config import EngineConfig
from tokenloom.engine.process import LaunchSpec
from tokenloom.logging import get_logger
from tokenloom.protocols.control import ControlMessage, Failed, Ready, Shutdown
from tokenloom.transport.serde import DecodeError, Decoder, Encoder
from tokenloom.transport.sockets import SOCKETS, EngineEndpoints, make_socket

log = get_logger(__name__)


class EngineStartError(RuntimeError):
    """The engine-core did not become ready; the message holds its traceback, or
    its exit code, or the timeout."""


class Supervisor:
    """Owns one engine-core process. Not thread-safe: call from one thread (or one
    event loop through the ``*_async`` methods)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        endpoints: EngineEndpoints | None = None,
        engine_factory: Callable[..., Any] | None = None,
    ) -> None:
        self.config = config
        self.endpoints = endpoints or EngineEndpoints.new_ipc()
        self.engine_factory = engine_factory  # module-level: imported by name in the child
        self.ready: Ready | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._ctx: zmq.Context | None = None
        self._control: zmq.Socket | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def exitcode(self) -> int | None:
        """The exit status; negative: killed by that signal. None while running."""
        return self._process.poll() if self._process is not None else None

    # ------------------------------------------------------------------ start

    def start(self) -> Ready:
        """Spawn the engine-core and wait up to ``config.engine_start_timeout_s`` for
        ``Ready``. Raises EngineStartError (the process is then gone)."""
        self._ctx = zmq.Context()
        self._control = make_socket(self._ctx, "control", self.endpoints.control, bind=True)
        factory = self.engine_factory
        spec = LaunchSpec(
            config=self.config,
            endpoints=self.endpoints,
            engine_factory=f"{factory.__module__}:{factory.__qualname__}" if factory else None,
            parent_pid=os.getpid(),
            sys_path=list(sys.path),
        )
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tokenloom.engine.process"], stdin=subprocess.PIPE
        )
        atexit.register(self._kill_now)
        try:
            assert self._process.stdin is not None
            with contextlib.suppress(BrokenPipeError), self._process.stdin as stdin:
                stdin.write(msgspec.msgpack.encode(spec))  # a dead child is reported below
            self.ready = self._wait_ready(self.config.engine_start_timeout_s)
        except BaseException:
            self._kill_now()
            self._close()
            raise
        log.info("engine-core %d ready", self._process.pid)
        return self.ready

    async def start_async(self) -> Ready:
        return await asyncio.to_thread(self.start)

    def _wait_ready(self, timeout_s: float) -> Ready:
        assert self._control is not None and self._process is not None
        decoder: Decoder[Any] = Decoder(ControlMessage, SOCKETS["control"].max_message_bytes)
        deadline = time.monotonic() + timeout_s
        while True:
            # Check for a message before the process state: a child that sent
            # Failed and exited must report its traceback, not just an exit code.
            if self._control.poll(100):
                try:
                    msg = decoder.decode(self._control.recv_multipart(copy=False))
                except DecodeError as exc:
                    log.warning("bad control message from the engine-core: %s", exc)
                    continue
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, Failed):
                    raise EngineStartError(f"engine-core failed to start:\n{msg.message}")
            elif self._process.poll() is not None:
                if self._control.poll(500):
                    continue  # its last message was still on the way
                raise EngineStartError(
                    f"engine-core exited with code {self._process.returncode} before it was ready"
                )
            elif time.monotonic() > deadline:
                raise EngineStartError(f"engine-core not ready within {timeout_s:g}s")

    # ------------------------------------------------------------------ watch

    def watch(self, on_death: Callable[[int | None], None]) -> None:
        """Call ``on_death(exitcode)`` from a watcher thread once the engine-core dies
        without ``stop`` having been asked for. Detection takes well under a second.
        ``on_death`` must be thread-safe (e.g. ``AsyncEngineClient.mark_dead``)."""
        process = self._process
        if process is None:
            raise RuntimeError("watch() before start()")

        def run() -> None:
            code = process.wait()  # returns the moment the process is gone
            if not self._stopping.is_set():
                log.error("engine-core %d died (exit code %s)", process.pid, code)
                on_death(code)

        self._watcher = threading.Thread(target=run, name="engine-core-watcher", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ stop

    def stop(self, grace_s: float | None = None) -> int | None:
        """Ask the engine-core to shut down (finishing in-flight work for ``grace_s``,
        default ``config.shutdown_grace_s``), then SIGTERM, then SIGKILL. Returns the
        exit code. Idempotent."""
        self._stopping.set()
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        process = self._process
        if process is not None and process.poll() is None and self._control is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._control.send_multipart(Encoder().encode(Shutdown(grace)), zmq.NOBLOCK)
            if not _wait(process, grace + 5.0):
                log.warning("engine-core %d ignored Shutdown; terminating", process.pid)
                process.terminate()
                if not _wait(process, 2.0):
                    process.kill()
                    process.wait()
        self._close()
        return self.exitcode

    async def stop_async(self, grace_s: float | None = None) -> int | None:
        return await asyncio.to_thread(self.stop, grace_s)

    def _kill_now(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._stopping.set()
            self._process.kill()
            _wait(self._process, 5.0)

    def _close(self) -> None:
        atexit.unregister(self._kill_now)
        if self._control is not None:
            self._control.close(linger=0)
            self._control = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self.endpoints.remove_files()

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for the process to exit; False if it still runs after ``timeout_s``."""
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True
