"""The tensor-parallel executor: rank 0 in the engine-core, ranks 1..N-1 in workers.

Built instead of the single-device ``ModelRunner`` when ``tensor_parallel_size`` > 1
(``plugins.executor.plugin.make_executor``). Rank 0 is an ordinary
``ModelRunner`` built for its shard, in this process; ``WorkerPool`` starts and watches
the other ranks. Per step the ``StepInput`` is encoded once and published on the
``worker-steps`` socket, then rank 0 runs it; the ranks meet in the collectives of the
forward pass, and every rank samples the same tokens from the same gathered logits,
so no tokens are sent back. Rank 0's ``StepOutput`` is the step's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, NoReturn

import torch
import zmq

from tokenloom.config import EngineConfig
from tokenloom.plugins.executor.model_runner import ModelRunner
from tokenloom.plugins.executor.parallel import group as dist_group
from tokenloom.plugins.executor.parallel import symmetric
from tokenloom.plugins.executor.parallel.worker import Command, worker_plugin_modules
from tokenloom.plugins.executor.parallel.workers import WorkerDiedError, WorkerPool
from tokenloom.protocols.components.executor import Executor, PendingStep
from tokenloom.protocols.components.model import ModelInfo
from tokenloom.protocols.step import StepInput, StepOutput
from tokenloom.transport.serde import Encoder
from tokenloom.transport.sockets import ipc_endpoint, make_socket, remove_ipc_file

if TYPE_CHECKING:
    from tokenloom.plugin_manager import PluginManager

log = logging.getLogger("tokenloom.executor.parallel")

# How long a failed collective waits for the pool to name the worker that died.
_DEATH_REPORT_S = 2.0


class TensorParallelExecutor(Executor):
    supports_pipelining = True

    def __init__(self, config: EngineConfig, plugins: PluginManager) -> None:
        self.size = config.tensor_parallel_size
        from tokenloom.plugin_manager import PluginManager

        # first: a plugin the workers cannot load fails the start before anything starts
        plugin_modules = worker_plugin_modules(
            plugins.registered(), set(PluginManager.default().registered()), self.size
        )
        self.backend = dist_group.choose_backend(config)
        self.config = config = dist_group.rank_config(config, self.backend)
        self.plugins = plugins
        self._threads_before = dist_group.share_cpu(config)
        self.runner = ModelRunner(config, plugins)
        self.runner.device = dist_group.rank_device(config, 0)
        self._ctx = zmq.Context()
        self._endpoint = ipc_endpoint("worker-steps")
        self._steps = make_socket(self._ctx, "worker-steps", self._endpoint, bind=True)
        self._encoder = Encoder()
        self.pool = WorkerPool(config, self.backend, self._endpoint, plugin_modules)
        self.group: dist_group.DistributedGroup | None = None

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's shard of the model."""
        return self.runner.model

    @property
    def rank_info(self) -> ModelInfo:
        """The model as rank 0 holds it (its heads; see ``parallel.rank_model_info``)."""
        return self.runner.rank_info

    @property
    def memory(self) -> Mapping[str, float]:  # type: ignore[override]
        return self.runner.memory

    @property
    def timings(self) -> Mapping[str, float]:  # type: ignore[override]
        return self.runner.timings

    # ------------------------------------------------------------------ start-up

    def load_model(self) -> ModelInfo:
        started = time.perf_counter()
        timeout = self.config.engine_start_timeout_s
        try:
            self._convert_gguf_once()
            store = dist_group.open_store(self.pool.store_port, 0, self.size, timeout)
            self.pool.start()
            self.pool.wait_joined(store, timeout)
            self.group = dist_group.join(store, 0, self.size, self.backend, timeout)
            self.runner.group = self.group
            info = self.runner.load_model()
            symmetric.enable(self.group, self.config, info.hidden_size, self.runner.dtype)
        except BaseException:
            self.shutdown()  # no worker, socket or process group outlives a failed start
            raise
        self.runner.timings["tp_start_s"] = time.perf_counter() - started
        log.info(
            "tensor parallel: %d ranks over %s, workers %s",
            self.size,
            self.backend,
            self.pool.pids,
        )
        return info

    def _convert_gguf_once(self) -> None:
        """A GGUF checkpoint is dequantized into the cache here, once, before the workers
        start; then every rank reads only its shard of the converted file (instead of
        each rank converting the whole file)."""
        from pathlib import Path

        from tokenloom.plugins.executor.model_runner import DTYPES
        from tokenloom.plugins.models.gguf import find_gguf

        gguf_file = find_gguf(Path(self.config.model))
        if gguf_file is not None and self.config.load_format != "random":
            from tokenloom.plugins.models.gguf.checkpoint import converted_weights

            converted_weights(gguf_file, DTYPES[self.config.dtype])

    def num_kv_blocks(self, block_size: int) -> int:
        """The smallest count over the ranks: every rank's pool has the same blocks."""
        group = self._command(Command.NUM_KV_BLOCKS, block_size)
        try:  # profiling runs forward passes, with their collectives, on every rank
            return group.all_reduce_min(self.runner.num_kv_blocks(block_size))
        except RuntimeError as exc:
            self._raise_death(exc)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._command(Command.INIT_KV_CACHE, num_blocks, block_size)
        try:  # graph capture's warm-up passes run collectives
            self.runner.init_kv_cache(num_blocks, block_size)
        except RuntimeError as exc:
            self._raise_death(exc)

    def _command(self, command: Command, a: int = 0, b: int = 0) -> dist_group.DistributedGroup:
        assert self.group is not None, "load_model first"
        self.pool.raise_if_dead()
        try:
            self.group.broadcast_ints([int(command), a, b])
        except RuntimeError as exc:  # a worker died during its start-up
            self._raise_death(exc)
        return self.group

    # ------------------------------------------------------------------ steps

    def execute(self, step: StepInput) -> StepOutput:
        return self.submit(step).result()

    def submit(self, step: StepInput) -> PendingStep:
        self.pool.raise_if_dead()
        self._steps.send_multipart(self._encoder.encode(step), copy=False)
        try:
            return self.runner.submit(step)
        except RuntimeError as exc:  # a collective failed: most likely a worker died
            self._raise_death(exc)

    def _raise_death(self, exc: RuntimeError) -> NoReturn:
        """Re-raise a failed collective as WorkerDiedError when a worker died."""
        if self.pool.wait_for_death(_DEATH_REPORT_S):
            raise WorkerDiedError(str(self.pool.failure)) from exc
        raise exc

    def shutdown(self) -> None:
        if self._steps.closed:  # already shut down
            return
        self.runner.shutdown()
        self.pool.terminate()
        dist_group.leave()  # a worker waiting in a collective sees the group close
        self.pool.wait_stopped()
        self._steps.close(linger=0)
        self._ctx.term()
        remove_ipc_file(self._endpoint)
        torch.set_num_threads(self._threads_before)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


__all__ = ["TensorParallelExecutor", "WorkerDiedError"]
