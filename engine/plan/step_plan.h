// The step's plan (the graphs axis and the fused GEMV): for one forward step, whether its launches
// are captured into a CUDA graph and replayed, whether the layers run as the persistent kernel
// or a chain of kernels a layer, and whether the linears take the fused GEMV. CudaModel's step
// reads it; its fallback lines go to the launch log. Host code: built and tested without CUDA.
#pragma once

#include <string>
#include <vector>

#include "engine/options.h"

namespace infersweep {

enum class StepLayers {
  kPersistent,  // graphs=persistent at batch 1: every layer in one cooperative kernel
  kChain,       // a chain of kernels a layer
};

struct StepShape {
  int rows = 0;          // activation rows of the step
  int n = 1;             // tokens a sequence: 1 for decode
  bool ragged = false;   // a serving step (per-row slots and positions)
  int gemv_k = 0;        // the widest K of the layers' GEMVs (hidden, q_dim, linear value dim)
  int intermediate = 0;  // the widest MLP intermediate (the down projection's K)
  bool persistent_ready = false;  // the persistent kernel's tables are built
  bool explain = false;           // fill StepPlan::fallbacks: the launch log is recording
};

struct StepPlan {
  StepLayers layers = StepLayers::kChain;
  bool fused_gemv = false;  // gemm=fused|tma's GEMV path with norms and residual adds fused in
  std::vector<std::string> fallbacks;  // for the launch log; empty unless StepShape::explain
};

StepPlan PlanStep(const CudaOptions& options, const StepShape& step);

// Whether a step of `tokens_per_sequence` tokens (the longest sequence's, in a ragged step) is
// captured into a CUDA graph and replayed: decode steps under graphs=on|persistent.
bool CapturesStep(const CudaOptions& options, int tokens_per_sequence, bool last_logits_only);

// Why the fused GEMV does not take `rows` rows of K up to `k`.
std::string GemvRefusal(int rows, int k);

}  // namespace infersweep
