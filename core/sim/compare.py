"""Simulation against the real server, figure by figure.

    python -m tokenloom.sim.compare REAL.json SIM.json [--label NAME] [--out FILE]

``REAL.json`` is ``bench serve --trace``'s output (its ``trace_summary``), or a
``sim.json`` itself; ``SIM.json`` is ``tokenloom sim``'s (its first run, or the
run ``--run`` names). Prints TTFT p50/p99, TPOT p50 and throughput of both with
the relative difference, and whether each is within the issue's 15%.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

FIGURES = (
    ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"]),
    ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"]),
    ("TPOT p50 (ms)", lambda s: s["tpot_ms"]["p50"]),
    ("E2E p50 (ms)", lambda s: s["e2e_ms"]["p50"]),
    ("output tok/s", lambda s: s["output_token_throughput"]),
    ("requests/s", lambda s: s["request_throughput"]),
)
TOLERANCE = 0.15


def summary_of(path: str | Path, run: str | None = None) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if "trace_summary" in data:
        return dict(data["trace_summary"])
    runs = data.get("runs")
    if not runs:
        raise ValueError(f"{path}: neither a bench serve --trace nor a tokenloom sim result")
    if run is None:
        return dict(runs[0])
    for candidate in runs:
        if candidate["label"] == run:
            return dict(candidate)
    raise ValueError(f"{path}: no run {run!r}; runs: {', '.join(r['label'] for r in runs)}")


def compare(real: dict[str, Any], sim: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, get in FIGURES:
        r, s = _num(get(real)), _num(get(sim))
        diff = (s - r) / r if r else math.nan
        rows.append(
            {"figure": name, "real": r, "sim": s, "diff": diff, "within": abs(diff) <= TOLERANCE}
        )
    return rows


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def render(rows: list[dict[str, Any]], label: str) -> str:
    lines = [
        f"== sim vs real: {label} ==",
        f"{'figure':<16}{'real':>12}{'sim':>12}{'sim/real-1':>12}",
    ]
    for row in rows:
        mark = "ok" if row["within"] else "OFF"
        lines.append(
            f"{row['figure']:<16}{row['real']:>12.1f}{row['sim']:>12.1f}"
            f"{100 * row['diff']:>11.1f}%  {mark}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenloom.sim.compare", description=__doc__)
    parser.add_argument("real")
    parser.add_argument("sim")
    parser.add_argument("--run", default=None, help="the sim run's label (default: the first)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None, help="append the comparison to this JSON file")
    args = parser.parse_args(argv)
    rows = compare(summary_of(args.real), summary_of(args.sim, args.run))
    label = args.label or f"{args.real} vs {args.sim}"
    print(render(rows, label))
    if args.out:
        path = Path(args.out)
        existing = json.loads(path.read_text()) if path.exists() else []
        existing.append({"label": label, "rows": rows})
        path.write_text(json.dumps(existing, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
