// What every runner of a CUDA model's step reads: the model's shapes and weights, the backend
// options, the TEST ONLY fault and the model's stream. Owned by the model; runners hold it by
// reference for the model's lifetime.
#pragma once

#include <cuda_runtime.h>

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

}  // namespace infersweep
