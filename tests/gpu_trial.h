// The trial request the GPU tests judge configs with: a 2-layer model, a short prompt, batch 1
// and 4 (4 rows take the batched decode kernels), 2 timed repeats after a warm-up.
#pragma once

#include <string>

#include "api/backend_config.h"
#include "engine/backends.h"
#include "api/trial.h"

namespace infersweep {

inline TrialRequest GpuRequest(const std::string& model, const std::string& config,
                               const std::string& fault = "") {
  TrialRequest r;
  r.trial_id = "gpu";
  r.model = model;
  r.layers = 2;
  r.config = *ParseBackendConfig(config);
  r.workload.prompt_len = 16;
  r.workload.output_len = 8;
  r.workload.repeats = 2;
  r.workload.warmup = 1;
  r.workload.batch_sizes = {1, 4};
  r.inject_fault = fault;
  return r;
}

// A CUDA build on one H200 (sm_90), as preflight sees it: for judging configs UNSUPPORTED
// before any weight loads, on machines without a GPU.
inline LocalDevices SimulatedH200() {
  LocalDevices h200;
  h200.has_cuda_build = true;
  h200.gpu_count = 1;
  h200.sm = 90;
  h200.gpu_name = "NVIDIA H200";
  return h200;
}

}  // namespace infersweep
