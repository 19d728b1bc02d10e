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

// The collective a tensor-parallel rank sums its partial results through (engine/tp_model.h).
class RankCollective {
 public:
  virtual ~RankCollective() = default;
  // Replaces data[0, n) by the sum over every rank of its data[0, n), the same on every rank.
  virtual void AllReduceSum(float* data, int64_t n) = 0;
};

struct CpuModelOptions {
  cpu::MatmulVariant matmul = cpu::MatmulVariant::kNaive;
  int threads = 0;  // 0: all cores
  FaultInjection fault;  // TEST ONLY
  // Set when the model is one rank of a tensor-parallel model: its weights are that rank's
  // shard, and the attention output, the MLP or MoE output and (Gated DeltaNet) out_proj's
  // output are partial sums, all-reduced here before they join the residual. Its logits are
  // the rank's lm_head rows (a vocabulary shard). Not owned.
  RankCollective* collective = nullptr;
};

// `weights` must outlive the model.
std::unique_ptr<Model> MakeCpuModel(const HostModel& weights, const CpuModelOptions& options = {});

}  // namespace infersweep
