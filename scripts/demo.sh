#!/usr/bin/env bash
# The README's main command: installs what it needs, builds, and runs the demo on the embedded
# default (a tiny synthetic MoE model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh
./build/cli/infersweep demo "$@"
