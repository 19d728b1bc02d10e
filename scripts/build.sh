#!/usr/bin/env bash
# Configures and builds into ./build (CUDA backends are compiled when a CUDA toolkit is found).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} ${CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$jobs"
