#!/usr/bin/env bash
# The README's main command: installs what it needs, builds, then runs the whole system on this
# machine with its embedded default sweep:
#   a coordinator (SQLite under data/demo), one local agent (GPU if present, else CPU),
#   the default sweep (sweeps/demo-gpu.yaml or sweeps/demo-cpu.yaml) with live progress,
#   then the results table and the best config.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh
B=$PWD/build/cli/infersweep
DATA=${DATA:-$PWD/data/demo}
rm -rf "$DATA" && mkdir -p "$DATA"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GRPC=127.0.0.1:$(free_port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

"$B" coordinator --listen "$GRPC" --db "$DATA/infersweep.db" \
  --metrics-listen "127.0.0.1:$(free_port)" >"$DATA/coordinator.log" 2>&1 &
pids+=($!)
sleep 1
"$B" agent --coordinator "$GRPC" --id demo-agent --spool "$DATA/agent-spool.db" \
  --metrics-listen "127.0.0.1:$(free_port)" >"$DATA/agent.log" 2>&1 &
pids+=($!)

# A GPU host sweeps the CUDA backends, anything else the CPU ones.
if "$B" agents --coordinator "$GRPC" >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 &&
   grep -q INFERSWEEP_HAVE_CUDA build/CMakeCache.txt 2>/dev/null; then
  SPEC=sweeps/demo-gpu.yaml MODEL=preset:qwen3-30b-a3b SM=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
else
  SPEC=sweeps/demo-cpu.yaml MODEL=preset:tiny-moe SM=cpu
fi
echo "# coordinator $GRPC, data in $DATA; sweep $SPEC"
"$B" agents --coordinator "$GRPC"
"$B" submit "$SPEC" --coordinator "$GRPC" --wait
echo
"$B" results --coordinator "$GRPC" --model "$MODEL" --format table
echo
"$B" best --coordinator "$GRPC" --model "$MODEL" --sm-arch "$SM"
