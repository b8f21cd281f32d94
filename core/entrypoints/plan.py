"""``tokenloom plan MODEL [flags]``: the memory budget of one GPU before starting an
engine: weights, KV bytes per token, activations, the resulting KV blocks and the
number of requests that fit at full length; a setting that cannot fit says what to
change. A table, or ``--json``.

It mirrors the engine's sizing rule (``ModelRunner._profile_num_blocks``): the KV
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.entrypoints.cli import add_config_flags, config_from_args

GiB = 1 << 30
OTHER_GIB = 0.7  # outside torch's allocator: CUDA context, cuBLAS, Triton (H200: 0.67-0.74)
GRAPH_RESERVE = 512 << 20  # ModelRunner's reserve for CUDA graphs (not with enforce_eager)
QUANTS = ("none", "fp8", "int8", "int4")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
INT4_GROUP = 128


@dataclass
class ModelShape:
    """What memory depends on, from a Hugging Face config."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    tie_word_embeddings: bool
    # int4's inputs per scale and zero point: 128 (RTN), or 32 where a GGUF file's
    # Q4_0/Q4_1 blocks are kept (plugins/quant/gguf_int4.py)
    int4_group: int = INT4_GROUP


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


def read_shape(model: str) -> ModelShape:
    """The shape of a shape name, a GGUF file (its metadata only) or a model directory."""
    from tokenloom.checkpoints.model_shapes import SHAPES
    from tokenloom.plugins.models.gguf import find_gguf
    from tokenloom.plugins.models.loader import model_info_from_config, read_hf_config

    if model in SHAPES:
        config = SHAPES[model]
    elif (gguf := find_gguf(Path(model))) is not None:
        from tokenloom.plugins.models.gguf.checkpoint import converted_dir

        config = read_hf_config(converted_dir(gguf))
    else:
        config = read_hf_config(Path(model))
    info = model_info_from_config(config, name=model)
    return ModelShape(
        name=Path(model).name,
        hidden_size=info.hidden_size,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def linear_bytes(
    out_features: int, in_features: int, quant: str, element: int, group: int = INT4_GROUP
) -> int:
    """One linear weight as each quant method stores it (plugins/quant): fp8 and int8
    one byte a weight plus an fp32 scale per output channel; int4 half a byte plus a
    scale and a zero point per ``group`` inputs (128; 32 from GGUF blocks), in the
    model dtype."""
    weights = out_features * in_features
    if quant == "none":
        return weights * element
    if quant in ("fp8", "int8"):
        return weights + 4 * out_features
    groups = -(-in_features // group)
    return weights // 2 + 2 * groups * out_features * element


def rank_heads(num_heads: int, tp: int) -> int:
    """Heads one rank holds (``parallel.head_range``: even split, or one replicated)."""
    if num_heads >= tp:
        if num_heads % tp:
            raise ValueError(f"{num_heads} heads cannot be split evenly over {tp} ranks")
        return num_heads // tp
    if tp % num_heads:
        raise ValueError(f"{num_heads} KV heads cannot be shared by {tp} ranks")
    return 1


def weight_bytes(
    shape: ModelShape, quant: str, element: int, tp: int, quant_lm_head: bool = False
) -> int:
    """One rank's weights: its q/k/v/o and MLP shards (quantized), its rows of the
    vocab-parallel embedding and LM head (the vocabulary padded to a multiple of the
    ranks) and the norms, in the model dtype; with ``quant_lm_head`` the head's rows as
    the method stores them (a tied embedding keeps its 16-bit rows besides)."""
    h, d = shape.hidden_size, shape.head_dim
    q = rank_heads(shape.num_heads, tp) * d
    kv = rank_heads(shape.num_kv_heads, tp) * d
    inter = shape.intermediate_size // tp
    g = shape.int4_group
    per_layer = (
        linear_bytes(q + 2 * kv, h, quant, element, g)  # qkv_proj (column)
        + linear_bytes(h, q, quant, element, g)  # o_proj (row)
        + linear_bytes(2 * inter, h, quant, element, g)  # gate_up_proj (column)
        + linear_bytes(h, inter, quant, element, g)  # down_proj (row)
        + 2 * h * element  # the two RMSNorms
    )
    vocab_rows = -(-shape.vocab_size // tp)
    if quant_lm_head and quant != "none":
        embeddings = vocab_rows * h * element + linear_bytes(vocab_rows, h, quant, element)
    else:
        embeddings = (1 if shape.tie_word_embeddings else 2) * vocab_rows * h * element
    return shape.num_layers * per_layer + embeddings + h * element


def dequant_scratch_bytes(shape: ModelShape, config: EngineConfig, element: int) -> int:
    """int4/int8 on a GPU: the 16-bit buffer that the whole-weight dequantization
    (``plugins/quant/kernels/dequant.py``, prefill chunks) reserves at load, sized to
    the largest decoder linear it may serve (at most 2^28 weights). The engine reserves
    it only for layers where the tuner chose that tiling, so this is an upper bound
    (235 MB for llama-3-8b's gate_up; a quantized LM head counts where it is small
    enough to be offered, as smaller models' are)."""
    from tokenloom.plugins.quant.kernels.dispatch import DEQUANT_MAX_ELEMENTS, dequant_offered

    if config.quant not in ("int4", "int8") or not dequant_offered():
        return 0
    tp = config.tensor_parallel_size
    h, d = shape.hidden_size, shape.head_dim
    q = rank_heads(shape.num_heads, tp) * d
    qkv = q + 2 * rank_heads(shape.num_kv_heads, tp) * d
    inter = shape.intermediate_size // tp
    sizes = [n * k for n, k in ((qkv, h), (h, q), (2 * inter, h), (h, inter))]
    if _quantizes_lm_head(config):  # a quantized head is a linear of the method too
        sizes.append(-(-shape.vocab_size // tp) * h)
    return max((s for s in sizes if s <= DEQUANT_MAX_ELEMENTS), default=0) * element


def activation_bytes(shape: ModelShape, config: EngineConfig, element: int) -> int:
    """The peak above weights and KV while the engine profiles: a forward pass of
    ``max_num_batched_tokens`` tokens (the MLP's gate_up and product, the qkv rows and
    about four hidden-sized tensors live at once), or the fp32 logits of
    ``max_num_seqs`` rows and their softmax, whichever is larger. Fit to the H200
    start-up logs of llama-3-8b, qwen3-0.6b and smollm2-135m within 50 MB."""
    tp = config.tensor_parallel_size
    tokens = config.max_num_batched_tokens
    qkv = rank_heads(shape.num_heads, tp) + 2 * rank_heads(shape.num_kv_heads, tp)
    forward = (
        tokens
        * element
        * (3 * shape.intermediate_size // tp + qkv * shape.head_dim + 4 * shape.hidden_size)
    )
    logits = 2 * config.max_num_seqs * shape.vocab_size * 4
    return max(forward, logits)


def _quantizes_lm_head(config: EngineConfig) -> bool:
    """The engine's choice: ``quant_lm_head`` where set, else the method's default."""
    from tokenloom.plugin_manager import PluginManager
    from tokenloom.protocols.components.quant import quantizes_lm_head

    if config.quant == "none":
        return False
    method = PluginManager.default().component("quant", config.quant).factory
    return quantizes_lm_head(config, method)


def make_plan(config: EngineConfig, gpu_memory_gb: float | None, advice: bool = True) -> Plan:
    """The budget of ``config`` on one GPU of ``gpu_memory_gb`` GiB (default: the
    local GPU's total memory); when it does not fit, with ``advice``."""
    from tokenloom.plugins.attention import kv_quant
    from tokenloom.plugins.executor.model_runner import DTYPES

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
    weights = weight_bytes(shape, config.quant, element, tp, _quantizes_lm_head(config))
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
        plan.advice = advise(plan, config, gpu_memory_gb)
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


def advise(plan: Plan, config: EngineConfig, gpu_memory_gb: float | None) -> list[str]:
    """What to change so that one request of full length fits: the shortest length
    that fits as is, then each alternative (and twice the GPUs) that fits, with the
    requests it holds at full length."""
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
            other = make_plan(
                msgspec.structs.replace(config, **fields), gpu_memory_gb, advice=False
            )
        except ValueError:  # e.g. heads that twice the GPUs cannot split
            continue
        if other.fits:
            flags = " ".join(_flag(k, v) for k, v in fields.items())
            advice.append(
                f"{flags}: {other.num_kv_blocks:,} blocks, "
                f"{other.max_concurrency_at_full_length:,} requests at full length"
            )
    return advice


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
    try:
        plan = make_plan(config_from_args(args), args.gpu_memory_gb)
    except (ConfigError, ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else format_table(plan))
    return 0 if plan.fits else 1
