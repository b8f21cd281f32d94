#!/usr/bin/env bash
# Tensor parallelism on one host with two (or more) GPUs (issue 10). Usage from the repo root:
#   OUT=tp-out bash scripts/gpu/tp.sh [tests] [allreduce] [bench8b] [bench70b]
# (no argument: all four). Logs and JSON land in $OUT (default ./tp-out):
#   tests      gpu-marked TP tests: TP=2 on one GPU over gloo, TP=2 over NCCL with CUDA graphs
#   allreduce  all-reduce latency per message size: NCCL eager / in a CUDA graph vs
#              symmetric-memory one-shot / two-shot (allreduce.json: rows, symm_threshold_kib)
#   bench8b    llama-3-8b: bench latency and throughput at -tp 1 and -tp 2, and latency at
#              -tp 2 with the symmetric-memory all-reduce (tuned at start-up, in the log)
#   bench70b   llama-3-70b: the same at -tp 2 (140 GB of bf16 weights)
set -uo pipefail
OUT=${OUT:-tp-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENLOOM_LOG_LEVEL=INFO
python3 -c "import tokenloom" 2>/dev/null \
  || python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . >/dev/null \
  || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
STEPS=" ${*:-tests allreduce bench8b bench70b} "
want() { [[ $STEPS == *" $1 "* ]]; }
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 15 "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0))s"; }
bench() { local kind=$1 model=$2 tp=$3 tag=$4; shift 4
  run "$kind-$model-tp$tp$tag" timeout 570 python3 -m tokenloom bench "$kind" --model "$model" \
    -tp "$tp" --out "$OUT/$kind-$model-tp$tp$tag.json" "$@"; }
SYMM="--plugin-option model.symm_mem_all_reduce=true"

want tests && run tp-gpu-tests timeout 570 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/plugins/executor/test_tp_gpu.py
if [[ $GPUS -lt 2 ]]; then echo "only $GPUS GPU(s): the two-GPU steps are skipped"; exit 0; fi
want allreduce && run allreduce timeout 570 python3 -m tokenloom.bench.allreduce --ranks 2 \
  --out "$OUT/allreduce.json"
if want bench8b; then
  bench latency llama-3-8b 1 ""; bench latency llama-3-8b 2 ""
  bench latency llama-3-8b 2 -symm $SYMM
  bench throughput llama-3-8b 1 ""; bench throughput llama-3-8b 2 ""
fi
if want bench70b; then
  bench latency llama-3-70b 2 ""; bench latency llama-3-70b 2 -symm $SYMM
  bench throughput llama-3-70b 2 "" --runs 1
fi
grep -h -E "tokens/s|roofline|faster up to|passed|failed|rc=" "$OUT"/*.log | head -60
