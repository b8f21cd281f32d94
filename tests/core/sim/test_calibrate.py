"""``tokenloom bench calibrate`` on the CPU with a tiny model: the grid's steps run
through the real engine, their features are the ones asked for, and a cost model
with per-class fit errors is written (the GPU run is the lead's: scripts/gpu/sim.sh)."""

from __future__ import annotations

import json
from typing import Any

import pytest

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


def test_calibrate_refuses_speculation(tmp_path, capsys):
    """With a proposer, a pipelined engine runs synchronous steps, which calibrate's
    step timing would pair with the wrong steps; the cost model has no verify steps."""
    with pytest.raises(SystemExit) as exc:
        main([
            "--model", "llama-3-8b", "--proposer", "ngram", "--num-speculative-tokens", "3",
            "--out", str(tmp_path / "x.json"),
        ])  # fmt: skip
    assert exc.value.code == 2
    assert "speculation" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


class _Clock:
    now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _PipelinedEngine:
    """A pipelined engine on a virtual clock (no tensors): step N+1 is submitted, then
    step N waited for. Decode steps take ``decode_s`` on the device, a step with a
    prefill ``mixed_s``; launching a step with a prefill (eager, hundreds of kernels)
    keeps the host busy for most of that while the device follows, so most of the step
    is over before the call that submitted it returns: what fooled the single-gap
    timing of issue 13."""

    pipelined = True

    def __init__(self, clock: _Clock, decode_s: float, mixed_s: float) -> None:
        from types import SimpleNamespace

        self.clock, self.decode_s, self.mixed_s = clock, decode_s, mixed_s
        self.config = SimpleNamespace(device="cuda", enforce_eager=True, max_num_seqs=256)
        self.info = SimpleNamespace(vocab_size=32000)
        self.executor = SimpleNamespace(submit=self._submit)
        self.waiting: list[str] = []
        self.lengths: dict[str, tuple[int, Any]] = {}
        self.running: dict[str, list[int]] = {}  # id -> [position, tokens left]
        self.device_free = 0.0
        self.in_flight: float | None = None  # end time of the step in flight
        self.step_id = 0

    def add_request(self, request) -> None:
        self.waiting.append(request.request_id)
        self.lengths[request.request_id] = (len(request.prompt_token_ids), request.params)

    def _submit(self, step):
        prefill = any(len(c.token_ids) > 1 for c in step.chunks)
        start = max(self.clock.now, self.device_free)
        self.device_free = start + (self.mixed_s if prefill else self.decode_s)
        # Launching an eager step is slow on the host; the device runs it as it comes.
        self.clock.now += 0.9 * self.mixed_s if prefill else 1e-4
        return self.device_free

    def step(self) -> list:
        from tokenloom.protocols.step import ScheduledChunk, StepInput

        chunks = []
        for rid, state in self.running.items():
            chunks.append(ScheduledChunk(rid, [7], state[0], [], sample=True))
            state[0] += 1
            state[1] -= 1
        for rid in self.waiting:
            length, params = self.lengths[rid]
            chunks.append(ScheduledChunk(rid, [7] * length, 0, [], sample=True))
            self.running[rid] = [length, params.max_tokens]
        self.waiting = []
        done = [rid for rid, state in self.running.items() if state[1] <= 0]
        for rid in done:
            del self.running[rid]
        chunks.sort(key=lambda c: len(c.token_ids))
        self.step_id += 1
        end = self.executor.submit(StepInput(self.step_id, chunks)) if chunks else None
        previous, self.in_flight = self.in_flight, end
        if previous is not None:
            self.clock.now = max(self.clock.now, previous)
        return []

    def stats(self):
        from types import SimpleNamespace

        return SimpleNamespace(num_waiting=len(self.waiting))

    def abort(self, ids) -> None:
        for rid in ids:
            self.running.pop(rid, None)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.in_flight is not None)


def test_mixed_step_time_survives_a_submit_that_waits_for_the_device(monkeypatch):
    """Issue 13: the H200 run measured 528-token mixed steps at 0.8 ms. When the
    submitting call returns late, the single gap of the folding call holds only the
    rest of the step; the two-gap measurement recovers the step's time."""
    from tokenloom.bench import calibrate

    clock = _Clock()
    monkeypatch.setattr(calibrate.time, "perf_counter", clock.perf_counter)
    engine = _PipelinedEngine(clock, decode_s=5e-3, mixed_s=40e-3)
    cal = calibrate.Calibration(engine, repeats=3)
    cal.mixed(16, 512, 512)
    mixed = [(f, t) for f, t in cal.samples if f.step_class == "mixed"]
    assert len(mixed) == 3
    assert all(f.num_tokens == 16 + 512 and f.num_seqs == 17 for f, _ in mixed)
    for _, seconds in mixed:
        assert seconds == pytest.approx(40e-3, rel=0.02)
    # The gap of the folding call alone is what the old calibrate recorded: far less.
    cal._start_decodes(16, 512)
    cal._timed_steps(3)
    cal._add(512, 1)
    gap = [t for f, t in cal._timed_steps(4) if f.step_class == "mixed"]
    assert len(gap) == 1 and gap[0] < 0.5 * 40e-3
