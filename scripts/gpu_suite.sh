#!/usr/bin/env bash
# One device run: install, GPU tests, kernel and engine benchmarks. Usage on the GPU host:
#   bash scripts/gpu_suite.sh [tests] [attn] [qwen] [llama] [hf]
# Logs and JSON land in $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENLOOM_LOG_LEVEL=INFO
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . >/dev/null 2>&1 \
  || { echo "editable install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
want() { [[ " $* " == *" all "* ]] || [[ " $STEPS " == *" $1 "* ]]; }
STEPS=" ${*:-all} "
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0))s"; }
if [[ $STEPS == *" all "* || $STEPS == *" tests "* ]]; then
  run gpu-tests timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TEST_PATHS:-tests/plugins/attention tests/plugins/executor tests/plugins/models}
fi
if [[ $STEPS == *" all "* || $STEPS == *" attn "* ]]; then
  run attention timeout 240 python3 scripts/bench_attention.py
fi
if [[ $STEPS == *" all "* || $STEPS == *" llama "* ]]; then
  run latency-llama timeout 300 python3 -m tokenloom bench latency --model llama-3-8b --out "$OUT/latency-llama.json"
  run throughput-llama timeout 420 python3 -m tokenloom bench throughput --model llama-3-8b --out "$OUT/throughput-llama.json"
fi
if [[ $STEPS == *" all "* || $STEPS == *" qwen "* ]]; then
  run latency-qwen3 timeout 240 python3 -m tokenloom bench latency --model qwen3-0.6b --out "$OUT/latency-qwen3.json"
  run throughput-qwen3 timeout 300 python3 -m tokenloom bench throughput --model qwen3-0.6b --out "$OUT/throughput-qwen3.json"
fi
if [[ $STEPS == *" prof "* ]]; then
  run profile timeout 150 python3 scripts/profile_gpu.py qwen3-0.6b
fi
if [[ $STEPS == *" hf "* ]]; then
  run throughput-llama-hf timeout 330 python3 -m tokenloom bench throughput --model llama-3-8b --peer hf --peer-num-prompts 64 --out "$OUT/throughput-llama-hf.json"
fi
grep -h -E "tokens/s|roofline|capture|ratio|passed|failed" "$OUT"/*.log | head -60
