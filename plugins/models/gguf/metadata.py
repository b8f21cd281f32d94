"""GGUF metadata -> the Hugging Face config dict the Llama-family factories take.

llama.cpp names its keys ``{arch}.embedding_length``, ``{arch}.attention.head_count``
and so on; ``hf_config`` maps them for the architectures tokenloom runs: ``llama``
(which covers Mistral: llama.cpp converts both to ``llama``), ``qwen2`` and
``qwen3``. Anything else fails with ``UnsupportedGGUFError`` naming it. Facts the
metadata leaves out are read off the tensors: tied embeddings (no ``output.weight``),
attention biases (``attn_q.bias``), and Llama 3.1 rope scaling (a ``rope_freqs``
tensor instead of keys).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# GGUF architecture -> (Hugging Face architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# Llama 3.1's rope scaling, the only one llama.cpp stores as a ``rope_freqs`` tensor
# of per-frequency divisors; recognised by recomputing the divisors from these.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ORIGINAL_LENGTHS = (8192,)


class UnsupportedGGUFError(ValueError):
    """The GGUF file uses an architecture, tensor type or setting tokenloom cannot run;
    the message names it."""


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of a ``gguf.GGUFReader`` as plain Python values (str,
    int, float, bool, or a list of them). Reads ``parts``/``data``/``types``, which
    every gguf release has (``ReaderField.contents`` came later)."""
    return {name: _field_value(field) for name, field in reader.fields.items()}


def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    def item(part: Any, kind: Any) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part[0].item()

    parts = [field.parts[i] for i in field.data]
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        kind = field.types[-1]
        return [item(part, kind) for part in parts]
    return item(parts[0], field.types[0]) if parts else None


def architecture(metadata: dict[str, Any]) -> str:
    """``general.architecture``, checked against ``ARCHITECTURES``."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {supported}"
        )
    return str(arch)


def hf_config(metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config of a GGUF file. ``tensors`` maps GGUF tensor names to
    reader tensors (their ``shape`` is GGUF order, fastest dimension first)."""
    arch = architecture(metadata)
    hf_arch, model_type = ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedGGUFError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise UnsupportedGGUFError(f"{arch}.attention.head_count_kv per layer is not supported")
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rotary_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise UnsupportedGGUFError(
            f"{arch}.rope.dimension_count {rotary_dim} != head dim {head_dim} "
            "(partial rotary embeddings) is not supported"
        )
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise UnsupportedGGUFError("GGUF file lacks the tensor token_embd.weight")
    attention_bias = "blk.0.attn_q.bias" in tensors
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "vocab_size": int(embed.shape[1]),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(metadata, arch, head_dim, tensors),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "attention_bias": attention_bias and model_type != "qwen2",
    }
    if model_type == "qwen2" and not attention_bias:
        raise UnsupportedGGUFError("GGUF qwen2 file without q/k/v biases is not supported")
    for role in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{role}_token_id")
        if token_id is not None:
            config["pad_token_id" if role == "padding" else f"{role}_token_id"] = int(token_id)
    return config


def rope_scaling(
    metadata: dict[str, Any], arch: str, head_dim: int, tensors: dict[str, Any]
) -> dict[str, Any] | None:
    """``rope_scaling`` from ``{arch}.rope.scaling.*`` keys, or Llama 3.1's from its
    ``rope_freqs`` tensor; None without scaling."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        if kind not in (None, "none"):
            raise UnsupportedGGUFError(f"rope_freqs together with rope scaling {kind!r}")
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32)
        return _llama3_rope(factors, metadata, arch, head_dim)
    if kind in (None, "none"):
        return None
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise UnsupportedGGUFError(f"GGUF rope scaling {kind!r} is not supported; supported: linear")


def _llama3_rope(
    factors: np.ndarray, metadata: dict[str, Any], arch: str, head_dim: int
) -> dict[str, Any]:
    """The llama3 rope parameters whose divisors are ``factors``; the divisors are
    recomputed and must match, else the scaling is one tokenloom does not know."""
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    factor = float(factors.max())
    low, high = _LLAMA3_ROPE["low_freq_factor"], _LLAMA3_ROPE["high_freq_factor"]
    for original in _LLAMA3_ORIGINAL_LENGTHS:
        smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
        expected = 1.0 / ((1 - smooth) / factor + smooth)
        if factors.shape == expected.shape and np.allclose(factors, expected, rtol=1e-3):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "original_max_position_embeddings": original,
                **_LLAMA3_ROPE,
            }
    raise UnsupportedGGUFError(
        "GGUF rope_freqs tensor with factors other than Llama 3.1's is not supported"
    )
