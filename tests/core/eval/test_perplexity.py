"""Perplexity through the engine's prompt logprobs equals the direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.eval.perplexity import (
    bootstrap_log_ratios,
    interval_pct,
    load_passages,
    measure_perplexity,
)

TEXT = (
    "The river runs slowly past the mill, and the herons wait in the reeds.\n\n"
    "Bread needs flour, water, salt and yeast, and then a long rest in a warm place.\n\n"
    "A bicycle turns the motion of the legs into forward motion with little waste, "
    "and a chain carries the force from the pedals to the rear wheel."
)


def _transformers_logprobs(model_dir, prompts: list[list[int]]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = []
    for ids in prompts:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        result.append(logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist())
    return result


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def chunked_llm(model_dir):
    # A 16-token budget splits every passage into several prefill chunks.
    return LLM(model_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)


def test_passages_are_the_paragraphs(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("One line\nwrapped.\n\n\nTwo.\n")
    assert load_passages(path) == ["One line wrapped.", "Two."]


def test_perplexity_equals_exp_mean_nll_from_transformers(model_dir, chunked_llm, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    passages = load_passages(path)
    result = measure_perplexity(chunked_llm, passages)

    prompts = [chunked_llm.tokenizer.encode(p) for p in passages]
    reference = _transformers_logprobs(model_dir, prompts)
    nll = -sum(math.fsum(values) for values in reference)
    num_tokens = sum(len(values) for values in reference)
    assert result.num_tokens == num_tokens == sum(len(p) - 1 for p in prompts)
    assert result.num_passages == 3
    # each passage's own figures, which the report's interval pairs with the reference's
    assert result.passage_tokens == [len(values) for values in reference]
    assert result.passage_nlls == pytest.approx(
        [-math.fsum(values) for values in reference], rel=1e-4
    )
    assert result.perplexity == pytest.approx(math.exp(nll / num_tokens), rel=1e-4)


def test_prompt_logprobs_match_transformers_per_token_with_chunked_prefill(model_dir, chunked_llm):
    prompts = [list(range(5, 70)), [3, 4, 5, 6, 7, 8, 9, 10, 11] * 3, [42, 43]]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=True)
    outputs = chunked_llm.generate(prompts, params, use_tqdm=False)
    reference = _transformers_logprobs(model_dir, prompts)
    for out, ref in zip(outputs, reference, strict=True):
        assert out.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(ref)
        assert out.prompt_logprobs == pytest.approx(ref, abs=1e-4)


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(chunked_llm):
    prompt = list(range(100, 180))  # several full blocks: cacheable
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    chunked_llm.generate([prompt], plain, use_tqdm=False)  # fills the prefix cache
    again = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True)
    first, second = (chunked_llm.generate([prompt], again, use_tqdm=False)[0] for _ in range(2))
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt) - 1
    assert not any(math.isnan(v) for v in first.prompt_logprobs)
    assert first.prompt_logprobs == second.prompt_logprobs


def test_requests_without_prompt_logprobs_get_none(chunked_llm):
    out = chunked_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


def test_the_paired_interval_is_zero_for_the_same_model_and_brackets_a_uniform_loss():
    tokens = [100, 150, 120, 90]
    ref = [300.0, 420.0, 380.0, 250.0]
    same = bootstrap_log_ratios(ref, ref, tokens, 500)
    assert interval_pct(same) == (0.0, 0.0)
    # 0.05 nats a token worse on every passage: every resample says exactly that
    worse = [r + 0.05 * n for r, n in zip(ref, tokens, strict=True)]
    lo, hi = interval_pct(bootstrap_log_ratios(worse, ref, tokens, 500))
    assert lo == pytest.approx(100 * math.expm1(0.05)) and hi == pytest.approx(lo)
    # worse on one passage only: the interval spans 0 (resamples without it) to well above
    mixed = [ref[0] + 40.0, *ref[1:]]
    ratios = bootstrap_log_ratios(mixed, ref, tokens, 2000)
    lo, hi = interval_pct(ratios)
    point = 100 * math.expm1(40.0 / sum(tokens))
    assert lo < point < hi and lo >= 0.0 and hi > 2 * point
    assert torch.equal(ratios, bootstrap_log_ratios(mixed, ref, tokens, 2000))  # seeded
    with pytest.raises(ValueError, match="per passage"):
        bootstrap_log_ratios(ref[:3], ref, tokens, 10)
