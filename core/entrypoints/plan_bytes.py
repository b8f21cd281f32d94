"""What each part of a model costs in memory, for ``tokenloom plan``: the shape memory
depends on (``ModelShape``, ``read_shape``), a linear weight as each quant method stores
it, one rank's weights, the whole-weight dequantization buffer and the activation peak."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenloom.config import EngineConfig

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
    shape: ModelShape, quant: str, element: int, tp: int, lm_head: str | None = None
) -> int:
    """One rank's weights: its q/k/v/o and MLP shards (quantized), its rows of the
    vocab-parallel embedding and LM head (the vocabulary padded to a multiple of the
    ranks) and the norms, in the model dtype; with ``lm_head`` (a method's name) the head's
    rows as that method stores them (a tied embedding keeps its 16-bit rows besides,
    unless the head's format serves its lookups: ``QuantMethod.serves_rows``)."""
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
    if lm_head is not None and lm_head != "none":
        table = vocab_rows * h * element
        if shape.tie_word_embeddings and quant_method(lm_head).serves_rows:
            table = 0
        embeddings = table + linear_bytes(vocab_rows, h, lm_head, element)
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
    if lm_head_method(config) in ("int4", "int8"):  # a quantized head is such a linear too
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


def quant_method(name: str) -> Any:
    """The class of the quant method registered as ``name``."""
    from tokenloom.plugin_manager import PluginManager

    return PluginManager.default().component("quant", name).factory


def lm_head_method(config: EngineConfig) -> str | None:
    """The engine's choice of the LM head's format: ``quant_lm_head`` where set, else the
    method's default (None: 16-bit)."""
    from tokenloom.protocols.components.quant import lm_head_method

    if config.quant == "none":
        return None
    return lm_head_method(config, quant_method(config.quant))
