"""Cost models refitted on the CPU from the steps ``tokenloom bench calibrate`` measured.

``data/<name>-calibrated-samples.json`` are the measured steps of one calibration run
as calibrate wrote them; ``refit`` screens them and fits the model shipped as
``data/<name>-calibrated.json`` (``launch_overlap`` form), so the shipped coefficients
are reproducible without a GPU (``python -m tokenloom.sim.calibrated``; a test checks
the files match).

The shipped samples are the second H200 calibration (2026-12-01 evening, Llama-3-8B and
Qwen3-0.6B, 54 steps each, mixed steps timed over two gaps). Screening stays for any
run: a step measured faster than its own weight read is dropped
(``cost_model.implausible``), and so is every step of a class a run lists as timed
wrongly. The first run (``data/llama-3-8b-first-run-samples.json``, kept for the
screening test) timed its mixed steps by one return-to-return gap, which misses the
part of the step that ran before the submitting call returned (all 15 came out at
3-95% of what the decode+prefill fit predicts, three below the weight read).
"""

from __future__ import annotations

import json
from typing import Any

from tokenloom.sim.cost_model import DATA_DIR, CostModel, StepFeatures, fit, implausible

# run -> (copy bandwidth the run measured, step classes whose timing was wrong)
RUNS: dict[str, tuple[float, tuple[str, ...]]] = {
    "llama-3-8b": (4128379000706.8745, ()),
    "qwen3-0.6b": (4208969647556.7026, ()),
}
FIRST_RUN = "llama-3-8b-first-run"  # the first H200 run: its mixed steps mistimed
SCREENING: dict[str, tuple[float, tuple[str, ...]]] = {
    **RUNS,
    FIRST_RUN: (4244307457267.947, ("mixed",)),
}
SOURCE = (
    "calibrated: tokenloom bench calibrate --grid full on NVIDIA H200, 2026-12-01 "
    "(second run); refit on the CPU by tokenloom.sim.calibrated from {kept} of {total} "
    "measured steps{dropped}"
)


def shape_name(run: str) -> str:
    return run.removesuffix("-first-run")


def load_samples(name: str) -> list[tuple[StepFeatures, float]]:
    """A run's measured steps: ``name`` is a shape (its shipped calibration) or
    ``FIRST_RUN``."""
    file = f"{name}-samples.json" if name == FIRST_RUN else f"{name}-calibrated-samples.json"
    rows = json.loads((DATA_DIR / file).read_text())
    return [(StepFeatures(**row["features"]), float(row["seconds"])) for row in rows]


def screen(
    name: str, samples: list[tuple[StepFeatures, float]]
) -> tuple[list[tuple[StepFeatures, float]], dict[str, int]]:
    """The samples to fit, and how many were dropped for which reason."""
    bandwidth, excluded = SCREENING[name]
    shape = CostModel.shipped(shape_name(name)).shape
    too_fast = set(implausible(shape, samples, bandwidth))
    kept, dropped = [], {"faster than the weight read": 0, "class timed wrongly": 0}
    for i, (f, seconds) in enumerate(samples):
        if i in too_fast:
            dropped["faster than the weight read"] += 1
        elif f.step_class in excluded:
            dropped["class timed wrongly"] += 1
        else:
            kept.append((f, seconds))
    return kept, dropped


def refit(name: str) -> CostModel:
    """The calibrated model of ``name`` from its shipped samples."""
    samples = load_samples(name)
    kept, dropped = screen(name, samples)
    why = "".join(f"; {n} dropped: {reason}" for reason, n in dropped.items() if n)
    source = SOURCE.format(kept=len(kept), total=len(samples), dropped=why)
    model = fit(CostModel.shipped(name).shape, kept, bandwidth=RUNS[name][0], source=source)
    return model


def main() -> int:
    for name in RUNS:
        model = refit(name)
        model.save(DATA_DIR / f"{name}-calibrated.json")
        summary: dict[str, Any] = {
            k: f"{v['steps']:.0f} steps, mean {100 * v['mean_rel_err']:.1f}%, "
            f"max {100 * v['max_rel_err']:.1f}%"
            for k, v in model.fit_error.items()
        }
        print(name, json.dumps(model.coefficients), json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
