"""``tokenloom sim``: compare schedulers and settings on a workload, on the CPU.

    tokenloom sim --trace azure-code --speed 4 --scheduler continuous,static
    tokenloom sim --num-requests 2000 --request-rate 20 --max-num-seqs 64,256
    tokenloom sim --trace azure-code --plugin examples/schedulers/spf_aging.py \\
        --scheduler continuous,spf-aging --slo-ttft-ms 2000 --out sim-out

Every comma-separated setting (``--scheduler``, ``--max-num-seqs``,
``--max-num-batched-tokens`` (the prefill chunk size), ``--num-blocks``) multiplies
the runs; each run replays the same workload. Prints one table, writes
``sim.json`` (summaries, settings, the workload) and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from tokenloom.sim.cost_model import CostModel


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tokenloom sim", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="Azure CSV, recorded JSONL, or azure-code (the shipped one)")
    w.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    w.add_argument("--skip", type=int, default=0, help="start the trace after N requests")
    w.add_argument("--speed", type=float, default=1.0, help="replay N times faster")
    w.add_argument("--rate", type=float, default=None, help="rescale arrivals to this req/s")
    w.add_argument("--num-requests", type=int, default=1000, help="synthetic workload size")
    w.add_argument("--request-rate", type=float, default=10.0, help="synthetic req/s (inf: burst)")
    w.add_argument("--arrival-cv", type=float, default=1.0, help="gamma gaps' CV; 1 = Poisson")
    w.add_argument("--prompt-len", type=int, default=512)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--length-dist", default="fixed", help="fixed | uniform | lognormal")
    w.add_argument("--priorities", default="", help="PRIO:WEIGHT,... e.g. 0:0.8,1:0.2")
    w.add_argument("--tenants", type=int, default=0, help="draw tenants t0..tN-1")
    w.add_argument("--tenant-skew", type=float, default=0.0, help="Zipf exponent; 0 = uniform")
    w.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine (comma lists multiply the runs)")
    e.add_argument("--scheduler", default="continuous")
    e.add_argument("--max-num-seqs", default="256")
    e.add_argument("--max-num-batched-tokens", default="8192", help="token budget = chunk size")
    e.add_argument("--num-blocks", default="", help="default: the H200's KV pool for the shape")
    e.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="default: the engine's (64 for an fp8 cache, else 16)",
    )
    e.add_argument("--max-model-len", type=int, default=None, help="default: the shape's")
    e.add_argument("--max-waiting-requests", type=int, default=100_000)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--sync", action="store_true", help="no async scheduling (pipelining)")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA-graph buckets")
    e.add_argument("--max-graph-batch", type=int, default=512, help="largest CUDA-graph batch")
    e.add_argument("--quant", default="none", help="none | fp8 (tokenloom.sim.quantized)")
    e.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    e.add_argument("--config", help="TOML engine config to start from")
    e.add_argument("--plugin", action="append", default=[], help="plugin .py file or module")
    m = p.add_argument_group("cost model and report")
    m.add_argument(
        "--cost-model",
        default="llama-3-8b-calibrated",
        help="shipped model name (llama-3-8b-calibrated, qwen3-0.6b-calibrated: fitted on an "
        "H200; llama-3-8b, qwen3-0.6b: derived from recorded figures) or a JSON file",
    )
    m.add_argument("--slo-ttft-ms", type=float, default=None)
    m.add_argument("--slo-tpot-ms", type=float, default=None)
    m.add_argument("--out", default="sim-out", help="directory for sim.json and the plots")
    m.add_argument("--no-plots", action="store_true")
    m.add_argument("--per-request", action="store_true", help="every request's record in JSON")
    return p.parse_args(argv)


def load_cost_model(name: str) -> CostModel:
    return CostModel.load(name) if name.endswith(".json") else CostModel.shipped(name)


def build_workload(args: argparse.Namespace) -> list[Any]:
    from tokenloom.sim import workload

    if args.trace:
        trace = workload.load_trace(args.trace, args.limit, args.skip)
    else:
        trace = workload.synthetic(
            args.num_requests,
            args.request_rate,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            length_dist=args.length_dist,
            cv=args.arrival_cv,
            seed=args.seed,
        )
    trace = workload.rescale(trace, speed=args.speed, rate=args.rate)
    priorities = {}
    for item in filter(None, args.priorities.split(",")):
        prio, _, weight = item.partition(":")
        priorities[int(prio)] = float(weight or 1)
    if priorities or args.tenants:
        trace = workload.assign_classes(
            trace,
            priorities=priorities,
            tenants=args.tenants,
            tenant_skew=args.tenant_skew,
            seed=args.seed,
        )
    return trace


def load_plugins(paths: list[str]) -> Any:
    """The default plugin manager plus ``paths`` (a .py file or a module name each)."""
    import importlib
    import importlib.util

    from tokenloom.plugin_manager import PluginManager

    pm = PluginManager.default()
    for item in paths:
        if item.endswith(".py"):
            name = Path(item).stem
            spec = importlib.util.spec_from_file_location(f"tokenloom_sim_plugin_{name}", item)
            if spec is None or spec.loader is None:
                raise SystemExit(f"--plugin {item}: cannot load")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            name, module = item, importlib.import_module(item)
        pm.register(module, name)
    return pm


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    from tokenloom.config import default_block_size, load_config
    from tokenloom.sim import report, workload
    from tokenloom.sim.derived import num_blocks
    from tokenloom.sim.metrics import summarize
    from tokenloom.sim.simulator import sim_config, simulate

    args = parse_args(list(argv or []))
    started = time.perf_counter()
    from tokenloom.sim import quantized

    given_blocks = _ints(args.num_blocks)
    args.block_size = args.block_size or default_block_size(
        args.kv_cache_dtype, given_blocks[0] if given_blocks else None
    )
    cost = quantized.apply(
        load_cost_model(args.cost_model), args.quant, args.kv_cache_dtype, args.block_size
    )
    trace = build_workload(args)
    pm = load_plugins(args.plugin)
    from tokenloom.checkpoints.model_shapes import SHAPES

    shape_cfg = SHAPES.get(cost.shape.name, {})
    base = load_config(args.config)
    max_len = args.max_model_len or shape_cfg.get("max_position_embeddings") or 8192
    if args.quant == "none" and args.kv_cache_dtype == "auto":
        default_blocks = num_blocks(cost.shape, _kv_gib(cost.shape.name), args.block_size)
    else:  # the planner's pool for the setting (fewer weight bytes, smaller KV)
        seqs = max(_ints(args.max_num_seqs))
        default_blocks = quantized.default_blocks(
            cost.shape.name, args.quant, args.kv_cache_dtype, seqs, args.block_size
        )
    grid = list(
        itertools.product(
            [s.strip() for s in args.scheduler.split(",") if s.strip()],
            _ints(args.max_num_seqs),
            _ints(args.max_num_batched_tokens),
            _ints(args.num_blocks) or [default_blocks],
        )
    )
    varying = [len(set(g[i] for g in grid)) > 1 for i in range(4)]
    names = ("", "seqs", "tokens", "blocks")
    summaries, results = [], []
    for sched, seqs, tokens, blocks in grid:
        config = sim_config(
            base,
            scheduler=sched,
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
            num_blocks=blocks,
            block_size=args.block_size,
            max_model_len=max_len,
            max_waiting_requests=args.max_waiting_requests,
            enable_prefix_caching=not args.no_prefix_caching,
            enforce_eager=args.enforce_eager,
            max_graph_batch=args.max_graph_batch,
        )
        parts = [sched] + [
            f"{names[i]}={v}"
            for i, v in enumerate((sched, seqs, tokens, blocks))
            if i and varying[i]
        ]
        result = simulate(trace, config, cost, pm, label=" ".join(parts), pipelined=not args.sync)
        summary = summarize(result.requests, args.slo_ttft_ms, args.slo_tpot_ms)
        summary.update(label=result.label, wall_s=result.wall_s, config=result.config)
        summary.update(steps=result.num_steps, recomputed_tokens=result.recomputed_tokens)
        summaries.append(summary)
        results.append(result)
    print(f"workload: {workload.describe(trace)}")
    print(f"cost model: {cost.shape.name} ({cost.source or 'no source given'})")
    print(report.table(summaries))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "workload": workload.describe(trace),
        "cost_model": {"shape": cost.shape.name, "source": cost.source},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "runs": summaries,
    }
    if args.per_request:
        from dataclasses import asdict

        payload["requests"] = {r.label: [asdict(x) for x in r.requests] for r in results}
    report.write_json(out / "sim.json", payload)
    written: list[str] = []
    if not args.no_plots:
        try:
            written = report.plot(results, summaries, out)
        except ImportError:
            print("no plots: matplotlib is not installed (pip install 'tokenloom[plot]')")
    print(f"wrote {out / 'sim.json'}" + (f" and {len(written)} plots" if written else ""))
    print(f"total wall time {time.perf_counter() - started:.1f}s")
    return 0


def _kv_gib(shape: str) -> float:
    from tokenloom.sim.derived import MEASURED

    return MEASURED.get(shape, {}).get("kv_gib", 100.0)
