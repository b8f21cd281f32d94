"""``tokenloom sim`` end to end: several schedulers and settings in one command, one
table, the JSON and the plots; and the sim-vs-real comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenloom.entrypoints.cli import main as tokenloom
from tokenloom.sim import compare

EXAMPLE = Path(__file__).parents[3] / "examples" / "schedulers" / "spf_aging.py"


def test_sim_compares_schedulers_and_settings_in_one_command(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    code = tokenloom([
        "sim", "--num-requests", "300", "--request-rate", "30", "--length-dist", "lognormal",
        "--prompt-len", "800", "--output-len", "100", "--priorities", "0:0.7,1:0.3",
        "--tenants", "3", "--plugin", str(EXAMPLE), "--scheduler", "continuous,spf-aging,static",
        "--max-num-seqs", "16,64", "--slo-ttft-ms", "1000", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "sim.json").read_text())
    labels = [run["label"] for run in report["runs"]]
    assert labels == [
        f"{s} seqs={n}" for s in ("continuous", "spf-aging", "static") for n in (16, 64)
    ]
    for run in report["runs"]:
        assert run["completed"] == 300 and run["label"] in printed
        assert set(run["by_priority"]) == {"0", "1"} and set(run["by_tenant"]) == {"t0", "t1", "t2"}
        assert 0 < run["jain_fairness"] <= 1
    by_label = {run["label"]: run for run in report["runs"]}
    # More sequences at once: a shorter queue.
    assert (
        by_label["continuous seqs=64"]["queue_ms"]["p99"]
        < by_label["continuous seqs=16"]["queue_ms"]["p99"]
    )
    # Priority 1 runs after priority 0 under continuous.
    prio = by_label["continuous seqs=16"]["by_priority"]
    assert prio["0"]["ttft_p50_ms"] < prio["1"]["ttft_p50_ms"]
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == [
        "latency_cdf.png",
        "queue_kv_over_time.png",
        "ttft_by_priority.png",
        "ttft_by_tenant.png",
    ]


def test_compare_flags_figures_outside_fifteen_percent(tmp_path, capsys):
    def summary(ttft, tpot, thr):
        return {
            "ttft_ms": {"p50": ttft, "p99": 2 * ttft}, "tpot_ms": {"p50": tpot},
            "e2e_ms": {"p50": ttft + 10 * tpot}, "output_token_throughput": thr,
            "request_throughput": thr / 10,
        }  # fmt: skip

    (tmp_path / "real.json").write_text(json.dumps({"trace_summary": summary(100, 20, 1000)}))
    (tmp_path / "sim.json").write_text(
        json.dumps({"runs": [{"label": "c", **summary(110, 30, 990)}]})
    )
    assert (
        compare.main(
            [
                str(tmp_path / "real.json"),
                str(tmp_path / "sim.json"),
                "--out",
                str(tmp_path / "c.json"),
            ]
        )
        == 0
    )
    rows = {r["figure"]: r for r in json.loads((tmp_path / "c.json").read_text())[0]["rows"]}
    assert rows["TTFT p50 (ms)"]["within"] and rows["output tok/s"]["within"]
    assert not rows["TPOT p50 (ms)"]["within"] and rows["TPOT p50 (ms)"]["diff"] == pytest.approx(
        0.5
    )
    assert "OFF" in capsys.readouterr().out
