"""Speculative decoding under async scheduling: pipelined steps while no request
speculates, synchronous steps while one does, greedy output unchanged.

One engine (``async_scheduling = true``, a proposer) runs a batch that mixes
requests with ``num_speculative_tokens`` 0 and > 0; speculating requests arrive
while plain ones run, finish, and one is aborted mid-run, so the engine switches
from pipelined to synchronous steps and back more than once. Every request that
runs to its end must produce exactly the tokens of an engine without speculation.
"""

from __future__ import annotations

import pytest

from tokenloom.config import load_config
from tokenloom.engine.engine_core import Engine
from tokenloom.protocols.requests import GenerateRequest
from tokenloom.protocols.sampling import SamplingParams
from tokenloom.protocols.step import PLACEHOLDER_TOKEN, StepInput

PROMPTS = {
    "plain-a": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    "plain-b": list(range(20, 45)),
    "spec-a": [10, 11, 12, 13, 14, 10, 11, 12],
    "spec-b": [3, 9, 3, 9, 3, 9, 3],
    "aborted": [30, 31, 32, 30, 31, 32, 30],
    "plain-c": [40, 41, 42, 43, 40, 41],
}


def _params(max_tokens: int, k: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k
    )


# request id -> (the step it arrives before, its params); k None = the engine's default.
ARRIVALS = {
    "plain-a": (0, _params(40, 0)),
    "plain-b": (0, _params(40, 0)),
    "spec-a": (4, _params(10, None)),  # arrives while two plain requests pipeline
    "spec-b": (16, _params(12, 2)),  # arrives after spec-a finished: pipelined again
    "aborted": (16, _params(40, None)),
    "plain-c": (18, _params(12, 0)),  # joins while two requests speculate
}
ABORT_AT = 22  # "aborted" is aborted before this step, mid-run
SPECULATING = ("spec-a", "spec-b", "aborted")


CPU = {"device": "cpu", "num_blocks": 128, "block_size": 4}


def _engine(model: object, **options: object) -> Engine:
    return Engine.from_config(load_config(model=str(model), **{**CPU, **options}))


def _greedy(
    model: object,
    prompts: dict[str, list[int]],
    max_tokens: int | None = None,
    **device: object,
) -> dict[str, list[int]]:
    """Each request through a synchronous engine without speculation."""
    engine = _engine(model, async_scheduling=False, **device)
    out: dict[str, list[int]] = {}
    for request_id, prompt in prompts.items():
        params = ARRIVALS[request_id][1]
        if max_tokens is not None:
            params = _params(max_tokens, 0)
        engine.add_request(GenerateRequest(request_id, prompt, params))
        out[request_id] = []
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += delta.new_token_ids
    return out


def _prompts(model: object, **device: object) -> dict[str, list[int]]:
    """The prompts, those of the speculating requests followed by 24 tokens of their
    own greedy continuation: a tiny random model soon repeats itself, so their
    output repeats tokens of their history and the n-gram proposer drafts."""
    own = _greedy(model, {r: PROMPTS[r] for r in SPECULATING}, max_tokens=24, **device)
    return {r: p + own[r] if r in SPECULATING else p for r, p in PROMPTS.items()}


def _run_mixed(
    engine: Engine, prompts: dict[str, list[int]]
) -> tuple[dict[str, list[int]], dict[str, str], str]:
    """The arrivals and the abort on one engine; returns the tokens, the finish
    reasons and the mode of each step: "P" when a step is left in flight
    (pipelined), "S" when not (synchronous)."""
    tokens: dict[str, list[int]] = {r: [] for r in ARRIVALS}
    reasons: dict[str, str] = {}
    modes = []
    for index in range(1000):
        for request_id, (at, params) in ARRIVALS.items():
            if at == index:
                engine.add_request(GenerateRequest(request_id, prompts[request_id], params))
        deltas = engine.abort(["aborted"]) if index == ABORT_AT else []
        if index > max(at for at, _ in ARRIVALS.values()) and not engine.has_unfinished():
            break
        deltas += engine.step()
        modes.append("P" if engine._in_flight is not None else "S")
        for delta in deltas:
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                reasons[delta.request_id] = delta.finish_reason
    assert not engine.has_unfinished()
    return tokens, reasons, "".join(modes)


def _check(engine: Engine, model: object, drafts: bool = True, **device: object) -> None:
    """The mixed run on ``engine`` against the synchronous engine without
    speculation; ``drafts``: the run must verify and accept drafts."""
    prompts = _prompts(model, **device)
    reference = _greedy(model, prompts, **device)
    tokens, reasons, modes = _run_mixed(engine, prompts)
    assert engine.pipelined
    finished = [r for r in ARRIVALS if r != "aborted"]
    assert {r: tokens[r] for r in finished} == {r: reference[r] for r in finished}
    assert reasons == {**{r: "length" for r in finished}, "aborted": "abort"}
    # Aborted mid-run: a true prefix of its tokens, none after the abort.
    assert 0 < len(tokens["aborted"]) < 40
    assert tokens["aborted"] == reference["aborted"][: len(tokens["aborted"])]
    # Pipelined at first, synchronous while spec-a runs, pipelined between spec-a
    # and spec-b, synchronous again, pipelined once the speculating ones are gone.
    assert modes.startswith("PPPP") and "PS" in modes and "SP" in modes
    runs = [m for i, m in enumerate(modes) if i == 0 or modes[i - 1] != m]
    assert "".join(runs).startswith("PSPSP"), modes
    assert not engine.speculating
    scheduler = engine.scheduler
    assert scheduler.spec_verify_steps > 0 or not drafts
    assert scheduler.spec_accepted_total > 0 or not drafts
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ngram_with_async_scheduling_is_identical(tiny_model_factory, arch: str) -> None:
    model = tiny_model_factory(arch)
    engine = _engine(model, async_scheduling=True, proposer="ngram", num_speculative_tokens=3)
    _check(engine, model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_target_as_its_own_draft_with_async_scheduling_is_identical(
    tiny_model_factory, arch: str
) -> None:
    model = tiny_model_factory(arch)
    engine = _engine(
        model,
        async_scheduling=True,
        proposer="draft",
        draft_model=str(model),
        num_speculative_tokens=4,
    )
    _check(engine, model)
    # Same weights: nearly every draft is accepted.
    scheduler = engine.scheduler
    assert scheduler.spec_accepted_total >= 0.9 * scheduler.spec_proposed_total


def test_placeholder_steps_never_take_the_speculative_path(tiny_model_factory) -> None:
    """The executor samples on the device (keeping the tokens for placeholders)
    in every step without a speculating request, and verifies only in the
    synchronous ones: no step that carries a placeholder goes through ``spec``."""
    model = tiny_model_factory("llama")
    engine = _engine(model, async_scheduling=True, proposer="ngram", num_speculative_tokens=3)
    runner = engine.executor
    spec = runner.spec
    assert spec is not None
    paths: list[tuple[bool, bool]] = []  # (has a placeholder, speculative path)
    sample = spec.sample

    def spy_sample(*args, **kwargs):  # type: ignore[no-untyped-def]
        paths[-1] = (paths[-1][0], True)
        return sample(*args, **kwargs)

    submit = runner.submit

    def spy_submit(step: StepInput):  # type: ignore[no-untyped-def]
        placeholder = any(PLACEHOLDER_TOKEN in c.token_ids for c in step.chunks)
        paths.append((placeholder, False))
        return submit(step)

    spec.sample = spy_sample  # type: ignore[method-assign]
    runner.submit = spy_submit  # type: ignore[method-assign]
    prompts = _prompts(model)
    tokens, _, _ = _run_mixed(engine, prompts)
    assert any(p for p, _ in paths) and any(s for _, s in paths)
    assert not any(p and s for p, s in paths)
    assert tokens["spec-a"] == _greedy(model, prompts)["spec-a"]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_tokens_stay_exact_even_if_a_speculating_step_is_pipelined(
    tiny_model_factory, proposer: str
) -> None:
    """The speculative path keeps its last tokens on the device too: with the
    engine's bookkeeping switched off (every step pipelined, a speculating one
    included), a later placeholder still reads the right token."""
    model = tiny_model_factory("llama")
    spec = {"proposer": proposer, "num_speculative_tokens": 3}
    if proposer == "draft":
        spec["draft_model"] = str(model)
    engine = _engine(model, async_scheduling=True, **spec)
    engine._track_speculation = False  # never synchronous
    prompts = _prompts(model)
    tokens, _, modes = _run_mixed(engine, prompts)
    reference = _greedy(model, prompts)
    finished = [r for r in ARRIVALS if r != "aborted"]
    assert {r: tokens[r] for r in finished} == {r: reference[r] for r in finished}
    assert set(modes[:-1]) == {"P"}


def test_the_speculative_path_keeps_each_last_token_on_the_device(tiny_model_factory) -> None:
    """After a verify step (and a speculative step without drafts) the runner's
    device copy of each sampled request's last token is the one the host got."""
    model = tiny_model_factory("llama")
    engine = _engine(
        model,
        async_scheduling=True,
        proposer="draft",
        draft_model=str(model),
        num_speculative_tokens=3,
    )
    runner = engine.executor
    batches, spec = runner.batches, runner.spec
    sample = spec.sample
    checked = {"verify": 0, "plain": 0}

    def spy_sample(step_id, chunks, *args, **kwargs):  # type: ignore[no-untyped-def]
        output = sample(step_id, chunks, *args, **kwargs)
        slots = [batches._slots[r] for r in output.request_ids]
        kept = batches.last_tokens[slots].tolist()
        assert kept == [ids[-1] for ids in output.token_ids]
        checked["verify" if any(c.num_draft_tokens for c in chunks) else "plain"] += 1
        return output

    spec.sample = spy_sample  # type: ignore[method-assign]
    _run_mixed(engine, _prompts(model))
    assert checked["verify"] > 0 and checked["plain"] > 0


@pytest.mark.slow
def test_tensor_parallel_ranks_take_the_same_path(tiny_model_factory) -> None:
    """TP = 2 on the CPU (gloo): every rank decides per step between the device
    path and the speculative one from the same NewRequestData, so the workers'
    placeholders follow rank 0's; the mixed run equals TP = 1 without speculation."""
    model = tiny_model_factory("llama")
    engine = _engine(
        model,
        async_scheduling=True,
        tensor_parallel_size=2,
        proposer="ngram",
        num_speculative_tokens=3,
    )
    try:
        _check(engine, model)
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("proposer", ["ngram", "draft-self"])
def test_on_cuda_with_graphs_the_mixed_run_is_identical(tiny_model_factory, proposer: str) -> None:
    """The same run on CUDA: pipelined steps decode in CUDA graphs (placeholders
    filled on the device), synchronous ones verify on the Triton extend path (in
    verify graphs when uniform); fp32, so tokens must be identical. The n-gram
    proposer's drafts depend on this model's outputs repeating themselves (on the
    CPU this run verifies one step), so only the draft model must draft here."""
    model = tiny_model_factory("llama", num_heads=8, num_kv_heads=2, hidden_size=256)
    cuda = {"device": "cuda", "dtype": "float32", "attention": "triton", "block_size": 16}
    spec: dict[str, object] = {"proposer": proposer.split("-")[0], "num_speculative_tokens": 4}
    if proposer == "draft-self":
        spec["draft_model"] = str(model)
    engine = _engine(model, async_scheduling=None, num_blocks=64, **cuda, **spec)
    assert engine.executor.graphs is not None, "CUDA graphs were not captured"
    _check(engine, model, proposer == "draft-self", num_blocks=64, **cuda)
