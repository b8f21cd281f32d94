"""The cost model: terms from a step's chunks, a least-squares fit that recovers
known coefficients, and shipped defaults that reproduce the figures they came from."""

from __future__ import annotations

import random

import pytest

from tokenloom.protocols.step import ScheduledChunk, StepInput
from tokenloom.sim.cost_model import (
    TERMS,
    CostModel,
    ModelShape,
    StepFeatures,
    fit,
    graph_sizes,
    step_features,
)
from tokenloom.sim.derived import MEASURED, mixed_step


def _chunk(rid: str, n: int, start: int) -> ScheduledChunk:
    return ScheduledChunk(rid, [1] * n, start, [0] * ((start + n) // 16 + 1))


def test_step_features_count_context_pairs_and_graph_bucket():
    decode = StepInput(1, [_chunk("a", 1, 99), _chunk("b", 1, 9), _chunk("c", 1, 0)], num_tokens=3)
    f = step_features(decode, graph_sizes(256))
    assert (f.num_seqs, f.num_tokens, f.num_decodes, f.num_sampled) == (3, 3, 3, 3)
    assert f.context_tokens == 100 + 10 + 1 and f.attn_pairs == 111
    assert f.graph_batch == 4 and f.step_class == "decode"
    mixed = StepInput(2, [_chunk("a", 1, 99), _chunk("d", 4, 8)], num_tokens=5)
    f = step_features(mixed, graph_sizes(256))
    assert f.graph_batch == 0 and f.step_class == "mixed"
    assert f.attn_pairs == 100 + (4 * 8 + 4 * 5 // 2) and f.context_tokens == 100 + 12
    assert step_features(decode, []).graph_batch == 0  # eager executor


def test_shape_bytes_match_the_recorded_roofline():
    # docs/performance.md: 15.04 GB per Llama-3-8B step (weights without the
    # embedding gather, plus KV at the mean context), 1.22 GB for Qwen3-0.6B.
    llama = ModelShape.named("llama-3-8b")
    assert llama.weight_bytes == pytest.approx(15.0e9, rel=0.01)
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert ModelShape.named("qwen3-0.6b").weight_bytes == pytest.approx(1.19e9, rel=0.02)


def _random_features(rng: random.Random) -> StepFeatures:
    kind = rng.choice(("decode", "prefill", "mixed"))
    seqs = rng.randint(1, 256)
    if kind == "decode":
        ctx = seqs * rng.randint(1, 4000)
        return StepFeatures(seqs, seqs, seqs, ctx, ctx, seqs, graph_sizes(256)[-1])
    tokens = rng.randint(64, 8192)
    decodes = 0 if kind == "prefill" else rng.randint(1, max(1, seqs - 1))
    seqs = max(seqs, decodes + 1)
    ctx = tokens + rng.randint(0, 100_000)
    return StepFeatures(seqs, tokens + decodes, decodes, ctx, tokens * tokens // 2, seqs, 0)


@pytest.mark.parametrize("overlap", [False, True], ids=["additive", "launch-overlap"])
def test_fit_recovers_known_coefficients_and_reports_error_per_class(overlap):
    shape = ModelShape.named("llama-3-8b")
    truth = CostModel(
        shape,
        {
            "const": 5e-4,
            "eager": 2e-3,
            "gemm": 1.1,
            "flops": 0.3,
            "kv": 1.4,
            "attn": 2.5,
            "seq": 4e-6,
        },
        launch_overlap=overlap,
    )
    if overlap:  # launches that outlast the GPU work of the smaller eager steps
        truth.coefficients["eager"] = 0.01
    rng = random.Random(0)
    steps = [_random_features(rng) for _ in range(300)]
    # Weight-bound decode steps (small graph batches) separate gemm from flops: the
    # random decode steps above all replay the 256 graph, where both read as FLOPs.
    for b in (1, 2, 4, 8, 16, 32, 64):
        ctx = rng.randint(b * 100, b * 4000)
        steps.append(StepFeatures(b, b, b, ctx, ctx, b, b))
    samples = [(f, truth.step_time(f)) for f in steps]
    if overlap:
        assert any(truth.step_time(f) == pytest.approx(0.0105) for f, _ in samples)
    fitted = fit(shape, samples, source="test", launch_overlap=overlap)
    for name in TERMS:
        assert fitted.coefficients[name] == pytest.approx(truth.coefficients[name], rel=1e-3)
    assert set(fitted.fit_error) == {"decode", "prefill", "mixed", "all"}
    assert fitted.fit_error["all"]["max_rel_err"] < 1e-6
    # Noisy times: still close, and the error figures say how close.
    noisy = [(f, t * rng.uniform(0.95, 1.05)) for f, t in samples]
    again = fit(shape, noisy, launch_overlap=overlap)
    assert 0.01 < again.fit_error["all"]["mean_rel_err"] < 0.05
    for probe in (mixed_step(), StepFeatures(32, 32, 32, 64_000, 64_000, 32, 32)):
        assert again.step_time(probe) == pytest.approx(truth.step_time(probe), rel=0.05)


def test_fit_never_returns_a_negative_cost():
    shape = ModelShape.named("qwen3-0.6b")
    rng = random.Random(1)
    # Times that fall with the KV read: least squares would give kv < 0.
    rows = []
    for _ in range(100):
        f = _random_features(rng)
        rows.append((f, 1e-3 + 1e-6 * f.num_tokens + max(0.0, 1e-3 - 1e-10 * f.context_tokens)))
    model = fit(shape, rows)
    assert all(c >= 0 for c in model.coefficients.values())


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_shipped_default_reproduces_the_measurements_it_was_derived_from(name):
    model = CostModel.shipped(name)
    assert "not calibrated" in model.source
    measured = MEASURED[name]
    batch1 = StepFeatures(1, 1, 1, 256, 256, 1, 1)
    assert model.step_time(batch1) == pytest.approx(measured["decode_step_s"], rel=0.02)
    if "mixed_8192_step_s" in measured:
        assert model.step_time(mixed_step()) == pytest.approx(
            measured["mixed_8192_step_s"], rel=0.05
        )
    # A bigger step costs more: the model is monotone in its work.
    bigger = StepFeatures(64, 64, 64, 64 * 2000, 64 * 2000, 64, 64)
    assert model.step_time(bigger) > model.step_time(batch1)


def test_cost_model_json_round_trip(tmp_path):
    model = CostModel.shipped("llama-3-8b")
    model.save(tmp_path / "m.json")
    again = CostModel.load(tmp_path / "m.json")
    assert again.coefficients == model.coefficients and again.shape == model.shape
