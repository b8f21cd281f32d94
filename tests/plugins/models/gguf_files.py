"""Test-only GGUF writer: a tiny Hugging Face checkpoint (``write_tiny_model``) written
as llama.cpp's converter would, with every matrix in one tensor type.

Types ``gguf.quants.quantize`` cannot produce (the K-quants) get random raw blocks
with small fp16 scales instead of the checkpoint's values: the file is still valid,
and transformers' own dequantizer gives the expected weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from tokenloom import LLM, SamplingParams

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# K-quant: (byte offsets of the fp16 scales in a block, scale magnitude)
RANDOM_BLOCKS = {"Q4_K": ((0, 2), 2e-4), "Q5_K": ((0, 2), 1e-4), "Q6_K": ((208,), 2e-5)}
_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter (``LlamaModel.permute``): per head, interleave the halves."""
    shape = rows.shape
    return (
        rows.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: str = "F32",
    *,
    arch: str | None = None,
    seed: int = 0,
    odd_tensor: tuple[str, str] | None = None,
) -> Path:
    """Write ``hf_dir`` as the GGUF file ``out``; matrices in ``qtype``, norms F32.
    ``arch`` overrides the GGUF architecture; ``odd_tensor`` = (name, type) writes that
    one tensor as random raw blocks of another type."""
    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    arch = arch or GGUF_ARCH[config["model_type"]]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, tok, tok_config, config)

    weights = load_file(str(hf_dir / "model.safetensors"))
    for name, value in weights.items():
        target = gguf_name(name)
        if GGUF_ARCH.get(config["model_type"]) == "llama" and ".self_attn." in name:
            if "q_proj" in name:
                value = llama_cpp_permute(value, config["num_attention_heads"])
            elif "k_proj" in name:
                value = llama_cpp_permute(value, config["num_key_value_heads"])
        if odd_tensor is not None and target == odd_tensor[0]:
            _add_random_blocks(writer, target, value.shape, odd_tensor[1], rng)
        elif value.ndim == 1:
            writer.add_tensor(target, value.astype(np.float32))
        elif qtype in RANDOM_BLOCKS:
            _add_random_blocks(writer, target, value.shape, qtype, rng)
        else:
            _add_quantized(writer, target, value.astype(np.float32), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer, tok, tok_config, config) -> None:
    vocab = tok["model"]["vocab"]
    tokens = [""] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"]: t["content"] for t in tok["added_tokens"] if t["special"]}
    for index, token in special.items():
        tokens[index] = token
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for index in special:
        types[index] = gguf.TokenType.CONTROL
    for index, token in enumerate(tokens):
        if not token:
            tokens[index], types[index] = f"[PAD{index}]", gguf.TokenType.UNUSED
    ids = {token: index for index, token in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(
        [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    )
    if tok_config.get("bos_token"):
        writer.add_bos_token_id(ids[tok_config["bos_token"]])
    eos = config["eos_token_id"]
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_add_bos_token(
        tok["post_processor"] is not None and "<s>" in json.dumps(tok["post_processor"])
    )
    writer.add_chat_template(tok_config["chat_template"])


def _add_quantized(writer, name: str, value: np.ndarray, qtype: str) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, value)
    elif qtype == "F16":
        writer.add_tensor(name, value.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)


def _add_random_blocks(writer, name: str, shape, qtype: str, rng) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = shape
    assert cols % block_size == 0, f"{name}: {cols} columns are not whole {qtype} blocks"
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    offsets, magnitude = RANDOM_BLOCKS.get(qtype, ((0,), 1e-3))
    for offset in offsets:
        scales = rng.uniform(0.5, 1.0, size=blocks.shape[:2]) * magnitude
        blocks[:, :, offset : offset + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=kind)


PROMPTS = [[5, 17, 33, 2, 99, 250, 7], [400, 12, 8, 8, 301, 77, 45, 9, 600, 3, 14, 111]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"device": "cpu", "dtype": "float32", "block_size": 4, "num_blocks": 64}


def greedy_tokens(model: Path, **options: object) -> list[list[int]]:
    """Six greedy tokens for each of two prompts from ``model`` on the CPU (fp32),
    engine options on top; the engine is shut down after."""
    llm = LLM(str(model), **ENGINE, **options)  # type: ignore[arg-type]
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
