// Linear attention's plan (Gated DeltaNet layers): which delta-rule kernel a layer runs and
// whether the causal conv applies SiLU itself, and what the model must be for it. The runner
// (engine/cuda/linear_attention_runner.cc) switches on the plan; the model limits and the probe
// read the same switch. Host code: built and tested without CUDA.
#pragma once

#include <string>
#include <vector>

#include "api/model_config.h"
#include "engine/options.h"

namespace infersweep {

enum class DeltaRulePath {
  kReference,  // one thread a state column, token by token: the reference
  kFused,      // a state column in registers over 8 lanes, gates and decay applied in place
  // Sequences of kGatedDeltaChunkedMinTokens+ rows in the chunked form on tensor cores, shorter
  // ones as kFused.
  kChunked,
};

struct LinearAttentionPlan {
  DeltaRulePath delta_rule = DeltaRulePath::kReference;
  bool silu_in_conv = false;  // the causal conv applies SiLU; else a separate pass over its output
  // One-row sequences (decode rows) take GatedDeltaDecode: conv, gates, delta rule and gated
  // RMSNorm in one launch. Sequences of more rows (prefill chunks) take the path above.
  bool decode_fused = false;
};

LinearAttentionPlan PlanLinearAttention(const CudaOptions& options);

// Every reason the model cannot run under the options' linear attention, or none.
std::vector<std::string> LinearAttentionRefusals(const CudaOptions& options,
                                                 const ModelConfig& model);

}  // namespace infersweep
