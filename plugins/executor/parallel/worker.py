"""A tensor-parallel worker process: ``python -m tokenloom.plugins.executor.parallel.worker``.

Rank 0 (the engine-core) starts one per extra rank, a ``WorkerSpec`` on stdin. The
worker joins the process group, loads its shard with the same ``ModelRunner`` as
rank 0, mirrors rank 0's start-up calls (``Command``s broadcast over the group, so
the collectives of the KV-pool profiling line up), then runs every ``StepInput`` it
receives on the ``worker-steps`` socket. It samples like rank 0 (the same logits on
every rank, the same seeds), so its placeholder tokens under async scheduling are
rank 0's; its ``StepOutput`` is dropped. It exits on SIGTERM, when a collective fails
(another rank died), or when its parent dies (a watchdog thread checks every 0.5 s).

Plugins: a worker builds ``PluginManager.default()`` (built-ins and entry points) like
rank 0; the caller's extra plugins (``LLM(plugins=[...])``) reach it by module name
(``plugin_modules``), so only importable modules can be passed; anything else is refused
at start-up rather than leaving the ranks with different components or hooks.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import logging
import signal
import sys
import types
from types import FrameType

import msgspec

from tokenloom.config import ConfigError, EngineConfig

log = logging.getLogger("tokenloom.executor.worker")


class WorkerSpec(msgspec.Struct, kw_only=True):
    """What rank 0 hands a worker on its stdin (msgpack)."""

    config: EngineConfig  # resolved: no "auto" device or dtype left
    rank: int
    backend: str  # "gloo" | "nccl"
    store_port: int  # rank 0's TCPStore
    steps_endpoint: str  # rank 0's "worker-steps" PUB socket
    parent_pid: int
    sys_path: list[str] = []
    plugin_modules: list[tuple[str, str]] = []  # (registered name, module) to import


class Command(enum.IntEnum):
    """Start-up calls rank 0 makes after loading; broadcast as ``[command, a, b]``."""

    NUM_KV_BLOCKS = 1  # a = block_size; then every rank all-reduces its count (MIN)
    INIT_KV_CACHE = 2  # a = num_blocks, b = block_size; then the step loop starts
    STOP = 3


def worker_plugin_modules(
    registered: dict[str, object], baseline: set[str], size: int
) -> list[tuple[str, str]]:
    """The plugins in ``registered`` that a fresh ``PluginManager.default()`` lacks (names
    not in ``baseline``), as (name, module name) for the workers to import. Raises
    ``ConfigError`` for one that is not a module importable by name (an object, or a
    module of ``__main__``): the workers could not load it, and ranks running with
    different components or hooks would compute different things."""
    result = []
    for name, plugin in registered.items():
        if name in baseline:
            continue
        module = getattr(plugin, "__name__", None)
        importable = (
            isinstance(plugin, types.ModuleType)
            and module not in (None, "__main__")
            and importlib.util.find_spec(module) is not None
        )
        if not importable:
            raise ConfigError(
                f"tensor_parallel_size={size}: plugin {name!r} ({plugin!r}) cannot be passed "
                "to the tensor-parallel worker processes, which load extra plugins by module "
                "name; register a module importable by name (its @hookimpl functions at "
                "module level, not in __main__), or install it as a 'tokenloom' entry point"
            )
        result.append((name, module))
    return result


def main() -> int:
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    sys.path[:0] = [p for p in spec.sys_path if p not in sys.path]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(message)s")
    return run_worker(spec)


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def run_worker(spec: WorkerSpec) -> int:
    import torch
    import zmq

    from tokenloom.engine.process import _watch_parent
    from tokenloom.plugin_manager import PluginManager
    from tokenloom.plugins.executor.model_runner import ModelRunner
    from tokenloom.plugins.executor.parallel import group as dist_group
    from tokenloom.plugins.executor.parallel import symmetric
    from tokenloom.protocols.step import StepInput
    from tokenloom.transport.serde import Decoder
    from tokenloom.transport.sockets import SOCKETS, make_socket

    signal.signal(signal.SIGTERM, _stop)
    _watch_parent(spec.parent_pid, 2.0)
    config = spec.config
    dist_group.share_cpu(config)
    ctx = zmq.Context()
    steps = make_socket(ctx, "worker-steps", spec.steps_endpoint, bind=False)
    size = config.tensor_parallel_size
    try:
        # Subscribed before the rendezvous, so no step is published before it listens.
        store = dist_group.open_store(
            spec.store_port, spec.rank, size, config.engine_start_timeout_s
        )
        store.set(f"worker-{spec.rank}", "ready")
        group = dist_group.join(store, spec.rank, size, spec.backend, config.engine_start_timeout_s)
        pm = PluginManager.default()
        for name, module in spec.plugin_modules:  # an import error fails the start
            pm.register(importlib.import_module(module), name)
        pm.configure(config)
        runner = ModelRunner(config, pm)
        runner.device = dist_group.rank_device(config, spec.rank)
        runner.group = group
        info = runner.load_model()
        symmetric.enable(group, config, info.hidden_size, runner.dtype)
        while True:
            command, a, b = group.broadcast_ints([0, 0, 0])
            if command == Command.NUM_KV_BLOCKS:
                group.all_reduce_min(runner.num_kv_blocks(a))
            elif command == Command.INIT_KV_CACHE:
                runner.init_kv_cache(a, b)
                break
            else:
                return 0
        decoder: Decoder[StepInput] = Decoder(StepInput, SOCKETS["worker-steps"].max_message_bytes)
        pending = None
        with torch.inference_mode():
            while True:
                step = decoder.decode(steps.recv_multipart(copy=False))
                launched = runner.submit(step)
                if pending is not None:  # one step in flight, as on rank 0
                    pending.result()
                pending = launched
    except SystemExit:
        return 0
    finally:
        steps.close(linger=0)
        ctx.term()
        dist_group.leave()


if __name__ == "__main__":
    sys.exit(main())
