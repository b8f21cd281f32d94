"""Speculative decoding keeps greedy output identical, whatever the proposer.

Each test runs the same requests through an engine without speculation and with
it, on the tiny random checkpoints, and compares the tokens. The prompts repeat
themselves, so the n-gram proposer drafts often; the draft-model tests use the
target itself (every draft should be accepted) and a smaller model of the same
tokenizer (many rejections). With async scheduling: test_async_speculation.py.
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.checkpoints.tiny_models import ARCHS
from tokenloom.config import load_config
from tokenloom.engine.engine_core import Engine
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [10, 11, 12, 13, 14, 10, 11, 12],
    list(range(20, 45)),
    [3, 9, 3, 9, 3, 9, 3],
]


def generate(
    model_dir: object,
    params: list[SamplingParams] | SamplingParams,
    prompts: list[list[int]] = PROMPTS,
    **options: object,
) -> tuple[dict[str, list[int]], Engine, dict[str, list[float]]]:
    config = load_config(model=str(model_dir), device="cpu", num_blocks=96, block_size=4)
    for key, value in options.items():
        config = type(config)(**{**_fields(config), key: value})
    engine = Engine.from_config(config)
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(GenerateRequest(f"r{index}", prompt, p))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
            logprobs[delta.request_id] += delta.logprobs or []
    assert not engine.has_unfinished()
    return tokens, engine, logprobs


def _fields(config: object) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__struct_fields__}  # type: ignore[attr-defined]


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
_PLAIN: dict[object, dict[str, list[int]]] = {}


def plain_greedy(model_dir: object) -> dict[str, list[int]]:
    """The greedy output without speculation (once per checkpoint)."""
    if model_dir not in _PLAIN:
        _PLAIN[model_dir] = generate(model_dir, GREEDY)[0]
    return _PLAIN[model_dir]


@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_greedy_output_is_identical(tiny_model_factory, arch: str) -> None:
    model = tiny_model_factory(arch)
    plain = plain_greedy(model)
    spec, engine, _ = generate(model, GREEDY, proposer="ngram", num_speculative_tokens=3)
    assert spec == plain
    scheduler = engine.scheduler
    assert scheduler.spec_verify_steps > 0 and scheduler.spec_proposed_total > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_target_as_its_own_draft_is_identical_and_accepts_its_drafts(
    tiny_model_factory, arch: str
) -> None:
    model = tiny_model_factory(arch)
    plain = plain_greedy(model)
    spec, engine, _ = generate(
        model, GREEDY, proposer="draft", draft_model=str(model), num_speculative_tokens=4
    )
    assert spec == plain
    scheduler = engine.scheduler
    # Same weights: a draft differs from the target's argmax only on a near-tie.
    assert scheduler.spec_accepted_total >= 0.95 * scheduler.spec_proposed_total > 0
    # Fewer steps than tokens: most verify steps emit several tokens.
    assert scheduler.num_steps < sum(len(t) for t in plain.values()) / 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_smaller_draft_of_the_same_tokenizer_is_identical(tiny_model_factory, arch: str) -> None:
    model = tiny_model_factory(arch)
    draft = tiny_model_factory(arch, hidden_size=32, intermediate_size=64, num_layers=1, seed=7)
    plain = plain_greedy(model)
    spec, engine, _ = generate(
        model, GREEDY, proposer="draft", draft_model=str(draft), num_speculative_tokens=3
    )
    assert spec == plain
    assert engine.scheduler.spec_proposed_total > engine.scheduler.spec_accepted_total


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_draft_quantized_apart_from_the_target_is_identical(tiny_model_factory, quant) -> None:
    """``[plugin.draft] quant``: the draft's weights quantized, the target's not; the
    output stays the target's (exactness never rests on the draft)."""
    model = tiny_model_factory("llama")
    plain = plain_greedy(model)
    spec, engine, _ = generate(
        model,
        GREEDY,
        proposer="draft",
        draft_model=str(model),
        num_speculative_tokens=3,
        plugin={"draft": {"quant": quant}},
    )
    assert spec == plain
    draft_kernels = {
        type(m.kernel).__name__
        for m in engine.executor.spec.proposer.model.modules()
        if hasattr(m, "kernel")
    }
    target_kernels = {
        type(m.kernel).__name__ for m in engine.executor.model.modules() if hasattr(m, "kernel")
    }
    assert any(quant in name.lower() for name in draft_kernels), draft_kernels
    assert not any(quant in name.lower() for name in target_kernels), target_kernels
    scheduler = engine.scheduler
    assert scheduler.spec_accepted_total > 0.5 * scheduler.spec_proposed_total > 0


def test_a_misspelt_draft_quant_fails_with_the_config_before_any_weights_load() -> None:
    from tokenloom.config import ConfigError
    from tokenloom.plugin_manager import PluginManager

    config = load_config(
        model="/nonexistent",
        proposer="draft",
        draft_model="/nonexistent",
        num_speculative_tokens=2,
        plugin={"draft": {"quant": "int9"}},
    )
    with pytest.raises(ConfigError, match="int9"):
        PluginManager.default().check_config(config)


def test_a_draft_with_another_vocabulary_fails_at_start_up(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    draft = tiny_model_factory("llama", vocab_size=1024)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, GREEDY, proposer="draft", draft_model=str(draft), num_speculative_tokens=2)


def test_mixed_batch_chunked_prefill_preemption_and_per_request_off(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_speculative_tokens=0),
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, num_speculative_tokens=1),
        GREEDY,
    ]
    # 24 blocks of 4 tokens cannot hold four 50-token sequences: preemption; a budget of
    # 8 tokens chunks the prompts.
    small = dict(num_blocks=24, max_num_batched_tokens=8)
    plain, base, _ = generate(model, params, **small)
    spec, engine, _ = generate(model, params, proposer="ngram", num_speculative_tokens=4, **small)
    assert spec == plain
    assert base.scheduler.num_preemptions > 0 and engine.scheduler.num_preemptions > 0
    assert engine.scheduler.spec_verify_steps > 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_max_tokens_and_stop_ids_cut_inside_a_draft(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    plain = plain_greedy(model)
    # The target as its own draft accepts every draft: 5 tokens per verify step after
    # the first token, so a stop at a token's first occurrence at index 12 and
    # max_tokens 8 or 23 cut inside accepted drafts.
    index = next(i for i in range(12, 32) if plain["r1"][i] not in plain["r1"][:i])
    params = [
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=[plain["r1"][index]]
        ),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    prompts = PROMPTS[:3]
    expected, _, _ = generate(model, params, prompts)
    spec, engine, _ = generate(
        model, params, prompts, proposer="draft", draft_model=str(model), num_speculative_tokens=4
    )
    assert spec == expected
    assert len(spec["r0"]) == 23 and len(spec["r2"]) == 8
    assert spec["r1"] == plain["r1"][: index + 1]
    assert engine.scheduler.spec_accepted_total > 0


def test_logprobs_are_the_targets_for_accepted_tokens(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain, _, plain_lp = generate(model, params)
    spec, engine, spec_lp = generate(model, params, proposer="ngram", num_speculative_tokens=3)
    assert spec == plain
    assert engine.scheduler.spec_accepted_total > 0
    for request_id, values in plain_lp.items():
        assert len(spec_lp[request_id]) == len(values) == 24
        assert spec_lp[request_id] == pytest.approx(values, abs=1e-4)


def test_seeded_sampling_with_penalties_min_tokens_and_logprobs_repeats(tiny_model_factory):
    """Sampled requests go through the verify path with every processing step; a
    seeded request draws from its own generator, so two runs agree exactly."""
    model = tiny_model_factory("llama")
    params = [
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=11, max_tokens=24,
            repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2,
            min_tokens=20, logprobs=2, prompt_logprobs=True,
        ),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]  # fmt: skip
    prompts = PROMPTS[:3]
    first, engine, logprobs = generate(
        model, params, prompts, proposer="draft", draft_model=str(model), num_speculative_tokens=3
    )
    second, _, _ = generate(
        model, params, prompts, proposer="draft", draft_model=str(model), num_speculative_tokens=3
    )
    assert first == second
    assert len(first["r0"]) >= 20 and len(first["r1"]) == 24
    assert len(logprobs["r0"]) == len(first["r0"])
    assert all(value <= 0.0 for value in logprobs["r0"])
    assert engine.scheduler.spec_accepted_total > 0


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_a_draft_beside_an_8_bit_target_cache_in_pages_of_64_is_identical(
    tiny_model_factory, kv_cache_dtype: str
) -> None:
    """An fp8 cache's pages hold 64 tokens by default (session 51); the draft keeps a
    16-bit pool in the target's page size and its own attention over it. Output past
    a page's end (up to 89 tokens a request) equals the 8-bit target's own greedy
    output without speculation, and the draft (the target's weights) is accepted as
    the target is."""
    model = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    cache = {"kv_cache_dtype": kv_cache_dtype, "block_size": 64, "num_blocks": 24}
    plain, _, _ = generate(model, params, **cache)
    spec, engine, _ = generate(
        model, params, proposer="draft", draft_model=str(model), num_speculative_tokens=3, **cache
    )
    assert spec == plain
    assert max(len(p) + len(t) for p, t in zip(PROMPTS, plain.values(), strict=True)) > 64
    proposer = engine.executor.spec.proposer
    assert proposer.block_size == 64 and proposer.kv_caches[0][0].dtype == torch.float32
    scheduler = engine.scheduler
    assert scheduler.spec_accepted_total >= 0.9 * scheduler.spec_proposed_total > 0
