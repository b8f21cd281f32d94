#!/usr/bin/env bash
# Issue 16 (and the fp8 workload of issue 12) on one H200: the profiles of every speed
# target against its floors, the benches, and the served run at 8 and 16 req/s.
# Usage on the GPU host, from the repo root:  bash scripts/gpu/speed.sh [STEP ...]
# Steps (default: profiles bench serve; about 8 minutes of GPU time):
#   profiles  batch-1 profiles (llama-3-8b, qwen3-0.6b), the 1,000/1,000 x 600 workload
#             (decode profiled at 256 x 1,500), the default offline workload (128 x 600)
#   fp8       the 1,000/1,000 x 600 workload with fp8 weights and KV (512 x 1,500 profiled)
#   bench     bench latency and bench throughput, llama-3-8b and qwen3-0.6b
#   serve     tokenloom serve llama-3-8b, bench serve at 8 and 16 req/s (256 in / 128 out,
#             240 prompts, --logprobs: every token streams, random weights' empty texts too)
#   serve1k   tokenloom serve llama-3-8b (default settings), bench serve with issue 16's
#             1,000 in / 1,000 out x 600 prompts sent at once (output tokens from usage),
#             SERVE1K_RUNS passes (default 1; ~70 s each) and their median
# Writes to $OUT (or ./gpu-out): one log and JSON per step. MODEL_SERVE (default llama-3-8b)
# lets a CPU dry run serve a small shape: MODEL_SERVE=smollm2-135m bash scripts/gpu/speed.sh serve
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TOKENLOOM_CACHE=${TOKENLOOM_CACHE:-$(mktemp -d)/cache}
if ! python3 -c "import msgspec, zmq, starlette, uvicorn" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
  python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . >/dev/null 2>&1 \
    || { echo "editable install failed"; exit 1; }
fi
run() {  # run NAME LIMIT CMD...: log to $OUT/NAME.log, print the lines that carry figures
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$?"
  grep -E "tok/s|roofline|ms per step|^class|^[a-z+]+ +[0-9.]+ +[0-9.]+%|busy|ttft_ms|tpot_ms" \
    "$OUT/$name.log" | grep -v " INFO " | tail -n 16
}
TL="python3 -m tokenloom"
for step in ${*:-profiles bench serve}; do case $step in
  profiles)
    run profile-b1-llama 150 env OUT="$OUT" python3 scripts/profile_gpu.py llama-3-8b graphs
    run profile-b1-qwen3 120 env OUT="$OUT" python3 scripts/profile_gpu.py qwen3-0.6b graphs
    run profile-1000x1000 260 env OUT="$OUT" MIN_LEN=1000 MAX_LEN=1000 PROF_SEQS=256 \
      PROF_CTX=1500 python3 scripts/profile_throughput.py llama-3-8b 600
    run profile-default 200 env OUT="$OUT" python3 scripts/profile_throughput.py llama-3-8b 256 ;;
  fp8)
    run profile-1000x1000-fp8 260 env OUT="$OUT" MIN_LEN=1000 MAX_LEN=1000 PROF_SEQS=512 \
      PROF_CTX=1500 python3 scripts/profile_throughput.py llama-3-8b 600 quant=fp8 \
      kv_cache_dtype=fp8 max_num_seqs=512 ;;
  bench)
    for model in llama-3-8b qwen3-0.6b; do
      run "latency-$model" 150 $TL bench latency --model "$model" --out "$OUT/latency-$model.json"
      run "throughput-$model" 200 $TL bench throughput --model "$model" \
        --out "$OUT/throughput-$model.json"
    done ;;
  serve|serve1k)
    work=$(mktemp -d); model=${MODEL_SERVE:-llama-3-8b}
    python3 -c "from tokenloom.checkpoints.model_shapes import write_shape_dir as w; w('$model', '$work/model')"
    # SERVER_PYTHONPATH: serve another install of tokenloom (scripts/gpu/serve_ab.sh);
    # the client below always runs from this tree
    env PYTHONPATH="${SERVER_PYTHONPATH:+$SERVER_PYTHONPATH:}${PYTHONPATH:-}" \
      $TL serve "$work/model" --load-format random --port 8011 > "$OUT/server.log" 2>&1 &
    server=$!
    python3 - <<'PY' || { tail -20 "$OUT/server.log"; kill $server; exit 1; }
import sys, time, urllib.request
for _ in range(600):
    try:
        if urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(1)
PY
    if [[ $step == serve1k ]]; then  # SERVE1K_RUNS passes (fresh prompts each), then the median
      for i in $(seq "${SERVE1K_RUNS:-1}"); do
        run "serve-1000x1000-$i" 400 $TL bench serve --base-url http://127.0.0.1:8011 \
          --request-rate inf --num-prompts "${NUM_PROMPTS:-600}" --input-len 1000 --output-len 1000 \
          --range-ratio 0 --seed $((6 + i)) --timeout-s 380 --out "$OUT/serve-1000x1000-$i.json"
      done
      python3 -c "import json, glob, statistics as st; v = [json.load(open(f))['output_token_throughput'] for f in glob.glob('$OUT/serve-1000x1000-*.json')]; print('serve1k output tok/s median', round(st.median(v), 1), 'of', [round(x) for x in v])" || true
      kill -INT $server; wait $server; continue
    fi
    seed=1
    for rate in 8 16; do
      seed=$((seed + 1))  # fresh prompt ids per run: no prefix-cache hits across runs
      run "serve-r$rate" 120 $TL bench serve --base-url http://127.0.0.1:8011 --request-rate "$rate" \
        --num-prompts "${NUM_PROMPTS:-240}" --seed "$seed" --logprobs --out "$OUT/serve-r$rate.json"
    done
    kill -INT $server; wait $server ;;
  *) echo "unknown step $step" ;;
esac; done
