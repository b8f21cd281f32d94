"""Session 33: from a sweep's JSON ($OUT/kern33-TAG.json, one per setting of the fp8-MMA
decode; ``pick33.py OUT [PREFIX]`` reads PREFIX-TAG.json instead, e.g. session 35's
kern35), the settings fastest at 512 rows that are not slower at 128 (2% slack), as
``--plugin-option triton.NAME=V`` arguments; nothing when the default wins."""

from __future__ import annotations

import json
import sys
from pathlib import Path

NAMES = {
    "bn": "decode_block_n",
    "st": "decode_num_stages",
    "w": "decode_num_warps",
    "r": "decode_maxnreg",
    "ma": "decode_fp8_meta_ahead",
    "f": "decode_fp8_fold",
}


def main(out: str, prefix: str = "kern33") -> int:
    times = {}
    for path in Path(out).glob(f"{prefix}-*.json"):
        rows = json.loads(path.read_text())["rows"]
        times[path.stem.removeprefix(f"{prefix}-")] = {
            r["batch"]: r["fp8"]["us_per_layer"] for r in rows
        }
    base = times.get("default")
    if not base:
        return 0
    ok = {t: v for t, v in times.items() if v.get(128, 1e9) <= 1.02 * base[128]}
    best = min(ok, key=lambda t: ok[t].get(512, 1e9))
    for tag, v in sorted(times.items(), key=lambda kv: kv[1].get(512, 1e9)):
        print(f"{tag}: {v}", file=sys.stderr)
    if best == "default" or ok[best][512] > 0.99 * base[512]:
        return 0
    opts = []
    for part in best.split("-"):
        key = part.rstrip("0123456789")
        opts.append(f"--plugin-option triton.{NAMES[key]}={part[len(key) :]}")
    print(" ".join(opts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
