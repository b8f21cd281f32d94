"""Reporting one or several runs: the comparison table, the JSON, the PNG plots.

Plots (matplotlib, imported only when asked for): TTFT and E2E CDFs, queue length
and KV use over time, and per-priority / per-tenant TTFT p50 and p99, one line or
bar group per run, so schedulers and settings compare on one page each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("run", 22, lambda s: s["label"]),
    ("done", 6, lambda s: s["completed"]),
    ("rej", 5, lambda s: s["rejected"]),
    ("req/s", 7, lambda s: s["request_throughput"]),
    ("out tok/s", 9, lambda s: s["output_token_throughput"]),
    ("TTFT p50", 9, lambda s: s["ttft_ms"]["p50"]),
    ("TTFT p99", 9, lambda s: s["ttft_ms"]["p99"]),
    ("TPOT p50", 9, lambda s: s["tpot_ms"]["p50"]),
    ("TPOT p99", 9, lambda s: s["tpot_ms"]["p99"]),
    ("E2E p50", 9, lambda s: s["e2e_ms"]["p50"]),
    ("E2E p99", 9, lambda s: s["e2e_ms"]["p99"]),
    ("queue p99", 9, lambda s: s["queue_ms"]["p99"]),
    ("preempt", 7, lambda s: s["preemptions"]),
    ("goodput", 7, lambda s: s["goodput_req_s"]),
    ("Jain", 5, lambda s: s["jain_fairness"]),
    ("wall s", 6, lambda s: s["wall_s"]),
)


def _cell(value: Any, width: int) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-".rjust(width)
        text = f"{value:.2f}" if abs(value) < 100 else f"{value:,.0f}"
        return text.rjust(width)
    return str(value).rjust(width) if isinstance(value, int) else str(value).ljust(width)


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """One row per run; latencies in ms, goodput in requests/s meeting the SLO."""
    lines = [
        "  ".join(name.rjust(w) if i else name.ljust(w) for i, (name, w, _) in enumerate(COLUMNS))
    ]
    for s in summaries:
        lines.append("  ".join(_cell(get(s), w) for _, w, get in COLUMNS))
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """JSON with NaN written as null (strict JSON has no NaN)."""
    Path(path).write_text(json.dumps(_clean(payload), indent=1) + "\n")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def plot(
    results: Sequence[Any], summaries: Sequence[dict[str, Any]], out_dir: str | Path
) -> list[str]:
    """Write the PNGs into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tokenloom.sim.metrics import request_metrics

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        done = [r for r in result.requests if r.num_output > 0 and not math.isnan(r.finished)]
        per = [request_metrics(r) for r in done]
        for ax, name in zip(axes, ("ttft", "e2e"), strict=True):
            values = sorted(m[name] * 1000 for m in per)
            if values:
                ax.plot(
                    values, [(i + 1) / len(values) for i in range(len(values))], label=result.label
                )
    for ax, name in zip(axes, ("TTFT", "E2E latency"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    written.append(_save(fig, out / "latency_cdf.png"))

    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for result in results:
        times = [t for t, *_ in result.timeline]
        axes[0].plot(times, [w for _, w, _, _ in result.timeline], label=result.label, lw=0.8)
        axes[1].plot(times, [100 * k for *_, k in result.timeline], label=result.label, lw=0.8)
    axes[0].set_ylabel("waiting requests")
    axes[1].set_ylabel("KV blocks in use (%)")
    axes[1].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    written.append(_save(fig, out / "queue_kv_over_time.png"))

    for key, title in (("by_priority", "priority"), ("by_tenant", "tenant")):
        classes = sorted({c for s in summaries for c in s[key]})
        if len(classes) < 2:
            continue
        fig, ax = plt.subplots(figsize=(11, 4))
        width = 0.8 / max(1, len(summaries))
        for j, s in enumerate(summaries):
            xs = [i + j * width for i in range(len(classes))]
            p50 = [s[key].get(c, {}).get("ttft_p50_ms", math.nan) for c in classes]
            p99 = [s[key].get(c, {}).get("ttft_p99_ms", math.nan) for c in classes]
            ax.bar(xs, p99, width, alpha=0.35, label=f"{s['label']} p99")
            ax.bar(xs, p50, width, label=f"{s['label']} p50")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(classes))], classes)
        ax.set_xlabel(title)
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"ttft_{key}.png"))
    return written


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
