"""What a scheduler researcher reads off a run: per-request latencies, goodput under
an SLO, and fairness across tenants. The same functions summarize a simulation and a
real replay (``bench serve --trace``), so the two compare figure by figure.

Definitions (seconds; reported in ms):
- TTFT: first token - arrival; E2E: finish - arrival; queue: first computed - arrival;
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one token;
- throughput: completed requests and output tokens over the span from the first
  arrival to the last finish;
- goodput: completed requests per second that met every SLO given;
- Jain's index over tenants of the output tokens each received per second of its
  requests' time in the system (1 = equal service, 1/n = one tenant got all).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def distribution(values: Sequence[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds (values in seconds)."""
    ms = [v * 1000 for v in values]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({f"p{p}": percentile(ms, p) for p in PERCENTILES})
    return out


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); nan when empty or all zero."""
    xs = list(values)
    squares = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * squares) if xs and squares else math.nan


def request_metrics(r: Any) -> dict[str, float]:
    """TTFT, TPOT, E2E and queue time of one completed request record (seconds)."""
    ttft = r.first_token - r.arrival
    e2e = r.finished - r.arrival
    tpot = (e2e - ttft) / (r.num_output - 1) if r.num_output > 1 else math.nan
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "queue": r.started - r.arrival}


def summarize(
    records: Sequence[Any], slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
) -> dict[str, Any]:
    """The summary of one run. ``records`` need ``arrival``, ``started``,
    ``first_token``, ``finished``, ``num_output``, ``finish_reason``, ``priority``,
    ``tenant`` and ``preemptions`` (``simulator.RequestRecord``)."""
    done = [r for r in records if r.num_output > 0 and not math.isnan(r.finished)]
    rejected = sum(1 for r in records if r.finish_reason == "rejected")
    per = [request_metrics(r) for r in done]
    span = (max(r.finished for r in done) - min(r.arrival for r in records)) if done else 0.0
    out_tokens = sum(r.num_output for r in done)
    good = sum(1 for m in per if _meets(m, slo_ttft_ms, slo_tpot_ms))
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "rejected": rejected,
        "duration_s": span,
        "request_throughput": len(done) / span if span else math.nan,
        "output_token_throughput": out_tokens / span if span else math.nan,
        "goodput_req_s": good / span if span else math.nan,
        "slo_attainment": good / len(done) if done else math.nan,
        "preemptions": sum(r.preemptions for r in records),
        "requests_preempted": sum(1 for r in records if r.preemptions),
    }
    for name in ("ttft", "tpot", "e2e", "queue"):
        values = [m[name] for m in per if not math.isnan(m[name])]
        summary[f"{name}_ms"] = distribution(values)
    summary["by_priority"] = _breakdown(done, per, "priority")
    summary["by_tenant"] = _breakdown(done, per, "tenant")
    tenants = summary["by_tenant"]
    summary["jain_fairness"] = (
        jain_index(t["service_tok_s"] for t in tenants.values()) if len(tenants) > 1 else math.nan
    )
    return summary


def _meets(m: dict[str, float], slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and m["ttft"] * 1000 > slo_ttft_ms:
        return False
    tpot = m["tpot"]
    return slo_tpot_ms is None or math.isnan(tpot) or tpot * 1000 <= slo_tpot_ms


def _breakdown(done: Sequence[Any], per: Sequence[dict[str, float]], key: str) -> dict[str, Any]:
    """Per class (priority or tenant): count, TTFT and E2E p50/p99, and its service
    rate (output tokens per second its requests spent in the system)."""
    groups: dict[str, list[int]] = {}
    for index, r in enumerate(done):
        groups.setdefault(str(getattr(r, key)), []).append(index)
    out = {}
    for name, members in sorted(groups.items()):
        ttft = [per[i]["ttft"] * 1000 for i in members]
        e2e = [per[i]["e2e"] * 1000 for i in members]
        time_in_system = sum(per[i]["e2e"] for i in members)
        tokens = sum(done[i].num_output for i in members)
        out[name] = {
            "completed": len(members),
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "e2e_p50_ms": percentile(e2e, 50),
            "e2e_p99_ms": percentile(e2e, 99),
            "service_tok_s": tokens / time_in_system if time_in_system else math.nan,
        }
    return out
