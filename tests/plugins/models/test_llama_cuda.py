"""On an NVIDIA GPU, the models load straight onto the device and their logits
track transformers' float32 reference on the CPU."""

from __future__ import annotations

import pytest
import torch

from tokenloom.plugins.models.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPTS = ([5, 17, 33, 2, 99, 250, 7], [400, 12, 8, 8, 301, 77, 45, 9, 600, 3, 14, 111])


@torch.inference_mode()
def cpu_reference(model_dir) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return torch.cat([model(torch.tensor([p])).logits[0] for p in PROMPTS])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_cuda_float32_logits_match_the_cpu_reference(arch, tiny_model_factory, paged_runner):
    model_dir = tiny_model_factory(arch)
    model, info = load_model(model_dir, torch.float32, "cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    runner = paged_runner(model, info, len(PROMPTS))

    logits = runner.step(list(enumerate(PROMPTS))).cpu()

    assert (logits - cpu_reference(model_dir)).abs().max().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_logits_track_the_cpu_reference(
    dtype, tiny_model_factory, paged_runner
):
    model_dir = tiny_model_factory("qwen3")
    model, info = load_model(model_dir, dtype, "cuda")
    assert {p.dtype for p in model.parameters()} == {dtype}
    runner = paged_runner(model, info, len(PROMPTS))

    logits = runner.step(list(enumerate(PROMPTS))).cpu()
    reference = cpu_reference(model_dir)

    assert (logits - reference).abs().max().item() < 0.05 * reference.abs().max().item()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.9
