"""``tokenloom bench scheduler``: the CPU cost of one scheduler step, without a model.

Builds the config, the ``paged`` KV manager and the chosen scheduler, prefills
``--num-running`` requests into steady decode, then queues ``--num-waiting`` more.
The pool holds the running requests for the whole run (their blocks are reserved
up front) plus one block fewer than a waiting prompt needs, so every step tries,
and fails, to admit the head of the queue: the worst case of a loaded server. Fake
step outputs stand in for the executor (one random token per sampled chunk; not
timed). Each step's ``schedule`` and ``update`` are timed with ``perf_counter_ns``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from tokenloom.bench.common import print_table, write_json
from tokenloom.config import EngineConfig
from tokenloom.protocols.components.scheduler import Scheduler
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import StepInput, StepOutput

SCHEDULER_PLUGINS = (
    "tokenloom.plugins.scheduler.continuous",
    "tokenloom.contrib.schedulers.static",
)


def scheduler_factories() -> dict[str, Callable[..., Scheduler]]:
    """Every registered scheduler: the built-in ones and those of the autoloaded
    entry points (third-party packages). Only the scheduler built-ins are loaded:
    the others would import torch for nothing."""
    from tokenloom.plugin_manager import PluginManager

    pm = PluginManager()
    pm.load_modules(SCHEDULER_PLUGINS)
    pm.load_entry_points()
    return {c.name: c.spec.factory for c in pm.components() if c.kind == "scheduler"}


def fake_output(step: StepInput, rng: random.Random, vocab_size: int) -> StepOutput:
    sampled = [chunk.request_id for chunk in step.chunks if chunk.sample]
    return StepOutput(step.step_id, sampled, [[rng.randrange(1, vocab_size)] for _ in sampled])


def summarize(values_ns: list[int]) -> dict[str, float]:
    micros = sorted(v / 1e3 for v in values_ns)
    return {
        "median_us": statistics.median(micros),
        "p90_us": micros[min(len(micros) - 1, int(0.9 * len(micros)))],
        "mean_us": statistics.fmean(micros),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenloom.plugins.kv_cache.paged import PagedKVCache

    rng = random.Random(args.seed)
    bs = args.block_size
    num_steps = args.warmup + args.steps
    final_len = args.prompt_len + num_steps + 8  # + prefill steps, with room to spare
    blocks_per_running = -(-final_len // bs)
    blocks_per_waiting = -(-args.waiting_prompt_len // bs)
    num_blocks = args.num_running * blocks_per_running + blocks_per_waiting - 1
    config = EngineConfig(
        scheduler=args.scheduler,
        max_model_len=max(final_len, args.waiting_prompt_len) + 16,
        block_size=bs,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting_requests=args.num_waiting + 1,
    )
    kv = PagedKVCache(config, num_blocks, bs)
    factories = scheduler_factories()
    if args.scheduler not in factories:
        raise SystemExit(
            f"--scheduler: no scheduler named {args.scheduler!r}; registered: "
            + ", ".join(sorted(factories))
        )
    scheduler = factories[args.scheduler](config, kv, clock=time.monotonic)
    params = SamplingParams(max_tokens=None, ignore_eos=True)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(1, args.vocab_size) for _ in range(length)]

    running_ids = [f"run-{i}" for i in range(args.num_running)]
    for request_id in running_ids:
        scheduler.add_request(GenerateRequest(request_id, prompt(args.prompt_len), params))
    prefill_steps = 0
    while scheduler.stats().num_running < args.num_running or _prefilling(scheduler):
        step = scheduler.schedule()
        scheduler.update(step, fake_output(step, rng, args.vocab_size))
        prefill_steps += 1
    for request_id in running_ids:  # reserve the whole run's blocks now
        if not kv.append(request_id, final_len):
            raise RuntimeError("the pool was sized too small for the running requests")
    for i in range(args.num_waiting):
        request = GenerateRequest(f"wait-{i}", prompt(args.waiting_prompt_len), params)
        scheduler.add_request(request)

    schedule_ns: list[int] = []
    update_ns: list[int] = []
    total_ns: list[int] = []
    clock = time.perf_counter_ns
    for index in range(num_steps):
        start = clock()
        step = scheduler.schedule()
        scheduled = clock()
        output = fake_output(step, rng, args.vocab_size)
        resumed = clock()
        scheduler.update(step, output)
        done = clock()
        if index >= args.warmup:
            schedule_ns.append(scheduled - start)
            update_ns.append(done - resumed)
            total_ns.append(scheduled - start + done - resumed)
    stats = scheduler.stats()
    if stats.num_running != args.num_running or stats.num_preemptions:
        raise RuntimeError(f"the workload drifted from steady decode: {stats}")
    return {
        "scheduler": args.scheduler,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_blocks": num_blocks,
        "block_size": bs,
        "prefill_steps": prefill_steps,
        "timed_steps": args.steps,
        "schedule": summarize(schedule_ns),
        "update": summarize(update_ns),
        "total": summarize(total_ns),
    }


def _prefilling(scheduler: Any) -> bool:
    stats = scheduler.stats()
    return stats.generation_tokens_total < stats.num_running


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom bench scheduler", description=__doc__)
    parser.add_argument(
        "--scheduler",
        default="continuous",
        help="any registered scheduler, third-party ones included (tokenloom plugins)",
    )
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--num-waiting", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--waiting-prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=1000, help="timed steps")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file (default bench-scheduler.json)")
    args = parser.parse_args(argv)

    result = run(args)
    rows: list[tuple[str, Any]] = [
        ("scheduler", result["scheduler"]),
        ("running / waiting", f"{result['num_running']} / {result['num_waiting']}"),
        ("timed steps", result["timed_steps"]),
    ]
    for part in ("schedule", "update", "total"):
        timing = result[part]
        rows.append(
            (
                f"{part} us (median / p90 / mean)",
                f"{timing['median_us']:.1f} / {timing['p90_us']:.1f} / {timing['mean_us']:.1f}",
            )
        )
    print_table("scheduler step CPU cost", rows)
    write_json(args.out, "bench-scheduler.json", result)
    return 0
