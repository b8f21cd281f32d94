"""The tiny-model factory: Hugging Face layout, determinism, shards, the CLI and the
built-in default model."""

from __future__ import annotations

import json
import time

import pytest
from safetensors import safe_open

from tokenloom.checkpoints.tiny_models import (
    ARCHS,
    default_model_dir,
    main,
    write_tiny_model,
    write_tokenizer_files,
)
from tokenloom.text.tokenizer import Tokenizer


def tensor_names(model_dir) -> set[str]:
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as reader:
            names.update(reader.keys())  # noqa: SIM118
    return names


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_writes_the_hugging_face_files(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_vocab = len(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"])
    assert config["vocab_size"] >= tokenizer_vocab and config["vocab_size"] % 64 == 0
    assert config["torch_dtype"] == "float32"
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_arch_specific_config_and_tensors(tiny_model_factory):
    llama3 = json.loads((tiny_model_factory("llama3") / "config.json").read_text())
    assert llama3["rope_scaling"]["rope_type"] == "llama3" and llama3["rope_theta"] == 500000.0
    assert llama3["eos_token_id"] == [1, 4]
    qwen3_dir = tiny_model_factory("qwen3")
    qwen3 = json.loads((qwen3_dir / "config.json").read_text())
    assert qwen3["head_dim"] * qwen3["num_attention_heads"] != qwen3["hidden_size"]
    assert "model.layers.0.self_attn.q_norm.weight" in tensor_names(qwen3_dir)
    assert "model.layers.0.self_attn.q_proj.bias" in tensor_names(tiny_model_factory("qwen2"))
    assert "model.layers.0.self_attn.q_proj.bias" not in tensor_names(tiny_model_factory("llama"))


def test_tied_embeddings_write_no_lm_head(tiny_model_factory):
    assert "lm_head.weight" in tensor_names(tiny_model_factory("llama"))
    assert "lm_head.weight" not in tensor_names(
        tiny_model_factory("llama", tie_word_embeddings=True)
    )


def test_same_seed_gives_identical_files_and_another_seed_differs(tmp_path):
    a = write_tiny_model(tmp_path / "a", "qwen2", seed=3)
    b = write_tiny_model(tmp_path / "b", "qwen2", seed=3)
    c = write_tiny_model(tmp_path / "c", "qwen2", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_shards_split_the_tensors_and_the_index_maps_each_once(tmp_path):
    model_dir = write_tiny_model(tmp_path, "llama", num_shards=3)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == tensor_names(model_dir)


def test_writing_a_model_is_fast(tmp_path):
    write_tiny_model(tmp_path / "warm", "llama")  # imports torch and tokenizers once
    start = time.perf_counter()
    write_tiny_model(tmp_path / "timed", "qwen3", dtype="bfloat16", seed=9)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"arch": "gpt2"}, "unknown arch"),
        ({"dtype": "int8"}, "unknown dtype"),
        ({"vocab_size": 10}, "smaller than the tokenizer"),
        ({"num_shards": 0}, "num_shards"),
    ],
)
def test_invalid_options_are_refused(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        write_tiny_model(tmp_path, **options)


def test_cli_writes_a_model_and_prints_its_path(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main([str(out), "--arch", "qwen3", "--num-layers", "1", "--tie-word-embeddings"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is True
    assert capsys.readouterr().out.strip() == str(out)


def test_default_model_is_generated_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    first = default_model_dir()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = default_model_dir()
    assert first == second and first.parent == tmp_path
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((first / "config.json").read_text())["model_type"] == "qwen3"
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging left behind


def test_tokenizer_files_alone_give_a_working_tokenizer(tmp_path):
    write_tokenizer_files(tmp_path, "llama3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.decode(tok.encode("Grüße 🙂")) == "Grüße 🙂"
    assert tok.eos_token_ids == [4]  # no config.json: the tokenizer's <|eot_id|> alone
