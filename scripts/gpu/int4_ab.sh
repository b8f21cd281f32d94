#!/usr/bin/env bash
# int4 at batch 1 on one H200, the open questions of sessions 17-18 (docs/quantization.md):
# bench latency and throughput --quant int4 of a BEFORE tree against this tree, alternated,
# and this tree with TOKENLOOM_INT4_ROW_MAJOR=0 (the [K / 8, N] storage and its GEMVs, with
# the int8 LM head); bf16 for the ratio; the int4 GPU tests; int4_gemv_nk per layer; an ncu
# profile of int4_gemv_nk on the Llama-3-8B shapes (firecracker hosts read the counters).
# Prepare here:   git archive REV > .snap/before.tar  (the BEFORE tree; .snap/ git-ignored)
#                 ../shared/tools/gpu-wheels .whl
# On the device:  bash scripts/gpu/int4_ab.sh STEP...   (carry [".snap", ".whl"])
# Steps: head28, s28, t28b (late28 ran on 74d224f, since removed) (session 28; its L2-prefetch steps l2p, l2px, profpf ran on 031371d-8d091d7, since removed); t28 (for session 28); t27, lat27, thr27, long27, crash27, fix27 (session 27); t26o, lat26o (session 26); t26, lat26a, lat26b, lat26c, thr26, prof26 (session 26, on a71c5eb's tree); t25, lat25a, lat25b, lat25c (session 25); t24, lat24a, lat24b, lat24c, attn24, thr24, t24b, thr24b, latrope (session 24); lat (int4 before/after/kn alternated twice, --runs 3), latbf16, latab and thrab
# (bf16 and int4, before/after), gpu20, sample and prof (session 20), thr (int4
# before/after/kn, one pass each), tests (int4 GPU tests), gputests (every GPU test under
# tests/plugins/quant and tests/plugins/models), gemv4 (gemv_bench nk layout), samebytes (the bf16 GEMV over the same bytes), latcold (the tuner timed cold),
# ncu, ncustall (stall reasons: int4 against int8). Each call must end within 600 s: lat alone takes about 8 minutes with tuning.
# Output: $OUT/lat-*.json, thr-*.json, *.log; the "lat" / "thr" lines are the table.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENLOOM_LOG_LEVEL=INFO TOKENLOOM_CACHE=/tmp/tlcache
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
fi
inst() {  # inst SRC DEST: a non-editable install of one tree, chosen per call by PYTHONPATH
  rm -rf "$2"
  python3 -m pip install -q --no-index --no-build-isolation --no-deps --no-compile --target "$2" \
    "$1" > /tmp/inst.log 2>&1 || { tail -5 /tmp/inst.log; exit 1; }
}
if [ -f .snap/before.tar ] && { [ ! -d /tmp/before ] || [ .snap/before.tar -nt /tmp/before ]; }; then
  rm -rf /tmp/before_src && mkdir -p /tmp/before_src && tar -xf .snap/before.tar -C /tmp/before_src
  inst /tmp/before_src /tmp/before
fi
inst . /tmp/after
for tree in before after; do
  [ -d /tmp/$tree ] && PYTHONPATH=/tmp/$tree:/tmp/site python3 -c \
    "import tokenloom; print('$tree:', tokenloom.__file__)"
done
bench() {  # bench latency|throughput TAG TREE QUANT [VAR=VALUE...]: one bench, its figure
  local kind=$1 tag=$2 tree=$3 q=$4; shift 4
  local name=${kind:0:3} runs=3 limit=200
  [ "$kind" = throughput ] && runs=1 limit=300
  env "$@" PYTHONPATH=/tmp/$tree:/tmp/site timeout $limit python3 -m tokenloom bench "$kind" \
    --model llama-3-8b --quant "$q" --runs $runs --out "$OUT/$name-$tag.json" ${BENCH_ARGS:-} \
    > "$OUT/$name-$tag.log" 2>&1 || { echo "$name $tag failed"; tail -5 "$OUT/$name-$tag.log"; }
  python3 -c "import json; d = json.load(open('$OUT/$name-$tag.json')); \
print('$name $tag', round(d['step_ms'], 4) if '$name' == 'lat' else \
round(d['tokenloom']['output_tokens_per_s'], 1))" 2>/dev/null
}
lat() { bench latency "$@"; }
thr() { bench throughput "$@"; }
for step in "$@"; do
  echo "[$(date +%T)] === $step"
  case $step in
    lat)
      for r in 1 2; do
        lat "before$r" before int4
        lat "after$r" after int4
        lat "kn$r" after int4 TOKENLOOM_INT4_ROW_MAJOR=0
      done ;;
    latbf16) lat bf16 after none ;;
    thr)
      thr before before int4
      thr after after int4
      thr kn after int4 TOKENLOOM_INT4_ROW_MAJOR=0 ;;
    tests)
      PYTHONPATH=/tmp/after:/tmp/site timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int4_row_major.py tests/plugins/quant/test_int4_gemv_nk.py \
        tests/plugins/quant/test_int4_gemv_mma.py \
        tests/plugins/quant/test_weight_gemm.py tests/plugins/quant/test_dequant.py \
        > "$OUT/gpu-tests.log" 2>&1
      echo "tests rc=$?"; tail -n 4 "$OUT/gpu-tests.log" ;;
    gputests|gpuquant|gpumodels)  # every GPU test of the quant methods and/or the models
      # (both together ran past 470 s in session 23: 477 passed by then; one call each fits)
      dirs="tests/plugins/quant tests/plugins/models"
      [ "$step" = gpuquant ] && dirs=tests/plugins/quant
      [ "$step" = gpumodels ] && dirs=tests/plugins/models
      PYTHONPATH=/tmp/after:/tmp/site timeout 470 python3 -m pytest -q -m gpu -p no:cacheprovider --maxfail=20 \
        $dirs > "$OUT/gpu-tests-$step.log" 2>&1
      echo "$step rc=$?"; tail -n 6 "$OUT/gpu-tests-$step.log" ;;
    ncustall)  # what the warps stall on: int4 nk and mma against int8 nk (unrun; the
      # stall metrics' names are the WarpStateStats section's, not checked on this host)
      PYTHONPATH=/tmp/after:/tmp/site timeout 500 ncu --clock-control none \
        -k "regex:int4_gemv_nk|int4_gemv_mma|int8_gemv_nk" -c 24 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 scripts/gpu/int4_nk_once.py --all > "$OUT/ncu-stall.log" 2>&1
      echo "ncustall rc=$?"
      grep -E "gemv_.*_kernel|Duration|DRAM Throughput" "$OUT/ncu-stall.log" | head -80 ;;
    latcold)  # TOKENLOOM_TUNE_COLD=1 (unmeasured): the tuner timing over HBM, not L2
      for r in 1 2; do lat "hot$r" after int4; lat "cold$r" after int4 TOKENLOOM_TUNE_COLD=1; done ;;
    samebytes)  # the bf16 GEMV over the int4 weight's bytes in rows of its length (unrun)
      PYTHONPATH=/tmp/after:/tmp/site timeout 300 python3 scripts/gpu/gemv_bench.py --bits 4 \
        --rows 1 --cold --same-bytes --json "$OUT/gemv4-same-bytes.json" > "$OUT/gemv4-sb.log" 2>&1
      grep -E "same bytes|per layer|^int4" "$OUT/gemv4-sb.log" | tail -12 ;;
    lat4)  # session 21: int4 before/after alternated twice, bf16 once each
      for r in 1 2; do lat "int4-before$r" before int4; lat "int4-after$r" after int4; done
      lat bf16-before before none; lat bf16-after after none ;;
    thr4) thr int4-before before int4; thr int4-after after int4 ;;
    lat23a|lat23b)  # session 23: int4 before / after / after without the fused SiLU, bf16
      r=${step: -1}
      lat "int4-before-$r" before int4; lat "int4-after-$r" after int4
      lat "int4-nosilu-$r" after int4 TOKENLOOM_INT4_FUSED_SILU=0
      [ "$r" = a ] && lat bf16-after after none || lat bf16-before before none ;;
    t24)  # session 24: the decode step's edges (graph inputs, token store, copies, rope)
      PYTHONPATH=/tmp/after:/tmp/site timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/executor tests/plugins/attention tests/plugins/models/test_layers.py \
        tests/plugins/models/test_fused_ops.py tests/plugins/quant/test_int4_gemv_nk.py \
        > "$OUT/gpu-tests-24.log" 2>&1
      echo "t24 rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-24.log" | head -8
      tail -n 2 "$OUT/gpu-tests-24.log" ;;
    lat24a|lat24b)  # session 24: int4 and bf16, before / after, alternated
      r=${step: -1}
      lat "int4-before-$r" before int4; lat "int4-after-$r" after int4
      lat "bf16-before-$r" before none; lat "bf16-after-$r" after none ;;
    lat24c)  # session 24, second pass: int4 before / after (the graph output kept), twice
      for r in 1 2; do lat "int4-before-c$r" before int4; lat "int4-after-c$r" after int4; done ;;
    attn24)  # session 24: fewer decode KV splits at batch 1 (int4, this tree)
      for opt in max_num_splits=1 max_num_splits=2 decode_min_split_tokens=128 \
          decode_min_split_tokens=256; do
        PYTHONPATH=/tmp/after:/tmp/site timeout 200 python3 -m tokenloom bench latency \
          --model llama-3-8b --quant int4 --runs 3 --plugin-option "triton.$opt" \
          --out "$OUT/lat-attn-$opt.json" > "$OUT/lat-attn-$opt.log" 2>&1 \
          || tail -3 "$OUT/lat-attn-$opt.log"
        python3 -c "import json; print('attn $opt', round(json.load(open('$OUT/lat-attn-$opt.json'))['step_ms'], 4))"
      done ;;
    t24b)  # session 24: the q/k/v GEMV's rope epilogue on the GPU
      PYTHONPATH=/tmp/after:/tmp/site timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int4_qkv_rope.py > "$OUT/gpu-tests-24b.log" 2>&1
      echo "t24b rc=$?"; grep -E "^FAILED|^ERROR|Error" "$OUT/gpu-tests-24b.log" | head -8
      tail -n 2 "$OUT/gpu-tests-24b.log" ;;
    thr24b) thr int4-before before int4; thr int4-after after int4 ;;
    t27)  # session 27: int8's one-row epilogues (SiLU, rope) and early release; the PDL chain
      PYTHONPATH=/tmp/after:/tmp/site timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int8_epilogues.py tests/plugins/models/test_pdl.py \
        tests/plugins/quant/test_int4_qkv_rope.py > "$OUT/gpu-tests-27.log" 2>&1
      echo "t27 rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-27.log" | head -8
      tail -n 2 "$OUT/gpu-tests-27.log" ;;
    lat27)  # session 27: int8 before / after alternated twice; after's parts; bf16 and int4
      for r in 1 2; do
        lat "int8-before-$r" before int8
        lat "int8-after-$r" after int8
      done
      lat int8-after-noepi after int8 TOKENLOOM_INT8_EPILOGUES=0
      lat int8-after-noearly after int8 TOKENLOOM_O_EARLY_RELEASE=0
      lat bf16-after after none
      lat int4-after after int4 ;;
    thr27)  # session 27: offline throughput before / after, int8, int4 and bf16
      for q in int8 int4 none; do thr "$q-before" before $q; thr "$q-after" after $q; done ;;
    crash27)  # session 27: bf16 bench latency --prompt-len 2048 hit a device-side assert
      # (an embedding index out of range) in long27; which settings and lengths do
      one() {  # one TAG TIMEOUT ARGS...: a short bench latency run, ok or its error
        local tag=$1 t=$2; shift 2
        env PYTHONPATH=/tmp/after:/tmp/site timeout "$t" python3 -m tokenloom bench latency \
          --model llama-3-8b --runs 1 --output-len 32 --out "$OUT/crash-$tag.json" "$@" \
          > "$OUT/crash-$tag.log" 2>&1 && echo "crash27 $tag ok" || {
          echo "crash27 $tag FAILED"; grep -v "Assertion\|^frame" "$OUT/crash-$tag.log" \
            | grep -E "File|Error|assert" | tail -4; }
      }
      one p2048 120 --prompt-len 2048
      CUDA_LAUNCH_BLOCKING=1 one p2048-blocking 120 --prompt-len 2048
      one p2048-sync 90 --prompt-len 2048 --no-async-scheduling
      one p2048-eager 90 --prompt-len 2048 --enforce-eager
      for len in 2047 2049 1024 4096 3000; do one "p$len" 60 --prompt-len $len; done
      one p2048-int8 90 --prompt-len 2048 --quant int8 ;;
    head28)  # session 28: int4 with its own 4-bit LM head against the default int8 head
      lat int4-head8 after int4
      BENCH_ARGS="--quant-lm-head" lat int4-head4 after int4 ;;
    s28)  # session 28: the side uploads made at capture: GPU tests, a long prompt's decode,
      # bench latency and throughput before (a62f77a) / after
      PYTHONPATH=/tmp/after:/tmp/site timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/executor/test_gpu_modes.py tests/plugins/executor/test_graph_inputs.py \
        > "$OUT/gpu-tests-s28.log" 2>&1
      echo "s28 tests rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-s28.log" | head -5
      tail -n 1 "$OUT/gpu-tests-s28.log"
      BENCH_ARGS="--prompt-len 2048 --output-len 32" lat bf16-p2048 after none
      lat bf16-before before none
      lat bf16-after after none
      lat int4-after after int4
      thr bf16-before before none
      thr bf16-after after none ;;
    t28b)  # session 28: the uploads' tests on the fix, then the ordering test without it
      PYTHONPATH=/tmp/after:/tmp/site timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/executor/test_graph_inputs.py > "$OUT/gpu-tests-t28b-uploads.log" 2>&1
      echo "t28b rc=$?"; grep -E "^FAILED|^ERROR|assert" "$OUT/gpu-tests-t28b-uploads.log" | head -8
      tail -n 1 "$OUT/gpu-tests-t28b-uploads.log"
      rm -rf /tmp/nowait && cp -r /tmp/after /tmp/nowait
      sed -i '/self.stream.wait_stream(torch.cuda.current_stream(device))/d' \
        /tmp/nowait/tokenloom/plugins/executor/graph_inputs.py
      grep -c "wait_stream" /tmp/nowait/tokenloom/plugins/executor/graph_inputs.py
      PYTHONPATH=/tmp/nowait:/tmp/site timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/executor/test_graph_inputs.py -k first_upload > "$OUT/gpu-tests-28-nowait2.log" 2>&1
      echo "without the wait (ordering test must fail): rc=$?"
      grep -E "^FAILED|passed|failed" "$OUT/gpu-tests-28-nowait2.log" | tail -3 ;;
    t28)  # for session 28: session 27's review fixes and the uploads test, unrun on a GPU;
      # then the uploads test against a copy without the fix's wait, where it must fail
      PYTHONPATH=/tmp/after:/tmp/site timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int8_epilogues.py tests/plugins/models/test_pdl.py \
        tests/plugins/executor/test_graph_inputs.py tests/plugins/quant/test_int4_qkv_rope.py \
        > "$OUT/gpu-tests-28.log" 2>&1
      echo "t28 rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-28.log" | head -8
      tail -n 1 "$OUT/gpu-tests-28.log"
      # int4's one-row entry points (moved into common.OneRowEpilogueKernel, session 27)
      PYTHONPATH=/tmp/after:/tmp/site timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int4_gemv_nk.py -k "fuses or silu" > "$OUT/gpu-tests-28b.log" 2>&1
      echo "t28b rc=$?"; tail -n 1 "$OUT/gpu-tests-28b.log"
      rm -rf /tmp/nowait && cp -r /tmp/after /tmp/nowait
      sed -i '/self.stream.wait_stream(torch.cuda.current_stream(device))/d' \
        /tmp/nowait/tokenloom/plugins/executor/graph_inputs.py
      PYTHONPATH=/tmp/nowait:/tmp/site timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/executor/test_graph_inputs.py -k first_upload > "$OUT/gpu-tests-28-nowait.log" 2>&1
      echo "without the wait (must fail): rc=$?"; tail -n 1 "$OUT/gpu-tests-28-nowait.log" ;;
    fix27)  # session 27: the side uploads' first copy after the compute stream (the fix)
      one() {
        local tag=$1 t=$2; shift 2
        env PYTHONPATH=/tmp/after:/tmp/site timeout "$t" python3 -m tokenloom bench latency \
          --model llama-3-8b --runs 1 --output-len 32 --out "$OUT/fix-$tag.json" "$@" \
          > "$OUT/fix-$tag.log" 2>&1 && echo "fix27 $tag ok" || echo "fix27 $tag FAILED"
      }
      one p2048 90 --prompt-len 2048
      for tree in after before; do
        PYTHONPATH=/tmp/$tree:/tmp/site timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider \
          tests/plugins/executor/test_graph_inputs.py > "$OUT/gpu-tests-27-uploads-$tree.log" 2>&1
        echo "uploads test on $tree: rc=$?"; tail -n 1 "$OUT/gpu-tests-27-uploads-$tree.log"
      done
      one p3000 60 --prompt-len 3000
      one p2047 60 --prompt-len 2047
      lat bf16-fix after none ;;
    long27)  # session 27: the o early release at long contexts (unmeasured before), on / off
      for len in 7800 2048; do
        for q in int4 none; do
          BENCH_ARGS="--prompt-len $len" lat "$q-o1-p$len" after $q TOKENLOOM_O_EARLY_RELEASE=1
          BENCH_ARGS="--prompt-len $len" lat "$q-o0-p$len" after $q TOKENLOOM_O_EARLY_RELEASE=0
        done
      done ;;
    t26o)  # session 26: the o projection's GEMV releasing before its wait (the next session
      # runs it first: the early release stays off by default until it passes)
      TOKENLOOM_O_EARLY_RELEASE=1 PYTHONPATH=/tmp/after:/tmp/site timeout 300 python3 -m pytest \
        -q -m gpu -p no:cacheprovider \
        tests/plugins/models/test_pdl.py tests/plugins/models/test_llama_cuda.py \
        tests/plugins/executor/test_gpu_modes.py tests/plugins/models/test_skinny_gemm.py \
        > "$OUT/gpu-tests-26o.log" 2>&1
      echo "t26o rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-26o.log" | head -8
      tail -n 2 "$OUT/gpu-tests-26o.log" ;;
    lat26o)  # session 26: the o projection's early release on / off, int4 twice, bf16
      for r in 1 2; do
        lat "int4-o1-$r" after int4 TOKENLOOM_O_EARLY_RELEASE=1
        lat "int4-o0-$r" after int4 TOKENLOOM_O_EARLY_RELEASE=0
      done
      lat bf16-o1 after none TOKENLOOM_O_EARLY_RELEASE=1
      lat bf16-o0 after none TOKENLOOM_O_EARLY_RELEASE=0 ;;
    # t26, lat26a/b/c, thr26 and prof26: session 26's experiment, the add+norm folded into
    # the int4 GEMV's prologue (TOKENLOOM_INT4_FUSED_NORM, TOKENLOOM_INT4_NORM_TILE), measured
    # slower and removed: they need its tree, `git checkout a71c5eb` (docs/quantization.md)
    prof26)  # the int4 step's profile with the norms folded and without
      for fold in 1 0; do
        TOKENLOOM_INT4_FUSED_NORM=$fold OUT=$OUT PYTHONPATH=/tmp/after:/tmp/site:scripts \
          timeout 200 python3 scripts/profile_gpu.py llama-3-8b graphs quant=int4 \
          > "$OUT/prof-int4-fold$fold.log" 2>&1
        grep -A12 "critical path per step" "$OUT/prof-int4-fold$fold.log"
      done ;;
    t26)  # session 26: the add+norm in the int4 GEMV's prologue; the paths around it
      PYTHONPATH=/tmp/after:/tmp/site timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int4_add_norm.py tests/plugins/quant/test_int4_qkv_rope.py \
        tests/plugins/quant/test_int4_gemv_nk.py tests/plugins/models/test_pdl.py \
        tests/plugins/models/test_fused_gemv.py tests/plugins/models/test_llama_cuda.py \
        tests/plugins/executor/test_gpu_modes.py > "$OUT/gpu-tests-26.log" 2>&1
      echo "t26 rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-26.log" | head -8
      tail -n 2 "$OUT/gpu-tests-26.log" ;;
    lat26a|lat26b)  # session 26: int4 before, then the norms folded: none, q/k/v's, gate/up's, both
      r=${step: -1}
      lat "int4-before-$r" before int4
      for fold in 0 qkv gate_up 1; do
        lat "int4-fold-$fold-$r" after int4 TOKENLOOM_INT4_FUSED_NORM=$fold
      done ;;
    lat26c)  # session 26: both norms folded over wider tiles; a control; before
      lat int4-fold-1-t32w8 after int4 TOKENLOOM_INT4_NORM_TILE=32,4096,8
      lat int4-fold-1-t32w4 after int4 TOKENLOOM_INT4_NORM_TILE=32,4096,4
      lat int4-fold-0-c after int4 TOKENLOOM_INT4_FUSED_NORM=0
      lat int4-before-c before int4 ;;
    thr26) thr int4-before before int4; thr int4-after after int4 TOKENLOOM_INT4_FUSED_NORM=0 ;;
    t25)  # session 25: the rotation rounded once (both rope kernels), the norm's early release
      PYTHONPATH=/tmp/after:/tmp/site timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int4_qkv_rope.py tests/plugins/models/test_pdl.py \
        tests/plugins/models/test_fused_ops.py tests/plugins/models/test_llama_cuda.py \
        tests/plugins/executor/test_gpu_modes.py > "$OUT/gpu-tests-25.log" 2>&1
      echo "t25 rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-25.log" | head -8
      tail -n 2 "$OUT/gpu-tests-25.log" ;;
    lat25a)  # session 25: int4 before / after / after with the rope epilogue
      lat int4-before before int4; lat int4-after after int4
      lat int4-after-rope after int4 TOKENLOOM_INT4_FUSED_ROPE=1 ;;
    lat25c)  # session 25: the norm's early release on / off (rope epilogue on), bf16 too
      for r in 1 2; do
        lat "int4-rope-early0-$r" after int4 TOKENLOOM_INT4_FUSED_ROPE=1 TOKENLOOM_NORM_EARLY_RELEASE=0
        lat "int4-rope-early1-$r" after int4 TOKENLOOM_INT4_FUSED_ROPE=1
        lat "int4-before-$r" before int4
      done
      lat bf16-before before none; lat bf16-early0 after none TOKENLOOM_NORM_EARLY_RELEASE=0
      lat bf16-early1 after none ;;
    lat25b)  # session 25: bf16 before / after, int4 again
      lat bf16-before before none; lat bf16-after after none
      lat int4-before-b before int4; lat int4-after-b after int4 ;;
    latrope)  # the q/k/v GEMV's rope epilogue (off by default), on against off, this tree
      for r in 1 2; do
        lat "int4-rope-off-$r" after int4; lat "int4-rope-on-$r" after int4 TOKENLOOM_INT4_FUSED_ROPE=1
      done ;;
    thr24)  # session 24: offline throughput, bf16 and int4, before / after
      thr bf16-before before none; thr bf16-after after none
      thr int4-before before int4; thr int4-after after int4 ;;
    attn23)  # session 23: the decode attention's knobs at batch 1 (int4, this tree)
      for opt in none decode_block_n=32 decode_block_n=16 decode_num_warps=2 max_num_splits=8 \
          decode_rope_min_batch=1; do
        extra=(); [ "$opt" != none ] && extra=(--plugin-option "triton.$opt")
        PYTHONPATH=/tmp/after:/tmp/site timeout 200 python3 -m tokenloom bench latency \
          --model llama-3-8b --quant int4 --runs 3 "${extra[@]}" --out "$OUT/lat-attn-$opt.json" \
          > "$OUT/lat-attn-$opt.log" 2>&1 || tail -3 "$OUT/lat-attn-$opt.log"
        python3 -c "import json; print('attn $opt', round(json.load(open('$OUT/lat-attn-$opt.json'))['step_ms'], 4))"
      done ;;
    t23)  # session 23: the one-row int4 GEMV (SiLU in the epilogue, one stage) on the GPU
      PYTHONPATH=/tmp/after:/tmp/site timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int4_gemv_nk.py tests/plugins/quant/test_int4_row_major.py \
        tests/plugins/models/test_fused_gemv.py > "$OUT/gpu-tests-23.log" 2>&1
      echo "t23 rc=$?"; grep -E "^FAILED|Error" "$OUT/gpu-tests-23.log" | head -8
      tail -n 2 "$OUT/gpu-tests-23.log" ;;
    t21)  # session 21: the int4 one-row GEMV's GPU tests (dp4a, the register cap)
      PYTHONPATH=/tmp/after:/tmp/site timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int4_gemv_nk.py > "$OUT/gpu-tests-21.log" 2>&1
      echo "t21 rc=$?"; tail -n 2 "$OUT/gpu-tests-21.log" ;;
    t22)  # session 22: the one-row int4 GEMVs' GPU tests (nk: K a constant, even tiles; mma)
      PYTHONPATH=/tmp/after:/tmp/site timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/quant/test_int4_gemv_nk.py tests/plugins/quant/test_int4_gemv_mma.py \
        tests/plugins/quant/test_int4_row_major.py > "$OUT/gpu-tests-22.log" 2>&1
      echo "t22 rc=$?"; grep -E "^FAILED|Error" "$OUT/gpu-tests-22.log" | head -8
      tail -n 2 "$OUT/gpu-tests-22.log" ;;
    gemvafter)
      PYTHONPATH=/tmp/after:/tmp/site timeout 280 python3 scripts/gpu/gemv_bench.py --bits 4 \
        --rows 1 --cold --json "$OUT/gemv4-after.json" > "$OUT/gemv4-after.log" 2>&1
      echo "gemv after rc=$?"; grep -E "WRONG|m=1:" "$OUT/gemv4-after.log" | head -12 ;;
    gemvab)  # session 21: int4 one-row GEMVs, the BEFORE tree against this one (dp4a, one tile)
      for tree in before after; do
        PYTHONPATH=/tmp/$tree:/tmp/site timeout 280 python3 scripts/gpu/gemv_bench.py --bits 4 \
          --rows 1 --cold --json "$OUT/gemv4-$tree.json" > "$OUT/gemv4-$tree.log" 2>&1
        echo "gemv $tree rc=$?"; grep -E "WRONG|skip|m=1:" "$OUT/gemv4-$tree.log" | head -12
      done ;;
    gemv4)
      PYTHONPATH=/tmp/after:/tmp/site timeout 300 python3 scripts/gpu/gemv_bench.py --bits 4 \
        --rows 1 --cold --int4-layout nk --json "$OUT/gemv4-nk.json" > "$OUT/gemv4-nk.log" 2>&1
      grep -E "per layer|^  " "$OUT/gemv4-nk.log" | tail -12 ;;
    ncu)
      PYTHONPATH=/tmp/after:/tmp/site timeout 400 ncu --clock-control none -k regex:int4_gemv_nk \
        -c 8 --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
        python3 scripts/gpu/int4_nk_once.py > "$OUT/ncu.log" 2>&1
      echo "ncu rc=$?"
      grep -E "Duration|Throughput|Executed Ipc|Stall|Registers|Achieved Occupancy|Warp Cycles" \
        "$OUT/ncu.log" | head -80 ;;
    latab)  # session 20 (decode prefetch, greedy argmax): bf16 and int4, alternated
      for r in 1 2; do
        for q in none int4; do lat "$q-before$r" before $q; lat "$q-after$r" after $q; done
      done ;;
    thrab) for q in none int4; do thr "$q-before" before $q; thr "$q-after" after $q; done ;;
    gpu20)  # the GPU tests of what session 20 touched
      PYTHONPATH=/tmp/after:/tmp/site timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/plugins/attention tests/plugins/executor/sampling tests/plugins/models/test_pdl.py \
        tests/plugins/executor/test_gpu_modes.py > "$OUT/gpu-tests-20.log" 2>&1
      echo "gpu20 rc=$?"; tail -n 3 "$OUT/gpu-tests-20.log" ;;
    sample)
      OUT=$OUT PYTHONPATH=/tmp/after:/tmp/site timeout 120 python3 scripts/gpu/sample_bench.py \
        --batches 1,8,64,256 2>&1 | grep argmax ;;
    prof)
      OUT=$OUT PYTHONPATH=/tmp/after:/tmp/site:scripts timeout 200 python3 scripts/profile_gpu.py \
        llama-3-8b graphs quant=int4 > "$OUT/prof-int4-after.log" 2>&1
      grep -A14 "critical path per step" "$OUT/prof-int4-after.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
