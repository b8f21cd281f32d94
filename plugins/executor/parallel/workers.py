"""Start, watch and stop the tensor-parallel worker processes (ranks 1..N-1).

Each worker is a fresh interpreter (``python -m ...parallel.worker``, its
``WorkerSpec`` on stdin), like the engine-core under its supervisor: nothing of the
parent's ``__main__`` is re-imported. A watcher thread polls the processes every
0.1 s; when one dies unexpectedly it records why, kills the other workers (their
collectives would wait for the dead one) and, on NCCL, aborts the process group so
that rank 0's waiting collective fails instead of hanging. Rank 0's next (or
current) step then raises ``WorkerDiedError`` naming the rank, its pid and exit code.
Workers also stop themselves when their parent dies, so none outlives the engine.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec

from tokenloom.config import EngineConfig
from tokenloom.plugins.executor.parallel import group as dist_group
from tokenloom.plugins.executor.parallel.worker import WorkerSpec

log = logging.getLogger("tokenloom.executor.parallel")

POLL_S = 0.1
STOP_GRACE_S = 3.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the group cannot run steps any more."""


class WorkerPool:
    """Ranks 1..N-1 of one tensor-parallel group."""

    def __init__(
        self,
        config: EngineConfig,
        backend: str,
        steps_endpoint: str,
        plugin_modules: list[tuple[str, str]] | None = None,
    ) -> None:
        self.config = config
        self.plugin_modules = plugin_modules or []  # the caller's extra plugins, by module
        self.backend = backend
        self.steps_endpoint = steps_endpoint
        self.store_port = dist_group.free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.failure: str | None = None
        self._died = threading.Event()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        for rank in range(1, self.config.tensor_parallel_size):
            spec = WorkerSpec(
                config=self.config,
                rank=rank,
                backend=self.backend,
                store_port=self.store_port,
                steps_endpoint=self.steps_endpoint,
                parent_pid=os.getpid(),
                sys_path=list(sys.path),
                plugin_modules=self.plugin_modules,
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", "tokenloom.plugins.executor.parallel.worker"],
                stdin=subprocess.PIPE,
            )
            self.procs.append(proc)
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError), proc.stdin as stdin:
                stdin.write(msgspec.msgpack.encode(spec))
        atexit.register(self._kill_all)
        self._watcher = threading.Thread(target=self._watch, name="tp-workers", daemon=True)
        self._watcher.start()

    def wait_joined(self, store: Any, timeout_s: float) -> None:
        """Wait until every worker reached the rendezvous; fail at once if one died."""
        keys = [f"worker-{rank}" for rank in range(1, len(self.procs) + 1)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            self.raise_if_dead()
            if time.monotonic() > deadline:
                self._kill_all()
                raise WorkerDiedError(f"tensor-parallel workers did not start in {timeout_s}s")
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ health

    def raise_if_dead(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def wait_for_death(self, timeout_s: float) -> bool:
        return self._died.wait(timeout_s)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    self._on_death(rank, proc.pid, code)
                    return
            time.sleep(POLL_S)

    def _on_death(self, rank: int, pid: int, code: int) -> None:
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self.failure = (
            f"tensor-parallel worker rank {rank} (pid {pid}) {how}; "
            "the tensor-parallel group is shut down"
        )
        log.error("%s", self.failure)
        self._kill_all()
        if self.backend == "nccl":  # a dead peer leaves NCCL collectives waiting forever
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                dist.distributed_c10d._abort_process_group()
        self._died.set()

    # ------------------------------------------------------------------ stop

    def terminate(self) -> None:
        """Ask every worker to stop (SIGTERM); ``wait_stopped`` then reaps them."""
        self._stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()

    def wait_stopped(self, grace_s: float = STOP_GRACE_S) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop in %.0fs; killing it", proc.pid, grace_s)
                proc.kill()
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(1.0)

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
