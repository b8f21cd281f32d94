"""Our Llama-family forward pass gives the logits of Hugging Face transformers on
the same random checkpoint, for every architecture and variant."""

from __future__ import annotations

import pytest
import torch

from tokenloom.checkpoints.tiny_models import write_tiny_model
from tokenloom.plugins.models.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPTS = ([5, 17, 33, 2, 99, 250, 7], [400, 12, 8, 8, 301, 77, 45, 9, 600, 3, 14, 111])
FP32_TOLERANCE = 2e-5  # observed ~2e-6; a wrong rope scaling gives ~6e-4

VARIANTS = {
    "llama": ("llama", {}),
    "llama3-rope-scaling": ("llama3", {}),
    "mistral": ("mistral", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-bf16-checkpoint": ("qwen3", {"dtype": "bfloat16"}),
    "llama-sharded": ("llama", {"num_shards": 3}),
    "llama-mha-head-dim": ("llama", {"num_kv_heads": 4, "head_dim": 32}),
}


@torch.inference_mode()
def hf_logits(model_dir, dtype: torch.dtype, prompts=PROMPTS) -> list[torch.Tensor]:
    """Per-prompt logits [len, vocab] float32 from transformers, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return [model(torch.tensor([p])).logits[0].float() for p in prompts]


def max_diff(ours: torch.Tensor, reference: list[torch.Tensor]) -> float:
    return (ours - torch.cat(reference)).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_prefill_logits_match_transformers(variant, tiny_model_factory, paged_runner):
    arch, options = VARIANTS[variant]
    model_dir = tiny_model_factory(arch, **options)
    model, info = load_model(model_dir, torch.float32, "cpu")
    runner = paged_runner(model, info, len(PROMPTS))

    logits = runner.step(list(enumerate(PROMPTS)))  # both prompts packed flat

    assert logits.shape == (sum(map(len, PROMPTS)), info.vocab_size)
    assert logits.dtype == torch.float32
    assert max_diff(logits, hf_logits(model_dir, torch.float32)) < FP32_TOLERANCE


def test_linear_rope_scaling_matches_transformers(tmp_path, paged_runner):
    scaling = {"rope_type": "linear", "factor": 4.0}
    model_dir = write_tiny_model(tmp_path, "llama", config_overrides={"rope_scaling": scaling})
    model, info = load_model(model_dir, torch.float32, "cpu")
    runner = paged_runner(model, info, len(PROMPTS))

    logits = runner.step(list(enumerate(PROMPTS)))

    assert max_diff(logits, hf_logits(model_dir, torch.float32)) < FP32_TOLERANCE


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_chunked_prefill_then_decode_reads_the_cache_like_one_full_pass(
    arch, tiny_model_factory, paged_runner
):
    model_dir = tiny_model_factory(arch)
    model, info = load_model(model_dir, torch.float32, "cpu")
    runner = paged_runner(model, info, len(PROMPTS))
    first, second = PROMPTS
    next_tokens = [21, 22]

    runner.step([(0, first[:3]), (1, second[:5])])  # first chunks
    chunk = runner.step([(0, first[3:]), (1, second[5:])])  # rest of the prompts
    decode = runner.step([(0, [next_tokens[0]]), (1, [next_tokens[1]])])

    full = hf_logits(model_dir, torch.float32, [first + [21], second + [22]])
    expected_chunk = torch.cat([full[0][3 : len(first)], full[1][5 : len(second)]])
    assert (chunk - expected_chunk).abs().max().item() < FP32_TOLERANCE
    expected_decode = torch.stack([full[0][-1], full[1][-1]])
    assert (decode - expected_decode).abs().max().item() < FP32_TOLERANCE


def test_bf16_model_tracks_transformers_bf16(tiny_model_factory, paged_runner):
    model_dir = tiny_model_factory("llama")
    model, info = load_model(model_dir, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    runner = paged_runner(model, info, len(PROMPTS))

    logits = runner.step(list(enumerate(PROMPTS)))
    reference = torch.cat(hf_logits(model_dir, torch.bfloat16))

    # Different (equally valid) bf16 rounding orders: compare against the logit scale.
    assert (logits - reference).abs().max().item() < 0.05 * reference.abs().max().item()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.9
