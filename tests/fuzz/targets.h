// The fuzz targets, by the area whose parsers they feed; tests/fuzz/targets.cc lists them all in
// one table.
#pragma once

#include <vector>

#include "tests/fuzz/driver.h"

namespace infersweep::fuzz {

// Command-line and config strings (api/, engine/fault_injection.h): --workload, --serve, --slo,
// --config, --test-inject-fault, model descriptions.
std::vector<FuzzTarget> StringTargets();
// Checkpoint files (engine/safetensors.h, engine/checkpoint.h, api/model_config.h,
// engine/quant/scheme.h): safetensors headers, config.json, quantization configs, shard indexes.
std::vector<FuzzTarget> CheckpointTargets();
// What crosses the network (coordinator/, proto/): sweep specs, agents' result JSON, the
// agent's assignments, and the gRPC messages themselves.
std::vector<FuzzTarget> ServiceTargets();

}  // namespace infersweep::fuzz
