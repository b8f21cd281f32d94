"""The discrete-event simulation of the engine loop.

The scheduler and the KV-cache manager are the real plugins, built by the plugin
manager from an ``EngineConfig`` exactly as ``Engine.from_config`` builds them; they
see the same ``add_request`` / ``schedule`` / ``update`` calls in the same order as
in ``Engine.step`` (pipelined like async scheduling on CUDA, or not). Only the
executor is replaced (``SimExecutor``): it returns sampled ids at once and the
cost model says how long the GPU would have taken, which advances a simulated
clock. The scheduler's clock is the simulated one when its factory takes ``clock``
(deadlines then expire in simulated time).

Requests enter when the simulated clock reaches their arrival (between steps, as
the engine-core loop drains its input between steps); when nothing runs the clock
jumps to the next arrival. Host time is not simulated: the cost model's per-step
term carries it.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenloom.config import EngineConfig
from tokenloom.protocols.components.errors import QueueFullError
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.sim.cost_model import CostModel
from tokenloom.sim.executor import TOKEN, SimExecutor
from tokenloom.sim.workload import TraceRequest

NAN = float("nan")


@dataclass
class RequestRecord:
    """What happened to one request, in simulated seconds since the trace began."""

    arrival: float
    prompt_len: int
    output_len: int  # wanted
    priority: int = 0
    tenant: str = ""
    started: float = NAN  # its first chunk began on the device
    first_token: float = NAN
    finished: float = NAN
    num_output: int = 0
    finish_reason: str = ""  # "rejected" when the engine refused it
    preemptions: int = 0


@dataclass
class SimResult:
    label: str
    config: dict[str, Any]
    requests: list[RequestRecord]
    timeline: list[tuple[float, int, int, float]]  # (time, waiting, running, KV use 0..1)
    num_steps: int = 0
    num_preemptions: int = 0
    recomputed_tokens: int = 0
    wall_s: float = 0.0
    sim_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def build_components(config: EngineConfig, plugins: Any, clock: Any) -> tuple[Any, Any]:
    """The KV manager and scheduler the config names, built as the engine builds them."""
    kv = plugins.build("kv_cache", config.kv_cache, config, config.num_blocks, config.block_size)
    factory = plugins.component("scheduler", config.scheduler).factory
    try:
        takes_clock = "clock" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_clock = False
    scheduler = factory(config, kv, clock=clock) if takes_clock else factory(config, kv)
    return kv, scheduler


def simulate(
    trace: list[TraceRequest],
    config: EngineConfig,
    cost: CostModel,
    plugins: Any,
    *,
    label: str = "",
    pipelined: bool = True,
    samples: int = 2000,
) -> SimResult:
    """Run ``trace`` through the scheduler ``config`` names; ``config.num_blocks`` and
    ``config.max_model_len`` must be set. ``samples`` bounds the timeline's length."""
    if config.num_blocks is None or config.max_model_len is None:
        raise ValueError("num_blocks and max_model_len must be set for a simulation")
    now = 0.0
    kv, scheduler = build_components(config, plugins, lambda: now)
    executor = SimExecutor(cost, config.max_num_seqs, config.enforce_eager, config.max_graph_batch)
    records = [
        RequestRecord(r.arrival_s, r.prompt_len, r.output_len, r.priority, r.tenant) for r in trace
    ]
    index_of: dict[str, int] = {}
    span = trace[-1].arrival_s if trace else 0.0
    interval = max(span, 1.0) / samples
    next_sample = 0.0
    timeline: list[tuple[float, int, int, float]] = []
    num_blocks = kv.num_blocks
    in_flight: tuple[Any, Any, float] | None = None
    device_free = 0.0
    arrivals = len(trace)
    i = 0
    steps = 0
    started_wall = time.perf_counter()

    def fold(deltas: list[Any], at: float) -> None:
        for delta in deltas:
            rec = records[index_of[delta.request_id]]
            if delta.new_token_ids:
                if rec.num_output == 0:
                    rec.first_token = at
                rec.num_output += len(delta.new_token_ids)
            if delta.finish_reason is not None:
                rec.finished = at
                rec.finish_reason = delta.finish_reason

    while True:
        while i < arrivals and trace[i].arrival_s <= now:
            _add(scheduler, trace[i], i, records[i], index_of, config)
            i += 1
        if in_flight is None and not scheduler.has_unfinished_requests():
            if i >= arrivals:
                break
            now = max(now, trace[i].arrival_s)
            continue
        step = scheduler.schedule()
        submitted = None
        if step.chunks or step.finished_request_ids:
            output = executor.execute(step)
            begin = max(now, device_free)
            device_free = begin + (executor.step_time(step) if step.chunks else 0.0)
            for request_id in executor.started:
                records[index_of[request_id]].started = begin
            submitted = (step, output, device_free)
            steps += 1 if step.chunks else 0
        if now >= next_sample:
            stats = scheduler.stats()
            used = 1.0 - stats.num_blocks_free / num_blocks
            timeline.append((now, stats.num_waiting, stats.num_running, used))
            next_sample = now + interval
        if pipelined:
            done, in_flight = in_flight, submitted
        else:
            done = submitted
        if done is None:
            if submitted is None:  # nothing could run: wait for the next arrival
                if i >= arrivals:
                    raise RuntimeError(
                        f"scheduler {config.scheduler!r} made no progress with "
                        "requests left and none arriving"
                    )
                now = max(now, trace[i].arrival_s)
            continue
        now = max(now, done[2])
        fold(scheduler.update(done[0], done[1]), now)
    for request_id, count in executor.preempted.items():
        records[index_of[request_id]].preemptions = count
    return SimResult(
        label=label or config.scheduler,
        config={
            k: getattr(config, k)
            for k in (
                "scheduler",
                "max_num_seqs",
                "max_num_batched_tokens",
                "num_blocks",
                "block_size",
                "max_model_len",
                "enable_prefix_caching",
            )
        }
        | {"pipelined": pipelined, "cost_model": cost.shape.name},
        requests=records,
        timeline=timeline,
        num_steps=steps,
        num_preemptions=sum(executor.preempted.values()),
        recomputed_tokens=executor.num_recomputed_tokens,
        wall_s=time.perf_counter() - started_wall,
        sim_s=now,
    )


def _add(
    scheduler: Any,
    request: TraceRequest,
    index: int,
    record: RequestRecord,
    index_of: dict[str, int],
    config: EngineConfig,
) -> None:
    """Submit one trace request. Its prompt is distinct from every other one (the
    first id is the request's index), so the prefix cache finds nothing to share,
    as with the random prompts ``bench serve --trace`` sends."""
    request_id = f"r{index}"
    prompt = [index + TOKEN + 1] + [TOKEN] * (request.prompt_len - 1)
    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)
    try:
        scheduler.add_request(
            GenerateRequest(
                request_id,
                prompt,
                params,
                priority=request.priority,
                arrival_time=request.arrival_s,
                deadline=request.deadline_s,
                tenant=request.tenant,
            )
        )
    except (QueueFullError, ValueError):
        record.finish_reason = "rejected"
        return
    index_of[request_id] = index


def sim_config(base: EngineConfig, **changes: Any) -> EngineConfig:
    """``base`` with ``changes`` applied and validated."""
    return msgspec.convert(msgspec.to_builtins(base) | changes, EngineConfig)
