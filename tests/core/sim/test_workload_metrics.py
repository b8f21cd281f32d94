"""Workloads (Azure CSV, JSONL, synthetic, scaling, classes) and the metrics a
scheduler researcher reads (percentiles, goodput under an SLO, Jain's index)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tokenloom.sim import workload
from tokenloom.sim.metrics import jain_index, percentile, summarize
from tokenloom.sim.workload import TraceRequest

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.4799600,110,27
2023-11-16 18:17:07.9799600,0,0
"""


def test_azure_csv_gives_relative_arrivals_and_lengths(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(CSV)
    trace = workload.load_trace(path)
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 0.052, 1.5, 4.0])
    assert [(r.prompt_len, r.output_len) for r in trace] == [
        (4808, 10),
        (3180, 8),
        (110, 27),
        (1, 1),
    ]
    window = workload.load_trace(path, limit=2, skip=1)
    assert [r.arrival_s for r in window] == pytest.approx([0.0, 1.448])


def test_shipped_azure_trace_is_the_published_one():
    trace = workload.load_trace("azure-code")
    assert len(trace) == 8819
    described = workload.describe(trace)
    assert described["mean_prompt_len"] == pytest.approx(2047.8, abs=0.1)
    assert described["mean_output_len"] == pytest.approx(27.88, abs=0.01)


def test_rescaling_changes_arrivals_only():
    trace = [TraceRequest(float(i), 10 + i, 5) for i in range(11)]  # 1 req/s
    fast = workload.rescale(trace, speed=4)
    assert fast[-1].arrival_s == pytest.approx(2.5) and fast[3].prompt_len == 13
    assert workload.describe(workload.rescale(trace, rate=5.0))["rate_req_s"] == pytest.approx(5.0)


def test_synthetic_arrivals_have_the_asked_rate_and_burstiness():
    poisson = workload.synthetic(4000, 50.0, seed=1)
    bursty = workload.synthetic(4000, 50.0, cv=3.0, seed=1)
    assert workload.describe(poisson)["rate_req_s"] == pytest.approx(50.0, rel=0.05)
    assert workload.describe(bursty)["rate_req_s"] == pytest.approx(50.0, rel=0.15)

    def cv(trace):
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:], strict=False)]
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean

    assert cv(poisson) == pytest.approx(1.0, abs=0.1) and cv(bursty) > 2.0
    lognormal = workload.synthetic(4000, math.inf, prompt_len=500, length_dist="lognormal")
    assert all(r.arrival_s == 0.0 for r in lognormal)
    assert workload.describe(lognormal)["mean_prompt_len"] == pytest.approx(500, rel=0.1)


def test_classes_are_drawn_with_their_weights_and_jsonl_round_trips(tmp_path):
    trace = workload.synthetic(3000, 10.0, seed=2)
    classes = workload.assign_classes(
        trace, priorities={0: 3.0, 1: 1.0}, tenants=3, tenant_skew=1.0
    )
    share_high = sum(r.priority == 1 for r in classes) / len(classes)
    assert share_high == pytest.approx(0.25, abs=0.03)
    counts = [sum(r.tenant == f"t{i}" for r in classes) for i in range(3)]
    assert counts[0] > counts[1] > counts[2]  # Zipf
    workload.write_jsonl(classes, tmp_path / "t.jsonl")
    assert workload.load_trace(tmp_path / "t.jsonl") == classes


def _rec(arrival, first, finished, n, priority=0, tenant=""):
    return SimpleNamespace(
        arrival=arrival, started=arrival, first_token=first, finished=finished, num_output=n,
        finish_reason="length", priority=priority, tenant=tenant, preemptions=0,
    )  # fmt: skip


def test_summary_latencies_goodput_and_fairness():
    records = [
        _rec(0.0, 0.1, 1.1, 11, tenant="a"),  # TTFT 100 ms, TPOT 100 ms
        _rec(1.0, 1.5, 2.0, 6, tenant="a"),  # TTFT 500 ms, TPOT 100 ms
        _rec(2.0, 2.2, 6.2, 5, tenant="b"),  # TTFT 200 ms, TPOT 1000 ms
    ]
    s = summarize(records, slo_ttft_ms=300, slo_tpot_ms=200)
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["p99"] == pytest.approx(500)
    assert s["tpot_ms"]["p50"] == pytest.approx(100)
    assert s["duration_s"] == pytest.approx(6.2)
    assert s["goodput_req_s"] == pytest.approx(1 / 6.2) and s["slo_attainment"] == pytest.approx(
        1 / 3
    )
    assert s["output_token_throughput"] == pytest.approx(22 / 6.2)
    a, b = s["by_tenant"]["a"]["service_tok_s"], s["by_tenant"]["b"]["service_tok_s"]
    assert a == pytest.approx(17 / 2.1) and b == pytest.approx(5 / 4.2)
    assert s["jain_fairness"] == pytest.approx(jain_index([a, b]))


def test_jain_index_and_percentile():
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert percentile([5, 1, 4, 2, 3], 50) == 3 and percentile([5, 1, 4, 2, 3], 99) == 5
    assert math.isnan(percentile([], 50))
