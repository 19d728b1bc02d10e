#!/usr/bin/env bash
# The README's test command: installs what it needs, builds, runs the whole suite with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 900 "$@"
