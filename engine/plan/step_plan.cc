#include "engine/plan/step_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/limits.h"

namespace infersweep {

StepPlan PlanStep(const CudaOptions& o, const StepShape& s) {
  StepPlan plan;
  const bool decode = s.n == 1;
  plan.layers = s.persistent_ready && s.rows == 1 && decode && !s.ragged ? StepLayers::kPersistent
                                                                         : StepLayers::kChain;
  plan.fused_gemv = UsesFusedGemv(o.gemm) && cuda::GemvSupports(s.rows, s.gemv_k) &&
                    cuda::GemvSupports(s.rows, s.intermediate);
  if (!s.explain) return plan;
  switch (plan.layers) {
    case StepLayers::kPersistent:
      break;
    case StepLayers::kChain:
      if (UsesFusedGemv(o.gemm) && !plan.fused_gemv)
        plan.fallbacks.push_back(absl::StrCat(
            "gemm=", AxisValueName(o.gemm), ": ", decode ? "decode, " : "prefill chunk, ",
            GemvRefusal(s.rows, std::max(s.gemv_k, s.intermediate)),
            ": the layers' linears unfused (cuBLASLt for bf16 weights), not the fused GEMV"));
      if (s.persistent_ready && decode)
        plan.fallbacks.push_back(absl::StrCat(
            "graphs=persistent: ", s.ragged ? "ragged " : "", "decode of ", s.rows,
            " rows: the graphs=on kernel chain (the persistent kernel takes batch 1)"));
      break;
  }
  return plan;
}

bool CapturesStep(const CudaOptions& o, int tokens_per_sequence, bool last_logits_only) {
  switch (o.graphs) {
    case Graphs::kOff:
      return false;
    case Graphs::kOn:
    case Graphs::kPersistent:
      return tokens_per_sequence == 1 && last_logits_only;
  }
  return false;
}

std::string GemvRefusal(int rows, int k) {
  if (rows > cuda::kGemvMaxRows) return absl::StrCat(rows, " rows (> ", cuda::kGemvMaxRows, ")");
  return absl::StrCat(rows, " rows of K up to ", k,
                      " (the GEMV takes K % 8 == 0 and rows x K x 4 bytes of shared memory up "
                      "to ",
                      cuda::kGemvMaxSharedBytes, ")");
}

}  // namespace infersweep
