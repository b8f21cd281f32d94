"""The SASS instructions where a kernel's warps stall, from ncu's per-instruction samples
(session 38). ncu writes them with its SourceCounters section; print them as CSV with

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass | gzip > FILE.csv.gz

(``scripts/gpu/fp8_attn.sh ncusrc38`` does both on the device), then here:

    python scripts/ncu_source_top.py FILE.csv[.gz] [--top 30]

Prints the samples by stall reason, then the instructions with the most samples, each with
its share and the reasons that hold at least a tenth of its samples.
"""

from __future__ import annotations

import argparse
import csv
import gzip
from collections.abc import Iterable

ALL = "Warp Stall Sampling (All Samples)"


def read(path: str) -> tuple[list[str], list[list[str]]]:
    """ncu's CSV: a kernel-name line, the header, then one row per SASS instruction."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, row in enumerate(rows) if ALL in row)
    return rows[start], rows[start + 1 :]


def count(cell: str) -> int:
    return int(cell) if cell.strip().isdigit() else 0


def summary(header: list[str], rows: Iterable[list[str]], top: int) -> list[str]:
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(" not in h]
    rows = list(rows)
    total = sum(count(r[col[ALL]]) for r in rows) or 1
    lines = [f"{total} samples"]
    by_reason = {h: sum(count(r[col[h]]) for r in rows) for h in reasons}
    for name, n in sorted(by_reason.items(), key=lambda kv: -kv[1]):
        if n:
            lines.append(f"  {name:24s} {n:8d} {100 * n / total:5.1f}%")
    for r in sorted(rows, key=lambda r: -count(r[col[ALL]]))[:top]:
        n = count(r[col[ALL]])
        main = {h.removeprefix("stall_"): count(r[col[h]]) for h in reasons}
        main = {h: v for h, v in main.items() if v >= 0.1 * n and v}
        lines.append(
            f"{r[col['Address']][-6:]} {n:7d} {100 * n / total:5.1f}%  "
            f"{r[col['Source']].strip()[:64]:64s} {main}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    header, rows = read(args.csv)
    print("\n".join(summary(header, rows, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
