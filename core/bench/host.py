"""``python -m tokenloom.bench.host``: the host's share of one decode step, on the CPU.

Question (issue 16): with async scheduling the host builds step N+1 while the GPU
runs step N, so host work is free only while it is shorter than the GPU step
(Llama-3-8B on the H200: ~19.5 ms at 256 running sequences of ~1,500 tokens). How
long is the host part at 64 / 256 / 512 running sequences, and where does it go?

Method: the real engine (``Engine.from_config``: ``continuous`` scheduler, ``paged``
KV manager, ``model`` executor) on the CPU with a tiny random llama, with the
model's forward replaced by a random hidden state (and its logits, the argmax and
the device copies timed apart as "device work": on a GPU they are kernel launches).
``--num-running`` requests with ``--context``-token random prompts are prefilled,
then every timed step is a steady decode step. Each component's methods are
wrapped with accumulators for the timed steps, on this thread's CPU clock
(``time.thread_time_ns``; ``--wall`` for ``perf_counter_ns``): on a shared box the
wall clock also counts the time other processes hold the core, which made single
steps of the same work vary 3x:

- scheduler: ``schedule`` minus the KV manager calls made inside it;
- KV manager: ``append`` / ``allocate`` / ``block_ids`` / ``commit`` / ``free``;
- executor input prep: ``BatchBuilder.build`` (positions, slot mapping, block
  table, packing; on a GPU host also the pinned staging and ~5 launches);
- sampler host: ``Sampler._batch_for`` (the batch key) and ``count_sampled``;
- output read: ``PendingStep.result`` (``tolist`` and the per-row lists);
- result folding: ``update`` minus its KV calls;
- engine glue: the rest of ``Engine.step``;
- loop output: ``EngineOutputs`` built, msgspec-encoded, sent over a ZMQ socket;
- frontend: receive + decode + one ``OutputProcessor.process`` per delta (the
  detokenization ``Generation`` does), in this process (a separate one in serving).

On a GPU host (``--device cuda --model llama-3-8b --wall``) the forward is real and
async scheduling on, as served: the same rows then time the host's share there,
"device work" is the time spent launching (counted in the host total), and
"gpu_wait" the host's wait for the sampled ids (its idle time per step: > 0 means
the host work is hidden behind the GPU's).

The workload is fixed by the seed, so "before" and "after" runs of a change time
the same steps; the digest of every step's deltas (request ids and tokens) printed
under the table says whether they produced the same output.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import hashlib
import pstats
import random
import statistics
import tempfile
import time
from collections import deque
from typing import Any

from tokenloom.bench.host_timers import (
    CLOCK,
    COMPONENTS,
    HOST_ENGINE,
    IN_STEP,
    Ns,
    Timers,
    stub_forward,
    wrap_engine_steps,
    wrap_kv,
)


def build_engine(args: argparse.Namespace, model_dir: str) -> Any:
    from tokenloom.checkpoints.model_shapes import is_shape_name
    from tokenloom.config import EngineConfig
    from tokenloom.engine.engine_core import Engine

    # Requests prefilled first decode while the others prefill: room for those steps.
    prefill_steps = -(-args.num_running * args.context // args.max_num_batched_tokens) + 1
    final_len = args.context + prefill_steps + args.warmup + args.steps + 8
    cpu = args.device == "cpu"
    config = EngineConfig(
        model=model_dir,
        device=args.device,
        dtype="float32" if cpu else "auto",
        attention="torch" if cpu else "auto",
        load_format="random" if args.model and is_shape_name(args.model) else "auto",
        max_model_len=final_len + 16,
        block_size=args.block_size,
        # On the GPU the pool is sized from memory (a preemption stops the run).
        num_blocks=args.num_running * -(-final_len // args.block_size) + 64 if cpu else None,
        max_num_seqs=args.num_running,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # CUDA: async, as served; the CPU: synchronous unless --async-scheduling.
        async_scheduling=True if args.async_scheduling else (None if not cpu else False),
        enable_prefix_caching=True,
        seed=args.seed,
    )
    return Engine.from_config(config)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import zmq

    from tokenloom.bench.common import _shape_or_dir
    from tokenloom.checkpoints.tiny_models import write_tiny_model
    from tokenloom.protocols.outputs import EngineOutput, EngineOutputs
    from tokenloom.protocols.requests import GenerateRequest
    from tokenloom.protocols.sampling import SamplingParams
    from tokenloom.text.output_processor import OutputProcessor
    from tokenloom.text.tokenizer import Tokenizer
    from tokenloom.transport.serde import Decoder, Encoder

    torch.set_num_threads(1)  # host work is single-threaded; a shared box stays calmer
    if args.model:
        model_dir = _shape_or_dir(args.model)
    else:
        model_dir = str(
            write_tiny_model(
                tempfile.mkdtemp(prefix="host-bench-"),
                "llama",
                hidden_size=32,
                intermediate_size=64,
                num_layers=1,
                num_heads=2,
                num_kv_heads=1,
                max_position_embeddings=2 * args.context + args.warmup + args.steps + 1024,
            )
        )
    engine = build_engine(args, model_dir)
    tuned_gc = contextlib.ExitStack()
    if args.engine_gc:  # as the served engine-core process runs, from before any request
        from tokenloom.engine.loop import engine_gc

        tuned_gc.enter_context(engine_gc())
    timers = Timers()
    stub_forward(engine, timers, args.seed, stub=args.device == "cpu")
    wrap_kv(engine, timers)
    tokenizer = Tokenizer.from_dir(model_dir)
    processor = OutputProcessor(tokenizer)
    rng = random.Random(args.seed)
    vocab = tokenizer.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for index in range(args.num_running):
        prompt = [rng.randrange(1, vocab) for _ in range(args.context)]
        rid = f"chatcmpl-{index:08x}-{rng.getrandbits(64):016x}"  # a server-like id
        (request,) = processor.add_request(rid, None, prompt, params, [])
        engine.add_request(GenerateRequest(rid, request.prompt_token_ids, params))
    prefill_started = time.perf_counter()
    num_prefill = 0
    started_ids: set[str] = set()
    while len(started_ids) < args.num_running:  # until every request decodes
        started_ids.update(delta.request_id for delta in engine.step())
        num_prefill += 1
    prefill_s = time.perf_counter() - prefill_started

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='host-bench-')}/out"
    pull.bind(endpoint)
    push.connect(endpoint)
    encoder = Encoder()
    decoder: Decoder[Any] = Decoder(EngineOutput, 1 << 30)
    queues: dict[str, list[Any]] = {}

    per_step: dict[str, list[Ns]] = {name: [] for name in COMPONENTS + ("step_total",)}
    mixed_steps: list[bool] = []  # per timed step: a prefill chunk joined the decodes
    digest = hashlib.sha256()
    clock = CLOCK[0]
    step_acc = timers.step
    wrap_engine_steps(engine, timers)
    profiler = cProfile.Profile() if args.profile else None
    gc_ns: dict[int, list[Ns]] = {0: [], 1: [], 2: []}  # per collection, by generation
    gc_started = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter_ns()
        else:
            gc_ns[info["generation"]].append(time.perf_counter_ns() - gc_started[0])

    live = deque(sorted(started_ids))  # the next to go with --churn first
    made = args.num_running
    for index in range(args.warmup + args.steps):
        step_acc.clear()
        aborted: list[Any] = []
        if args.churn and index % args.churn == args.churn - 1:
            # One request leaves (an abort, as a stop string or a gone client makes) and
            # a new one arrives: its prefill makes the next step a mixed one.
            rid = f"chatcmpl-{made:08x}-{rng.getrandbits(64):016x}"
            made += 1
            prompt = [rng.randrange(1, vocab) for _ in range(args.context)]
            (request,) = processor.add_request(rid, None, prompt, params, [])  # frontend's
            c0 = clock()  # the engine's part: the abort and the new request's intake
            aborted = engine.abort([live.popleft()])
            engine.add_request(GenerateRequest(rid, request.prompt_token_ids, params))
            step_acc["loop_input"] += clock() - c0
            live.append(rid)
        if index == args.warmup:
            gc.callbacks.append(on_gc)
            if profiler is not None:
                profiler.enable()
        started = clock()
        deltas = engine.step()
        step_wall = clock() - started
        step_input = timers.last_step
        step_acc["engine_glue"] += step_wall - sum(step_acc[name] for name in IN_STEP)
        # The engine-core loop's output: one EngineOutputs per step over ZMQ.
        o0 = clock()
        frames = encoder.encode(EngineOutputs(aborted + deltas, time.monotonic()))
        push.send_multipart(frames, copy=len(frames) == 1)
        o1 = clock()
        step_acc["loop_output"] += o1 - o0
        # The frontend: receive, decode, route, detokenize each delta.
        received = pull.recv_multipart(copy=False)
        message = decoder.decode(received)
        for delta in message.outputs:
            queues.setdefault(delta.request_id, []).append(delta)
            processor.process([delta])
        step_acc["frontend"] += clock() - o1
        total = clock() - started
        for delta in deltas:
            digest.update(delta.request_id.encode())
            digest.update(bytes(str(delta.new_token_ids), "ascii"))
        queues.clear()
        mixed = step_input.num_tokens > len(step_input.chunks)
        if index >= args.warmup:
            for name in COMPONENTS:
                per_step[name].append(step_acc.get(name, 0))
            per_step["step_total"].append(total)
            mixed_steps.append(mixed)
        if args.churn:  # the sizes move by one around an abort; a drift stays caught
            if not args.num_running - 1 <= len(step_input.chunks) <= args.num_running:
                raise RuntimeError(f"step {index}: {len(step_input.chunks)} chunks")
        elif len(step_input.chunks) != args.num_running or len(deltas) != args.num_running:
            raise RuntimeError(
                f"step {index}: {len(step_input.chunks)} chunks, {len(deltas)} deltas; "
                f"expected {args.num_running} decodes (the workload drifted)"
            )
    gc.callbacks.remove(on_gc)
    tuned_gc.close()
    if profiler is not None:
        profiler.disable()
        print(f"cProfile of the {args.steps} timed steps at {args.num_running} running:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    engine.shutdown()
    medians = {name: statistics.median(v) / 1e3 for name, v in per_step.items()}
    # On a GPU host, "device work" is the host launching kernels: host time too.
    counted = HOST_ENGINE if args.device == "cpu" else (*HOST_ENGINE, "device_work")
    host_engine = [
        sum(per_step[name][i] for name in counted) for i in range(len(per_step["frontend"]))
    ]
    medians["engine_host_total"] = statistics.median(host_engine) / 1e3
    mixed_medians = {}
    if any(mixed_steps):
        for name, values in (*per_step.items(), ("engine_host_total", host_engine)):
            picked = [v for v, m in zip(values, mixed_steps, strict=True) if m]
            mixed_medians[name] = statistics.median(picked) / 1e3
    return {
        "num_running": args.num_running,
        "context": args.context,
        "steps": args.steps,
        "prefill_steps": num_prefill,
        "prefill_s": prefill_s,
        "median_us": medians,
        "num_mixed_steps": sum(mixed_steps),
        "mixed_median_us": mixed_medians,  # over the steps with a prefill chunk only
        "p90_us": {name: sorted(v)[int(0.9 * (len(v) - 1))] / 1e3 for name, v in per_step.items()},
        "tokens_digest": digest.hexdigest()[:16],
        # Collections during the timed steps (engine and frontend work together here;
        # wall time, inside whichever component allocated at the moment).
        "gc": {
            f"gen{gen}": {
                "count": len(v),
                "total_ms": sum(v) / 1e6,
                "max_ms": max(v, default=0) / 1e6,
            }
            for gen, v in gc_ns.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenloom.bench.host", description=__doc__)
    parser.add_argument("--num-running", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--context", type=int, default=1500, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--runs", type=int, default=1, help="runs per size; medians of runs")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model",
        default="",
        help="a model shape (llama-3-8b) or directory, random weights; default: a tiny llama",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu: forward stubbed; cuda: the real forward, async scheduling (use --wall)",
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--profile", type=int, default=0, help="print cProfile's top N functions (tottime)"
    )
    parser.add_argument(
        "--churn",
        type=int,
        default=0,
        help="every N steps one request is aborted and a new prompt arrives (0: none)",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="pipelined steps on the CPU too (the order of work a GPU host runs)",
    )
    parser.add_argument(
        "--python-gc",
        dest="engine_gc",
        action="store_false",
        help="Python's default GC thresholds, not the served engine's (engine.loop.engine_gc)",
    )
    parser.add_argument("--wall", action="store_true", help="wall clock, not thread CPU time")
    args = parser.parse_args(argv)
    CLOCK[0] = time.perf_counter_ns if args.wall else time.thread_time_ns
    from tokenloom.bench.common import write_json

    results = []
    for num in args.num_running:
        runs = []
        for _ in range(args.runs):
            one = argparse.Namespace(**{**vars(args), "num_running": num})
            runs.append(run(one))
        digests = {r["tokens_digest"] for r in runs}
        merged = dict(runs[0])
        merged["median_us"] = {
            k: statistics.median(r["median_us"][k] for r in runs) for k in runs[0]["median_us"]
        }
        merged["runs_median_us"] = [r["median_us"] for r in runs]
        if runs[0]["mixed_median_us"]:
            merged["mixed_median_us"] = {
                k: statistics.median(r["mixed_median_us"][k] for r in runs)
                for k in runs[0]["mixed_median_us"]
            }
        merged["tokens_digests"] = sorted(digests)
        results.append(merged)
    print_breakdown(results)
    write_json(args.output_json, "host-bench.json", {"args": vars(args), "results": results})
    return 0


def print_breakdown(results: list[dict[str, Any]]) -> None:
    names = list(COMPONENTS) + ["engine_host_total", "step_total"]
    header = "component (median us/step)".ljust(30) + "".join(
        f"{r['num_running']:>10}" for r in results
    )
    print(header)
    print("-" * len(header))
    for name in names:
        row = name.ljust(30) + "".join(f"{r['median_us'][name]:>10.0f}" for r in results)
        print(row)
    if all(r["mixed_median_us"] for r in results):  # --churn
        print("steps with a prefill chunk only (median us/step):")
        for name in names:
            row = name.ljust(30) + "".join(f"{r['mixed_median_us'][name]:>10.0f}" for r in results)
            print(row)
    print("tokens digest".ljust(30) + "".join(f"{r['tokens_digest']:>10.8}" for r in results))


if __name__ == "__main__":
    raise SystemExit(main())
