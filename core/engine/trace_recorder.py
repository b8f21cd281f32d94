"""The server's request log (``tokenloom serve --record-trace FILE``), for ``tokenloom sim``.

``TraceRecorder`` wraps the engine in the engine-core process (it is an
``EngineCore`` itself) and appends one JSON line per finished request: arrival
(seconds since the epoch; the simulator starts the trace at its first request),
prompt length, output length, priority, tenant and finish reason, the fields of
``sim.workload.TraceRequest``, plus the engine's own timings when the scheduler
gives them (``RequestMetrics`` on the last delta: TTFT, E2E, queue time,
preemptions). Never any text or token id. A request the engine refuses at once is
not recorded (it never entered); lines are written when requests finish, so they
are ordered by finish, and the simulator sorts them by arrival.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from tokenloom.config import EngineConfig

FACTORY_KEY = "trace_recorder"  # config.plugin[FACTORY_KEY]["engine_factory"]: the wrapped one


class _Live(msgspec.Struct, gc=False):
    arrival: float  # time.time() scale
    prompt_len: int
    priority: int
    tenant: str
    num_output: int = 0


class TraceRecorder:
    def __init__(self, engine: Any, path: str, clock: Any = time.monotonic) -> None:
        self.engine = engine
        self._clock = clock
        self._epoch_offset = time.time() - clock()  # engine clock -> seconds since the epoch
        self._file = open(path, "ab")  # noqa: SIM115 - closed by shutdown
        self._encoder = msgspec.json.Encoder()
        self._live: dict[str, _Live] = {}

    # EngineCore ------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        self.engine.add_request(request)  # raises for a refused request: not recorded
        arrival = (request.arrival_time or self._clock()) + self._epoch_offset
        self._live[request.request_id] = _Live(
            arrival, len(request.prompt_token_ids), request.priority, request.tenant
        )

    def abort(self, request_ids: Sequence[str]) -> list[Any]:
        deltas = self.engine.abort(request_ids)
        self._observe(deltas)
        return deltas

    def step(self) -> list[Any]:
        deltas = self.engine.step()
        self._observe(deltas)
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished())

    def stats(self) -> Any:
        return self.engine.stats()

    def ready_info(self) -> Any:
        return self.engine.ready_info()

    def shutdown(self) -> None:
        self._file.close()
        self.engine.shutdown()

    # ------------------------------------------------------------------------------

    def _observe(self, deltas: list[Any]) -> None:
        live = self._live
        for delta in deltas:
            entry = live.get(delta.request_id)
            if entry is None:
                continue
            entry.num_output += len(delta.new_token_ids)
            if delta.finish_reason is None:
                continue
            del live[delta.request_id]
            self._write(entry, delta)

    def _write(self, entry: _Live, delta: Any) -> None:
        line: dict[str, Any] = {
            "arrival_s": round(entry.arrival, 6),
            "prompt_len": entry.prompt_len,
            "output_len": entry.num_output,
            "finish_reason": delta.finish_reason,
        }
        if entry.priority:
            line["priority"] = entry.priority
        if entry.tenant:
            line["tenant"] = entry.tenant
        metrics = getattr(delta, "metrics", None)
        if metrics is not None and metrics.arrival_time:
            start = metrics.arrival_time
            if metrics.first_token_time:
                line["ttft_s"] = round(metrics.first_token_time - start, 6)
            if metrics.finished_time:
                line["e2e_s"] = round(metrics.finished_time - start, 6)
            if metrics.first_scheduled_time:
                line["queue_s"] = round(metrics.first_scheduled_time - start, 6)
            line["preemptions"] = metrics.num_preemptions
        self._file.write(self._encoder.encode(line) + b"\n")
        self._file.flush()


def recording_engine(config: EngineConfig, plugins: Any) -> TraceRecorder:
    """The engine factory ``tokenloom serve`` uses with ``record_trace``: builds the
    engine the usual way (or with the factory named in
    ``config.plugin["trace_recorder"]["engine_factory"]``) and wraps it."""
    inner = config.plugin.get(FACTORY_KEY, {}).get("engine_factory")
    if inner:
        module_name, _, qualname = str(inner).partition(":")
        build: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            build = getattr(build, part)
        engine = build(config, plugins)
    else:
        from tokenloom.engine.engine_core import Engine

        engine = Engine.from_config(config, plugins)
    return TraceRecorder(engine, config.record_trace)


def with_recording(config: EngineConfig, engine_factory: Any) -> tuple[EngineConfig, Any]:
    """``(config, factory)`` for a server that records its trace: ``recording_engine``,
    with the factory it wraps (if any) named in the config by reference."""
    if not config.record_trace:
        return config, engine_factory
    if engine_factory is not None:
        if isinstance(engine_factory, str):
            ref = engine_factory
        else:
            ref = f"{engine_factory.__module__}:{engine_factory.__qualname__}"
        plugin = dict(config.plugin)
        plugin[FACTORY_KEY] = {"engine_factory": ref}
        config = msgspec.structs.replace(config, plugin=plugin)
    return config, recording_engine
