#!/usr/bin/env bash
# Scheduler lab on one H200 (issue 13). Usage on the GPU host, from the repo root:
#   bash scripts/gpu/sim.sh [calibrate] [replay] [example]      (default: calibrate replay)
# calibrate: fit the sim's cost model for llama-3-8b and qwen3-0.6b (random weights).
# replay:    an Azure trace window (SKIP, LIMIT) against `tokenloom serve` llama-3-8b at two
#            speeds (LOADED: loaded, not saturated; OVER: overloaded), the same window through
#            `tokenloom sim` with the fresh model (else core/sim/data/llama-3-8b.json), and the
#            sim-vs-real table for each. The server records its own trace (--record-trace).
# example:   the worked example (examples/schedulers/spf_aging.py) on the real server, OVER speed,
#            to confirm the simulator's ranking against continuous.
# Results: $OUT/compare.json, the cost models, a log, and sim-results.tar.gz with the rest.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; WORK=$(mktemp -d); LOG="$OUT/sim-gpu.log"
SKIP=${SKIP:-5000}; LIMIT=${LIMIT:-400}; LOADED=${LOADED:-1.5}; OVER=${OVER:-4}; PORT=${PORT:-8011}
MODEL=${MODEL:-llama-3-8b}  # the served shape (a CPU dry run: MODEL=smollm2-135m COST=... LIMIT=4)
export PYTHONUNBUFFERED=1 TOKENLOOM_LOG_LEVEL=${TOKENLOOM_LOG_LEVEL:-WARNING}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . >/dev/null 2>&1 \
  || { echo "editable install failed"; exit 1; }
STEPS=" ${*:-calibrate replay} "
log() { echo "=== $(date +%T) $*" | tee -a "$LOG"; }
WINDOW=(--trace azure-code --skip "$SKIP" --limit "$LIMIT")

serve() {  # serve SCHEDULER: start $MODEL (random weights) on $PORT, wait for /health
  local sched=$1
  python3 -c "from tokenloom.checkpoints.model_shapes import write_shape_dir as w; w('$MODEL', '$WORK/model')"
  # The worked example, installed as a third-party plugin would be: an entry point.
  mkdir -p "$WORK/ep/spf_aging_example-0.dist-info"
  printf 'Metadata-Version: 2.1\nName: spf-aging-example\nVersion: 0\n' \
    > "$WORK/ep/spf_aging_example-0.dist-info/METADATA"
  printf '[tokenloom]\nspf-aging = spf_aging\n' > "$WORK/ep/spf_aging_example-0.dist-info/entry_points.txt"
  PYTHONPATH="$PWD/examples/schedulers:$WORK/ep:${PYTHONPATH:-}" python3 -m tokenloom serve \
    "$WORK/model" --load-format random --port "$PORT" --scheduler "$sched" \
    --record-trace "$WORK/recorded-$sched.jsonl" > "$WORK/serve-$sched.log" 2>&1 &
  SERVER=$!
  python3 - "$PORT" <<'PY' || { tail -30 "$WORK/serve-$sched.log"; return 1; }
import sys, time, urllib.request
for _ in range(600):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(1)
PY
}
stop_server() { kill -INT "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; }
replay() {  # replay NAME SPEED SEED: the trace window against the server on $PORT
  # Each replay draws its own prompt ids (SEED): a second replay of the same ids would
  # hit the server's prefix cache and skip most of its prefill (the first validation's
  # overloaded run did: TTFT p50 33 ms at 4x the load that gave 204 ms).
  log "replay $1 at speed $2 (prompt seed $3)"
  timeout 300 python3 -m tokenloom bench serve --base-url "http://127.0.0.1:$PORT" "${WINDOW[@]}" \
    --speed "$2" --seed "$3" --out "$WORK/real-$1.json" | tail -14 | tee -a "$LOG"
}
simulate() {  # simulate NAME SPEED COST [extra args]
  local name=$1 speed=$2 cost=$3; shift 3
  python3 -m tokenloom sim "${WINDOW[@]}" --speed "$speed" --cost-model "$cost" --no-plots \
    --out "$WORK/sim-$name" "$@" | tail -6 | tee -a "$LOG"
  cp "$WORK/sim-$name/sim.json" "$WORK/sim-$name.json"
}

if [[ $STEPS == *" calibrate "* ]]; then
  for shape in llama-3-8b qwen3-0.6b; do
    log "calibrate $shape"
    timeout 280 python3 -m tokenloom bench calibrate --model "$shape" --out "$OUT/cost-$shape.json" \
      2>&1 | tail -16 | tee -a "$LOG"
    cp "$OUT/cost-$shape-samples.json" "$WORK/" 2>/dev/null && rm -f "$OUT/cost-$shape-samples.json"
  done
fi
COST=${COST:-$OUT/cost-$MODEL.json}; [[ -f $COST ]] || COST=core/sim/data/$MODEL-calibrated.json
DERIVED=core/sim/data/$MODEL.json
if [[ $STEPS == *" replay "* ]]; then
  log "serve $MODEL (continuous)"; serve continuous || exit 1
  replay loaded "$LOADED" 1; replay over "$OVER" 2
  stop_server
  for pair in "loaded $LOADED" "over $OVER"; do
    set -- $pair
    simulate "$1" "$2" "$COST"
    [[ -f $DERIVED ]] && simulate "$1-derived" "$2" "$DERIVED"
    python3 -m tokenloom.sim.compare "$WORK/real-$1.json" "$WORK/sim-$1.json" \
      --label "$1 (speed $2), calibrated model" --out "$OUT/compare.json" | tee -a "$LOG"
    [[ -f $DERIVED ]] && python3 -m tokenloom.sim.compare "$WORK/real-$1.json" \
      "$WORK/sim-$1-derived.json" --label "$1 (speed $2), shipped derived model" \
      --out "$OUT/compare.json" | tee -a "$LOG"
  done
  python3 -m tokenloom sim --trace "$WORK/recorded-continuous.jsonl" --cost-model "$COST" \
    --no-plots --out "$WORK/sim-recorded" | tail -4 | tee -a "$LOG"
fi
if [[ $STEPS == *" example "* ]]; then
  log "serve $MODEL (spf-aging)"; serve spf-aging || exit 1
  replay spf-over "$OVER" 3
  stop_server
  simulate example "$OVER" "$COST" --plugin examples/schedulers/spf_aging.py \
    --scheduler continuous,spf-aging
  python3 -m tokenloom.sim.compare "$WORK/real-spf-over.json" "$WORK/sim-example.json" \
    --run spf-aging --label "spf-aging over (speed $OVER)" --out "$OUT/compare.json" | tee -a "$LOG"
  [[ -f $WORK/real-over.json ]] && python3 - "$WORK" <<'PY' | tee -a "$LOG"
import json, sys
w = sys.argv[1]
real = {n: json.load(open(f"{w}/real-{f}.json"))["trace_summary"] for n, f in
        (("continuous", "over"), ("spf-aging", "spf-over"))}
sim = {r["label"]: r for r in json.load(open(f"{w}/sim-example.json"))["runs"]}
for name in ("continuous", "spf-aging"):
    print(f"{name:>10}: TTFT p50 real {real[name]['ttft_ms']['p50']:.0f} ms, sim "
          f"{sim[name]['ttft_ms']['p50']:.0f} ms; E2E p50 real {real[name]['e2e_ms']['p50']:.0f}"
          f" ms, sim {sim[name]['e2e_ms']['p50']:.0f} ms")
PY
fi
tar -czf "$OUT/sim-results.tar.gz" -C "$WORK" . && log "done: $OUT"
