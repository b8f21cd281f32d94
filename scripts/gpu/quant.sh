#!/usr/bin/env bash
# Issue 12 (weights) on one H200: the quant GPU tests (kernels against the reference
# paths), then single-stream latency and offline throughput of the llama-3-8b shape
# with --quant none / int8 / int4 / fp8. About 6 minutes of GPU time.
# Usage on the GPU host, from the repo root:
#   bash scripts/gpu/quant.sh [tests] [bench] [gemv] [gemm] [lmhead] [dequant] [fp8gemv] [h2]
# (gemv: every GEMV/GEMM tiling per Llama-3-8B shape at 1, 4 and 16 rows, gemv.json;
#  gemm: the same at 64-1,024 rows, beside bf16 cuBLAS, gemm.json;
#  lmhead: bench latency and throughput of int8 and int4 with and without --quant-lm-head;
#  dequant: the opt-in whole-weight dequantization then cuBLAS (TOKENLOOM_WEIGHT_DEQUANT=1):
#  its GPU tests, the tilings at 512-4,096 rows, and offline throughput with and without it;
#  fp8gemv: the opt-in fp8 GEMV for <= 4 rows (TOKENLOOM_FP8_GEMV=1): its GPU tests, then
#  bench latency --quant fp8 with and without it;
#  h2: the f16x2 int4 GEMV (on by default since session 14; TOKENLOOM_INT4_H2=0 withholds it):
#  its GPU tests, its per-layer table (scripts/lab/gemv_h2_check.py gpu) and ablation (what the
#  range guard, PDL and the split sum cost: gemv_h2_check.py ablate), then bench latency
#  --quant int4 without, with, without it, and offline throughput with it)
# Writes to $OUT (or ./gpu-out): quant.json (every figure and the speedups over none),
# quant-tests.log, quant-bench.log, weight-gemm.json (the tilings measured per shape).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
RUNS=$(mktemp -d)
export PYTHONUNBUFFERED=1 TOKENLOOM_LOG_LEVEL=INFO TOKENLOOM_CACHE=${TOKENLOOM_CACHE:-$RUNS/cache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . >/dev/null 2>&1 \
  || { echo "editable install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
STEPS=" ${*:-tests bench} "
if [[ $STEPS == *" tests "* ]]; then
  echo "=== gpu tests"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/plugins/quant \
    > "$OUT/quant-tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -n 5 "$OUT/quant-tests.log"
fi
if [[ $STEPS == *" bench "* ]]; then
  for q in none int8 int4 fp8; do
    echo "=== llama-3-8b --quant $q"
    timeout 150 python3 -m tokenloom bench latency --model llama-3-8b --quant "$q" --runs 2 \
      --out "$RUNS/latency-$q.json" >> "$OUT/quant-bench.log" 2>&1 || echo "latency $q failed"
    timeout 150 python3 -m tokenloom bench throughput --model llama-3-8b --quant "$q" --runs 1 \
      --out "$RUNS/throughput-$q.json" >> "$OUT/quant-bench.log" 2>&1 || echo "throughput $q failed"
  done
  python3 scripts/gpu/quant_summary.py "$RUNS" "$OUT/quant.json"
fi
if [[ $STEPS == *" gemv "* ]]; then
  echo "=== weight GEMV/GEMM tilings"
  timeout 300 python3 scripts/gpu/gemv_bench.py --rows 1,4,16 --json "$OUT/gemv.json" \
    > "$OUT/gemv.log" 2>&1 || echo "gemv bench failed"
  grep -E "per layer" "$OUT/gemv.log"
fi
if [[ $STEPS == *" gemm "* ]]; then
  echo "=== weight GEMM tilings at decode-batch and prefill rows"
  timeout 400 python3 scripts/gpu/gemv_bench.py --rows 64,128,256,1024 --json "$OUT/gemm.json" \
    > "$OUT/gemm.log" 2>&1 || echo "gemm bench failed"
  grep -E "per layer" "$OUT/gemm.log"
fi
if [[ $STEPS == *" dequant "* ]]; then
  echo "=== whole-weight dequantization, then cuBLAS"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/plugins/quant/test_dequant.py \
    2>&1 | tail -n 2
  TOKENLOOM_WEIGHT_DEQUANT=1 timeout 400 python3 scripts/gpu/gemv_bench.py --rows 512,1024,4096 \
    --json "$OUT/dequant-gemm.json" > "$OUT/dequant-gemm.log" 2>&1 || echo "dequant gemm failed"
  grep -E "^  |per layer" "$OUT/dequant-gemm.log"
  for q in int4 int8; do
    for dq in 0 1; do
      echo "=== llama-3-8b --quant $q, TOKENLOOM_WEIGHT_DEQUANT=$dq"
      TOKENLOOM_WEIGHT_DEQUANT=$dq timeout 250 python3 -m tokenloom bench throughput \
        --model llama-3-8b --quant "$q" --runs 1 --out "$OUT/dequant-throughput-$q-$dq.json" \
        2>&1 | grep -E "^output tokens/s"
    done
  done
fi
if [[ $STEPS == *" fp8gemv "* ]]; then
  echo "=== fp8 GEMV for decode rows"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/plugins/quant/test_fp8_gemv.py \
    tests/plugins/quant/test_gpu_kernels.py 2>&1 | tail -n 2
  for g in 0 1; do
    echo "=== llama-3-8b --quant fp8, TOKENLOOM_FP8_GEMV=$g"
    TOKENLOOM_FP8_GEMV=$g timeout 150 python3 -m tokenloom bench latency --model llama-3-8b \
      --quant fp8 --runs 3 --out "$OUT/fp8gemv-latency-$g.json" 2>&1 | grep -E "ms per step|% of roofline"
  done
fi
if [[ $STEPS == *" lmhead "* ]]; then
  for q in int8 int4; do
    for head in --no-quant-lm-head --quant-lm-head; do
      echo "=== llama-3-8b --quant $q $head"
      timeout 150 python3 -m tokenloom bench latency --model llama-3-8b --quant "$q" $head --runs 3 \
        --out "$OUT/lmhead-latency-$q$head.json" 2>&1 | grep -E "ms per step|% of roofline"
      timeout 200 python3 -m tokenloom bench throughput --model llama-3-8b --quant "$q" $head \
        --runs 1 --out "$OUT/lmhead-throughput-$q$head.json" 2>&1 | grep -E "^output tokens/s"
    done
  done
fi
if [[ $STEPS == *" h2 "* ]]; then
  echo "=== f16x2 int4 GEMV"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/plugins/quant/test_int4_gemv_h2.py \
    2>&1 | tail -n 2
  timeout 200 python3 scripts/lab/gemv_h2_check.py gpu "$OUT/h2-layers.json" 2>&1 | grep -E "^[|]|per layer"
  timeout 200 python3 scripts/lab/gemv_h2_check.py ablate "$OUT/h2-ablate.json" 2>&1 | grep -E "^[|]"
  i=0
  for g in 0 1 0; do
    i=$((i + 1))
    echo "=== llama-3-8b --quant int4, TOKENLOOM_INT4_H2=$g"  # the first run compiles and tunes
    TOKENLOOM_INT4_H2=$g timeout 150 python3 -m tokenloom bench latency --model llama-3-8b \
      --quant int4 --runs 3 --out "$OUT/h2-latency-$i-$g.json" 2>&1 | grep -E "ms per step|% of roofline"
  done
  TOKENLOOM_INT4_H2=1 timeout 200 python3 -m tokenloom bench throughput --model llama-3-8b \
    --quant int4 --runs 1 --out "$OUT/h2-throughput-1.json" 2>&1 | grep -E "output tokens/s"
fi
cp "$TOKENLOOM_CACHE/weight-gemm.json" "$OUT/" 2>/dev/null || true
