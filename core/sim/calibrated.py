"""Cost models refitted on the CPU from the steps ``tokenloom bench calibrate`` measured.

``data/<name>-calibrated-samples.json`` are the measured steps of one calibration run
as calibrate wrote them; ``refit`` screens them and fits the model shipped as
``data/<name>-calibrated.json``, so the shipped coefficients are reproducible without
a GPU (``python -m tokenloom.sim.calibrated``; a test checks the file matches).

Screening (issue 13): a step measured faster than its own weight read is dropped
(``cost_model.implausible``), and so is every step of a class listed in ``EXCLUDED``:
the 2026-12-01 H200 run timed its mixed steps by one return-to-return gap, which
misses the part of the step that ran before the submitting call returned (all 15
came out at 3-95% of what the decode+prefill fit predicts, three below the weight
read). Calibrate
now times mixed steps over two gaps; a re-run's samples need no exclusion.
"""

from __future__ import annotations

import json
from typing import Any

from tokenloom.sim.cost_model import DATA_DIR, CostModel, StepFeatures, fit, implausible

# name -> (copy bandwidth the run measured, step classes whose timing was wrong)
RUNS: dict[str, tuple[float, tuple[str, ...]]] = {
    "llama-3-8b": (4244307457267.947, ("mixed",)),
}
SOURCE = (
    "calibrated: tokenloom bench calibrate --grid full on NVIDIA H200, 2026-12-01; "
    "refit on the CPU by tokenloom.sim.calibrated from {kept} of {total} measured steps "
    "({dropped}); the derived model (data/{name}.json, from recorded figures) is kept "
    "beside it"
)


def load_samples(name: str) -> list[tuple[StepFeatures, float]]:
    rows = json.loads((DATA_DIR / f"{name}-calibrated-samples.json").read_text())
    return [(StepFeatures(**row["features"]), float(row["seconds"])) for row in rows]


def screen(
    name: str, samples: list[tuple[StepFeatures, float]]
) -> tuple[list[tuple[StepFeatures, float]], dict[str, int]]:
    """The samples to fit, and how many were dropped for which reason."""
    bandwidth, excluded = RUNS[name]
    shape = CostModel.shipped(name).shape
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
    why = ", ".join(f"{n} dropped: {reason}" for reason, n in dropped.items() if n)
    source = SOURCE.format(kept=len(kept), total=len(samples), dropped=why, name=name)
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
