"""Loading a checkpoint: dtype and device, shards, the registry, and a clear error
for every way a checkpoint can be wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenloom.checkpoints.tiny_models import write_tiny_model
from tokenloom.plugins.models import MODEL_FACTORIES, tokenloom_register_components
from tokenloom.plugins.models.loader import CheckpointError, load_model, model_info_from_config


@pytest.fixture
def llama_dir(tmp_path):
    return write_tiny_model(tmp_path / "llama", "llama")


def rewrite_weights(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_weights_land_in_the_requested_dtype_with_checkpoint_values(llama_dir):
    model, info = load_model(llama_dir, torch.bfloat16, "cpu")
    checkpoint = load_file(llama_dir / "model.safetensors")

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    k = checkpoint["model.layers.1.self_attn.k_proj.weight"].to(torch.bfloat16)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    q_size = info.num_heads * info.head_dim
    assert torch.equal(qkv[q_size : q_size + k.shape[0]], k)
    up = checkpoint["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight[up.shape[0] :], up)
    assert info.dtype == torch.bfloat16 and info.device == torch.device("cpu")


def test_model_info_comes_from_config_json(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3")
    _, info = load_model(model_dir, torch.float32, "cpu")
    config = json.loads((model_dir / "config.json").read_text())

    assert info.architecture == "Qwen3ForCausalLM"
    assert info.max_model_len == config["max_position_embeddings"]
    assert info.head_dim == config["head_dim"] != config["hidden_size"] // info.num_heads
    assert (info.num_layers, info.num_heads, info.num_kv_heads) == (2, 4, 2)
    assert info.vocab_size == config["vocab_size"]
    assert info.eos_token_ids == [2, 0]  # <|im_end|> from config, <|endoftext|> from generation


def test_sliding_window_caps_max_model_len_only_when_enabled():
    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 8192,
    }
    assert model_info_from_config({**base, "sliding_window": 4096}).max_model_len == 4096
    assert model_info_from_config({**base, "sliding_window": None}).max_model_len == 8192
    disabled = {**base, "sliding_window": 4096, "use_sliding_window": False}
    assert model_info_from_config(disabled).max_model_len == 8192


def test_sharded_checkpoint_loads_the_same_weights_as_one_file(tmp_path):
    one, _ = load_model(write_tiny_model(tmp_path / "one", "qwen2"), torch.float32, "cpu")
    sharded_dir = write_tiny_model(tmp_path / "many", "qwen2", num_shards=3)
    many, _ = load_model(sharded_dir, torch.float32, "cpu")

    assert len(list(sharded_dir.glob("*.safetensors"))) == 3
    for (name, a), (_, b) in zip(one.named_parameters(), many.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_tied_model_shares_one_tensor_for_embedding_and_head(tiny_model_factory):
    model, _ = load_model(
        tiny_model_factory("llama", tie_word_embeddings=True), torch.float32, "cpu"
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unknown_architecture_is_named_with_the_supported_ones(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(llama_dir, torch.float32, "cpu")


def test_registry_callable_picks_the_factory(llama_dir):
    asked = []

    def lookup(arch):
        asked.append(arch)
        return MODEL_FACTORIES["LlamaForCausalLM"] if arch == "LlamaForCausalLM" else None

    model, _ = load_model(llama_dir, torch.float32, "cpu", registry=lookup)
    assert asked == ["LlamaForCausalLM"]
    assert hasattr(model, "compute_logits")
    with pytest.raises(ValueError, match="unknown model architecture 'LlamaForCausalLM'"):
        load_model(llama_dir, torch.float32, "cpu", registry=lambda arch: None)


def test_missing_tensor_is_named(llama_dir):
    rewrite_weights(llama_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks tensors: model\.layers\.1\.mlp\.up_proj"):
        load_model(llama_dir, torch.float32, "cpu")


def test_unexpected_tensor_is_named(llama_dir):
    rewrite_weights(llama_dir, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"does not have: model\.extra\.weight"):
        load_model(llama_dir, torch.float32, "cpu")


def test_misshaped_tensor_is_named_with_both_shapes(llama_dir):
    rewrite_weights(llama_dir, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(63,\).*\(64,\)"):
        load_model(llama_dir, torch.float32, "cpu")


def test_corrupt_weights_file_is_named(llama_dir):
    path = llama_dir / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read"):
        load_model(llama_dir, torch.float32, "cpu")


def test_missing_config_and_missing_weights_are_file_errors(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nothing", torch.float32, "cpu")
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(llama_dir, torch.float32, "cpu")


def test_shard_listed_in_index_but_absent_is_named(tmp_path):
    model_dir = write_tiny_model(tmp_path, "llama", num_shards=2)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(model_dir, torch.float32, "cpu")


def test_every_architecture_is_registered_as_a_model_component():
    specs = tokenloom_register_components()
    assert {s.name for s in specs} == set(MODEL_FACTORIES)
    assert {s.kind for s in specs} == {"model"}
