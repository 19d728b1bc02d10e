#!/usr/bin/env bash
# Runs on the GPU machine, in one device call: GPU tests, then the benchmarks, then the peer.
#   here:   bash scripts/gpu_bundle.sh
#   device: bash scripts/gpu.sh        (carry .carry.tar.xz; results and logs land in $OUT)
# STAGES (default "test bench peer fixtures") picks what runs; quant_fixtures regenerates the
# quantized fixtures (scripts/gen_quant_fixtures.py) and checks the loader against them there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -f .carry.tar.xz ] && [ ! -x .carry/infersweep ]; then
  mkdir -p .carry && tar xJf .carry.tar.xz -C .carry
fi
export LD_LIBRARY_PATH="$PWD/.carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export INFERSWEEP_SOURCE_DIR="$PWD" INFERSWEEP_BINARY="$PWD/.carry/infersweep"
# cuDNN is there only inside PyTorch's wheel: the engine dlopens it from INFERSWEEP_CUDNN_DIR.
if [ -z "${INFERSWEEP_CUDNN_DIR:-}" ]; then
  INFERSWEEP_CUDNN_DIR=$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2>/dev/null || true)
  export INFERSWEEP_CUDNN_DIR
fi
B=.carry/infersweep
STAGES=${STAGES:-"test bench peer fixtures"}

# Batch-1 decode of qwen3-30b-a3b quantized on the host to format $2 (FP4: qgemm=w4a16, FP8:
# qgemm=w8a16), fastest configs, graphs=$3, by binary $1, its persistent timeline to $4; more
# arguments go to `run`.
quant_run() {
  local binary=$1 format=$2 graphs=$3 timeline=$4 q=w8a16
  shift 4
  case $format in nvfp4|mxfp4) q=w4a16 ;; esac
  INFERSWEEP_PERSISTENT_TIMELINE="$timeline" "$binary" run --model preset:qwen3-30b-a3b --quantize "$format" \
    --config "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=$graphs,qgemm=$q" \
    --workload prompt=512,output=64,batch=1,repeats=3,warmup=1,timeout=900 "$@"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv

# A GPU test binary under a time limit (TEST_TIMEOUT_S, default $2 s), its log to $OUT/$3, the
# interesting lines on stdout: a hang ends the binary, not the device call (which would otherwise
# spend its whole time limit), and the stages after it still run.
gpu_tests() {
  local binary=$1 limit=${TEST_TIMEOUT_S:-$2} log=$3 pattern=$4
  shift 4
  # stdbuf: the tests' printf lines reach the log as they happen, not lost in a buffer when the
  # process dies
  timeout -k 5 "$limit" stdbuf -oL "$binary" "$@" 2>&1 | tee "$OUT/$log" | grep -E "$pattern"
  local rc=${PIPESTATUS[0]}
  if ((rc == 124 || rc == 137)); then echo "# $binary: killed after $limit s (TEST_TIMEOUT_S)"; fi
  return 0
}

for stage in $STAGES; do
  case $stage in
  test)
    for t in gpu_kernels_test gpu_test gpu_quant_test gpu_scaled_gemm_test gpu_probe_test; do
      gpu_tests ".carry/$t" 540 "$t.log" '^#|OK \]|FAILED|Failure|error'
    done ;;
  ptests)  # the GPU test binaries (PTESTS, default every one but gpu_test) and gpu_test at
    # once, each under its limit (PTESTS_TIMEOUT_S, default 330 s); then the memory tests (*Fit*)
    # alone, since one holds 90 % of the GPU and the others measure the device's memory in use
    for t in ${PTESTS:-gpu_kernels_test gpu_quant_test gpu_scaled_gemm_test gpu_probe_test gpu_tp_test}; do
      # gpu_tp_test's two ranks share this GPU through the TEST ONLY device map
      [ "$t" = gpu_tp_test ] && ranks=0,0 || ranks=
      INFERSWEEP_RANK_DEVICES=$ranks gpu_tests ".carry/$t" "${PTESTS_TIMEOUT_S:-330}" "$t.log" \
        '^#|OK \]|FAILED|Failure|error' &
    done
    gpu_tests .carry/gpu_test "${PTESTS_TIMEOUT_S:-330}" gpu_test.log '^#|OK \]|FAILED|Failure|error' \
      --gtest_filter='-*Fit*:*GpuMatrix.*' &
    # The registry's whole matrix (some 13,800 configs a tiny preset), a preset a process
    for shard in 0 1 2 3 4; do
      GTEST_TOTAL_SHARDS=5 GTEST_SHARD_INDEX=$shard gpu_tests .carry/gpu_test \
        "${PTESTS_TIMEOUT_S:-330}" "gpu_matrix_$shard.log" 'OK \]|FAILED|Failure|error' \
        --gtest_filter='*GpuMatrix.*' &
    done
    wait
    gpu_tests .carry/gpu_test 120 gpu_memory_test.log '^#|OK \]|FAILED|Failure|error|planned' \
      --gtest_filter='*Fit*' ;;
  new_tests)  # the GPU tests of the unverified work first, in parallel, each under its limit
    # (NEW_TIMEOUT_S, default 300 s): the E4M3 kernels (wgmma included), graphs=persistent on
    # mxfp4 and fp8_block128 codes against the kernel chain, and the fused quantized configs
    # (persistent on every FP4 and FP8 format); before the whole suites (STAGES=ptests)
    t=${NEW_TIMEOUT_S:-300}
    gpu_tests .carry/gpu_quant_test "$t" new_quant.log '^#|OK \]|FAILED|Failure|error' \
      --gtest_filter='*Fp8*:*E4m3*' &
    gpu_tests .carry/gpu_test "$t" new_gpu.log '^#|OK \]|FAILED|Failure|error' \
      --gtest_filter='Gpu.PersistentDecodeMatchesTheKernelChain:Gpu.FusedQuantizedConfigsAreOkAndBadScaleIsIncorrect:Gpu.W8a8ConfigsRunE4m3TensorCoresAndABadExpertScaleIsIncorrect' &
    wait ;;
  ordering)  # gpu_test's sequence (ORDER_FILTER, default every test but the memory ones and the
    # matrix) three ways at once, each under ORDER_TIMEOUT_S (default 420 s): as built, with plain
    # launches (INFERSWEEP_PLAIN_LAUNCHES: no programmatic dependent launch) and with every launch
    # synchronous (CUDA_LAUNCH_BLOCKING). A fault in the first alone is an ordering race between
    # kernels; in the first two, one between the host and the device or inside a kernel.
    f=${ORDER_FILTER:--*Fit*:*GpuMatrix.*}
    t=${ORDER_TIMEOUT_S:-420}
    gpu_tests .carry/gpu_test "$t" order_default.log 'FAILED  \]|illegal|CUDA error' --gtest_filter="$f" &
    INFERSWEEP_PLAIN_LAUNCHES=1 gpu_tests .carry/gpu_test "$t" order_plain.log \
      'FAILED  \]|illegal|CUDA error' --gtest_filter="$f" &
    CUDA_LAUNCH_BLOCKING=1 gpu_tests .carry/gpu_test "$t" order_blocking.log \
      'FAILED  \]|illegal|CUDA error' --gtest_filter="$f" &
    wait
    for l in order_default order_plain order_blocking; do
      echo "# $l: $(grep -c '^\[       OK \]' "$OUT/$l.log") tests OK; last: $(grep -E '^\[ RUN|illegal' "$OUT/$l.log" | tail -1)"
    done ;;
  diagnose)  # a GPU test that died, pinned: DIAG_FILTER (default the quantized fused configs'
    # test) for each DIAG_BINARIES build in .carry (default gpu_test_base, the previous main's,
    # then gpu_test), line-buffered; a build whose run does not pass runs it again under
    # compute-sanitizer's memcheck where the GPU machine has it (the faulting kernel, thread and
    # address)
    filter=${DIAG_FILTER:-Gpu.FusedQuantizedConfigsAreOkAndBadScaleIsIncorrect}
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    for b in ${DIAG_BINARIES:-gpu_test_base gpu_test}; do
      echo "# $b: $filter"
      gpu_tests ".carry/$b" "${DIAG_TIMEOUT_S:-120}" "diagnose_$b.log" '^#|OK \]|FAILED|Failure|error' \
        --gtest_filter="$filter"
      if [ -n "$sanitizer" ] && ! grep -q '^\[  PASSED  \]' "$OUT/diagnose_$b.log"; then
        echo "# $b under $sanitizer"
        timeout -k 5 "${SANITIZER_TIMEOUT_S:-240}" stdbuf -oL "$sanitizer" --tool memcheck \
          --print-limit 10 ".carry/$b" --gtest_filter="$filter" 2>&1 |
          tee "$OUT/sanitizer_$b.log" | grep -E '^#|OK \]|FAILED|=========' | head -80
      fi
    done ;;
  poison)  # device memory poisoned as it is allocated (INFERSWEEP_POISON_DEVICE_MEMORY) under the
    # tiny presets' fast configs, each in a worker; launches synchronous (CUDA_LAUNCH_BLOCKING), so
    # a kernel that faults on what it read before a write is named by the CHECK_LAUNCH after it
    CUDA_LAUNCH_BLOCKING=1 gpu_tests .carry/gpu_test "${POISON_TIMEOUT_S:-240}" gpu_poison.log \
      '^#|OK \]|FAILED|Failure|error|CUDA' --gtest_filter='Gpu.PoisonedDeviceMemory*' ;;
  memory)  # memory as a verdict on the hunt's model: qwen3.5-397b-a17b@nvfp4 at MEMORY_LAYERS
    # (default "8 16") layers under MEMORY_CONFIG (the fast hybrid configs, qgemm=w4a16 and
    # dequant_bf16), batches 1 and 64: each (config, batch) OK or "does not fit" (decided before
    # loading where the plan says so), planned against measured memory for each OK one
    for layers in ${MEMORY_LAYERS:-8 16}; do
      timeout -k 5 "${MEMORY_TIMEOUT_S:-400}" $B run --model preset:qwen3.5-397b-a17b@nvfp4 --layers "$layers" \
        --config "${MEMORY_CONFIG:-device=cuda,gemm=fused,attention=naive,moe=fused,graphs=on,linear_attn=fused,qgemm=w4a16|dequant_bf16}" \
        --workload prompt=128,output=16,batch=1:64,repeats=1,warmup=0,timeout=600 \
        --json "$OUT/memory_$layers.json" 2>&1 | tee "$OUT/memory_$layers.log" | grep -vE "spread over|timed by"
    done ;;
  tp)  # the collective seam: its GPU tests (custom/fused ranks as streams of one GPU, NCCL's
    # single-rank communicator, the engine at tp=1 through the seam judged OK), allreduce-bench
    # --device cuda (4 KB to 256 MB, eager and graph), and batch 1 and 64 decode with the seam
    # (allreduce=nccl|custom) against the default on 8 layers of qwen3-30b-a3b.
    gpu_tests .carry/gpu_allreduce_test 150 gpu_allreduce_test.log '^#|OK \]|FAILED|Failure|error'
    timeout -k 5 60 $B allreduce-bench --device cuda --iters 20 2>&1 | tee "$OUT/allreduce_bench.log"
    timeout -k 5 120 $B run --model preset:qwen3-30b-a3b --layers 8 \
      --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=on,allreduce=auto|nccl|custom' \
      --workload prompt=128,output=32,batch=1:64,repeats=3,warmup=1,timeout=100 \
      --json "$OUT/tp1_seam.json" 2>&1 | tee "$OUT/tp1_seam.log" | grep -vE "spread|load "
    # tp=2 as two rank processes on this one GPU (TEST ONLY map INFERSWEEP_RANK_DEVICES=0,0;
    # allreduce=custom over CUDA IPC, NCCL takes one rank a GPU): tiny presets against tp=1, a
    # killed rank CRASHED, then 8 layers of qwen3-30b-a3b.
    INFERSWEEP_RANK_DEVICES=0,0 gpu_tests .carry/gpu_tp_test 200 gpu_tp_test.log '^#|OK \]|FAILED|Failure|error'
    INFERSWEEP_RANK_DEVICES=0,0 timeout -k 5 240 $B run --model preset:qwen3-30b-a3b --layers 8 \
      --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=off,tp=2,allreduce=custom' \
      --workload prompt=128,output=32,batch=1,repeats=3,warmup=1,timeout=200 \
      --json "$OUT/tp2_custom.json" 2>&1 | tee "$OUT/tp2_custom.log" | grep -vE "spread|load " ;;
  probe)  # the capability probe: test_kernel=sm100a UNSUPPORTED in the driver's words, never CRASHED
    gpu_tests .carry/gpu_probe_test 180 gpu_probe_test.log '^#|OK \]|FAILED|Failure|error'
    timeout -k 5 120 $B run --model preset:tiny-moe --config 'device=cuda,attention=naive|flash,test_kernel=none|sm100a' \
      --workload prompt=16,output=4,batch=1,repeats=1,warmup=0,timeout=60 2>&1 | tee "$OUT/probe_run.log" ;;
  cudnn)  # the cuDNN backends' GPU tests (GpuCudnn.*), then beside attention=flash on qwen3-30b-a3b
    # (48 layers): batch 1 and 64 decode (graphs=on), prefill 2048 (graphs=off), one run each
    gpu_tests .carry/gpu_probe_test 300 gpu_cudnn_test.log '^#|OK \]|FAILED|Failure|error' \
      --gtest_filter='GpuCudnn*:GpuProbe.*'
    $B run --model preset:qwen3-30b-a3b \
      --config 'device=cuda,gemm=fused,attention=flash|cudnn,kv_cache=bf16,moe=wgmma,graphs=on' \
      --workload prompt=512,output=64,batch=1:64,repeats=3,warmup=1,timeout=600 \
      --json "$OUT/cudnn_decode.json" 2>&1 | tee "$OUT/cudnn_decode.log" | grep -vE "spread|load "
    $B run --model preset:qwen3-30b-a3b \
      --config 'device=cuda,gemm=fused,attention=flash|cudnn,kv_cache=bf16,moe=wgmma,graphs=off' \
      --workload prompt=2048,output=2,batch=1,repeats=3,warmup=1,timeout=600 \
      --json "$OUT/cudnn_prefill.json" 2>&1 | tee "$OUT/cudnn_prefill.log" | grep -vE "spread|load " ;;
  cudnn_fp8)  # qgemm=cudnn beside qgemm=fp8_cublaslt (both moe=loop: the library GEMMs
    # run the experts one by one, a host sync each layer) on qwen3-30b-a3b@fp8_channel quantized
    # on the host, CUDNN_FP8_LAYERS layers (default 8: at 48 the loop's host syncs make a batch-64
    # step slow): batch 1 and 64 decode, then prefill 2048, graphs off
    $B run --model preset:qwen3-30b-a3b --layers "${CUDNN_FP8_LAYERS:-8}" --quantize fp8_channel \
      --config 'device=cuda,gemm=cublaslt,attention=flash,kv_cache=bf16,moe=loop,graphs=off,qgemm=fp8_cublaslt|cudnn' \
      --workload prompt=512,output=16,batch=1:64,repeats=3,warmup=1,timeout=600 \
      --json "$OUT/cudnn_fp8_decode.json" 2>&1 | tee "$OUT/cudnn_fp8_decode.log" | grep -vE "spread|load "
    $B run --model preset:qwen3-30b-a3b --layers "${CUDNN_FP8_LAYERS:-8}" --quantize fp8_channel \
      --config 'device=cuda,gemm=cublaslt,attention=flash,kv_cache=bf16,moe=loop,graphs=off,qgemm=fp8_cublaslt|cudnn' \
      --workload prompt=2048,output=2,batch=1,repeats=3,warmup=1,timeout=600 \
      --json "$OUT/cudnn_fp8_prefill.json" 2>&1 | tee "$OUT/cudnn_fp8_prefill.log" | grep -vE "spread|load " ;;
  ptest)  # the persistent kernel's GPU tests only (PTEST_FILTER: more, e.g. '*FusedQuantized*')
    gpu_tests .carry/gpu_test 240 gpu_ptest.log '^#|OK \]|FAILED|Failure|error|worst|steps' \
      --gtest_filter="*Persistent*${PTEST_FILTER:+:$PTEST_FILTER}" ;;
  bench)
    # qwen3-30b-a3b shapes, all 48 layers, bf16 synthetic weights generated on the GPU.
    # Every config at batch 1 (the reference ones are slow by design), the fast ones at 64 too.
    $B run --model preset:qwen3-30b-a3b \
      --config 'device=cuda,gemm=reference|cublaslt,attention=naive|flash,moe=loop|fused,graphs=off|on' \
      --workload prompt=512,output=64,batch=1,repeats=3,warmup=1,timeout=900 \
      --json "$OUT/bench_decode_b1.json" 2>&1 | tee "$OUT/bench_decode_b1.log"
    $B run --model preset:qwen3-30b-a3b \
      --config 'device=cuda,gemm=cublaslt,attention=flash,moe=fused,graphs=off|on' \
      --workload prompt=512,output=64,batch=64,repeats=3,warmup=1,timeout=900 \
      --json "$OUT/bench_decode_b64.json" 2>&1 | tee "$OUT/bench_decode_b64.log"
    $B run --model preset:qwen3-30b-a3b --config 'device=cuda,gemm=cublaslt,attention=flash,moe=fused,graphs=on' \
      --workload prompt=2048,output=2,batch=1,repeats=3,warmup=1,timeout=900 \
      --json "$OUT/bench_prefill.json" 2>&1 | tee "$OUT/bench_prefill.log" ;;
  matrix)  # every registered GPU config on the full 48 layers: the verdict (light timing)
    $B run --model preset:qwen3-30b-a3b \
      --config 'device=cuda,gemm=reference|cublaslt|fused|tma,attention=naive|flash,kv_cache=fp32|bf16,moe=loop|grouped|fused|wgmma,graphs=off|on|persistent' \
      --workload prompt=128,output=8,batch=1,repeats=1,warmup=0,timeout=900 \
      --json "$OUT/matrix.json" 2>&1 | tee "$OUT/matrix.log" | grep -vE "spread|timed by|load " ;;
  best)  # the fast configs: batch 1 and 64, prefill 2048
    $B run --model preset:qwen3-30b-a3b \
      --config 'device=cuda,gemm=fused|tma,attention=flash,kv_cache=bf16|fp32,moe=fused|wgmma,graphs=on' \
      --workload prompt=512,output=64,batch=1:64,repeats=3,warmup=1,timeout=900 \
      --json "$OUT/bench_best.json" 2>&1 | tee "$OUT/bench_best.log"
    $B run --model preset:qwen3-30b-a3b --config 'device=cuda,gemm=fused,attention=flash,moe=grouped,graphs=off' \
      --workload prompt=512,output=64,batch=1:64,repeats=3,warmup=1,timeout=900 \
      --json "$OUT/bench_grouped.json" 2>&1 | tee "$OUT/bench_grouped.log"
    $B run --model preset:qwen3-30b-a3b --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused|grouped|wgmma,graphs=off' \
      --workload prompt=2048,output=2,batch=1,repeats=3,warmup=1,timeout=900 \
      --json "$OUT/bench_prefill.json" 2>&1 | tee "$OUT/bench_prefill.log" ;;
  persistent)  # graphs=persistent against graphs=on at batch 1 (batch 64: both the kernel chain),
    # with where a persistent step's layer spends its time (TEST ONLY timeline, last step)
    INFERSWEEP_PERSISTENT_TIMELINE="$OUT/persistent_timeline.txt" $B run --model preset:qwen3-30b-a3b \
      --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent|on' \
      --workload prompt=512,output=64,batch=1:64,repeats=3,warmup=1,timeout=900 \
      --json "$OUT/bench_persistent.json" 2>&1 | tee "$OUT/bench_persistent.log"
    cat "$OUT/persistent_timeline.txt" ;;
  knobs)  # graphs=persistent at batch 1 under each TEST ONLY knob set of KNOB_SETS (bits: see
    # PersistentDecode in kernels/cuda/sm90a/decode_persistent.cu), then its spills in SASS
    for k in ${KNOB_SETS:-0}; do
      echo "# knobs $k"
      INFERSWEEP_PERSISTENT_KNOBS=$k INFERSWEEP_PERSISTENT_TIMELINE="$OUT/timeline_$k.txt" $B run --model preset:qwen3-30b-a3b \
        --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent' \
        --workload prompt=512,output=64,batch=1,repeats=3,warmup=1,timeout=900 \
        --json "$OUT/bench_knobs_$k.json" >"$OUT/bench_knobs_$k.log" 2>&1
      grep -E "^ +[0-9]+ +[0-9]|OK|INCORRECT|ERROR|UNSUPPORTED|spread" "$OUT/bench_knobs_$k.log" | head -6
      grep -v "^# block" "$OUT/timeline_$k.txt" | grep -E "layer|attention|q/k/v|gate|down|router|^ *o|steps" | tail -12
    done
    cuobjdump -sass -fun PersistentDecodeKernel "$B" 2>/dev/null | grep -cE "LDL|STL" ;;
  ab)  # graphs=persistent at batch 1: the builds AB_BINARIES in .carry (default infersweep_base, a
    # baseline build copied there, then infersweep) in turn, AB_ROUNDS times, each with its
    # timeline: lent machines differ between calls, so a change is judged against its baseline
    # within one call. An entry binary:n runs that build with TEST ONLY knobs n.
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for entry in ${AB_BINARIES:-infersweep_base infersweep}; do
        b=${entry%%:*} k=0
        [ "$b" != "$entry" ] && k=${entry#*:}
        echo "# $entry"
        t="$OUT/timeline_$b.txt"  # with knobs: timeline_<binary>_<knobs>.txt
        [ "$k" != 0 ] && t="$OUT/timeline_${b}_$k.txt"
        INFERSWEEP_PERSISTENT_KNOBS=$k INFERSWEEP_PERSISTENT_TIMELINE="$t" .carry/$b run --model preset:qwen3-30b-a3b \
          --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent' \
          --workload prompt=512,output=64,batch=1,repeats=3,warmup=1,timeout=900 2>&1 |
          grep -E "OK|INCORRECT|ERROR|UNSUPPORTED|spread"
        grep -v "^# block" "$t" | tail -11
      done
    done ;;
  mini_ab)  # a short A/B for a call with little device time left: qwen3-30b-a3b at MINI_LAYERS
    # (default 12) layers, batch 1, graphs=on and persistent, each AB_BINARIES build in turn,
    # AB_ROUNDS times (default 2); fits an H100's memory
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for b in ${AB_BINARIES:-infersweep_base infersweep}; do
        echo "# round $round: $b"
        timeout -k 5 90 .carry/$b run --model preset:qwen3-30b-a3b --layers "${MINI_LAYERS:-12}" \
          --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=on|persistent' \
          --workload prompt=512,output=64,batch=1,repeats=3,warmup=1,timeout=120 \
          --json "$OUT/mini_ab_${b}_$round.json" 2>&1 | grep -E " OK | INCORRECT| ERROR| UNSUPPORTED|CRASHED|spread"
      done
    done ;;
  ab_figures)  # the landed figures for each AB_BINARIES build in turn, AB_ROUNDS times, in one
    # call: graphs=persistent at batch 1 and 64 (64 runs the kernel chain; AB_BATCHES=1 on a GPU
    # that does not hold batch 64's 98 GB), prefill 2048 with moe=wgmma. A refactor is judged
    # against the previous main's build within one call.
    for round in $(seq "${AB_ROUNDS:-1}"); do
      for b in ${AB_BINARIES:-infersweep_base infersweep}; do
        echo "# round $round: $b"
        .carry/$b run --model preset:qwen3-30b-a3b \
          --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent' \
          --workload prompt=512,output=64,batch=${AB_BATCHES:-1:64},repeats=3,warmup=1,timeout=900 \
          --json "$OUT/ab_decode_${b}_$round.json" 2>&1 | grep -E " OK | INCORRECT| ERROR| UNSUPPORTED|spread"
        .carry/$b run --model preset:qwen3-30b-a3b \
          --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=wgmma,graphs=off' \
          --workload prompt=2048,output=2,batch=1,repeats=3,warmup=1,timeout=900 \
          --json "$OUT/ab_prefill_${b}_$round.json" 2>&1 | grep -E " OK | INCORRECT| ERROR| UNSUPPORTED|spread"
      done
    done ;;
  b64)  # batch-64 decode alone (graphs=persistent: the kernel chain) for each AB_BINARIES build in
    # turn, AB_ROUNDS times: the A/B of a batch-64 change, or a bisection over builds of several
    # commits in one call
    for round in $(seq "${AB_ROUNDS:-1}"); do
      for b in ${AB_BINARIES:-infersweep_base infersweep}; do
        echo "# round $round: $b"
        .carry/$b run --model preset:qwen3-30b-a3b \
          --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent' \
          --workload prompt=512,output=64,batch=64,repeats=3,warmup=1,timeout=300 \
          --json "$OUT/b64_${b}_$round.json" 2>&1 | grep -E " OK | INCORRECT| ERROR| UNSUPPORTED|spread"
      done
    done ;;
  quant_ab)  # the quantized persistent builds at batch 1, like ab: each QUANT_FORMATS format
    # (default "nvfp4 fp8_channel") with each AB_BINARIES build in turn, AB_ROUNDS times
    for round in $(seq "${AB_ROUNDS:-1}"); do
      for f in ${QUANT_FORMATS:-nvfp4 fp8_channel}; do
        for entry in ${AB_BINARIES:-infersweep_base infersweep}; do  # binary[:knobs], as in ab
          b=${entry%%:*} k=0
          [ "$b" != "$entry" ] && k=${entry#*:}
          echo "# $f $entry"
          t="$OUT/timeline_${f}_$b.txt"
          [ "$k" != 0 ] && t="$OUT/timeline_${f}_${b}_$k.txt"
          INFERSWEEP_PERSISTENT_KNOBS=$k quant_run ".carry/$b" "$f" persistent "$t" 2>&1 |
            grep -E "OK|INCORRECT|ERROR|UNSUPPORTED|spread"
          grep -v "^# block" "$t" | tail -11
        done
      done
    done ;;
  tail)  # the batch-1 step outside the persistent kernel, for each AB_BINARIES build: the lm_head
    # kernel (the streamed GEMV, or cuBLASLt's GEMM in builds before it) timed by ncu over three
    # decode steps with the bytes it read, then TPOT at 1 and 2 layers (the step's fixed part is
    # TPOT(1) minus a layer)
    for b in ${AB_BINARIES:-infersweep_base infersweep}; do
      echo "# $b"
      ncu --clock-control none --kernel-name regex:'GemvStream|nvjet_sm90_tss_384x8' --launch-count 3 \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --print-units base --csv .carry/$b generate \
        --model preset:qwen3-30b-a3b --backend cuda --tokens 1,2,3,4 --max-new-tokens 4 \
        --config gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent 2>/dev/null |
        python3 -c '
import csv, sys
for r in csv.reader(sys.stdin):
    if len(r) > 14 and r[12] in ("gpu__time_duration.sum", "dram__bytes_read.sum"):
        print(r[4][:60], r[12], r[14])'
      for layers in 1 2; do
        .carry/$b run --model preset:qwen3-30b-a3b --layers $layers \
          --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent' \
          --workload prompt=512,output=64,batch=1,repeats=3,warmup=1 2>&1 | grep -E "OK|INCORRECT|ERROR"
      done
    done ;;
  fixed)  # the step's parts outside the layers, for each AB_BINARIES build: graphs=persistent
    # TPOT at 1 and 2 layers (the fixed part is TPOT(1) minus a layer), then the 48-layer kernel
    # chain (graphs=on) at batch 1 and 64, where the logits' copy grows with the batch
    for b in ${AB_BINARIES:-infersweep_base infersweep}; do
      echo "# $b"
      for layers in 1 2; do
        .carry/$b run --model preset:qwen3-30b-a3b --layers $layers \
          --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent' \
          --workload prompt=512,output=64,batch=1,repeats=3,warmup=1 2>&1 | grep -E "OK|INCORRECT|ERROR"
      done
      .carry/$b run --model preset:qwen3-30b-a3b \
        --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=on' \
        --workload prompt=512,output=64,batch=1:64,repeats=3,warmup=1,timeout=900 2>&1 |
        grep -E "OK|INCORRECT|ERROR|spread"
    done ;;
  icache)  # cycles per FMA of straight-line code bodies of 8-192 KB: one warp per SM sub-partition,
    # a block of 16 warps, and 132 blocks of 16 (the instruction caches' sizes and their sharing)
    for shape in "1 4" "1 16" "132 16"; do .carry/icache_probe $shape; done 2>&1 | tee "$OUT/icache_probe.log" ;;
  smstream)  # every SM streaming at once from one instant: when each SM's first copy lands and
    # its bandwidth; 4 KB copies 48 (the decode kernel's MLP burst), 16 and 3 in flight an SM, the
    # same ~192 KB in flight as larger copies, from 1-8 issuing warps, and plain loads
    for a in "--in-flight 48" "--in-flight 16" "--in-flight 3" "--unit 8192 --in-flight 24" \
      "--unit 16384 --in-flight 12" "--unit 32768 --in-flight 6" "--in-flight 48 --issuers 2" \
      "--in-flight 48 --issuers 4" "--in-flight 48 --issuers 8" "--unit 8192 --in-flight 24 --issuers 2" \
      "--mode loads"; do
      .carry/sm_stream_probe $a
    done 2>&1 | tee "$OUT/sm_stream_probe.log" | grep -E "^# (sm_|aggregate|first)" ;;
  pprofile)  # where graphs=persistent's warps stall: ncu's sampled source counters (per SASS
    # instruction) and its warp-state and memory sections, one decode step at context 512
    ncu --clock-control none --kernel-name regex:PersistentDecodeKernel --launch-skip 2 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section SpeedOfLight -f -o "$OUT/pk" $B generate --model preset:qwen3-30b-a3b --backend cuda \
      --tokens "$(seq -s, 1 512)" --max-new-tokens 4 \
      --config gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent >"$OUT/pprofile.log" 2>&1
    tail -3 "$OUT/pprofile.log"
    ncu --import "$OUT/pk.ncu-rep" --page details >"$OUT/pk_details.txt" 2>&1
    ncu --import "$OUT/pk.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/pk_source.csv.gz"
    rm -f "$OUT/pk.ncu-rep"
    grep -iE "duration|throughput|stall|warp cycles|issued" "$OUT/pk_details.txt" | head -40 ;;
  quant)  # batch-1 decode of qwen3-30b-a3b quantized on the host, fastest configs
    # (FP4: qgemm=w4a16, FP8: qgemm=w8a16; QUANT_GRAPHS, default "persistent|on": the persistent
    # kernel, which streams every format, and the kernel chain). Each format
    # quantizes the 48 layers on the host first (tens of seconds on 16 cores; STAGES=quant_host
    # measures it); QUANT_FORMATS picks a subset, e.g. QUANT_FORMATS="nvfp4 fp8_block128".
    for f in ${QUANT_FORMATS:-nvfp4 mxfp4 fp8_block128 fp8_channel}; do
      quant_run "$B" "$f" "${QUANT_GRAPHS:-persistent|on}" "$OUT/timeline_$f.txt" \
        --json "$OUT/bench_quant_$f.json" 2>&1 | tee "$OUT/bench_quant_$f.log"
      [ -f "$OUT/timeline_$f.txt" ] && grep -v "^# block" "$OUT/timeline_$f.txt" | tail -11
    done ;;
  fp8_figures)  # qwen3-30b-a3b fp8_channel (FP8_FORMATS), 48 layers quantized on the host: decode
    # at batch 1 (graphs=persistent) and 64 (prompt 512, 64 tokens), prefill 2048 (moe=wgmma),
    # under qgemm=w8a16 (the codes decoded to bf16) and w8a8 (E4M3 activations on E4M3 tensor
    # cores), one binary, one call: the FP8 rows of the quantized figures.
    for f in ${FP8_FORMATS:-fp8_channel}; do
      for q in ${FP8_QGEMMS:-w8a16 w8a8}; do
        echo "# $f qgemm=$q"
        $B run --model preset:qwen3-30b-a3b --quantize "$f" \
          --config "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent,qgemm=$q" \
          --workload prompt=512,output=64,batch=1:64,repeats=3,warmup=1,timeout=900 \
          --json "$OUT/fp8_decode_${f}_$q.json" 2>&1 | grep -E " OK | INCORRECT| ERROR| UNSUPPORTED|CRASHED|spread"
        $B run --model preset:qwen3-30b-a3b --quantize "$f" \
          --config "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=wgmma,graphs=off,qgemm=$q" \
          --workload prompt=2048,output=2,batch=1,repeats=3,warmup=1,timeout=900 \
          --json "$OUT/fp8_prefill_${f}_$q.json" 2>&1 | grep -E " OK | INCORRECT| ERROR| UNSUPPORTED|CRASHED|spread"
      done
    done ;;
  quant_batch)  # the quantized grouped MMA kernels' GPU tests (mma.sync and wgmma),
    # a bad expert scale under each moe value, then qwen3-30b-a3b, 48 layers, quantized on the
    # host: QUANT_FORMATS (default fp8_channel nvfp4) x QUANT_SHAPES (graphs:workload, default
    # batch 1 and 64 at graphs=on, prefill 2048 at graphs=off), moe=QUANT_MOE (default
    # fused|wgmma: moe=wgmma takes the prefill chunks' experts)
    gpu_tests .carry/gpu_quant_test 300 gpu_quant_test.log '^#|OK \]|FAILED|Failure|error' \
      --gtest_filter='*Grouped*:*MoeExpert*:*DenseQuantMma*'
    # An expert's channel scale x1000 (batch 64, prefill 64 x 128 tokens): INCORRECT. fp8_channel
    # scales a whole row; NVFP4's first group scale x1000 saturates at E4M3's 448 and stays OK.
    for moe in fused wgmma; do
      $B run --model preset:qwen3-30b-a3b --layers 4 --quantize fp8_channel \
        --test-inject-fault bad-quant-scale:1000@model.layers.0.mlp.experts.2.down_proj.weight \
        --config device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=$moe,graphs=on,qgemm=w8a16 \
        --workload prompt=128,output=8,batch=64,repeats=1,warmup=0,timeout=600 2>&1 |
        grep -E " OK | INCORRECT|reason" | cut -c1-300
    done
    for f in ${QUANT_FORMATS:-fp8_channel nvfp4}; do
      q=w8a16; case $f in nvfp4|mxfp4) q=w4a16 ;; esac
      for shape in ${QUANT_SHAPES:-"on:prompt=512,output=64,batch=1:64" "off:prompt=2048,output=2,batch=1"}; do
        set -- ${shape/:/ }
        $B run --model preset:qwen3-30b-a3b --quantize "$f" \
          --config "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=${QUANT_MOE:-fused|wgmma},graphs=$1,qgemm=$q" \
          --workload "$2,repeats=3,warmup=1,timeout=900" --json "$OUT/quant_batch_${f}_$1.json" 2>&1 |
          tee "$OUT/quant_batch_${f}_$1.log" | grep -vE "timed by|spread"
      done
    done ;;
  kv_fp8)  # kv_cache=fp8 beside bf16: the KV kernels' GPU tests, then qwen3-30b-a3b
    # (bf16 weights, 48 layers), the fast config at batch 64 and a 4k context (KV_WORKLOAD); the
    # prompt's prefill runs as chunks of 512 tokens a sequence (32,768 rows a step)
    gpu_tests .carry/gpu_kernels_test 120 gpu_kernels_kv.log '^#|OK \]|FAILED|Failure' \
      --gtest_filter='*FlashAttention*:*QkNormRope*'
    $B run --model preset:qwen3-30b-a3b \
      --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16|fp8,moe=fused,graphs=on' \
      --workload "${KV_WORKLOAD:-prompt=4032,output=64,batch=64},repeats=3,warmup=1,timeout=900" \
      --json "$OUT/kv_fp8.json" 2>&1 | tee "$OUT/kv_fp8.log" | grep -vE "timed by|spread" ;;
  kv_profile)  # the decode attention kernels under kv_cache=bf16 and fp8 at batch 64 and a
    # 4k context (qwen3-30b-a3b --layers 2, graphs off), from ncu: time, DRAM bytes and
    # throughput, instructions per cycle, occupancy, registers
    for kv in bf16 fp8; do
      ncu --clock-control none --cache-control none --kernel-name regex:'FlashDecode|FlashCombine' \
        --launch-count 8 --csv --print-units base \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.avg.per_cycle_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \
        $B generate --model preset:qwen3-30b-a3b --layers 2 --tokens "$(seq -s, 1 4000)" \
        --max-new-tokens 4 --batch 64 --backend cuda \
        --config "gemm=fused,attention=flash,kv_cache=$kv,moe=fused,graphs=off" \
        >"$OUT/kvprofile_$kv.csv" 2>"$OUT/kvprofile_$kv.err"
      echo "## kv_cache=$kv"
      python3 scripts/ncu_table.py "$OUT/kvprofile_$kv.csv" --metrics | tail -9
    done ;;
  quant_profile)  # which kernel limits the quantized figures, from ncu: per-kernel time
    # and DRAM bytes of qwen3-30b-a3b --layers 3 steps, graphs off, for each QUANT_FORMATS format
    # (default bf16 fp8_channel nvfp4; bf16: the dense model, beside) and each
    # QPROFILE_SHAPES (tokens:batch:new, default 1 prompt token x 64 rows x 2 decode steps, then a
    # 2048-token prefill), QPROFILE_CONFIG (default the fast config's kernels at graphs=off),
    # QPROFILE_QGEMM (default w8a16 for FP8, w4a16 for FP4).
    for f in ${QUANT_FORMATS:-bf16 fp8_channel nvfp4}; do
      q=w8a16 quantize="--quantize $f"
      case $f in nvfp4|mxfp4) q=w4a16 ;; bf16) q=reference quantize= ;; esac
      if [ "$f" != bf16 ] && [ -n "${QPROFILE_QGEMM:-}" ]; then q=$QPROFILE_QGEMM; fi
      for shape in ${QPROFILE_SHAPES:-1:64:2 2048:1:1}; do
        IFS=: read -r tokens batch new <<<"$shape"
        ncu --clock-control none --cache-control none --launch-count "${PROFILE_LAUNCHES:-400}" \
          --kernel-name regex:'^[^S]|^S[^y]' \
          --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --print-units base \
          $B generate --model preset:qwen3-30b-a3b --layers 3 $quantize --tokens "$(seq -s, 1 "$tokens")" \
          --max-new-tokens "$new" --batch "$batch" --backend cuda \
          --config "${QPROFILE_CONFIG:-gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=off},qgemm=$q" \
          >"$OUT/qprofile_${f}_${shape//:/_}.csv" 2>"$OUT/qprofile_${f}_${shape//:/_}.err"
        echo "## $f tokens=$tokens batch=$batch new=$new"
        python3 scripts/ncu_table.py "$OUT/qprofile_${f}_${shape//:/_}.csv" --summary
      done
    done ;;
  quant_host)  # host quantization of qwen3-30b-a3b: seconds per layer (no GPU work)
    .carry/quantize_bench --layers 1,3 --formats "${QUANT_BENCH_FORMATS:-nvfp4,fp8_block128}" 2>&1 |
      tee "$OUT/quantize_bench.log" ;;
  profile)  # per-kernel times of batch-1 decode steps (3 layers; graphs off so ncu sees kernels)
    # The first 1,182 launches generate the synthetic weights (then 3 router upcasts at the first
    # batch); then prefill of PROFILE_PROMPT tokens + decode.
    # PROFILE_PROMPT=2048 PROFILE_NEW_TOKENS=1 profiles a prefill of 2048 tokens instead.
    ncu --clock-control none --cache-control none --target-processes all --launch-skip 1183 \
      --launch-count "${PROFILE_LAUNCHES:-120}" \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --print-units base \
      $B generate --model preset:qwen3-30b-a3b --layers 3 --tokens "$(seq -s, 1 "${PROFILE_PROMPT:-1}")" \
      --max-new-tokens "${PROFILE_NEW_TOKENS:-3}" --batch "${PROFILE_BATCH:-1}" --backend cuda \
      --config "${PROFILE_CONFIG:-gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=off}" >"$OUT/ncu.csv" 2>"$OUT/ncu.err"
    python3 scripts/ncu_table.py "$OUT/ncu.csv" ;;
  hybrid_matrix)  # every registered config's verdict on qwen3-next-80b-a3b, 8 layers
    $B run --model preset:qwen3-next-80b-a3b --layers 8 \
      --config 'device=cuda,gemm=reference|cublaslt|fused|tma,attention=naive|flash,kv_cache=fp32|bf16,moe=loop|grouped|fused|wgmma,graphs=off|on|persistent,linear_attn=reference|fused' \
      --workload prompt=128,output=8,batch=1,repeats=1,warmup=0,timeout=600 \
      --json "$OUT/hybrid_matrix.json" >"$OUT/hybrid_matrix.log" 2>&1
    grep -E " OK | INCORRECT| ERROR| CRASHED| TIMEOUT" "$OUT/hybrid_matrix.log" | head -80
    grep -cE " UNSUPPORTED" "$OUT/hybrid_matrix.log"
    grep -E "configs|summary|verdicts" "$OUT/hybrid_matrix.log" | tail -5 ;;
  yardstick)  # qwen3-next-80b-a3b at 16 layers, bf16: the fast config judged by the ceilings
    # widened to the bf16 yardstick's drift; a corrupted recurrent state and NaNs from the fourth
    # layer (its first full-attention one) stay INCORRECT under them
    for fault in "" bad-state:0 nan-layer:3; do
      $B run --model preset:qwen3-next-80b-a3b --layers 16 ${fault:+--test-inject-fault $fault} \
        --config device=cuda,gemm=fused,attention=naive,moe=fused,linear_attn=fused,graphs=on \
        --workload prompt=64,output=8,batch=1,repeats=1,warmup=0,timeout=600 2>&1 |
        grep -E " OK | INCORRECT|judged by|reason" | cut -c1-60,170-400
    done ;;
  hybrid_figures)  # qwen3-next-80b-a3b, 48 layers, quantized on the host: the hybrids' headline rows under the
    # fastest registered config of each format: batch 1 and 64 (prompt 512, 64 tokens), prefill
    # 4096 (moe=wgmma: long chunks' experts on wgmma; decode rows take moe=fused's kernels either
    # way), and served at concurrency 10 (ISL 512, OSL 64, 40 requests). HYBRID_LAYERS fewer
    # layers where the GPU holds less than the model (24 on an 80 GB H100); HYBRID_SERVE=0 skips
    # the served row.
    cfg=${HYBRID_CONFIG:-attention=flash,kv_cache=bf16,linear_attn=chunked}
    for f in ${HYBRID_FORMATS:-fp8_channel nvfp4}; do
      q=w8a16; case $f in nvfp4|mxfp4) q=w4a16 ;; esac
      $B run --model preset:qwen3-next-80b-a3b --layers "${HYBRID_LAYERS:-48}" --quantize "$f" \
        --config "device=cuda,gemm=fused,moe=fused,graphs=on,qgemm=$q,$cfg" \
        --workload prompt=512,output=64,batch=1:64,repeats=3,warmup=1,timeout=900 \
        --json "$OUT/hybrid_decode_$f.json" 2>&1 | tee "$OUT/hybrid_decode_$f.log" | grep -vE "timed by"
      $B run --model preset:qwen3-next-80b-a3b --layers "${HYBRID_LAYERS:-48}" --quantize "$f" \
        --config "device=cuda,gemm=fused,moe=${HYBRID_PREFILL_MOE:-wgmma},graphs=off,qgemm=$q,$cfg" \
        --workload prompt=4096,output=2,batch=1,repeats=3,warmup=1,timeout=900 \
        --json "$OUT/hybrid_prefill_$f.json" 2>&1 | tee "$OUT/hybrid_prefill_$f.log" | grep -vE "timed by"
      if [ "${HYBRID_SERVE:-1}" != 0 ]; then
        $B run --model preset:qwen3-next-80b-a3b --layers "${HYBRID_LAYERS:-48}" --quantize "$f" \
          --config "device=cuda,gemm=fused,moe=fused,graphs=on,qgemm=$q,$cfg" --workload timeout=900 \
          --serve concurrency=10,isl=512,osl=64,requests=40,warmup=1 \
          --json "$OUT/hybrid_serve_$f.json" 2>&1 | tee "$OUT/hybrid_serve_$f.log" | grep -vE "timed by"
      fi
    done ;;
  hybrid_ab)  # qwen3-next-80b-a3b fp8_channel (HYBRID_FORMATS), 48 layers, quantized on the host:
    # decode at batch 1 and 64 (prompt 512, 64 tokens) and prefill 4096, each AB_BINARIES build
    # under its fastest config: HYBRID_CONFIG_BASE for the first (the kernels main had), then
    # HYBRID_CONFIG (flash at head_dim 256 on a bf16 cache, linear_attn=chunked) for the rest.
    # The hybrids' headline rows, against the previous main's, in one call.
    # HYBRID_LAYERS (default 48) fewer layers where the GPU holds less than the whole model;
    # HYBRID_QGEMM another qgemm than the format's (w8a16 or w4a16), e.g. w8a8;
    # HYBRID_PREFILL_MOE the prefill's moe (default fused; wgmma for long chunks' experts).
    base_cfg=${HYBRID_CONFIG_BASE:-attention=naive,linear_attn=fused}
    new_cfg=${HYBRID_CONFIG:-attention=flash,kv_cache=bf16,linear_attn=chunked}
    first=1
    for b in ${AB_BINARIES:-infersweep_base infersweep}; do
      cfg=$new_cfg
      if ((first)); then cfg=$base_cfg; first=0; fi
      for f in ${HYBRID_FORMATS:-fp8_channel}; do
        q=w8a16; case $f in nvfp4|mxfp4) q=w4a16 ;; esac
        q=${HYBRID_QGEMM:-$q}
        echo "# $b $f qgemm=$q: $cfg"
        .carry/$b run --model preset:qwen3-next-80b-a3b --layers "${HYBRID_LAYERS:-48}" --quantize "$f" \
          --config "device=cuda,gemm=fused,moe=fused,graphs=on,qgemm=$q,$cfg" \
          --workload prompt=512,output=64,batch=1:64,repeats=3,warmup=1,timeout=900 \
          --json "$OUT/hybrid_ab_decode_${b}_$f.json" 2>&1 | grep -E " OK | INCORRECT| ERROR| UNSUPPORTED|CRASHED|spread"
        .carry/$b run --model preset:qwen3-next-80b-a3b --layers "${HYBRID_LAYERS:-48}" --quantize "$f" \
          --config "device=cuda,gemm=fused,moe=${HYBRID_PREFILL_MOE:-fused},graphs=off,qgemm=$q,$cfg" \
          --workload prompt=4096,output=2,batch=1,repeats=3,warmup=1,timeout=900 \
          --json "$OUT/hybrid_ab_prefill_${b}_$f.json" 2>&1 | grep -E " OK | INCORRECT| ERROR| UNSUPPORTED|CRASHED|spread"
      done
    done ;;
  hybrid_profile)  # per-kernel times of qwen3-next-80b-a3b batch-1 steps, 4 layers (3 linear, 1
    # full), bf16 (PROFILE_QUANTIZE: a format, quantized on the host), graphs off so ncu sees each
    # kernel: every kernel but the weight generator's. PROFILE_PROMPT tokens (default 8) then
    # PROFILE_NEW_TOKENS (default 3) decode steps at PROFILE_BATCH rows (default 1).
    quantize=
    if [ -n "${PROFILE_QUANTIZE:-}" ]; then quantize="--quantize $PROFILE_QUANTIZE"; fi
    ncu --clock-control none --cache-control none --target-processes all \
      --kernel-name-base demangled --kernel-name "regex:^(?!.*Synthetic)" \
      --launch-skip "${PROFILE_SKIP:-0}" --launch-count "${PROFILE_LAUNCHES:-200}" \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --print-units base \
      $B generate --model preset:qwen3-next-80b-a3b --layers 4 $quantize \
      --tokens "$(seq -s, 1 "${PROFILE_PROMPT:-8}")" --max-new-tokens "${PROFILE_NEW_TOKENS:-3}" \
      --batch "${PROFILE_BATCH:-1}" --backend cuda \
      --config "${PROFILE_CONFIG:-gemm=fused,attention=naive,moe=fused,graphs=off,linear_attn=fused}" >"$OUT/ncu_hybrid.csv" 2>"$OUT/ncu_hybrid.err"
    python3 scripts/ncu_table.py "$OUT/ncu_hybrid.csv" ;;
  serve)  # serving on the H200: qwen3-30b-a3b bf16, 48 layers, ISL 1024 / OSL 256, the fast
    # graphs=on config: lockstep batch 1 and 64, then served at concurrency 1, 8, 10 (the vLLM
    # anchor's), 64 and 256, prompts prefilled in 1024-token chunks, up to 8,192 a step, and
    # the highest concurrency meeting TTFT p99 <= 2 s and TPOT p99 <= 50 ms
    c=${SERVE_CONFIG:-device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=on}
    $B run --model preset:qwen3-30b-a3b --config "$c" \
      --workload prompt=1024,output=256,batch=1:64,repeats=3,warmup=1,timeout=900 \
      --json "$OUT/serve_lockstep.json" 2>&1 | tee "$OUT/serve_lockstep.log" | grep -vE "timed by"
    $B run --model preset:qwen3-30b-a3b --config "$c" \
      --serve "${SERVE_LOAD:-concurrency=1:8:10:64:256,isl=1024,osl=256,duration=4,warmup=1,chunk=1024,prefill_tokens=8192}" \
      --slo "${SERVE_SLO:-ttft_ms=2000,tpot_ms=50}" \
      --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log" ;;
  fleet_sweep)  # sweeps through a local fleet (a coordinator and one agent on this machine, as
    # scripts/demo.sh runs them): FLEET_SWEEPS (default the hunt's serving sweeps at tp=1 and 2;
    # the agent's ranks share this GPU through the TEST ONLY map), then each sweep's results
    free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
    grpc=127.0.0.1:$(free_port) data=$(mktemp -d)
    $B coordinator --listen "$grpc" --db "$data/infersweep.db" --metrics-listen "127.0.0.1:$(free_port)" \
      >"$OUT/fleet_coordinator.log" 2>&1 &
    coordinator=$!
    sleep 1
    INFERSWEEP_RANK_DEVICES=0,0 $B agent --coordinator "$grpc" --id h200 --spool "$data/spool.db" \
      --metrics-listen "127.0.0.1:$(free_port)" >"$OUT/fleet_agent.log" 2>&1 &
    agent=$!
    for spec in ${FLEET_SWEEPS:-sweeps/hunt-serving.yaml sweeps/hunt-serving-tp2.yaml}; do
      name=$(basename "$spec" .yaml)
      start=$(date +%s)
      timeout "${FLEET_TIMEOUT_S:-280}" $B submit "$spec" --coordinator "$grpc" --wait >"$OUT/fleet_$name.log" 2>&1
      echo "# $spec: $(( $(date +%s) - start )) s"
      $B results --coordinator "$grpc" --format table >"$OUT/fleet_${name}_results.txt" 2>&1
      grep -E "^#|summary|OK|UNSUPPORTED|INCORRECT|CRASHED|TIMEOUT|ERROR" "$OUT/fleet_$name.log" | tail -8
    done
    $B results --coordinator "$grpc" --format json >"$OUT/fleet_results.json" 2>&1
    kill $agent $coordinator 2>/dev/null; wait $agent $coordinator 2>/dev/null ;;
  hunt_figures)  # served against lockstep: qwen3-next-80b-a3b fp8_channel (48 layers) at
    # concurrency 1, 10 and 64, and qwen3.5-397b-a17b@nvfp4 (HUNT_397B_LAYERS) at 1 and 64; ISL
    # 512, OSL 64, the hybrid fast config (graphs=on, flash attention at head_dim 256 on a bf16
    # cache, chunked Gated DeltaNet prefill; HUNT_CONFIG another); HUNT_LOCKSTEP=0 skips the
    # lockstep runs
    for job in ${HUNT_JOBS:-"qwen3-next-80b-a3b fp8_channel w8a16 48 1:10:64" "qwen3.5-397b-a17b nvfp4 w4a16 ${HUNT_397B_LAYERS:-8} 1:64"}; do
      set -- $job
      c="device=cuda,gemm=fused,moe=fused,graphs=on,qgemm=$3,${HUNT_CONFIG:-attention=flash,kv_cache=bf16,linear_attn=chunked}"
      if [ "${HUNT_LOCKSTEP:-1}" != 0 ]; then
        $B run --model "preset:$1" --layers "$4" --quantize "$2" --config "$c" \
          --workload "prompt=512,output=64,batch=$5,repeats=3,warmup=1,timeout=900" \
          --json "$OUT/hunt_lockstep_$1.json" 2>&1 | tee "$OUT/hunt_lockstep_$1.log" | grep -vE "timed by"
      fi
      $B run --model "preset:$1" --layers "$4" --quantize "$2" --config "$c" \
        --workload timeout=900 --serve "concurrency=$5,isl=512,osl=64,requests=${HUNT_REQUESTS:-64},warmup=1" \
        --json "$OUT/hunt_serve_$1.json" 2>&1 | tee "$OUT/hunt_serve_$1.log"
    done ;;
  hybrid_397b)  # qwen3.5-397b-a17b@nvfp4, 4 layers: every config judged, none CRASHED
    $B run --model preset:qwen3.5-397b-a17b --layers 4 --quantize nvfp4 \
      --config 'device=cuda,gemm=reference|fused,attention=naive,moe=loop|fused,graphs=off|on|persistent,qgemm=reference|dequant_bf16|w4a16,linear_attn=reference|fused' \
      --workload prompt=128,output=8,batch=1,repeats=1,warmup=0,timeout=600 \
      --json "$OUT/hybrid_397b.json" >"$OUT/hybrid_397b.log" 2>&1
    grep -E " OK | INCORRECT| ERROR| CRASHED| TIMEOUT| UNSUPPORTED" "$OUT/hybrid_397b.log" | head -60 ;;
  provenance)  # what ran: the fast config at batch 1 (a graph replay) and 64 (cuBLASLt rows),
    # and graphs=off; each result's kernel log printed and kept in its JSON
    $B run --model preset:qwen3-30b-a3b --show-kernels \
      --config 'device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=on|off' \
      --workload prompt=512,output=16,batch=1:64,repeats=1,warmup=1,timeout=900 \
      --json "$OUT/provenance.json" 2>&1 | tee "$OUT/provenance.log" | grep -vE "spread|timed by" ;;
  peer)
    timeout 420 python3 scripts/hf_peer_bench.py 2>&1 ;;
  fixtures)
    python3 scripts/gen_hf_fixtures.py --out "$OUT/hf" 2>&1 | grep -v "it/s" &&
      tar czf "$OUT/hf.tgz" -C "$OUT" hf && rm -rf "$OUT/hf" ;;
  quant_fixtures)  # unpack quant.tgz into tests/fixtures/ here, then commit it
    python3 scripts/gen_quant_fixtures.py --out tests/fixtures/quant 2>&1 | grep -v "it/s" &&
      .carry/quant_fixtures_test 2>&1 | tee "$OUT/quant_fixtures_test.log" |
      grep -E '^#|OK \]|FAILED|Failure|error|SKIPPED'
    tar czf "$OUT/quant.tgz" -C tests/fixtures quant ;;
  esac
done
