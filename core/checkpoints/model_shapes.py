"""Real model shapes with random weights, for benchmarks: speed does not depend on
the weight values, and no weights can be downloaded.

``write_shape_dir("llama-3-8b", path)`` writes the model's real config.json and a
small tokenizer; load it with ``load_format="random"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

# Meta-Llama-3-70B: at bf16 140 GB of weights, so it runs at tensor_parallel_size >= 2.
_LLAMA_3_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

# Qwen2.5-32B-Instruct: 65 GB of bf16 weights; 40 query heads split over 2, 4 or 8 ranks.
_QWEN25_32B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

_QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

_QWEN3_06B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

# SmolLM2-135M-Instruct, the built-in default model (its GGUF metadata, as HF config).
_SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

# Llama-3.2-1B: the speculative-decoding draft for the Llama-3 8B shape (same vocabulary).
_LLAMA_32_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": _LLAMA_3_8B,
    "llama-3.2-1b": _LLAMA_32_1B,
    "llama-3-70b": _LLAMA_3_70B,
    "qwen2.5-32b": _QWEN25_32B,
    "qwen2.5-0.5b": _QWEN25_05B,
    "qwen3-0.6b": _QWEN3_06B,
    "smollm2-135m": _SMOLLM2_135M,
}


def is_shape_name(model: str) -> bool:
    return model in SHAPES


def write_shape_dir(name: str, path: str | Path) -> Path:
    """Write ``name``'s config.json and a small tokenizer into ``path``."""
    from tokenloom.checkpoints.tiny_models import write_tokenizer_files

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[name])
    arch = "qwen3" if "qwen" in name else "llama3"
    write_tokenizer_files(out, arch)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
