"""``tokenloom bench calibrate`` on the CPU with a tiny model: the grid's steps run
through the real engine, their features are the ones asked for, and a cost model
with per-class fit errors is written (the GPU run is the lead's: scripts/gpu/sim.sh)."""

from __future__ import annotations

import json

from tokenloom.bench.calibrate import GRIDS, load_samples, main
from tokenloom.sim.cost_model import TERMS, CostModel


def test_calibrate_measures_the_grid_and_writes_a_fitted_model(tiny_model_factory, tmp_path):
    out = tmp_path / "tiny.json"
    code = main([
        "--model", str(tiny_model_factory("llama")), "--grid", "tiny", "--repeats", "1",
        "--max-model-len", "256", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    model = CostModel.load(out)
    assert model.source.startswith("calibrated:") and set(model.coefficients) == set(TERMS)
    assert all(c >= 0 for c in model.coefficients.values())
    samples = load_samples(tmp_path / "tiny-samples.json")
    grid = GRIDS["tiny"]
    decodes = sorted(f.num_seqs for f, _ in samples if f.step_class == "decode")
    assert decodes == sorted(b for b, _ in grid["decode"])
    prefill_tokens = {f.num_tokens for f, _ in samples if f.step_class == "prefill"}
    assert prefill_tokens == {n * length for n, length in grid["prefill"]}
    assert any(f.step_class == "mixed" for f, _ in samples)
    assert all(seconds > 0 for _, seconds in samples)
    errors = json.loads(out.read_text())["fit_error"]
    assert errors["all"]["steps"] == len(samples)
    assert {"decode", "prefill", "mixed"} <= set(errors)
