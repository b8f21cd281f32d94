"""``tokenloom plan MODEL [flags]``: the memory budget of one GPU before starting an
engine: weights, KV bytes per token, activations, the resulting KV blocks and the
number of requests that fit at full length; a setting that cannot fit says what to
change. A table, or ``--json``.

It mirrors the engine's sizing rule (``plugins.executor.memory_profile``): the KV
pool gets ``total * gpu_memory_utilization`` minus the weights, the activation peak
of a forward pass at ``max_num_batched_tokens``, the memory outside torch's
allocator (CUDA context, libraries) and the CUDA-graph reserve, divided by the bytes
of one block (``kv_quant.block_bytes``, the engine's own), capped as the engine caps
it (four full-length sequences per ``max_num_seqs``). The engine measures the
activation peak and the memory outside torch; here they are estimates: the larger of
the forward pass's live tensors and the sampler's fp32 logits, and the 0.67-0.74 GiB
measured on an H200 (docs/results). MODEL is a model directory, a GGUF file or a
shape name of ``checkpoints/model_shapes.py``; every engine flag applies.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import msgspec

from tokenloom.config import ConfigError, EngineConfig, default_block_size
from tokenloom.entrypoints.cli import add_config_flags, config_from_args
from tokenloom.entrypoints.plan_bytes import (
    INT4_GROUP,
    activation_bytes,
    dequant_scratch_bytes,
    lm_head_method,
    rank_heads,
    read_shape,
    weight_bytes,
)

GiB = 1 << 30
OTHER_GIB = 0.7  # outside torch's allocator: CUDA context, cuBLAS, Triton (H200: 0.67-0.74)
GRAPH_RESERVE = 512 << 20  # ModelRunner's reserve for CUDA graphs (not with enforce_eager)
QUANTS = ("none", "fp8", "int8", "int4")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class Plan:
    """One GPU's budget (bytes unless named otherwise); ``fits`` with ``advice`` when not."""

    model: str
    dtype: str
    quant: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    max_model_len: int
    block_size: int
    gpu: str
    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activations_bytes: int
    other_bytes: int
    graph_reserve_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: float
    kv_bytes_per_block: int
    num_kv_blocks: int
    kv_tokens: int
    max_concurrency_at_full_length: int
    fits: bool
    scratch_bytes: int = 0  # int4/int8: the whole-weight dequantization buffer
    advice: list[str] = field(default_factory=list)


# The config again with some fields changed, from whatever the user gave.
Remake = Callable[[dict[str, Any]], EngineConfig]


def make_plan(
    config: EngineConfig,
    gpu_memory_gb: float | None,
    advice: bool = True,
    remake: Remake | None = None,
) -> Plan:
    """The budget of ``config`` on one GPU of ``gpu_memory_gb`` GiB (default: the
    local GPU's total memory); when it does not fit, with ``advice`` (each alternative's
    config made by ``remake``: see ``advise``)."""
    from tokenloom.engine.engine_core import resolve_quant
    from tokenloom.plugin_manager import PluginManager
    from tokenloom.plugins.attention import kv_quant
    from tokenloom.plugins.executor.model_runner import DTYPES

    config = resolve_quant(config, PluginManager.default())
    if config.quant not in QUANTS:
        raise ValueError(f"quant: the planner knows {', '.join(QUANTS)}, got {config.quant!r}")
    shape = read_shape(config.model)
    keeps_blocks = config.plugin.get("int4", {}).get("gguf_blocks", True)
    if config.quant == "int4" and keeps_blocks and config.load_format != "random":
        from tokenloom.plugins.quant.gguf_int4 import block_group

        shape = replace(shape, int4_group=block_group(config.model) or INT4_GROUP)
    dtype = "bfloat16" if config.dtype == "auto" else config.dtype
    element = DTYPE_BYTES[dtype]
    gpu, total = _gpu(gpu_memory_gb)
    tp = config.tensor_parallel_size
    max_len = config.max_model_len or shape.max_model_len
    kv_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, DTYPES[dtype])
    kv_heads = rank_heads(shape.num_kv_heads, tp)
    per_layer = kv_quant.block_bytes(config.block_size, kv_heads, shape.head_dim, kv_dtype)
    per_block = 2 * shape.num_layers * per_layer
    weights = weight_bytes(shape, config.quant, element, tp, lm_head_method(config))
    activations = activation_bytes(shape, config, element)
    scratch = dequant_scratch_bytes(shape, config, element)
    other = int(OTHER_GIB * GiB)
    reserve = 0 if config.enforce_eager else GRAPH_RESERVE
    available = int(total * config.gpu_memory_utilization) - weights - activations - other
    available -= scratch
    available -= reserve
    blocks_per_seq = -(-max_len // config.block_size)
    # The engine caps the pool at what every running sequence at full length can use
    # four times over (Engine.__init__): more would only serve the prefix cache.
    blocks = max(0, min(available // per_block, 4 * config.max_num_seqs * blocks_per_seq))
    plan = Plan(
        model=shape.name,
        dtype=dtype,
        quant=config.quant,
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        tensor_parallel_size=tp,
        max_model_len=max_len,
        block_size=config.block_size,
        gpu=gpu,
        total_bytes=total,
        gpu_memory_utilization=config.gpu_memory_utilization,
        weights_bytes=weights,
        activations_bytes=activations,
        scratch_bytes=scratch,
        other_bytes=other,
        graph_reserve_bytes=reserve,
        kv_cache_bytes=blocks * per_block,
        kv_bytes_per_token=per_block / config.block_size,
        kv_bytes_per_block=per_block,
        num_kv_blocks=blocks,
        kv_tokens=blocks * config.block_size,
        max_concurrency_at_full_length=blocks // blocks_per_seq,
        fits=blocks >= blocks_per_seq,
    )
    if advice and not plan.fits:
        plan.advice = advise(plan, config, gpu_memory_gb, remake)
    return plan


# Changes the advice tries, cheapest first in quality: flags -> config fields.
ALTERNATIVES: tuple[dict[str, Any], ...] = (
    {"kv_cache_dtype": "fp8"},
    {"quant": "fp8"},
    {"quant": "fp8", "kv_cache_dtype": "fp8"},
    {"quant": "int4"},
    {"quant": "int4", "kv_cache_dtype": "fp8"},
    {"enforce_eager": True},
)


def advise(
    plan: Plan, config: EngineConfig, gpu_memory_gb: float | None, remake: Remake | None = None
) -> list[str]:
    """What to change so that one request of full length fits: the shortest length
    that fits as is, then each alternative (and twice the GPUs) that fits, with the
    requests it holds at full length. ``remake(changes)`` makes each alternative's
    config from the user's own inputs (``main``'s: a block size the user left at 0
    then follows the new cache's default, one given stays); without it, ``config``
    with the changes, and a block size equal to its cache's default taken as left
    at it (a resolved config keeps no mark of which fields were given)."""
    advice = []
    if plan.kv_tokens > 0:
        advice.append(f"--max-model-len {plan.kv_tokens} (the KV cache holds that many tokens)")
    else:
        advice.append("the weights and activations leave no room for the KV cache")
    tp = config.tensor_parallel_size
    for change in (*ALTERNATIVES, {"tensor_parallel_size": 2 * tp}):
        fields = {k: v for k, v in change.items() if getattr(config, k) != v}
        if len(fields) != len(change):
            continue
        try:
            changed = remake(fields) if remake is not None else _changed(config, fields)
            other = make_plan(changed, gpu_memory_gb, advice=False)
        except ValueError:  # e.g. heads that twice the GPUs cannot split
            continue
        if other.fits:
            flags = " ".join(_flag(k, v) for k, v in fields.items())
            advice.append(
                f"{flags}: {other.num_kv_blocks:,} blocks of {other.block_size} tokens, "
                f"{other.max_concurrency_at_full_length:,} requests at full length"
            )
    return advice


def _changed(config: EngineConfig, fields: dict[str, Any]) -> EngineConfig:
    """``config`` with ``fields``; a block size at its cache's default follows the new
    cache's (64 tokens for fp8)."""
    settings = dict(fields)
    if "kv_cache_dtype" in fields and config.block_size == default_block_size(
        config.kv_cache_dtype, config.num_blocks
    ):
        settings["block_size"] = default_block_size(fields["kv_cache_dtype"], config.num_blocks)
    return msgspec.structs.replace(config, **settings)


def _flag(name: str, value: Any) -> str:
    if name == "tensor_parallel_size":
        return f"-tp {value}"
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def _gpu(gpu_memory_gb: float | None) -> tuple[str, int]:
    if gpu_memory_gb is not None:
        return f"{gpu_memory_gb:g} GiB (given)", int(gpu_memory_gb * GiB)
    import torch

    if not torch.cuda.is_available():
        raise ValueError("no local GPU: give --gpu-memory-gb (an H200 reports 139.8 GiB)")
    _, total = torch.cuda.mem_get_info()
    return torch.cuda.get_device_name(), int(total)


def format_table(plan: Plan) -> str:
    g = GiB
    per_token = plan.kv_bytes_per_token
    rows = [
        (
            "model",
            f"{plan.model} ({plan.dtype}, quant {plan.quant}, tp {plan.tensor_parallel_size})",
        ),
        ("GPU", f"{plan.gpu}: {plan.total_bytes / g:.2f} GiB x {plan.gpu_memory_utilization:.2f}"),
        ("weights", f"{plan.weights_bytes / g:.2f} GiB per GPU"),
        ("activations (peak)", f"{plan.activations_bytes / g:.2f} GiB (estimate)"),
        *(
            [("dequantization buffer", f"{plan.scratch_bytes / g:.2f} GiB (if the tuner picks it)")]
            if plan.scratch_bytes
            else []
        ),
        ("outside torch", f"{plan.other_bytes / g:.2f} GiB (estimate)"),
        ("CUDA-graph reserve", f"{plan.graph_reserve_bytes / g:.2f} GiB"),
        ("KV cache", f"{plan.kv_cache_bytes / g:.2f} GiB ({plan.kv_cache_dtype})"),
        ("KV bytes per token", f"{per_token:,.0f} per GPU"),
        (
            "KV blocks",
            f"{plan.num_kv_blocks:,} x {plan.block_size} tokens = {plan.kv_tokens:,} tokens",
        ),
        (
            "max concurrency",
            f"{plan.max_concurrency_at_full_length:,} requests of {plan.max_model_len:,} tokens",
        ),
        ("fits", "yes" if plan.fits else "NO"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    lines += [f"  - {line}" for line in plan.advice]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom plan",
        description="Memory budget of one GPU: weights, KV bytes per token, activations, "
        "KV blocks and the requests that fit at full length (the engine's sizing rule).",
    )
    parser.add_argument("model_dir", metavar="MODEL", help="model directory, .gguf or shape name")
    parser.add_argument("--config", metavar="FILE", help="TOML config file")
    parser.add_argument(
        "--gpu-memory-gb", type=float, metavar="GIB", help="GPU memory (default: the local GPU's)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_config_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 when one request of full length fits, 1 when not, 2 on errors."""
    args = build_parser().parse_args(argv)

    def remake(changes: dict[str, Any]) -> EngineConfig:  # the same flags and file, changed
        return config_from_args(argparse.Namespace(**{**vars(args), **changes}))

    try:
        plan = make_plan(config_from_args(args), args.gpu_memory_gb, remake=remake)
    except (ConfigError, ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else format_table(plan))
    return 0 if plan.fits else 1
