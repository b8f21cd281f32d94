"""GGUF tensors -> Hugging Face named torch tensors in the target dtype.

Each tensor is dequantized with ``gguf.quants.dequantize`` (which returns the torch
layout ``[rows, cols]``: GGUF lists dimensions fastest first, the reverse of torch),
renamed from llama.cpp's ``blk.N.attn_q.weight`` to ``model.layers.N.self_attn.q_proj.weight``,
and, for ``llama`` files, the rope permutation of Q and K is undone: llama.cpp's
converter reorders each head's rows so that the two rotary halves interleave
(row ``2i`` is the first half's ``i``, row ``2i+1`` the second half's) for its
interleaved rope kernel; tokenloom's rope rotates the halves of the head, as
Hugging Face checkpoints expect. qwen2 and qwen3 files are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from tokenloom.plugins.models.gguf.metadata import UnsupportedGGUFError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Read into the config (metadata.rope_scaling), not into a parameter.
_CONFIG_TENSORS = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; raises UnsupportedGGUFError for a
    tensor the Llama-family models have no place for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise UnsupportedGGUFError(f"GGUF tensor {gguf_name!r} is not supported")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def check_tensor_types(reader: Any) -> None:
    """Raise UnsupportedGGUFError naming the first tensor of a type not in
    ``SUPPORTED_TYPES`` (before any work is done)."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedGGUFError(
                f"GGUF tensor type {tensor.tensor_type.name} (tensor {tensor.name!r}) is not "
                f"supported; supported: {', '.join(SUPPORTED_TYPES)}"
            )


def hf_tensors(
    reader: Any, hf_config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in ``dtype`` on the CPU) for every weight of the file,
    dequantized and, for llama files, with Q/K un-permuted."""
    from gguf.quants import dequantize

    check_tensor_types(reader)
    permuted = hf_config["model_type"] == "llama"
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type)  # float32, [rows, cols]
        values = torch.from_numpy(array if array.flags.writeable else array.copy())
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if permuted and part in heads:
            values = unpermute_rope(values, heads[part])
        yield name, values.to(dtype).contiguous()


def unpermute_rope(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation of ``rows`` [num_heads * head_dim, ...]
    (a weight or a bias): per head, rows (0, 1, 2, 3, ...) hold the halves'
    (first 0, second 0, first 1, second 1, ...); put each half back together."""
    head_dim = rows.shape[0] // num_heads
    per_head = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return per_head.transpose(1, 2).reshape(rows.shape)
