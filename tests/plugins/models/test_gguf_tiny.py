"""GGUF files the tests write themselves (``gguf_files.write_gguf``) load with the
right weights, config, tokenizer and errors, one file per supported tensor type."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import gguf_name, llama_cpp_permute, write_gguf
from safetensors.torch import load_file

from tokenloom.checkpoints.tiny_models import write_tiny_model
from tokenloom.plugins.models.gguf import find_gguf
from tokenloom.plugins.models.gguf.checkpoint import converted_dir, converted_weights
from tokenloom.plugins.models.loader import load_model
from tokenloom.text.tokenizer import Tokenizer

QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# K-quants need rows of whole 256-value blocks: every input dimension is 256 or 512.
TINY_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2}
PROMPTS = ([5, 17, 33, 2, 99, 250, 7], [400, 12, 8, 8, 301, 77, 45, 9, 600, 3, 14, 111])


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """``make(arch) -> Path``: a tiny Hugging Face checkpoint of GGUF-friendly shape."""
    made: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = write_tiny_model(tmp_path_factory.mktemp(arch), arch, **TINY_SHAPE)
        return made[arch]

    return make


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf, tmp_path_factory):
    """``make(qtype, arch) -> Path``: a directory holding only that checkpoint as GGUF."""
    made: dict[tuple[str, str], Path] = {}

    def make(qtype: str = "F32", arch: str = "llama") -> Path:
        if (qtype, arch) not in made:
            out = tmp_path_factory.mktemp(f"gguf-{arch}-{qtype}")
            write_gguf(tiny_hf(arch), out / f"tiny-{qtype}.gguf", qtype)
            made[qtype, arch] = out
        return made[qtype, arch]

    return make


def expected_weight(tensor, original: dict[str, torch.Tensor], hf_name: str) -> torch.Tensor:
    """What a GGUF tensor should dequantize to, by other means than gguf.quants: the
    original weight rounded the way the type rounds, or transformers' own torch
    dequantizer on the raw blocks (in the file's, i.e. llama.cpp's, row order)."""
    kind = tensor.tensor_type.name
    if kind == "F32":
        return original[hf_name]
    if kind == "F16":
        return original[hf_name].half().float()
    if kind == "BF16":
        return original[hf_name].bfloat16().float()
    shape = tuple(reversed(tensor.shape.tolist()))
    if kind in ("Q4_0", "Q4_1"):  # spelled out: transformers 5.17 has no torch dequantizer for them
        return torch.from_numpy(q4_blocks(np.array(tensor.data).reshape(-1), kind)).reshape(shape)
    from transformers.integrations.gguf.dequant import dequantize

    raw = torch.from_numpy(np.array(tensor.data)).reshape(-1)
    return dequantize(raw, int(tensor.tensor_type)).reshape(shape)


def q4_blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    """llama.cpp's Q4_0 / Q4_1 blocks of 32 weights: a float16 scale ``d`` (Q4_1: then a
    float16 minimum ``m``), 16 bytes whose low nibbles are weights 0-15 and high nibbles
    16-31; ``d (q - 8)`` or ``d q + m``."""
    head = 2 if kind == "Q4_0" else 4
    blocks = raw.view(np.uint8).reshape(-1, head + 16)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blocks[:, head:] & 0xF, blocks[:, head:] >> 4], axis=1).astype(np.float32)
    if kind == "Q4_0":
        return (d * (q - 8)).reshape(-1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(-1)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantized_weights_match_an_independent_dequantizer(qtype, tiny_hf, tiny_gguf):
    path = find_gguf(tiny_gguf(qtype))
    config = json.loads((tiny_hf("llama") / "config.json").read_text())
    original = load_file(str(tiny_hf("llama") / "model.safetensors"))
    ours = load_file(str(converted_weights(path, torch.float32)[1]))
    reader = gguf.GGUFReader(path)

    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {qtype}
    assert set(ours) == set(original)
    for name, value in ours.items():
        tensor = next(t for t in reader.tensors if t.name == gguf_name(name))
        expected = expected_weight(tensor, original, name)
        if tensor.tensor_type.name not in ("F32", "F16", "BF16"):  # raw blocks: file order
            heads = {
                "q_proj": config["num_attention_heads"],
                "k_proj": config["num_key_value_heads"],
            }
            part = name.split(".")[-2]
            if part in heads:
                value = torch.from_numpy(llama_cpp_permute(value.numpy(), heads[part]))
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=name)


@torch.inference_mode()
def transformers_greedy(model_dir: Path, prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations by transformers loading the GGUF file, argmax each step."""
    transformers = pytest.importorskip("transformers")
    name = find_gguf(model_dir).name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=name, dtype=torch.float32
    )
    results = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        results.append(ids[len(prompt) :])
    return results


def tokenloom_greedy(model_path: Path, prompts, max_new_tokens: int) -> list[list[int]]:
    from tokenloom.llm import LLM
    from tokenloom.protocols.sampling import SamplingParams

    llm = LLM(str(model_path), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("qtype", QTYPES)
def test_greedy_tokens_match_transformers_on_the_same_file(qtype, tiny_gguf):
    model_dir = tiny_gguf(qtype)
    assert tokenloom_greedy(model_dir, PROMPTS, 8) == transformers_greedy(model_dir, PROMPTS, 8)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_file_loads_the_original_checkpoint_exactly(arch, tiny_hf, tiny_gguf):
    """The GGUF config and weights equal those of the checkpoint it was written from.
    For llama this needs the rope un-permutation: the file's Q/K rows differ."""
    hf_dir = tiny_hf(arch)
    path = find_gguf(tiny_gguf("F32", arch))
    original = load_file(str(hf_dir / "model.safetensors"))
    ours = load_file(str(converted_weights(path, torch.float32)[1]))

    assert set(ours) == set(original)
    for name in ours:
        assert torch.equal(ours[name], original[name]), name
    config = json.loads((converted_dir(path) / "config.json").read_text())
    hf_config = json.loads((hf_dir / "config.json").read_text())
    for key in (
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
    ):
        assert config[key] == pytest.approx(hf_config[key]), key
    if arch == "llama":
        raw_q = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
        assert not np.array_equal(
            np.array(raw_q.data), original["model.layers.0.self_attn.q_proj.weight"].numpy()
        )


def test_tokenizer_matches_the_original_tokenizer_json(tiny_hf, tiny_gguf):
    for arch in ("llama", "qwen2"):
        ours = Tokenizer.from_dir(tiny_gguf("F32", arch))
        reference = Tokenizer.from_dir(tiny_hf(arch))
        texts = [
            "Hello, world!  How are   you?\n\nFine.",
            "Caf\u00e9 \u65e5\u672c\u8a9e \U0001f600 2024-05-17",
            "<|im_start|>user\nhi<|im_end|>" if arch == "qwen2" else "<s>[INST] hi [/INST]</s>",
        ]
        for text in texts:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == reference.encode(text, add_special_tokens=special), (arch, text)
                assert ours.decode(ids) == reference.decode(ids)
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages)
        assert ours.eos_token_ids == reference.eos_token_ids[:1]
        assert ours.bos_token_id == reference.bos_token_id


def test_unsupported_architecture_fails_naming_it(tiny_hf, tmp_path):
    write_gguf(tiny_hf("llama"), tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_model(tmp_path / "m.gguf", torch.float32, "cpu")


def test_unsupported_tensor_type_fails_naming_it(tiny_hf, tmp_path):
    write_gguf(tiny_hf("llama"), tmp_path / "m.gguf", odd_tensor=("blk.1.ffn_down.weight", "Q2_K"))
    with pytest.raises(ValueError, match="tensor type Q2_K .*blk.1.ffn_down.weight"):
        load_model(tmp_path / "m.gguf", torch.float32, "cpu")


def test_directory_with_several_gguf_files_is_refused(tiny_gguf, tmp_path):
    source = find_gguf(tiny_gguf("F32"))
    shutil.copy(source, tmp_path / "a.gguf")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    shutil.copy(source, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several .gguf files"):
        load_model(tmp_path, torch.float32, "cpu")


def test_cache_is_keyed_by_content_and_dtype(tiny_gguf, tmp_path):
    source = find_gguf(tiny_gguf("Q8_0"))
    copy = tmp_path / "copy.gguf"
    shutil.copy(source, copy)
    out, fp32 = converted_weights(source, torch.float32)
    written = fp32.stat().st_mtime_ns

    assert converted_weights(copy, torch.float32) == (out, fp32)  # same content, same entry
    assert fp32.stat().st_mtime_ns == written  # not converted again
    _, bf16 = converted_weights(copy, torch.bfloat16)
    assert bf16 != fp32 and next(iter(load_file(str(bf16)).values())).dtype == torch.bfloat16
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left
    model, info = load_model(copy, torch.bfloat16, "cpu")
    assert info.name == str(copy) and next(model.parameters()).dtype == torch.bfloat16
