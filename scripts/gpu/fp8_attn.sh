#!/usr/bin/env bash
# Session 29, issue 12 (written then, not yet run: no device time was left): the fp8
# cache's transposed value pages and the fp8-MMA decode kernel, opt-in with
# [plugin.triton] decode_fp8_mma = 1 (plugins/attention/triton_kernels/decode_fp8_mma.py),
# on one H200, against a BEFORE tree (the f16-converting kernel over values as stored).
# Prepare here:   git archive REV > .snap/before.tar ; ../shared/tools/gpu-wheels .whl
# On the device:  bash scripts/gpu/fp8_attn.sh STEP...   (carry [".snap", ".whl"])
# Steps (each call must end within 600 s):
#   t29     every GPU test of the attention backends (the fp8-MMA kernel, eager and in a
#           CUDA graph; the f16 kernels over both fp8 layouts; the stale-NaN slots), and the
#           graph-input uploads' tests (session 28's revised ordering test, unrun on a GPU)
#   kern29  decode attention per layer over an fp8 cache at Llama-3-8B heads
#           (scripts/gpu/kvq_decode_bench.py): before; after (the default, unchanged); the
#           fp8-MMA kernel (decode_fp8_mma=1) with its stage / register variants
#   wide29  issue 12's workload (fp8 weights + fp8 KV, 600 x 1000/1000, all at once):
#           before, after, after with decode_fp8_mma=1
#   kern32 / wide32 / lat32: session 32's shorter forms (device time was scarce)
#   t33 / kern33 / wide33 / lat33 / prof33: session 33's sweep of the fp8-MMA kernel's
#           settings, the workload with the best, a profile
#   kern35 / wide35 / lat35: session 35's sweep of the stages that pipeline its copies (9
#           settings, about 80 s on an H100), the workload and batch 1 with its best
#           ($OUT/best35 from kern35 in the same call, else the BEST35 environment variable)
#   kern36 / wide36: session 36's sweep on the H200 (kern35's overlap, 3-5 buffers, 64-
#           and 128-token tiles), the workload with its best ($OUT/best36, else BEST36)
#   t36     the attention modules' GPU tests (-m gpu), the CUDA-when-there modules included
#   pre37 / wide37: session 37's sweep of the prefill kernel's tiles (bf16 and fp8 caches,
#           the workload's 8 x 1,000-token chunks), the workload with its best ($OUT/best37,
#           else BEST37)
#   ba37    fp8 weights + fp8 KV bench latency / throughput, before / after (session 37)
#   t38 / kern38 / wide38: session 38's one reduction a tile (decode_fp8_fold): the fp8-MMA
#           kernel's tests on the GPU, a sweep with it at MMA_DECODE's and wider tiles, the
#           workload with the sweep's best ($OUT/best38, else BEST38) against the default
#   ba38    fp8 weights + fp8 KV bench latency / throughput, before / after (session 38)
#   ncu38   ncu's stall reasons of the fp8-MMA decode, unfolded and folded (an H100: ncu reads
#           no counters on the H200s' gVisor hosts); ncusrc38 the same per SASS instruction
#   kern38d / wide38d: 5 stages without the block numbers ahead (unrun), the workload with it
#   ovl38   scripts/gpu/overlap_probe.py: does the decode attention overlap the fp8 GEMMs (unrun)
#   ovl39   the decode step as one chain against two half-batch chains on two streams
#   t39 / fresh39: session 39's GPU tests of prefill_fresh_16bit, and the workload with it
#           against none (interleaved, two pairs)
#   t39q / fold39 / ba39: the fp8 activation quantization folded into the norm and
#           SiLU-and-mul (TOKENLOOM_FP8_FOLD_QUANT): GPU tests, the workload off / on, bench
#           latency / throughput before / after
#   auto40  session 40's steps for whichever GPU comes (see below)
#   auto41  session 41: t41, green41, then the engine with the best N (mbg41; on an H200 mbw41)
#   auto42  session 42: t39, then on an H200 fold39 (PAIRS=1) and freshw42 (the workload with the
#           fresh prefill), elsewhere fresh42 (the default workload, fresh prefill off / on)
#   auto42b t42 (test_int4_gemv_nk.py whole), then on an H200 wide42 and freshw42
#   t43     four quant test files whole (CUDA where present), failures named (-rf)
#   auto43  session 43: t44 (test_weight_gemm.py whole), then on an H200 wide42 and freshw42,
#           elsewhere t44m (tests/plugins/models and executor whole, -v, T44M seconds)
#   t44n    the part of t44m that its 330 s did not reach (T44N seconds)
#   t45     t44n's six failures (fixed in the tests, unrun on a GPU) and the executor files
#           t44n did not reach
#   ao45    session 45: the act-order gather's cost at one row (scripts/gpu/act_order_bench.py)
#   t47     session 45: test_checkpoints.py on the GPU (compressed-tensors among them)
#   auto46  session 46: on an H200 wide42, freshw42, ao45; elsewhere ao45, t47
#   t53     session 53: the 8-bit caches' tests (test_kv_quant*.py) on the GPU
#   i8pg53  an int8 cache in pages of 16 against 64: decode per layer, benches
#   sck53 / ba53 / lean53: session 53's head-major scales (not landed: no device time
#           was left to time them), before / after: first `git archive HEAD > .snap/before.tar`,
#           then `git apply scripts/gpu/session53-scales-head-major.patch` (the working tree is
#           the after); sck53 the decode and prefill per layer, ba53 bench latency and
#           throughput, lean53 a shorter form
#   (session 55 landed the head-major scales with the prefill look-ahead's fix: the patch
#   file is gone; sck53 / ba53 / t54 compare any .snap/before.tar with the tree)
#   auto55  session 55: the head-major patch with its look-ahead fixed (applied as auto54's):
#           t54 (its GPU tests, the poisoned-table test among them), then on an H200 lb54
#           (bench latency bf16 / int4 on main), elsewhere ba53 with KVS=fp8; the second
#           call (auto55b) ba53 KVS=int8, and on an H200 wideb54
#   ncu55   session 55: ncu over the int8 decode (128 rows x 1,500, pages of 16), token-major
#           scales (.snap/tok.tar: git archive 0599390) against the tree's head-major, twice
#   auto54  session 54 (ran once on an H100: ba53 no regression, t54 an illegal memory
#           access in the prefill with the patch applied, docs/quantization.md): first `git
#           archive HEAD > .snap/before.tar && git apply
#           scripts/gpu/session53-scales-head-major.patch`. On an H200 wideb54 lb54 (the
#           issue's workload, bench latency bf16 / int4, on main = .snap/before.tar), then
#           in a second call ba53 t54; elsewhere ba53 t54 (the head-major scales before /
#           after; t54 the attention backend's GPU tests on the patched tree)
#   auto53  session 53: on an H200 wide52 l47 t53 (the workload, bench latency bf16 / int4,
#           the 8-bit caches' tests); elsewhere t53 pre52b
#   auto49  session 49: t49 (its two premises fixed); on an H200 then wide42 and l47
#           (bf16, int4)
#   auto48  session 48: t49 (quantize --device cuda's tests), ba46l, then wide42 on an H200,
#           else ba46t (before = .snap/before.tar, 1fbef6c)
#   auto47  session 47: on an H200 wide42, freshw42; elsewhere t48, ao45, ba46l (before =
#           .snap/before.tar, 9089b60: o's gather re-landed after it). lat47: bench
#           latency bf16 / int4 / int8 on today's tree (QS)
#   auto46b session 46's act-order fold: ao45 (now the chains: plain, gather, folded), t48
#           (its GPU tests), ba46l (bench latency bf16 / int4 before / after); ba46t the
#           default workload's bench throughput before / after (QS, default bf16)
#   t46     t45's three failures (fixed in the tests), test_spec_gpu.py, test_checkpoints.py
#   ba44l / ba44t: bench latency / throughput, int4 and int8, before (.snap) / after (session
#           43's weight_gemm fallback tilings; the served groups' tilings unchanged)
#   t41     the micro-batch GPU tests, plain streams and green contexts
#   green41 green_probe.py --green N --pipeline: attention on N SMs (a green context) beside
#           the GEMMs on the rest, and two half batches pipelined over the partitions
#   mbg41 / mbw41: the default / the issue's workload, micro-batches off, and on with the
#           attention on SMS SMs (MB: the smallest bucket split)
#   t40 / mbt40 / mb40 / ba40: session 40's two micro-batches a decode step ([plugin.model]
#           micro_batch_min, opt-in): its GPU tests; the default workload and the issue's
#           workload with it off / on (MB: the smallest bucket split, TURNS=0: no turns);
#           fp8 bench latency / throughput before / after (the default path: no change)
#   (since session 37 the fp8 defaults are MMA_DECODE's and FP8_PREFILL's: kern36's and
#   wide36's "default" is then kern36's best, and pre37's before variants set 3 stages)
#   ba35    fp8 weights + fp8 KV bench latency / throughput, before / after
#   bf29    bf16 bench latency and throughput, before / after (kernels touched: no change
#           expected on a 16-bit cache)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENLOOM_LOG_LEVEL=INFO TOKENLOOM_CACHE=/tmp/tlcache
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site .whl/*.whl || exit 1
inst() {  # inst SRC DEST: a non-editable install of one tree, chosen per call by PYTHONPATH
  rm -rf "$2"
  python3 -m pip install -q --no-index --no-build-isolation --no-deps --no-compile --target "$2" \
    "$1" > /tmp/inst.log 2>&1 || { tail -5 /tmp/inst.log; exit 1; }
}
if [ ! -d /tmp/before ] || [ .snap/before.tar -nt /tmp/before ]; then
  rm -rf /tmp/before_src && mkdir -p /tmp/before_src && tar -xf .snap/before.tar -C /tmp/before_src
  inst /tmp/before_src /tmp/before
fi
inst . /tmp/after
py() { local tree=$1; shift; PYTHONPATH=/tmp/$tree:/tmp/site python3 "$@"; }
bench() {  # bench latency|throughput TAG TREE QUANT [ARGS...]: one bench, its figure
  local kind=$1 tag=$2 tree=$3 q=$4; shift 4
  local name=${kind:0:3} runs=3 limit=200
  [ "$kind" = throughput ] && runs=1 limit=300
  py "$tree" -m tokenloom bench "$kind" --model llama-3-8b --quant "$q" --runs $runs \
    --out "$OUT/$name-$tag.json" "$@" > "${LOGS:-$OUT}/$name-$tag.log" 2>&1 \
    || { echo "$name $tag failed"; tail -5 "${LOGS:-$OUT}/$name-$tag.log"; }
  python3 -c "import json; d = json.load(open('$OUT/$name-$tag.json')); \
print('$name $tag', round(d['step_ms'], 4) if '$name' == 'lat' else \
round(d['tokenloom']['output_tokens_per_s'], 1))" 2>/dev/null
}
kern() {  # kern TAG TREE [--setting K=V...]: the fp8 decode per layer (the tree's own script)
  local script=scripts/gpu/kvq_decode_bench.py
  [ "$2" = before ] && script=/tmp/before_src/$script
  timeout 150 env PYTHONPATH=/tmp/$2:/tmp/site python3 "$script" --kv fp8 \
    --batches 1,32,128,512 --contexts 1500 --json "$OUT/kern-$1.json" "${@:3}" \
    > "$OUT/kern-$1.log" 2>&1 || { echo "kern $1 failed"; tail -3 "$OUT/kern-$1.log"; }
  sed "s/^/kern $1: /" "$OUT/kern-$1.log" | grep batch
}
sweep() {  # sweep N CFG...: the fp8-MMA decode per layer at 128 and 512 rows for each
  # setting (bn tile, st stages, w warps, r register cap, ma block numbers a tile ahead,
  # f one cross-warp reduction a tile; "" the defaults); $OUT/bestN
  # holds the fastest at 512 rows as plugin options (scripts/gpu/pick33.py), or nothing
  local n=$1 cfg kv tag S; shift
  for cfg in "$@"; do
    S=(--setting decode_fp8_mma=1); tag=${cfg:-default}; tag=${tag//,/-}; tag=${tag//=/}
    for kv in ${cfg//,/ }; do
      case ${kv%%=*} in
        bn) S+=(--setting decode_block_n=${kv#*=}) ;;
        st) S+=(--setting decode_num_stages=${kv#*=}) ;;
        w) S+=(--setting decode_num_warps=${kv#*=}) ;;
        r) S+=(--setting decode_maxnreg=${kv#*=}) ;;
        ma) S+=(--setting decode_fp8_meta_ahead=${kv#*=}) ;;
        f) S+=(--setting decode_fp8_fold=${kv#*=}) ;;
      esac
    done
    timeout 120 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/kvq_decode_bench.py \
      --kv fp8 --contexts 1500 --batches 128,512 --json "$OUT/kern$n-$tag.json" "${S[@]}" \
      --page-size ${PAGE:-16} \
      > "$OUT/kern$n-$tag.log" 2>&1 || { echo "kern$n $tag failed"; tail -3 "$OUT/kern$n-$tag.log"; }
    echo "$tag ${S[*]}" >> "$OUT/kern$n-settings.txt"
    sed "s/^/kern$n $tag: /" "$OUT/kern$n-$tag.log" | grep batch
  done
  python3 scripts/gpu/pick33.py "$OUT" "kern$n" > "$OUT/best$n"; echo "best$n: $(cat "$OUT/best$n")"
}
pgk() {  # pgk PAGE TREE: the fp8 decode per layer over pages of PAGE tokens (today's script,
  # the TREE's package), batches 128 and 512 at context 1,500
  timeout 150 env PYTHONPATH=/tmp/$2:/tmp/site python3 scripts/gpu/kvq_decode_bench.py --kv ${KV:-fp8} \
    --batches 128,512 --contexts 1500 --page-size "$1" --json "$OUT/pg-$1-$2.json" \
    > "$OUT/pg-$1-$2.log" 2>&1 || { echo "pg $1 $2 failed"; tail -3 "$OUT/pg-$1-$2.log"; }
  sed "s/^/page $1 $2: /" "$OUT/pg-$1-$2.log" | grep batch
}
WIDE=(--kv-cache-dtype fp8 --num-prompts 600 --min-len 1000 --max-len 1000 --max-num-seqs 640
      --max-graph-batch 640)
if [ "${1:-}" = auto40 ]; then  # session 40 in one call on whichever GPU comes: the tests,
  # then on an H200 the issue's workload and the default one, micro-batches off / on;
  # elsewhere the default workload, before / after, and the chains probe at carveout 0
  # (the benches' logs stay on the machine: 8 files come back)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    set -- t40 mb40 mbt40
  else
    export CARVEOUTS=${CARVEOUTS:-0}; set -- t40 mbt40 ba40 ovl39
  fi
fi
if [ "${1:-}" = auto41 ]; then  # session 41 in one call on whichever GPU comes
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- green41 t41 pick41 mbg41  # an H200: the issue's workload instead of the default
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && set -- green41 t41 pick41 mbw41
fi
if [ "${1:-}" = auto42 ]; then  # session 42 on whichever GPU comes: the fresh prefill's GPU
  # tests, then on an H200 the issue's workload with the fold off / on and the fresh prefill;
  # elsewhere the default workload, the fresh prefill off / on (PAIRS pairs)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- t39 fresh42
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && set -- t39 fold39 freshw42
fi
if [ "${1:-}" = auto42b ]; then  # session 42's second call: the int4 row-major test fixed for
  # GPUs and the rest of its file; on an H200 then the issue's workload, default and fresh
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- t42
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && set -- t42 wide42 freshw42
fi
if [ "${1:-}" = auto43 ]; then  # session 43 on whichever GPU comes: the weight GEMM's
  # fallback tiling fixed (t44); on an H200 then the issue's workload, default and fresh;
  # elsewhere the model and executor tests whole (CUDA where present, never run so)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- t44 t44m
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && set -- t44 wide42 freshw42
fi
if [ "${1:-}" = auto46 ]; then  # session 46 on whichever GPU comes: on an H200 the issue's
  # workload (default, fresh prefill), then the act-order gather; elsewhere the gather and
  # the pre-quantized checkpoints' GPU tests (their readers now share one loop)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- ao45 t47
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && set -- wide42 freshw42 ao45
fi
if [ "${1:-}" = auto47 ]; then  # session 47: on an H200 the issue's workload on today's
  # defaults and with the fresh prefill; elsewhere o's gather: its tests, timing, benches
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- t48 ao45 ba46l
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && set -- wide42 freshw42
fi
if [ "${1:-}" = auto49 ]; then  # session 49: t49 again (its two premises fixed); on an H200
  # then the issue's workload and bench latency bf16 / int4 on today's tree
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- t49
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && QS="none int4" && \
    set -- t49 wide42 l47
fi
if [ "${1:-}" = auto55 ] || [ "${1:-}" = auto55b ]; then  # session 55 (see the header)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  h200=0; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && h200=1
  if [ "$1" = auto55 ]; then
    export KVS=fp8; set -- t54 ba53
    [ $h200 = 1 ] && QS="none int4" && set -- t54 lb54
  else
    export KVS=int8; set -- ba53
    [ $h200 = 1 ] && set -- wideb54
  fi
fi
if [ "${1:-}" = auto54 ]; then  # session 54: .snap/before.tar = main, the tree = main with
  # session 53's head-major scales applied. On an H200 the issue's workload and bench latency
  # bf16 / int4 on main (the H200 figures the issue asks for); elsewhere the scales' layout
  # before / after (ba53: bench latency and throughput, fp8 + fp8 KV and bf16 + int8 KV)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- ba53 t54
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && QS="none int4" && \
    set -- wideb54 lb54
fi
if [ "${1:-}" = auto53 ]; then  # session 53: on an H200 the issue's workload on today's
  # defaults, bench latency bf16 / int4, then the 8-bit caches' tests; elsewhere the tests
  # and the prefill per layer
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- t53 pre52b
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && QS="none int4" && \
    set -- wide52 l47 t53
fi
if [ "${1:-}" = auto52 ]; then  # session 52: on an H200 the issue's workload on today's
  # defaults, fp8 + fp8 KV bench latency / throughput with the prefill's look-ahead off /
  # on, bench latency bf16 / int4, the prefill per layer; elsewhere the benches off / on
  # (ah52, KVS) and the prefill per layer (pre52b)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- ah52 pre52b
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && QS="none int4" && \
    KVS=${KVS:-fp8} && set -- wide52 ah52 l47 pre52b
fi
if [ "${1:-}" = auto51 ]; then  # session 51: on an H200 the issue's workload with blocks of 16
  # and of 64 (an fp8 cache's default since session 51), then bench latency bf16 / int4;
  # elsewhere the attention and KV tests over pages of 16 to 128 (t51)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- t51
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && QS="none int4" && \
    set -- wpg51 l47
fi
if [ "${1:-}" = auto48 ]; then  # session 48: quantize --device cuda's tests (t49), bench
  # latency bf16 / int4 before (.snap/before.tar = 1fbef6c) / after (the model's fused ops
  # now also ask that no gradient be recorded); on an H200 then the issue's workload, else
  # bench throughput before / after
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- t49 ba46l ba46t
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && set -- t49 ba46l wide42
fi
if [ "${1:-}" = lat47 ]; then  # session 47: bench latency bf16 / int4 / int8 on today's tree
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- l47
fi
if [ "${1:-}" = auto46b ]; then  # session 46's act-order fold (the norm and SiLU-and-mul store
  # their columns in the weights' input order): its chains timed, its GPU tests, and bench
  # latency before / after (bf16, int4: both run the norm kernel, whose default is unchanged)
  export LOGS=/tmp/benchlogs; mkdir -p "$LOGS"
  set -- ao45 t48 ba46l
fi
for step in "$@"; do
  echo "[$(date +%T)] === $step"
  case $step in
    t44)  # t43's one failure (a fallback tiling over groups of 96 took 704 KB of shared
      # memory in fp32): test_weight_gemm.py whole
      py after -m pytest -q -rf -p no:cacheprovider tests/plugins/quant/test_weight_gemm.py \
        > "$OUT/a-t44.log" 2>&1
      echo "t44 rc=$?"; grep -E "^FAILED" "$OUT/a-t44.log" | head -12; tail -1 "$OUT/a-t44.log" ;;
    t44n)  # what t44m's 330 s did not reach: the model tests from test_pdl.py on, and
      # the executor's (-v, T44N seconds)
      M=tests/plugins/models
      timeout ${T44N:-420} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -v -rf \
        -p no:cacheprovider $M/test_pdl.py $M/test_random_weights.py $M/test_skinny_gemm.py \
        $M/test_streamed_load.py $M/test_tuning_cache.py tests/plugins/executor \
        > "$OUT/a-t44n.log" 2>&1
      echo "t44n rc=$?"; grep -E "FAILED|ERROR" "$OUT/a-t44n.log" | head -12
      grep -cE " PASSED" "$OUT/a-t44n.log"; tail -1 "$OUT/a-t44n.log" ;;
    ao45)  # session 45: what the act-order input gather costs at one row (4 projections)
      py after scripts/gpu/act_order_bench.py --out "$OUT/ao45.json" ;;
    t48)  # session 46: the fused norm / SiLU-and-mul kernels in an input order (bf16 on the
      # GPU), and the act-order checkpoints end to end (the fold taken, tokens as the twin)
      timeout ${T48:-240} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -rfs \
        -p no:cacheprovider tests/plugins/models/test_fused_ops.py tests/plugins/models/test_pdl.py \
        tests/plugins/quant/test_checkpoints.py > "$OUT/a-t48.log" 2>&1
      echo "t48 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/a-t48.log" | head -8; tail -1 "$OUT/a-t48.log" ;;
    pg51)  # session 51: the fp8-MMA decode over pages of 16, 32 and 64 tokens (pages of whole
      # tiles load one block number a tile), and over pages of 64 with the tree before (a
      # block number loaded per token)
      for pg in 16 32 64; do pgk $pg after; done; pgk 64 before; pgk 16 before ;;
    pg51b)  # the decode per layer (bf16, fp8 and int8 caches) over pages of 16, 64 and 128
      # tokens (the scalar block number fixed: one return), then the prefill (8 x 1,000)
      for pg in 16 64 128; do KV=auto,fp8,int8 pgk $pg after; done
      for pg in 16 64; do
        timeout 120 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/kvq_prefill_bench.py \
          --kv auto,fp8 --page-size $pg --json "$OUT/pre51-$pg.json" > "$OUT/pre51-$pg.log" 2>&1 \
          || { echo "pre51 $pg failed"; tail -3 "$OUT/pre51-$pg.log"; }
        sed "s/^/prefill page $pg: /" "$OUT/pre51-$pg.log" | grep -E "us|failed" | head -4
      done ;;
    pgab51)  # the fp8 decode over pages of 64 and 32: one block number a tile (after) against
      # one a token (before, 0af9f0c), twice, interleaved
      for i in 1 2; do for pg in 64 32; do pgk $pg before; pgk $pg after; done; done ;;
    ba51)  # fp8 weights + fp8 KV, before (0af9f0c: blocks of 16) / after (blocks of 64 by
      # default for an fp8 cache): bench latency, then bench throughput (default workload)
      for kind in latency throughput; do
        bench $kind fp8kv51-before before fp8 --kv-cache-dtype fp8
        bench $kind fp8kv51-after after fp8 --kv-cache-dtype fp8
      done
      grep -hoE "[0-9]+ KV blocks x [0-9]+ tokens" "${LOGS:-$OUT}"/thr-fp8kv51-*.log ;;
    sw51)  # the fp8-MMA decode's settings over pages of 64 (the fp8 cache's default since
      # session 51): MMA_DECODE's (bn 64, 3 stages, 128 registers, block numbers ahead, the
      # fold) against more stages, 128-token tiles, no block numbers ahead, no cap
      # (a tile key set drops all of MMA_DECODE's, so each names all three)
      PAGE=64 sweep 51 "" bn=64,st=4,r=128 bn=64,st=5,r=128 bn=128,st=3,r=128 ma=0 \
        bn=64,st=4,r=128,ma=0 bn=64,st=3,r=0 ;;
    rv51)  # ba51's bench latency in the reverse order (after, then before)
      bench latency fp8kv51-after2 after fp8 --kv-cache-dtype fp8
      bench latency fp8kv51-before2 before fp8 --kv-cache-dtype fp8 ;;
    t51)  # session 51: the decode / prefill / KV-write tests over pages of 16 to 128 tokens
      timeout ${T51:-240} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -rfs \
        -p no:cacheprovider tests/plugins/attention/test_decode_fp8_mma.py \
        tests/plugins/attention/test_kv_quant.py > "$OUT/a-t51.log" 2>&1
      echo "t51 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/a-t51.log" | head -8; tail -1 "$OUT/a-t51.log" ;;
    t53)  # session 53: the 8-bit caches' tests (the prefill's tile helpers moved to
      # prefill_tile.py, prefill_meta_ahead=2 removed; the fp8-MMA prefill at 64 x 64 tiles)
      timeout ${T53:-300} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -s -rfs \
        -p no:cacheprovider tests/plugins/attention/test_kv_quant.py \
        tests/plugins/attention/test_kv_quant_prefill.py \
        tests/plugins/attention/test_kv_quant_gpu.py > "$OUT/a-t53.log" 2>&1
      echo "t53 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/a-t53.log" | head -8; tail -1 "$OUT/a-t53.log"
      grep -E "fp8-MMA prefill, pages" "$OUT/a-t53.log" ;;
    ncu55)  # session 55: where the head-major scales' int8 decode loss goes (see the header)
      rm -rf /tmp/tok_src && mkdir -p /tmp/tok_src && tar -xf .snap/tok.tar -C /tmp/tok_src
      inst /tmp/tok_src /tmp/tok
      for t in tok after tok after; do
        timeout 110 env PYTHONPATH=/tmp/$t:/tmp/site ncu --clock-control none -k regex:_decode_kernel \
          -s 5 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --metrics \
          lts__t_sector_hit_rate.pct,dram__bytes_read.sum,lts__t_sectors_op_read.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum \
          python3 scripts/gpu/kvq_decode_bench.py --kv int8 --contexts 1500 --batches 128 \
          --page-size 16 > "$OUT/ncu55-$t.log" 2>&1
        echo "ncu55 $t rc=$?"
        grep -E " Duration|L2 Hit Rate|dram__bytes_read.sum|lts__t_sectors_op_read|l1tex__t_sectors_pipe" \
          "$OUT/ncu55-$t.log" | sed "s/^/$t /"
      done ;;
    t54)  # session 54: the attention backend's GPU tests (its settings resolved in
      # triton_settings.resolve; with the tree's head-major scales where applied)
      timeout ${T54:-420} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -s -rfs \
        -p no:cacheprovider tests/plugins/attention/test_kv_quant.py \
        tests/plugins/attention/test_kv_quant_prefill.py \
        tests/plugins/attention/test_kv_quant_gpu.py tests/plugins/attention/test_triton_resolve.py \
        tests/plugins/attention/test_decode_fp8_mma.py tests/plugins/attention/test_triton_backend.py \
        > "$OUT/a-t54.log" 2>&1
      echo "t54 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/a-t54.log" | head -8; tail -1 "$OUT/a-t54.log"
      grep -E "fp8-MMA prefill, pages" "$OUT/a-t54.log" ;;
    i8pg53)  # session 53: an int8 cache in pages of 16 (its default) against 64 (an fp8
      # cache's since session 51): the decode per layer at 1,500 tokens, bench throughput
      # (bf16 weights, two interleaved pairs) and bench latency
      for pg in 16 64; do
        timeout 150 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/kvq_decode_bench.py \
          --kv int8 --batches 1,128,512 --contexts 1500 --page-size $pg \
          --json "$OUT/i8pg53-kern$pg.json" > "$OUT/i8pg53-kern$pg.log" 2>&1 \
          || { echo "i8pg53 kern $pg failed"; tail -3 "$OUT/i8pg53-kern$pg.log"; }
        sed "s/^/i8pg53 kern page $pg: /" "$OUT/i8pg53-kern$pg.log" | grep batch
      done
      for i in 1 2; do
        for pg in 16 64; do
          bench throughput int8kv53-page$pg-$i after none --kv-cache-dtype int8 --block-size $pg
        done
      done
      for pg in 16 64; do bench latency int8kv53-page$pg after none --kv-cache-dtype int8 --block-size $pg; done ;;
    wpg51)  # the issue's workload (fp8 weights + fp8 KV), pages of 16 and of 64 tokens
      for pg in ${PAGES:-16 64}; do bench throughput fp8w51-page$pg after fp8 "${WIDE[@]}" --block-size $pg; done ;;
    pre52)  # session 52: the prefill attention per layer over an fp8 cache in pages of 64: f16
      # products (the default) against fp8 ones (prefill_fp8_mma), each with the unmasked
      # tiles' blocks and scales a tile ahead, fp8 at 3 stages; a bf16 cache's default beside
      # (session 52 also ran the blocks alone ahead, prefill_meta_ahead=2, since removed)
      V=(--variant mma:prefill_fp8_mma=1 --variant ahead1:prefill_meta_ahead=1
         --variant mma_ahead1:prefill_fp8_mma=1,prefill_meta_ahead=1
         --variant mma_st3:prefill_fp8_mma=1,prefill_num_stages=3)
      for kv in auto fp8; do
        [ $kv = auto ] && vs=() || vs=("${V[@]}")
        timeout 300 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/kvq_prefill_bench.py \
          --shapes 8x1000,2x4000 --kv $kv --page-size 64 "${vs[@]}" \
          --json "$OUT/pre52-$kv.json" > "$OUT/pre52-$kv.log" 2>&1 || echo "pre52 $kv failed"
        sed "s/^/pre52: /" "$OUT/pre52-$kv.log" | grep -E " us |failed"
      done ;;
    pre52b)  # session 52, the defaults after: an fp8 cache (pages of 64) and an int8 cache (pages
      # of 16, its default) with the blocks and scales ahead against without (the
      # default), fp8 with the fp8-MMA prefill and both beside
      for kv in fp8 int8; do
        pg=64; vs=(--variant ahead:prefill_meta_ahead=1 --variant mma:prefill_fp8_mma=1
                   --variant mma_ahead:prefill_fp8_mma=1,prefill_meta_ahead=1)
        [ $kv = int8 ] && pg=16 vs=(--variant ahead:prefill_meta_ahead=1)
        timeout 200 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/kvq_prefill_bench.py \
          --shapes 8x1000,2x4000 --kv $kv --page-size $pg "${vs[@]}" \
          --json "$OUT/pre52b-$kv.json" > "$OUT/pre52b-$kv.log" 2>&1 || echo "pre52b $kv failed"
        sed "s/^/pre52b: /" "$OUT/pre52b-$kv.log" | grep -E " us |failed"
      done ;;
    sck53)  # session 53: an 8-bit cache's scales stored head-major in each block (a head's
      # tokens adjacent), before (.snap/before.tar) / after: the decode per layer (fp8 in
      # pages of 64, int8 in pages of 16: their defaults) and the prefill per layer
      for t in before after; do
        src=.; [ $t = before ] && src=/tmp/before_src
        for kv in fp8 int8; do
          pg=64; [ $kv = int8 ] && pg=16
          timeout 150 env PYTHONPATH=/tmp/$t:/tmp/site python3 $src/scripts/gpu/kvq_decode_bench.py \
            --kv $kv --batches 128,512 --contexts 1500 --page-size $pg \
            --json "$OUT/sck53-dec-$kv-$t.json" > "$OUT/sck53-dec-$kv-$t.log" 2>&1 \
            || { echo "sck53 decode $kv $t failed"; tail -3 "$OUT/sck53-dec-$kv-$t.log"; }
          sed "s/^/sck53 decode $t: /" "$OUT/sck53-dec-$kv-$t.log" | grep batch
          timeout 150 env PYTHONPATH=/tmp/$t:/tmp/site python3 $src/scripts/gpu/kvq_prefill_bench.py \
            --shapes 8x1000,2x4000 --kv $kv --page-size $pg \
            --json "$OUT/sck53-pre-$kv-$t.json" > "$OUT/sck53-pre-$kv-$t.log" 2>&1 \
            || { echo "sck53 prefill $kv $t failed"; tail -3 "$OUT/sck53-pre-$kv-$t.log"; }
          sed "s/^/sck53 prefill $t: /" "$OUT/sck53-pre-$kv-$t.log" | grep -E " us "
        done
      done ;;
    lean53)  # session 53 with little device time left: the scales' layout before / after,
      # bench throughput then bench latency (one run each) for fp8 + fp8 KV and bf16 + int8
      # KV, then the decode per layer at 512 rows and the prefill at 8 x 1,000 (fp8 in pages
      # of 64, int8 in pages of 16), as far as the call's time goes
      for kind in throughput latency; do
        for kv in fp8 int8; do
          q=fp8; [ $kv = int8 ] && q=none
          for t in before after; do
            [ $kind = latency ] && r=(--runs 1) || r=()
            bench $kind ${kv}kv53-$t $t $q --kv-cache-dtype $kv ${r[@]+"${r[@]}"}
          done
        done
      done
      for kv in fp8 int8; do
        pg=64; [ $kv = int8 ] && pg=16
        for t in before after; do
          src=.; [ $t = before ] && src=/tmp/before_src
          timeout 60 env PYTHONPATH=/tmp/$t:/tmp/site python3 $src/scripts/gpu/kvq_decode_bench.py \
            --kv $kv --batches 512 --contexts 1500 --page-size $pg 2>&1 | grep batch | sed "s/^/lean53 decode $t: /"
          timeout 60 env PYTHONPATH=/tmp/$t:/tmp/site python3 $src/scripts/gpu/kvq_prefill_bench.py \
            --shapes 8x1000 --kv $kv --page-size $pg 2>&1 | grep -E " us " | sed "s/^/lean53 prefill $t: /"
        done
      done ;;
    ba53)  # session 53: bench latency and throughput before (.snap/before.tar) / after (the
      # scales head-major), fp8 weights + fp8 KV, then bf16 weights + int8 KV
      for kv in ${KVS:-fp8 int8}; do
        q=fp8; [ $kv = int8 ] && q=none
        for kind in latency throughput; do
          for t in before after; do bench $kind ${kv}kv53-$t $t $q --kv-cache-dtype $kv; done
        done
      done ;;
    ba52)  # session 52: bench latency and throughput before (.snap/before.tar = 18c57be) / after
      # (the 8-bit caches' prefill loads its blocks and scales a tile ahead), fp8 weights +
      # fp8 KV, then bf16 weights + int8 KV; pairs in both orders (ORDERS)
      for kv in ${KVS:-fp8 int8}; do
        q=fp8; [ $kv = int8 ] && q=none
        for kind in latency throughput; do
          for o in ${ORDERS:-1}; do
            if [ $o = 1 ]; then trees="before after"; else trees="after before"; fi
            for t in $trees; do bench $kind ${kv}kv52-$t$o $t $q --kv-cache-dtype $kv; done
          done
        done
      done ;;
    ah52)  # session 52: bench latency and throughput, the 8-bit caches' prefill look-ahead off
      # (the default) / on (prefill_meta_ahead=1), fp8 weights + fp8 KV, then bf16 + int8 KV
      for kv in ${KVS:-fp8 int8}; do
        q=fp8; [ $kv = int8 ] && q=none
        for kind in latency throughput; do
          bench $kind ${kv}kv52-off after $q --kv-cache-dtype $kv
          bench $kind ${kv}kv52-ahead after $q --kv-cache-dtype $kv \
            --plugin-option triton.prefill_meta_ahead=1
        done
      done ;;
    t52)  # session 52: the fp8 cache's attention tests on the GPU (the fp8-MMA prefill's among them)
      timeout ${T52:-240} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -rfs \
        -p no:cacheprovider tests/plugins/attention/test_kv_quant.py \
        tests/plugins/attention/test_decode_fp8_mma.py > "$OUT/a-t52.log" 2>&1
      echo "t52 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/a-t52.log" | head -8; tail -1 "$OUT/a-t52.log" ;;
    fp52)  # the default workload, fp8 + fp8 KV: the fp8-MMA prefill off / on (PAIRS pairs)
      for i in $(seq ${PAIRS:-2}); do
        bench throughput fp8p52-off$i after fp8 --kv-cache-dtype fp8
        bench throughput fp8p52-mma$i after fp8 --kv-cache-dtype fp8 \
          --plugin-option triton.prefill_fp8_mma=1
      done ;;
    wideb54)  # the issue's workload on main (.snap/before.tar)
      bench throughput fp8w54 before fp8 "${WIDE[@]}" ;;
    lb54)  # bench latency on main (.snap/before.tar), QS
      for q in ${QS:-none int4 int8}; do bench latency $q-main54 before $q; done ;;
    wide52)  # the issue's workload on today's defaults (an fp8 cache in blocks of 64)
      bench throughput fp8w52 after fp8 "${WIDE[@]}" ;;
    widem52)  # the same with the fp8-MMA prefill
      bench throughput fp8w52-mma after fp8 "${WIDE[@]}" --plugin-option triton.prefill_fp8_mma=1 ;;
    ipg52)  # session 52: bf16 weights + an int8 cache, the default workload, blocks of 16 and
      # of 64 alternated (PAIRS pairs): is 64 worth an int8 cache's default too?
      for i in $(seq ${PAIRS:-2}); do for pg in 16 64; do
        bench throughput int8kv-page$pg-$i after none --kv-cache-dtype int8 --block-size $pg
      done; done ;;
    dpg51)  # the default workload, fp8 weights + fp8 KV, pages of 16 and of 64 tokens
      for pg in ${PAGES:-16 64}; do bench throughput fp8d51-page$pg after fp8 --kv-cache-dtype fp8 --block-size $pg; done ;;
    t49)  # session 48: tokenloom quantize --device cuda (test_quantize_device.py whole, on the GPU)
      timeout ${T49:-200} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -rfs \
        -p no:cacheprovider tests/plugins/quant/test_quantize_device.py > "$OUT/a-t49.log" 2>&1
      echo "t49 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/a-t49.log" | head -8; tail -1 "$OUT/a-t49.log" ;;
    l47)  # bench latency on today's tree (QS)
      for q in ${QS:-none int4 int8}; do bench latency $q-now after $q; done ;;
    ba46l)  # bench latency before (.snap/before.tar) / after, bf16 and int4
      for q in ${QS:-none int4}; do
        bench latency $q-before before $q
        bench latency $q-after after $q
      done ;;
    ba46t)  # bench throughput (the default workload) before / after, bf16 (QS)
      for q in ${QS:-none}; do
        bench throughput $q-before before $q
        bench throughput $q-after after $q
      done ;;
    t47)  # session 45: the pre-quantized checkpoints' tests on the GPU (compressed-tensors
      # fp8 / int4 / int8 among them: int4's words load as the row-major storage as they are)
      timeout ${T47:-300} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -rfs \
        -p no:cacheprovider tests/plugins/quant/test_checkpoints.py \
        tests/plugins/quant/test_compressed_tensors.py > "$OUT/a-t47.log" 2>&1
      echo "t47 rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/a-t47.log" | head -8; tail -1 "$OUT/a-t47.log" ;;
    t46)  # session 44: t45's three failures, fixed in the tests (the TP serve test as python
      # -m tokenloom; the interpreter comparisons of test_verify_graphs skip on a GPU host),
      # their GPU form (test_spec_gpu.py), and the pre-quantized checkpoints' tests (a
      # checkpoint's own format taken when quant is left at none)
      E=tests/plugins/executor
      timeout ${T46:-400} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -v -rfs \
        -p no:cacheprovider $E/test_tp_serve.py $E/test_verify_graphs.py \
        tests/plugins/proposer/test_spec_gpu.py tests/plugins/quant/test_checkpoints.py \
        > "$OUT/a-t46.log" 2>&1
      echo "t46 rc=$?"; grep -E "FAILED|ERROR|SKIPPED" "$OUT/a-t46.log" | head -12
      tail -1 "$OUT/a-t46.log" ;;
    ba44l)  # session 44: bench latency before (.snap/before.tar, c0c4ae0) / after session 43's
      # weight_gemm fallback change (gather tilings capped at 64 deep, 3 stages), int4 / int8
      for q in ${QS:-int4 int8}; do
        bench latency $q-before before $q
        bench latency $q-after after $q
      done ;;
    ba44t)  # the same for bench throughput (the default workload)
      for q in ${QS:-int4 int8}; do
        bench throughput $q-before before $q
        bench throughput $q-after after $q
      done ;;
    t45)  # t44n's six failures, fixed in the tests (host tensors beside a GPU engine; a
      # stand-in Stream that broke the engine's own), and the executor files its 450 s did
      # not reach
      E=tests/plugins/executor
      timeout ${T45:-420} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -v -rf \
        -p no:cacheprovider $E/test_batch_tables.py $E/test_graph_decode_path.py \
        $E/test_micro_batches.py $E/test_tp_compose.py $E/test_tp_gpu.py $E/test_tp_serve.py \
        $E/test_verify_graphs.py > "$OUT/a-t45.log" 2>&1
      echo "t45 rc=$?"; grep -E "FAILED|ERROR" "$OUT/a-t45.log" | head -12
      grep -cE " PASSED" "$OUT/a-t45.log"; tail -1 "$OUT/a-t45.log" ;;
    t44m)  # the model and executor tests whole (CUDA where present), each result named as
      # it comes (-v), so that a timeout still names the failures
      timeout ${T44M:-300} env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -v -rf \
        -p no:cacheprovider tests/plugins/models tests/plugins/executor > "$OUT/a-t44m.log" 2>&1
      echo "t44m rc=$?"; grep -E "FAILED|ERROR" "$OUT/a-t44m.log" | head -12
      grep -cE " PASSED" "$OUT/a-t44m.log"; tail -1 "$OUT/a-t44m.log" ;;
    t29)
      py after -m pytest -q -s -m gpu -p no:cacheprovider tests/plugins/attention \
        tests/plugins/executor/test_graph_inputs.py > "$OUT/gpu-tests-t29.log" 2>&1
      echo "t29 rc=$?"; grep -E "^FAILED|^ERROR|fp8_mma=" "$OUT/gpu-tests-t29.log" | head -12
      tail -n 1 "$OUT/gpu-tests-t29.log" ;;
    kern29)
      kern before before
      kern after after
      M=(--setting decode_fp8_mma=1)
      kern mma after "${M[@]}"  # its defaults: 2 stages, no register cap
      kern mma-s1r128 after "${M[@]}" --setting decode_num_stages=1 --setting decode_maxnreg=128
      kern mma-s2r128 after "${M[@]}" --setting decode_num_stages=2 --setting decode_maxnreg=128
      kern mma-s1r0 after "${M[@]}" --setting decode_num_stages=1 --setting decode_maxnreg=0
      # 149 registers and 70 KB of shared memory: 3 programs an SM, where the splits assume 4
      kern mma-pps3 after "${M[@]}" --setting decode_programs_per_sm=3 ;;
    wide29)
      bench throughput fp8w-before before fp8 "${WIDE[@]}"
      bench throughput fp8w-after after fp8 "${WIDE[@]}"
      bench throughput fp8w-mma after fp8 "${WIDE[@]}" --plugin-option triton.decode_fp8_mma=1 ;;
    kern32)  # session 32's short form of kern29: the default and the kernel's two likeliest settings
      kern after after
      kern mma after --setting decode_fp8_mma=1
      kern mma-pps3 after --setting decode_fp8_mma=1 --setting decode_programs_per_sm=3 ;;
    wide32)  # wide29 without the before tree (the default path's SASS is unchanged)
      bench throughput fp8w-mma after fp8 "${WIDE[@]}" --plugin-option triton.decode_fp8_mma=1
      bench throughput fp8w-after after fp8 "${WIDE[@]}" ;;
    lat32)
      bench latency bf16-before before none
      bench latency bf16-after after none ;;
    t33)  # the attention backends' GPU tests, then the fp8-MMA kernel's own tests (not
      # gpu-marked: they take CUDA when it is there)
      py after -m pytest -q -s -m gpu -p no:cacheprovider tests/plugins/attention \
        > "$OUT/gpu-tests-t33.log" 2>&1
      echo "t33 rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-t33.log" | head -12
      tail -n 1 "$OUT/gpu-tests-t33.log"
      py after -m pytest -q -p no:cacheprovider tests/plugins/attention/test_decode_fp8_mma.py \
        > "$OUT/gpu-tests-t33-mma.log" 2>&1
      echo "t33 mma rc=$?"; tail -n 1 "$OUT/gpu-tests-t33-mma.log" ;;
    t36)  # session 36: the attention modules' GPU tests, now that the five modules whose
      # tests run on CUDA when it is there carry the gpu mark there (about 20 s on an H100
      # with its kernels compiled; on a fresh H200, session 37, 120 s saw 87 of 144 tests:
      # the limit is 300 s; the quant, models and sampling modules' 1,200 such tests take
      # over 7 minutes)
      timeout 300 env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -m gpu \
        -p no:cacheprovider tests/plugins/attention > "$OUT/gpu-tests-t36.log" 2>&1
      echo "t36 rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-t36.log" | head -20
      tail -n 1 "$OUT/gpu-tests-t36.log" ;;
    t33x)  # the executor's GPU tests (session 33: run_pack's uploads made by capture only)
      py after -m pytest -q -s -m gpu -p no:cacheprovider tests/plugins/executor \
        > "$OUT/gpu-tests-t33x.log" 2>&1
      echo "t33x rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-t33x.log" | head -12
      tail -n 1 "$OUT/gpu-tests-t33x.log" ;;
    kern33)  # the fp8-MMA kernel's tile / warps / stages at the throughput batches; writes
      # $OUT/best33 (the settings fastest at 512 rows, none if the default). Session 33 ran
      # this without decode_fp8_mma=1 (the f16-converting kernel ran); fixed since, unrun
      sweep 33 "" bn=64 bn=64,st=3 st=3 st=1 w=8 bn=256,w=8 ;;
    kern35)  # session 35: Triton 3.6 pipelines the MMA kernel's K/V copies only from 5
      # stages (offline TTGIR: at 2-4 stages the next tile's copies are issued after the
      # tile's products and waited at the loop's top, so a program never loads while it
      # computes; from 5, 3 buffers and a wait that leaves a tile in flight; with the
      # block numbers a tile ahead, ma=1, from 3)
      sweep 35 "" st=5 bn=64,st=5 bn=64,st=5,r=128 bn=64,st=3,ma=1 bn=64,st=3,ma=1,r=128 \
        st=3,ma=1 bn=64,st=7 bn=64 ;;
    kern36)  # session 36, on the H200: kern35's overlap with more tiles in flight (64-token
      # tiles, block numbers ahead, 3-5 stages, offline: 3-5 K/V buffers a program)
      # (the H100, session 36: 3 buffers best, more no better; bn64-st3-ma1 and
      # bn64-st4-ma1 without the register cap dropped after it)
      sweep 36 "" bn=64,st=3,ma=1,r=128 bn=64,st=4,ma=1,r=128 st=3,ma=1 bn=64,st=5,ma=1,r=128 \
        st=5 ;;
    wide36)  # the issue's workload: the default against kern36's best (or BEST36)
      bench throughput fp8w36-default after fp8 "${WIDE[@]}"
      BEST=$(cat "$OUT/best36" 2>/dev/null || echo "${BEST36:-}")
      [ -n "$BEST" ] && bench throughput fp8w36-best after fp8 "${WIDE[@]}" $BEST ;;
    t38)  # the fp8-MMA decode's own tests on the GPU (the fold against the unfolded kernel)
      timeout 200 env PYTHONPATH=/tmp/after:/tmp/site python3 -m pytest -q -p no:cacheprovider \
        tests/plugins/attention/test_decode_fp8_mma.py > "$OUT/gpu-tests-t38.log" 2>&1
      echo "t38 rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests-t38.log" | head -12
      tail -n 1 "$OUT/gpu-tests-t38.log" ;;
    kern38)  # session 38: one cross-warp reduction a tile (offline at MMA_DECODE's tiles 9 ->
      # 5 barriers, 455 -> 406 instructions a tile; 128-token tiles over 8 warps 88
      # registers, 70 KB at 2 stages: 3 programs of 8 warps an SM; 64-token tiles at 2
      # stages, 36 KB, with 80 / 96 registers: 6 / 5 programs, against MMA_DECODE's 4; the
      # bf16 kernel, at 4.1 TB/s, holds 7). "" is MMA_DECODE
      sweep 38 "" f=1 bn=64,st=2,ma=1,r=80,f=1 bn=64,st=2,ma=1,r=96,f=1 bn=128,st=2,w=8,f=1 \
        bn=64,st=3,ma=1,f=1 bn=64,st=4,ma=1,r=128,f=1 bn=128,st=3,ma=1,w=8,f=1 ;;
    kern38b)  # the fold on the H200, and the block numbers' L1 prefetch (ncusrc38 on an H100:
      # 17% of the folded kernel's stall samples wait for their load; the prefetch, an
      # inline prefetch.global.L1 of their line 2, 3 or 6 tiles ahead, measured 0.7% slower
      # and was removed: its tp=N settings no longer exist)
      sweep 38b "" f=1 ;;
    kern38c)  # with the fold on by default (""): its tiles again (no cap, 4 stages, 128 tokens,
      # 2 stages at 96 registers)
      sweep 38c "" bn=64,st=3,ma=1 bn=64,st=4,ma=1,r=128 bn=128,st=3,ma=1 bn=64,st=2,ma=1,r=96 ;;
    kern38d)  # the fold's default against 5 stages without the block numbers ahead: offline
      # the pipeliner then copies the block numbers into shared memory with the K/V tiles
      # (4-byte cp.async, no load in the loop; ncusrc38's largest stall), 3 K/V buffers, 7
      # copy groups in flight, 54.8 KB, 128 registers, 0 spills
      sweep 38d "" bn=64,st=5,r=128 ;;
    wide38d)  # the workload with kern38d's best first, then the default (device time was short)
      BEST=$(cat "$OUT/best38d" 2>/dev/null)
      [ -n "$BEST" ] && bench throughput fp8w38d-best after fp8 "${WIDE[@]}" $BEST
      [ -n "$BEST" ] && bench throughput fp8w38d-default after fp8 "${WIDE[@]}" ;;
    t39)  # the fresh prefill's tests on the GPU (fp8 and int8 caches) and the verify graphs
      py after -m pytest -q -s -m gpu -p no:cacheprovider tests/plugins/attention/test_prefill_fresh16.py \
        tests/plugins/executor/test_verify_graphs.py > "$OUT/a-t39.log" 2>&1
      echo "t39 rc=$?"; tail -3 "$OUT/a-t39.log" ;;
    fresh39)  # the workload with prefill_fresh_16bit against none, interleaved (none, on, none, on)
      for i in $(seq ${PAIRS:-2}); do
        bench throughput fp8f39-none$i after fp8 "${WIDE[@]}"
        bench throughput fp8f39-fresh$i after fp8 "${WIDE[@]}" --plugin-option triton.prefill_fresh_16bit=1
      done ;;
    fresh42)  # the default workload (fits an H100), fp8 + fp8 KV: prefill_fresh_16bit off / on
      for i in $(seq ${PAIRS:-2}); do
        bench throughput fp8f42-none$i after fp8 --kv-cache-dtype fp8
        bench throughput fp8f42-fresh$i after fp8 --kv-cache-dtype fp8 \
          --plugin-option triton.prefill_fresh_16bit=1
      done ;;
    t42)  # test_int4_gemv_nk.py whole on the GPU (CUDA where present, not under -m gpu): its
      # row-major engine test expected float32 to be stored row-major, which only bf16 is there
      py after -m pytest -q -p no:cacheprovider tests/plugins/quant/test_int4_gemv_nk.py \
        > "$OUT/a-t42.log" 2>&1
      echo "t42 rc=$?"; grep -E "^FAILED" "$OUT/a-t42.log" | head -5; tail -1 "$OUT/a-t42.log" ;;
    t43)  # session 42's H100 run of the quant tests whole (CUDA where present) timed out with 10
      # failures, named from their positions in the collection (not from a summary): these files
      # again, with the failures named (test_checkpoints' two were a device mismatch, fixed)
      py after -m pytest -q -rf -p no:cacheprovider tests/plugins/quant/test_checkpoints.py \
        tests/plugins/quant/test_int4_row_major.py tests/plugins/quant/test_int8_gemv_nk.py \
        tests/plugins/quant/test_weight_gemm.py > "$OUT/a-t43.log" 2>&1
      echo "t43 rc=$?"; grep -E "^FAILED" "$OUT/a-t43.log" | head -12; tail -1 "$OUT/a-t43.log" ;;
    wide42)  # the issue's workload on today's defaults (the fold on)
      bench throughput fp8w42-default after fp8 "${WIDE[@]}" ;;
    freshw42)  # the issue's workload with prefill_fresh_16bit (fold39's "on" is its baseline)
      bench throughput fp8f42w-fresh after fp8 "${WIDE[@]}" --plugin-option triton.prefill_fresh_16bit=1 ;;
    t39q)  # the fp8 activation quantization folded into the norm and SiLU-and-mul: its GPU
      # tests, and the fp8 kernels' GPU tests
      py after -m pytest -q -s -m gpu -p no:cacheprovider tests/plugins/models/test_fp8_fold_quant.py \
        tests/plugins/quant/test_gpu_kernels.py tests/plugins/quant/test_fp8_gemv.py \
        tests/plugins/quant/test_fp8_quant.py > "$OUT/a-t39q.log" 2>&1
      echo "t39q rc=$?"; tail -3 "$OUT/a-t39q.log" ;;
    fold39)  # the workload, the fold off (TOKENLOOM_FP8_FOLD_QUANT=0) and on, interleaved
      for i in $(seq ${PAIRS:-2}); do
        TOKENLOOM_FP8_FOLD_QUANT=0 bench throughput fp8q39-off$i after fp8 "${WIDE[@]}"
        TOKENLOOM_FP8_FOLD_QUANT=1 bench throughput fp8q39-on$i after fp8 "${WIDE[@]}"
      done ;;
    lat39)  # bench latency, fp8 weights + fp8 KV, the fold off / on (one round)
      TOKENLOOM_FP8_FOLD_QUANT=0 bench latency fp8-fold-off after fp8 --kv-cache-dtype fp8
      TOKENLOOM_FP8_FOLD_QUANT=1 bench latency fp8-fold-on after fp8 --kv-cache-dtype fp8 ;;
    thr39)  # bench throughput (the default workload), fp8 weights + fp8 KV, the fold off / on
      TOKENLOOM_FP8_FOLD_QUANT=0 bench throughput fp8-fold-off after fp8 --kv-cache-dtype fp8
      TOKENLOOM_FP8_FOLD_QUANT=1 bench throughput fp8-fold-on after fp8 --kv-cache-dtype fp8 ;;
    ba39)  # before (.snap/before.tar) / after, fp8 weights + fp8 KV, the default workloads
      for i in 1 2; do
        bench latency fp8-before$i before fp8 --kv-cache-dtype fp8
        bench latency fp8-after$i after fp8 --kv-cache-dtype fp8
      done
      bench throughput fp8-before before fp8 --kv-cache-dtype fp8
      bench throughput fp8-after after fp8 --kv-cache-dtype fp8 ;;
    t40)  # session 40: two micro-batches in one decode graph (two streams), and the graph
      # decode path's GPU tests
      py after -m pytest -q -s -m gpu -p no:cacheprovider tests/plugins/executor/test_micro_batches.py \
        tests/plugins/executor/test_graph_decode_path.py tests/plugins/executor/test_verify_graphs.py \
        > "$OUT/a-t40.log" 2>&1
      echo "t40 rc=$?"; tail -3 "$OUT/a-t40.log" ;;
    mbt40)  # the default workload (fits an H100), fp8 + fp8 KV, micro-batches off / on
      MBO=(--plugin-option model.micro_batch_min=${MB:-128})
      [ "${TURNS:-1}" = 0 ] && MBO+=(--plugin-option model.micro_batch_turns=false)
      for i in $(seq ${PAIRS:-1}); do
        bench throughput mbt40-off$i after fp8 --kv-cache-dtype fp8
        bench throughput mbt40-on$i after fp8 --kv-cache-dtype fp8 "${MBO[@]}"
      done ;;
    mb40)  # the issue's workload (600 x 1,000 / 1,000, an H200), micro-batches off / on
      MBO=(--plugin-option model.micro_batch_min=${MB:-256})
      [ "${TURNS:-1}" = 0 ] && MBO+=(--plugin-option model.micro_batch_turns=false)
      for i in $(seq ${PAIRS:-1}); do
        bench throughput mb40-off$i after fp8 "${WIDE[@]}"
        bench throughput mb40-on$i after fp8 "${WIDE[@]}" "${MBO[@]}"
      done ;;
    ba40)  # before (.snap/before.tar, f6be4af) / after, fp8 weights + fp8 KV, the defaults
      bench latency fp8-before before fp8 --kv-cache-dtype fp8
      bench latency fp8-after after fp8 --kv-cache-dtype fp8
      bench throughput fp8-before before fp8 --kv-cache-dtype fp8
      bench throughput fp8-after after fp8 --kv-cache-dtype fp8 ;;
    t41)  # session 41: the micro-batch GPU tests (plain streams, and green contexts)
      py after -m pytest -q -s -m gpu -p no:cacheprovider tests/plugins/executor/test_micro_batches.py \
        tests/plugins/executor/test_graph_decode_path.py > "$OUT/a-t41.log" 2>&1
      echo "t41 rc=$?"; grep -E "green contexts:|^FAILED|Error" "$OUT/a-t41.log" | head -8
      tail -1 "$OUT/a-t41.log" ;;
    green41)  # the attention on N SMs (green context) beside the GEMMs on the rest, and the
      # two halves pipelined over the partitions against the whole step on every SM
      timeout 420 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/green_probe.py \
        --green ${GREEN:-40,56,66,80} --pipeline --json "$OUT/green41.json" \
        > "$OUT/green41.log" 2>&1 || { echo "green41 failed"; tail -5 "$OUT/green41.log"; }
      grep -E "green|Error" "$OUT/green41.log" ;;
    pick41)  # SMS: the N whose pipelined halves gained most (none gained: 0, and stop)
      SMS=$(python3 -c "import json; r = [x for x in json.load(open('$OUT/green41.json'))['green'] \
if x.get('gain', 0) > 1]; print(max(r, key=lambda x: x['gain'])['attention_sms'] if r else 0)" \
        2>/dev/null || echo 0)
      echo "pick41: SMS=$SMS"; export SMS
      [ "$SMS" = 0 ] && break ;;
    mbg41)  # the default workload (fits an H100), fp8 + fp8 KV: off / green micro-batches
      bench throughput mbg41-off after fp8 --kv-cache-dtype fp8
      bench throughput mbg41-on after fp8 --kv-cache-dtype fp8 --plugin-option \
        model.micro_batch_min=${MB:-128} --plugin-option model.micro_batch_sms=${SMS:-66} ;;
    mbw41)  # the issue's workload (an H200): off / green micro-batches
      bench throughput mbw41-off after fp8 "${WIDE[@]}"
      bench throughput mbw41-on after fp8 "${WIDE[@]}" --plugin-option \
        model.micro_batch_min=${MB:-256} --plugin-option model.micro_batch_sms=${SMS:-66} ;;
    ovl39)  # session 39: the decode step as one chain against two half-batch chains on two
      # streams (scripts/gpu/overlap_probe.py --chains; 300 rows a half, carveouts 0 and 32)
      timeout 400 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/overlap_probe.py \
        --chains --carveouts ${CARVEOUTS:-0,32} --json "$OUT/a-ovl39.json" > "$OUT/ovl39.log" 2>&1 \
        || { echo "ovl39 failed"; tail -5 "$OUT/ovl39.log"; }
      grep -E "chains|error" "$OUT/ovl39.log" ;;
    ovl38)  # whether the decode attention and the fp8 GEMMs overlap on one GPU (two streams,
      # 300 rows each, the GEMMs' SM carveout swept; scripts/gpu/overlap_probe.py)
      timeout 400 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/overlap_probe.py \
        --json "$OUT/ovl38.json" > "$OUT/ovl38.log" 2>&1 || { echo "ovl38 failed"; tail -5 "$OUT/ovl38.log"; }
      grep carveout "$OUT/ovl38.log" ;;
    ncu38)  # what the fp8-MMA decode's warps stall on, unfolded and folded (batch 512 x
      # 1,500, MMA_DECODE's tiles; ncu reads counters on Firecracker hosts only: the H100s)
      for f in 0 1; do
        timeout 200 env PYTHONPATH=/tmp/after:/tmp/site ncu --clock-control none \
          -k regex:_decode_fp8_mma_kernel -c 1 --section SpeedOfLight --section WarpStateStats \
          --section Occupancy --section SchedulerStats --section LaunchStats \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 scripts/gpu/kvq_decode_bench.py --kv fp8 --contexts 1500 --batches 512 \
          --setting decode_fp8_fold=$f > "$OUT/ncu38-f$f.log" 2>&1
        echo "ncu38 f$f rc=$?"
        grep -E "Duration|DRAM Throughput|Issued Warp|No Eligible|Achieved Occupancy|Registers Per|stalled_(barrier|long|wait|short|math|mio|lg|not_sel|gmma|dispatch|membar|no_inst)" \
          "$OUT/ncu38-f$f.log" | sed "s/^/f$f /" | head -30
      done ;;
    ncusrc38)  # where in the folded kernel the warps stall: ncu's per-instruction samples
      # (SourceCounters), printed as SASS with their counts ($OUT/a-ncusrc38.csv.gz;
      # NCUSRC="--setting K=V ..." adds settings to the fold)
      timeout 240 env PYTHONPATH=/tmp/after:/tmp/site ncu --clock-control none \
        -k regex:_decode_fp8_mma_kernel -c 1 --section SourceCounters --section WarpStateStats \
        -o /tmp/ncusrc38 -f python3 scripts/gpu/kvq_decode_bench.py --kv fp8 --contexts 1500 \
        --batches 512 --setting decode_fp8_fold=1 ${NCUSRC:-} > "$OUT/ncusrc38.log" 2>&1
      echo "ncusrc38 rc=$?"
      ncu -i /tmp/ncusrc38.ncu-rep --page source --csv --print-source sass 2> "$OUT/a-ncusrc38.err" \
        | gzip > "$OUT/a-ncusrc38.csv.gz"
      echo "csv $(zcat "$OUT/a-ncusrc38.csv.gz" | wc -l) lines"; head -c 600 "$OUT/a-ncusrc38.err" ;;
    wide38)  # the issue's workload: the default against kern38b's best (else kern38's, else BEST38)
      bench throughput fp8w38-default after fp8 "${WIDE[@]}"
      BEST=$(cat "$OUT/best38b" 2>/dev/null || cat "$OUT/best38" 2>/dev/null || echo "${BEST38:-}")
      [ -n "$BEST" ] && bench throughput fp8w38-best after fp8 "${WIDE[@]}" $BEST ;;
    ba38)  # before (.snap/before.tar) / after, fp8 weights + fp8 KV, the default workloads
      bench latency fp8-before before fp8 --kv-cache-dtype fp8
      bench latency fp8-after after fp8 --kv-cache-dtype fp8
      bench throughput fp8-before before fp8 --kv-cache-dtype fp8
      bench throughput fp8-after after fp8 --kv-cache-dtype fp8 ;;
    pre37)  # session 37: the prefill kernel over a bf16 and an fp8 cache at the workload's
      # chunks (8 prompts x 1,000 new tokens; 1.33 ms a layer on the H200 with an fp8
      # cache, about 10x its FLOP floor): an 8-bit cache's products in f16 (the new
      # default, prefill_kv_f16=1) against bf16 (0, before), and the tiles; $OUT/best37:
      # the fastest fp8 variant's plugin options
      V=(--variant "bf16ops:prefill_kv_f16=0,prefill_num_stages=3")
      V+=(--variant "m128n64w8s3-bf16ops:prefill_block_m=128,prefill_block_n=64,prefill_num_warps=8,prefill_num_stages=3,prefill_kv_f16=0")
      # (offline, sm_90, f16 products: 128x64 over 4 warps, 64x128 and 128x32 over 4 spill)
      for v in m128n64w8s3 m128n64w8s2 m128n128w8s2 m128n64w8s4 m128n32w8s3 m64n64w4s2 \
        m64n32w4s3; do
        [[ $v =~ m([0-9]+)n([0-9]+)w([0-9]+)s([0-9]+) ]]
        V+=(--variant "$v:prefill_block_m=${BASH_REMATCH[1]},prefill_block_n=${BASH_REMATCH[2]},prefill_num_warps=${BASH_REMATCH[3]},prefill_num_stages=${BASH_REMATCH[4]}")
      done
      timeout 300 env PYTHONPATH=/tmp/after:/tmp/site python3 scripts/gpu/kvq_prefill_bench.py \
        --shapes 8x1000 --kv auto,fp8 --json "$OUT/pre37.json" "${V[@]}" > "$OUT/pre37.log" 2>&1 \
        || { echo "pre37 failed"; tail -3 "$OUT/pre37.log"; }
      cat "$OUT/pre37.log"
      python3 - "$OUT/pre37.json" > "$OUT/best37" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["kv"] == "fp8" and "ms" in r]
best = min(rows, key=lambda r: r["ms"])
keys = {"prefill_block_m": 64, "prefill_block_n": 64, "prefill_num_warps": 4,
        "prefill_num_stages": 2, "prefill_kv_f16": 1}  # the fp8 defaults since session 37
print(" ".join(f"--plugin-option triton.{k}={best.get(k, d)}" for k, d in keys.items()))
PY
      echo "best37: $(cat "$OUT/best37")" ;;
    wide37)  # the issue's workload: the prefill as before (bf16 products, default tiles)
      # against pre37's best (or BEST37)
      BEST=$(cat "$OUT/best37" 2>/dev/null); BEST=${BEST:-${BEST37:-}}
      bench throughput fp8w37-bf16ops after fp8 "${WIDE[@]}" --plugin-option triton.prefill_kv_f16=0 \
        --plugin-option triton.prefill_num_stages=3
      [ -n "$BEST" ] && bench throughput fp8w37-best after fp8 "${WIDE[@]}" $BEST
      rm -f "$OUT"/thr-fp8w37-*.log ;;  # the JSONs hold the figures (8 files come back)
    wide33)  # the issue's workload: the default against kern33's best settings (if other)
      bench throughput fp8w33-default after fp8 "${WIDE[@]}"
      BEST=$(cat "$OUT/best33" 2>/dev/null)
      [ -n "$BEST" ] && bench throughput fp8w33-best after fp8 "${WIDE[@]}" $BEST ;;
    lat33)  # batch 1, fp8 weights + fp8 KV: the default against kern33's best
      bench latency fp8lat33-default after fp8 --kv-cache-dtype fp8
      BEST=$(cat "$OUT/best33" 2>/dev/null)
      [ -n "$BEST" ] && bench latency fp8lat33-best after fp8 --kv-cache-dtype fp8 $BEST ;;
    wide35)  # the issue's workload: the default against kern35's best settings (if other)
      bench throughput fp8w35-default after fp8 "${WIDE[@]}"
      BEST=$(cat "$OUT/best35" 2>/dev/null || echo "${BEST35:-}")
      [ -n "$BEST" ] && bench throughput fp8w35-best after fp8 "${WIDE[@]}" $BEST ;;
    lat35)  # batch 1, fp8 weights + fp8 KV: the default against kern35's best
      bench latency fp8lat35-default after fp8 --kv-cache-dtype fp8
      BEST=$(cat "$OUT/best35" 2>/dev/null || echo "${BEST35:-}")
      [ -n "$BEST" ] && bench latency fp8lat35-best after fp8 --kv-cache-dtype fp8 $BEST ;;
    ba37)  # before / after session 37's prefill default for an 8-bit cache (fp8 KV)
      bench latency fp8kv37-before before fp8 --kv-cache-dtype fp8
      bench latency fp8kv37-after after fp8 --kv-cache-dtype fp8
      bench throughput fp8kv37-before before fp8 --kv-cache-dtype fp8
      bench throughput fp8kv37-after after fp8 --kv-cache-dtype fp8 ;;
    ba35)  # before / after this session's kernel change (the default's SASS unchanged), fp8 KV
      bench latency fp8kv35-before before fp8 --kv-cache-dtype fp8
      bench latency fp8kv35-after after fp8 --kv-cache-dtype fp8
      bench throughput fp8kv35-before before fp8 --kv-cache-dtype fp8
      bench throughput fp8kv35-after after fp8 --kv-cache-dtype fp8 ;;
    prof33)  # where the issue's workload's time goes: step classes, a decode step's kernels
      # at 600 x ~1,500, and one 8,192-token prefill step's kernels
      MIN_LEN=1000 MAX_LEN=1000 PROF_SEQS=600 PROF_CTX=1500 timeout 400 env \
        PYTHONPATH=/tmp/after:/tmp/site python3 scripts/profile_throughput.py llama-3-8b 600 \
        quant=fp8 kv_cache_dtype=fp8 max_num_seqs=640 max_graph_batch=640 \
        > "$OUT/prof33.log" 2>&1 || { echo "prof33 failed"; tail -5 "$OUT/prof33.log"; }
      grep -E "out_tok_s|class|attention|gemm|quantize|prefill" "$OUT/prof33.log" | head -30 ;;
    bf29)
      bench latency bf16-before before none
      bench latency bf16-after after none
      bench throughput bf16-before before none
      bench throughput bf16-after after none ;;
    *) echo "unknown step $step" ;;
  esac
done
