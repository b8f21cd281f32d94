"""Timing wrappers of ``bench host``: per-step accumulators installed on a live
engine's components (see ``tokenloom.bench.host``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Ns = int
COMPONENTS = (
    "loop_input",
    "scheduler",
    "kv_manager",
    "input_prep",
    "sampler_host",
    "device_work",
    "output_read",
    "result_folding",
    "engine_glue",
    "loop_output",
    "frontend",
    "gpu_wait",
)
HOST_ENGINE = (  # what the engine-core process spends per step, device work excluded
    "loop_input",
    "scheduler",
    "kv_manager",
    "input_prep",
    "sampler_host",
    "output_read",
    "result_folding",
    "engine_glue",
    "loop_output",
)


CLOCK = [time.thread_time_ns]  # set by ``--wall``


class Timers:
    """Per-step nanosecond accumulators, keyed by component."""

    def __init__(self) -> None:
        self.step: dict[str, Ns] = defaultdict(int)
        self.last_step: Any = None  # the StepInput of the latest schedule

    def wrap(self, owner: Any, name: str, component: str) -> None:
        """Replace ``owner.name`` (an instance attribute) with a timed call."""
        inner = getattr(owner, name)
        step = self.step
        clock = CLOCK[0]

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                step[component] += clock() - started

        setattr(owner, name, timed)


OUTSIDE_STEP = ("loop_input", "engine_glue", "loop_output", "frontend")
IN_STEP = tuple(c for c in COMPONENTS if c not in OUTSIDE_STEP)  # timed inside ``Engine.step``


def wrap_engine_steps(engine: Any, timers: Timers) -> None:
    """Time ``schedule`` and ``update`` without their KV manager calls, and the
    read of each step's output; keep the last built step (for the drift check)."""
    step = timers.step
    clock = CLOCK[0]
    scheduler = engine.scheduler
    executor = engine.executor

    def without_kv(inner: Callable[..., Any], component: str) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            kv_before = step["kv_manager"]
            started = clock()
            try:
                return inner(*args)
            finally:
                step[component] += clock() - started - (step["kv_manager"] - kv_before)

        return timed

    inner_schedule = scheduler.schedule

    def schedule() -> Any:
        timers.last_step = inner_schedule()
        return timers.last_step

    scheduler.schedule = without_kv(schedule, "scheduler")
    scheduler.update = without_kv(scheduler.update, "result_folding")
    inner_submit = executor.submit

    def submit(step_input: Any) -> Any:
        pending = inner_submit(step_input)
        timers.wrap(pending, "result", "output_read")
        done = getattr(pending, "_done", None)  # a CUDA event: the sampled ids' copy
        if done is not None:  # wait for it first, as gpu_wait, then read as usual
            read = pending.result

            def result() -> Any:
                started = clock()
                done.synchronize()
                step["gpu_wait"] += clock() - started
                return read()

            pending.result = result
        return pending

    executor.submit = submit


def stub_forward(engine: Any, timers: Timers, seed: int, stub: bool = True) -> None:
    """With ``stub``, the forward pass and the logits become random rows, timed as
    device work; so do the argmax and the sampled-id copies (kernels on a GPU).
    Without (``--device cuda``), the same calls time the host's launches."""
    import torch

    runner = engine.executor
    hidden_size = runner.info.hidden_size
    generator = torch.Generator().manual_seed(seed)

    def forward(batch: Any) -> torch.Tensor:
        return torch.randn(batch.num_tokens, hidden_size, generator=generator)

    if stub:
        runner._forward = forward
    timers.wrap(runner, "_forward", "device_work")
    if runner.graphs is not None:  # a GPU's decode steps: packed, then replayed
        timers.wrap(runner.graphs, "run_pack", "device_work")
    timers.wrap(runner.model, "compute_logits", "device_work")
    sampler = runner.sampler
    timers.wrap(sampler, "_batch_for", "sampler_host")
    timers.wrap(sampler, "count_sampled", "sampler_host")
    timers.wrap(runner.batches, "store_sampled_tokens", "device_work")
    # sample() = _batch_for (host, timed above) + argmax (device): time the whole call
    # as device work and take the nested host part back out below.
    inner_sample = sampler.sample
    step = timers.step
    clock = CLOCK[0]

    def sample(logits: Any, request_ids: Any, store: Any = None) -> Any:
        started = clock()
        host_before = step["sampler_host"]
        try:
            return inner_sample(logits, request_ids, store)
        finally:
            step["device_work"] += clock() - started - (step["sampler_host"] - host_before)

    sampler.sample = sample
    timers.wrap(runner.batches, "build", "input_prep")
    timers.wrap(runner.batches, "pack_decode", "input_prep")


def wrap_kv(engine: Any, timers: Timers) -> None:
    for name in ("append", "allocate", "block_ids", "commit", "free", "num_cached_prefix_tokens"):
        timers.wrap(engine.kv_cache, name, "kv_manager")
