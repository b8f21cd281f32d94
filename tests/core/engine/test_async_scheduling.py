"""Async scheduling on the real engine (CPU): step N+1 is built and submitted before
step N's tokens are read, its decode inputs are placeholders the executor fills on
the device, and every output equals the synchronous engine's."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.config import load_config
from tokenloom.engine.engine_core import Engine, async_scheduling_enabled
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.step import PLACEHOLDER_TOKEN

PROMPTS = [[5, 9, 2, 33, 17, 8], [40, 41, 42] * 9, list(range(100, 160)), [7]]


def _tokens(outs):
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def pair(model):
    sync = LLM(model, dtype="float32", async_scheduling=False)
    pipelined = LLM(model, dtype="float32", async_scheduling=True)
    assert not sync.engine.pipelined and pipelined.engine.pipelined
    return sync, pipelined


def _both(pair, prompts, params):
    sync, pipelined = pair
    a = sync.generate(prompts, params, use_tqdm=False)
    b = pipelined.generate(prompts, params, use_tqdm=False)
    return a, b


def test_greedy_tokens_and_stop_token_finishes_are_identical(pair):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = _tokens(pair[0].generate(PROMPTS, greedy, use_tqdm=False))
    # A stop id that occurs mid-way ends requests early: the pipelined engine has
    # already scheduled their next token, which must be discarded.
    stop_id = reference[1][0][4]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    a, b = _both(pair, PROMPTS, params)
    assert _tokens(a) == _tokens(b)
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]
    assert b[1].outputs[0].finish_reason == "stop"
    assert len(b[1].outputs[0].token_ids) == 5


def test_seeded_sampling_penalties_min_tokens_and_logprobs_are_identical(pair):
    params = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        seed=11,
        max_tokens=14,
        min_tokens=6,
        presence_penalty=0.7,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logprobs=2,
    )
    a, b = _both(pair, PROMPTS, params)
    assert _tokens(a) == _tokens(b)
    for x, y in zip(a, b, strict=True):
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert lx.keys() == ly.keys()
            assert all(lx[t] == pytest.approx(ly[t], abs=1e-5) for t in lx)


def test_penalties_see_the_token_sampled_one_step_earlier(pair):
    # Penalties this strong forbid repeating any generated token (a seen token's logit
    # ends up below -2; some unseen token beats that): had the pipelined engine counted
    # tokens only once it read them, the step right after would not see the last one.
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        repetition_penalty=1e9,
        presence_penalty=2.0,
        frequency_penalty=2.0,
    )
    a, b = _both(pair, PROMPTS, params)
    assert _tokens(a) == _tokens(b)
    for out in b:
        tokens = out.outputs[0].token_ids
        assert len(set(tokens)) == len(tokens)


def test_n_siblings_and_stop_strings_are_identical(pair):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)
    a, b = _both(pair, [PROMPTS[2]], params)
    assert _tokens(a) == _tokens(b)
    text = pair[0].generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12))
    stop = text[0].outputs[0].text[2:4]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
    a, b = _both(pair, [PROMPTS[1]], params)
    assert b[0].outputs[0].finish_reason == "stop" and stop not in b[0].outputs[0].text
    assert a[0].outputs[0].text == b[0].outputs[0].text


def test_preemption_and_chunked_prefill_give_the_same_tokens(model, pair):
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = _tokens(pair[0].generate(prompts, params, use_tqdm=False))
    small = LLM(
        model,
        dtype="float32",
        num_blocks=12,
        block_size=8,
        max_num_batched_tokens=24,
        async_scheduling=True,
    )
    assert _tokens(small.generate(prompts, params, use_tqdm=False)) == reference
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.kv_cache.num_free_blocks == 12


def test_one_step_is_in_flight_and_decodes_carry_placeholders(model):
    engine = Engine.from_config(load_config(model=model, async_scheduling=True))
    seen: list[list[int]] = []
    submit = engine.executor.submit

    def spy(step):
        seen.append([t for c in step.chunks for t in c.token_ids])
        return submit(step)

    engine.executor.submit = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request(GenerateRequest("a", [5, 6, 7], params))
    assert engine.step() == []  # the prefill is in flight; nothing to report yet
    assert engine.has_unfinished()
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [t for d in deltas for t in d.new_token_ids] == [
        t for t in _sync_tokens(model, [5, 6, 7], params)
    ]
    assert deltas[-1].finish_reason == "length"
    assert seen[0] == [5, 6, 7]
    assert all(tokens == [PLACEHOLDER_TOKEN] for tokens in seen[1:])
    assert len(seen) == 4  # max_tokens is known ahead: no wasted step


def _sync_tokens(model, prompt, params):
    engine = Engine.from_config(load_config(model=model, async_scheduling=False))
    engine.add_request(GenerateRequest("a", prompt, params))
    out = []
    while engine.has_unfinished():
        out += [t for d in engine.step() for t in d.new_token_ids]
    return out


def test_async_scheduling_is_refused_for_an_executor_that_cannot_pipeline():
    class Plain:
        supports_pipelining = False

    config = load_config(model="x", async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling"):
        async_scheduling_enabled(config, Plain())  # type: ignore[arg-type]
    assert not async_scheduling_enabled(load_config(model="x"), Plain())  # type: ignore[arg-type]


def test_async_scheduling_stays_on_with_speculation():
    class Pipelining:
        supports_pipelining = True

    executor = Pipelining()
    spec = {"proposer": "ngram", "num_speculative_tokens": 3}
    for wanted in (True, False):
        config = load_config(model="x", async_scheduling=wanted, **spec)
        assert async_scheduling_enabled(config, executor) is wanted  # type: ignore[arg-type]
    # None: on for CUDA, as without speculation.
    cuda = load_config(model="x", device="cuda", **spec)
    assert async_scheduling_enabled(cuda, executor)  # type: ignore[arg-type]
    assert not async_scheduling_enabled(load_config(model="x", device="cpu", **spec), executor)  # type: ignore[arg-type]


def test_pipelined_without_a_speculating_request_synchronous_with_one(model):
    """Speculation configured, async scheduling on: a step is left in flight while
    only k = 0 requests run, none while a speculating one is live, and again once
    it has finished; the tokens equal the synchronous engine's."""
    config = load_config(
        model=model, async_scheduling=True, proposer="ngram", num_speculative_tokens=3
    )
    engine = Engine.from_config(config)
    assert engine.pipelined
    plain = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, num_speculative_tokens=0
    )
    spec = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens: dict[str, list[int]] = {"plain": [], "spec": []}

    def step() -> bool:
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
        return engine._in_flight is not None

    engine.add_request(GenerateRequest("plain", [5, 9, 2, 33], plain))
    assert step() and step()  # pipelined: each call leaves the next step in flight
    assert tokens["plain"] and not engine.speculating
    engine.add_request(GenerateRequest("spec", [40, 41, 42] * 3, spec))
    assert engine.speculating == {"spec"}
    while engine.speculating:
        assert not step()  # synchronous: the step in flight was finished first
    assert len(tokens["spec"]) == 5
    assert step()  # the speculating request is gone: pipelined again
    while engine.has_unfinished():
        step()
    assert tokens["plain"] == _sync_tokens(model, [5, 9, 2, 33], plain)
    assert tokens["spec"] == _sync_tokens(model, [40, 41, 42] * 3, spec)
