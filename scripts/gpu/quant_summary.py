"""Merge the bench JSON files of scripts/gpu/quant.sh into one report, with each
method's single-stream and offline speedup over ``none`` (bf16), and print the table.

Usage: python3 scripts/gpu/quant_summary.py RUNS_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METHODS = ("none", "int8", "int4", "fp8")
TARGETS = {"int8": 1.6, "int4": 2.5}  # issue 12: single-stream decode over bf16


def main(runs: Path, out: Path) -> None:
    report: dict[str, dict] = {}
    for q in METHODS:
        entry: dict = {}
        lat, thr = runs / f"latency-{q}.json", runs / f"throughput-{q}.json"
        if lat.is_file():
            d = json.loads(lat.read_text())
            entry["latency"] = d
            entry["decode_tokens_per_s"] = d["decode_tokens_per_s"]
            entry["percent_of_roofline"] = d.get("percent_of_roofline")
            entry["bytes_per_step_gb"] = d.get("bytes_per_step_gb")
            entry["weights_gib"] = d.get("memory_gib", {}).get("weights_gib")
        if thr.is_file():
            d = json.loads(thr.read_text())
            entry["throughput"] = d
            entry["output_tokens_per_s"] = d["tokenloom"]["output_tokens_per_s"]
        report[q] = entry
    base = report.get("none", {})
    print(
        f"{'quant':<6} {'decode tok/s':>12} {'x bf16':>7} {'target':>6} {'% roofline':>10} "
        f"{'weights GiB':>11} {'offline tok/s':>13} {'x bf16':>7}"
    )
    for q, e in report.items():
        for key, name in (
            ("decode_tokens_per_s", "decode_speedup"),
            ("output_tokens_per_s", "offline_speedup"),
        ):
            if key in e and key in base:
                e[name] = e[key] / base[key]
        if q in TARGETS and "decode_speedup" in e:
            e["decode_target"] = TARGETS[q]
            e["decode_target_met"] = e["decode_speedup"] >= TARGETS[q]

        def f(key: str, fmt: str, e: dict = e) -> str:
            width = int(fmt.split(".")[0])
            return format(e[key], fmt) if e.get(key) is not None else "-".rjust(width)

        print(
            f"{q:<6} {f('decode_tokens_per_s', '12.1f')} {f('decode_speedup', '7.2f')} "
            f"{TARGETS.get(q, '-')!s:>6} {f('percent_of_roofline', '10.1f')} "
            f"{f('weights_gib', '11.2f')} {f('output_tokens_per_s', '13.0f')} "
            f"{f('offline_speedup', '7.2f')}"
        )
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
