// The CPU reference: fp32 arithmetic on weights upcast exactly from their stored dtype.
// The root of the trust chain; kept simple so it is obviously right.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/fault_injection.h"
#include "engine/model.h"
#include "engine/weights.h"
#include "kernels/cpu/matmul.h"

namespace infersweep {

struct CpuModelOptions {
  cpu::MatmulVariant matmul = cpu::MatmulVariant::kNaive;
  int threads = 0;  // 0: all cores
  FaultInjection fault;  // TEST ONLY
};

// `weights` must outlive the model.
std::unique_ptr<Model> MakeCpuModel(const HostModel& weights, const CpuModelOptions& options = {});

}  // namespace infersweep
