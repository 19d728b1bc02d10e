#!/usr/bin/env bash
# The README's test command: installs what it needs, builds, runs the whole suite with ctest,
# then the fuzz harness again under AddressSanitizer and UBSan in a build of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 900 "$@"
# The sanitizer build compiles only the harness and the libraries it links (no CUDA); the run is
# bounded by inputs per target (docs/SECURITY.md "Fuzzing the parsers").
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINFERSWEEP_CUDA=OFF \
  -DINFERSWEEP_SANITIZE=address ${CMAKE_ARGS:-} >/dev/null
cmake --build build-asan -j"${JOBS:-$(nproc)}" --target fuzz_test
(cd build-asan/tests/fuzz &&
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  INFERSWEEP_FUZZ_INPUTS="${INFERSWEEP_FUZZ_INPUTS:-5000}" \
  INFERSWEEP_FUZZ_SECONDS="${INFERSWEEP_FUZZ_SECONDS:-30}" ./fuzz_test)
