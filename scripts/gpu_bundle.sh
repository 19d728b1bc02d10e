#!/usr/bin/env bash
# Builds the CUDA binaries here (the GPU machine has no Abseil/gRPC) and packs them, stripped,
# with the shared libraries they need, into .carry/, and that folder into .carry.tar.xz (~12 MB:
# the device tool carries 64 MiB with the working tree, less than .carry itself). Carry
# `.carry.tar.xz`; scripts/gpu.sh unpacks it there.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
# CUDA_ARCHS: the portable kernels' GPU architectures (INFERSWEEP_CUDA_ARCHS: default 90, the
# lent H200's; "fleet" for a bundle that runs on every GPU generation from sm_80 on).
cmake -S . -B "$BUILD" -G Ninja -DINFERSWEEP_CUDA=ON -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} \
  -DINFERSWEEP_CUDA_ARCHS="${CUDA_ARCHS:-90}" >/dev/null
# The device tool carries at most 64 MiB (working tree included), less than every binary
# together: PACK=gpu (default) packs what STAGES=test|bench|best|matrix|quant|profile|peer|tp|probe
# use, PACK=tp, PACK=probe and PACK=quant what STAGES=tp, STAGES=probe and
# STAGES=quant_batch|quant_profile use alone, PACK=fixtures what
# STAGES=quant_fixtures|quant_host use (plus the CPU-runnable fixture tests), PACK=ab the CLI
# alone beside EXTRA_CARRY's builds of other commits (STAGES=b64).
case ${PACK:-gpu} in
  gpu) BINARIES="cli/infersweep tests/gpu_test tests/gpu_quant_test tests/gpu_kernels_test tests/gpu_scaled_gemm_test tests/gpu_allreduce_test tests/gpu_probe_test tests/gpu_tp_test" ;;
  tp) BINARIES="cli/infersweep tests/gpu_allreduce_test tests/gpu_tp_test" ;;
  probe) BINARIES="cli/infersweep tests/gpu_probe_test" ;;
  quant) BINARIES="cli/infersweep tests/gpu_quant_test" ;;
  probes) BINARIES="cli/infersweep bench/decode_chain_probe bench/icache_probe bench/sm_stream_probe" ;;
  fixtures) BINARIES="cli/infersweep tests/quant_fixtures_test tests/hf_fixtures_test tests/harness_test bench/quantize_bench" ;;
  ab) BINARIES="cli/infersweep" ;;  # with EXTRA_CARRY builds of other commits, for STAGES=b64
  *) echo "PACK must be gpu, tp, probe, quant, probes, fixtures or ab" >&2; exit 2 ;;
esac
cmake --build "$BUILD" -j"$(nproc)" --target $(for b in $BINARIES; do basename "$b"; done)
rm -rf .carry && mkdir -p .carry/lib
for b in $BINARIES; do
  strip -o ".carry/$(basename "$b")" "$BUILD/$b"
done
# Every non-system, non-CUDA shared library the binaries load (Abseil, protobuf, ...).
for b in .carry/*; do
  [ -f "$b" ] || continue
  ldd "$b" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux)[.-]|cuda|cublas' || true
done | sort -u | xargs -r -I{} cp -L {} .carry/lib/
# Extra binaries (EXTRA_CARRY="path:name ..."), e.g. a build of the previous main for an A/B.
for extra in ${EXTRA_CARRY:-}; do
  strip -o ".carry/${extra#*:}" "${extra%%:*}"
done
tar cJf .carry.tar.xz -C .carry .
du -sh .carry .carry.tar.xz
