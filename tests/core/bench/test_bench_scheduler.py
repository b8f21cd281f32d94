"""``tokenloom bench scheduler`` runs on small sizes and reports its timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenloom.bench.scheduler import main


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_scheduler_bench_reports_step_timings(
    scheduler: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--scheduler", scheduler, "--num-running", "16", "--num-waiting", "20"]
    argv += ["--prompt-len", "40", "--steps", "30", "--warmup", "5", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert (result["scheduler"], result["num_running"], result["num_waiting"]) == (
        scheduler,
        16,
        20,
    )
    for part in ("schedule", "update", "total"):
        assert 0 < result[part]["median_us"] <= result[part]["p90_us"]
    assert "total us (median / p90 / mean)" in capsys.readouterr().out
