// What every runner of a CUDA model's step reads: the model's shapes and weights, the backend
// options, the TEST ONLY fault and the model's stream. Owned by the model; runners hold it by
// reference for the model's lifetime.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "api/model_config.h"
#include "engine/fault_injection.h"
#include "engine/options.h"
#include "engine/weights.h"

namespace infersweep {

struct RunnerContext {
  const ModelConfig& config;
  const ModelWeights& weights;  // what the step reads: a quantized model's view, else the upload
  const CudaOptions& options;
  const FaultInjection& fault;  // TEST ONLY
  cudaStream_t stream;
};

// A ragged step's rows (serving: continuous batching). Rows [0, decode_rows) are one token of a
// sequence each, at their own positions; each prefill chunk's rows follow, contiguous.
struct RaggedRows {
  const int2* rows = nullptr;  // device [rows]: each row's (KV slot, position)
  int decode_rows = 0;
  struct Chunk {
    int first_row = 0, tokens = 0, slot = 0;
  };
  std::vector<Chunk> chunks;  // the prefill chunks (2+ tokens)
};

}  // namespace infersweep
