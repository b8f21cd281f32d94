#!/usr/bin/env bash
# Speculative decoding on one H200 (issue 11). Usage from the repo root:
#   OUT=spec-out bash scripts/gpu/spec.sh [tests] [bench] [latency]
# (no argument: all three; about 2 + 5 + 3 minutes, so under the 10-minute limit of one
# command run `tests`, `latency` and `bench` separately). Logs and JSON land in $OUT:
#   tests  gpu-marked tests: greedy tokens with speculation (ngram, the target as its own
#          draft, a smaller draft) equal the CUDA-graph decode without it (fp32, Triton);
#          verify steps replayed from CUDA graphs == eager verify == no speculation (fp32,
#          bf16), every uniform 1 + k step replayed
#   bench  scripts/gpu/spec_bench.py on the llama-3-8b shape, bf16, random weights:
#          baseline decode tokens/s at batch 1, 32, 128; replay at acceptance 0.6/0.8/0.9
#          with k = 2/4/6 single-stream and k = 2/4 at batch 32 and 128 (speedup, measured
#          acceptance, tokens per verify step, verify step / decode step, analytic speedup);
#          the llama-3.2-1b shape as draft: ms per proposed token, % of a target step.
#   graphs128  spec_bench at batch 1 and 128 with verify graphs up to 128 requests (the default
#          64 leaves batch-128 verify steps eager: 0.55-1.04x there on 2026-12-01)
#   latency  `tokenloom bench latency` for the headline: no speculation vs replay at
#          acceptance 0.8, k = 4 (the issue asks for >= 2.5x there), verify steps in CUDA
#          graphs (the default) and eager (--max-verify-graph-seqs 0) for the A/B
set -uo pipefail
OUT=${OUT:-spec-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENLOOM_LOG_LEVEL=INFO
python3 -c "import tokenloom" 2>/dev/null \
  || python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . >/dev/null \
  || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
STEPS=" ${*:-tests bench latency} "
want() { [[ $STEPS == *" $1 "* ]]; }
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  grep -v " INFO " "$OUT/$name.log" | tail -n 40; echo "=== $name rc=$rc in $((SECONDS - t0))s"; }

want tests && run spec-gpu-tests timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/plugins/proposer/test_spec_gpu.py
if want bench; then
  run spec-bench timeout 540 python3 scripts/gpu/spec_bench.py --model llama-3-8b \
    --draft llama-3.2-1b --out "$OUT"
fi
if want graphs128; then  # batch 128 with verify graphs up to 128 requests (default 64: eager)
  run spec-graphs128 timeout 400 python3 scripts/gpu/spec_bench.py --model llama-3-8b \
    --batches 1,128 --ks 4 --acceptances 0.8 --batch-acceptances 0.6,0.8,0.9 --batch-grid 2,4 \
    --max-verify-graph-seqs 128 --draft none --out "$OUT/graphs128"
fi
if want latency; then
  run latency-none timeout 120 python3 -m tokenloom bench latency --model llama-3-8b \
    --dtype bfloat16 --runs 3 --out "$OUT/latency-none.json"
  run latency-replay-0.8-k4 timeout 120 python3 -m tokenloom bench latency --model llama-3-8b \
    --dtype bfloat16 --runs 3 --proposer replay --num-speculative-tokens 4 \
    --plugin-option replay.acceptance=0.8 --out "$OUT/latency-replay-0.8-k4.json"
  run latency-replay-0.8-k4-eager-verify timeout 120 python3 -m tokenloom bench latency \
    --model llama-3-8b --dtype bfloat16 --runs 3 --proposer replay --num-speculative-tokens 4 \
    --plugin-option replay.acceptance=0.8 --max-verify-graph-seqs 0 \
    --out "$OUT/latency-replay-0.8-k4-eager-verify.json"
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); path = out / "spec_bench.json"
lat = {}
for name in ("none", "replay-0.8-k4", "replay-0.8-k4-eager-verify"):
    f = out / f"latency-{name}.json"
    if f.is_file():
        lat[name] = json.loads(f.read_text())["decode_tokens_per_s"]
        print(f"latency {name}: {lat[name]:.1f} decode tok/s")
for name in ("replay-0.8-k4", "replay-0.8-k4-eager-verify"):
    if "none" in lat and name in lat:
        print(f"speedup {name}: {lat[name] / lat['none']:.2f}x (target >= 2.5x with graphs)")
if path.is_file():
    r = json.loads(path.read_text())
    for run in r.get("replay", []):
        s = run.get("speculative") or {}
        print(f"B={run['batch']:>3} a={run['acceptance']} k={run['k']} "
              f"tok/s={run['decode_tokens_per_s']:.0f} speedup={run['speedup']:.2f} "
              f"acc={s.get('acceptance_rate', 0):.2f} len={s.get('mean_accepted_length', 0):.2f} "
              f"verify/decode={run.get('verify_over_decode_step') or 0:.2f} "
              f"analytic={run.get('analytic_speedup') or 0:.2f}")
    for b, d in (r.get("draft") or {}).items():
        print(f"draft B={b}: {d.get('draft_ms_per_token')} ms/token, "
              f"{d.get('draft_token_over_target_step_percent')} % of a target step")
PY
