#!/usr/bin/env bash
# The served run of issue 16 (8 and 16 req/s, 256 in / 128 out, 240 prompts, --logprobs),
# before and after a change, on one GPU: two `git archive` snapshots, each installed into
# its own folder, served in turn in the order before, after, after, before, every time by
# `scripts/gpu/speed.sh serve` with this tree's client (so both servers are measured the
# same way). Interleaving separates a change from the drift of one machine start.
#
# Here:   mkdir -p .snap && git archive -o .snap/before.tar REV && git archive -o .snap/after.tar HEAD
# There:  OUT=$OUT bash scripts/gpu/serve_ab.sh .snap/before.tar .snap/after.tar   (carry .snap, .whl)
# Writes a table of TTFT p99 / TPOT p50, $OUT/serve-ab.json (every run's summary, without the
# per-request lists) and $OUT/serve-ab-logs.tgz (the device returns only a few files).
set -uo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 BEFORE.tar AFTER.tar"; exit 2; }
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
if ! python3 -c "import msgspec, zmq, starlette, uvicorn" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . >/dev/null 2>&1 \
  || { echo "editable install of this tree failed"; exit 1; }
work=$(mktemp -d)
for name in before after; do
  tar=$1; [[ $name == after ]] && tar=$2
  mkdir -p "$work/$name/src" && tar -xf "$tar" -C "$work/$name/src" || exit 1
  python3 -m pip install -q --no-index --no-build-isolation --no-deps --no-compile \
    --target "$work/$name/site" "$work/$name/src" >/dev/null 2>&1 \
    || { echo "install of $tar failed"; exit 1; }
done
i=0
for name in before after after before; do
  i=$((i + 1)); dir="$OUT/$i-$name"; mkdir -p "$dir"
  echo "=== run $i: $name"
  SERVER_PYTHONPATH="$work/$name/site" OUT="$dir" bash scripts/gpu/speed.sh serve
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | 8 req/s: TTFT p99, TPOT p50 (ms) | 16 req/s |")
print("|---|---|---|")
for run in sorted(p for p in out.iterdir() if p.is_dir()):
    cells = []
    for rate in (8, 16):
        f = run / f"serve-r{rate}.json"
        if not f.exists():
            cells.append("missing")
            continue
        d = json.loads(f.read_text())
        cells.append(f"{d['ttft_ms']['p99']:.1f}, {d['tpot_ms']['p50']:.2f}")
    print(f"| {run.name} | {cells[0]} | {cells[1]} |")
summary = {}
for f in sorted(out.glob("*/serve-r*.json")):
    d = json.loads(f.read_text())
    d.pop("requests", None)
    summary.setdefault(f.parent.name, {})[f.stem] = d
(out / "serve-ab.json").write_text(json.dumps(summary, indent=1))
PY
(cd "$OUT" && tar czf serve-ab-logs.tgz [0-9]*-* && rm -rf [0-9]*-*)
