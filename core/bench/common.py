"""What the benchmarks share: model resolution, engine flags, tables and JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tokenloom.checkpoints.model_shapes import SHAPES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="qwen3-0.6b",
        help="model directory, or a real shape with random weights: " + ", ".join(SHAPES),
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap the host's next step with the device's current one (default: on CUDA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quant", default="none", help="weight quantization method")
    parser.add_argument(
        "--quant-lm-head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also quantize the LM head with the weight method (default: the method's: "
        "int8 yes, fp8 and int4 no)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | int8")
    parser.add_argument(
        "--block-size", type=int, default=0, help="tokens a KV-cache block (0: the engine's)"
    )
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--proposer", default="none", help="speculative-decoding proposer")
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument("--draft-model", default="", help="the draft proposer's model")
    parser.add_argument(
        "--max-verify-graph-seqs",
        type=int,
        default=64,
        help="verify steps in CUDA graphs up to this many requests; 0: eager (speculation)",
    )
    parser.add_argument(
        "--max-graph-batch",
        type=int,
        default=512,
        help="decode steps of up to this many requests replay CUDA graphs",
    )
    parser.add_argument(
        "--plugin-option",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="a [plugin.NAME] setting (JSON value, else a string); repeatable",
    )
    parser.add_argument("--out", default=None, help="JSON output file")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    from tokenloom.checkpoints.model_shapes import is_shape_name, write_shape_dir

    model = args.model
    options: dict[str, Any] = {}
    if is_shape_name(model):
        model = str(write_shape_dir(model, Path(tempfile.mkdtemp(prefix="tokenloom-shape-"))))
        options["load_format"] = "random"
    options.update(
        model=model,
        dtype=args.dtype,
        attention=args.attention,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
        quant=args.quant,
        quant_lm_head=args.quant_lm_head,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        proposer=args.proposer,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=_shape_or_dir(args.draft_model),
        max_verify_graph_seqs=args.max_verify_graph_seqs,
        max_graph_batch=args.max_graph_batch,
        plugin=plugin_options(args.plugin_option),
    )
    return options


def _shape_or_dir(model: str) -> str:
    from tokenloom.checkpoints.model_shapes import is_shape_name, write_shape_dir

    if model and is_shape_name(model):
        return str(write_shape_dir(model, Path(tempfile.mkdtemp(prefix="tokenloom-shape-"))))
    return model


def plugin_options(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["replay.acceptance=0.8"]`` -> ``{"replay": {"acceptance": 0.8}}``."""
    result: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        name, dot, field = key.partition(".")
        if not sep or not dot or not name or not field:
            raise SystemExit(f"--plugin-option {item!r}: expected NAME.KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        result.setdefault(name, {})[field] = value
    return result


def spec_summary(before: Any, after: Any) -> dict[str, float] | None:
    """Speculative-decoding figures between two ``EngineStats``: drafts verified and
    accepted, acceptance rate, tokens per verify step; None when nothing was verified."""
    drafts = after.spec_draft_tokens_total - before.spec_draft_tokens_total
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    steps = after.spec_verify_steps_total - before.spec_verify_steps_total
    if not steps:
        return None
    return {
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "verify_steps": steps,
        "acceptance_rate": accepted / max(drafts, 1),
        "mean_accepted_length": (accepted + steps) / steps,
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max(len(name) for name, _ in rows)
    print(f"\n== {title} ==")
    for name, value in rows:
        shown = f"{value:,.2f}" if isinstance(value, float) else str(value)
        print(f"{name:<{width}}  {shown}")


def write_json(path: str | None, default: str, payload: dict[str, Any]) -> str:
    target = path or default
    Path(target).write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {target}")
    return target
