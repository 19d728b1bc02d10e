// The list of weight tensors a model needs, derived from its config alone.
//
// One table drives checkpoint validation, synthetic weight generation and device upload, so the
// three can never disagree about names or shapes. Names are canonical HF names in the qwen3_moe
// style (per-expert `mlp.experts.E.{gate,up,down}_proj.weight`); the checkpoint loader maps them to
// each architecture's spelling on disk.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/model_config.h"

namespace infersweep {

enum class WeightKind {
  kEmbedding,   // [vocab, hidden]
  kNorm,        // RMSNorm gain
  kLinear,      // [out, in] projection
  kBias,        // projection bias
  kRouter,      // [experts, hidden]
};

struct TensorSpec {
  std::string name;             // canonical name
  std::vector<int64_t> shape;   // row-major, HF order ([out, in] for linears)
  WeightKind kind = WeightKind::kLinear;
  int layer = -1;               // -1 for embed / final norm / lm_head
  int expert = -1;              // routed expert index, -1 otherwise
  int64_t fan_in = 0;           // input width for linears (sets the synthetic init scale)

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Every weight the forward pass reads, in a stable order.
std::vector<TensorSpec> ModelTensorSpecs(const ModelConfig& config);

}  // namespace infersweep
