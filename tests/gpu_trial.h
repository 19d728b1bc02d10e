// The trial request the GPU tests judge configs with: a 2-layer model, a short prompt, batch 1
// and 4 (4 rows take the batched decode kernels), 2 timed repeats after a warm-up.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "api/backend_config.h"
#include "api/trial.h"
#include "engine/backends.h"
#include "engine/model.h"

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

// Every position's logits of one prompt at batch 1 under `config` (normalized here); empty, with
// a failure recorded, where the model cannot be built.
inline std::vector<float> AllLogits(HostModel& host, const BackendConfig& config,
                                    const std::vector<int32_t>& prompt) {
  auto normalized = NormalizeBackendConfig(config);
  EXPECT_TRUE(normalized.ok()) << normalized.status();
  if (!normalized.ok()) return {};
  auto model = CreateModel(host, *normalized);
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<float> logits;
  if (!model.ok()) return logits;
  EXPECT_TRUE((*model)->StartBatch(1, static_cast<int>(prompt.size())).ok());
  EXPECT_TRUE(
      (*model)->Forward(prompt, static_cast<int>(prompt.size()), LogitsMode::kAll, &logits).ok());
  return logits;
}

}  // namespace infersweep
