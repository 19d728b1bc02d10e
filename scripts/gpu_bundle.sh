#!/usr/bin/env bash
# Builds the CUDA binaries here (the GPU machine has no Abseil/gRPC) and packs them, stripped,
# with the shared libraries they need, into .carry/ for the device tool (`carry: [".carry"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
cmake -S . -B "$BUILD" -G Ninja -DINFERSWEEP_CUDA=ON -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target infersweep gpu_test hf_fixtures_test harness_test \
  gpu_quant_test quant_fixtures_test gpu_kernels_test gpu_scaled_gemm_test quantize_bench
rm -rf .carry && mkdir -p .carry/lib
for b in cli/infersweep tests/gpu_test tests/hf_fixtures_test tests/harness_test \
         tests/gpu_quant_test tests/quant_fixtures_test tests/gpu_kernels_test \
         tests/gpu_scaled_gemm_test bench/quantize_bench; do
  strip -o ".carry/$(basename "$b")" "$BUILD/$b"
done
# Every non-system, non-CUDA shared library the binaries load (Abseil, protobuf, ...).
for b in .carry/infersweep .carry/gpu_test; do
  ldd "$b" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux)[.-]|cuda|cublas' || true
done | sort -u | xargs -r -I{} cp -L {} .carry/lib/
du -sh .carry
