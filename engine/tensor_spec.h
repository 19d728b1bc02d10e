// The list of weight tensors a model needs, derived from its config alone.
//
// One table drives checkpoint validation, synthetic weight generation and device upload, so the
// three can never disagree about names or shapes. Names are canonical HF names in the qwen3_moe
// style (per-expert `mlp.experts.E.{gate,up,down}_proj.weight`); the checkpoint loader maps them to
// each architecture's spelling on disk.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "api/model_config.h"
#include "core/quant/format.h"

namespace infersweep {

enum class WeightKind {
  kEmbedding,     // [vocab, hidden]
  kNorm,          // RMSNorm gain
  kLinear,        // [out, in] projection
  kBias,          // projection bias
  kRouter,        // [experts, hidden]
  kCenteredNorm,  // RMSNorm gain applied as (1 + w) (hybrid decoder norms)
  kConv,          // depthwise conv [channels, 1, kernel] (fan_in = kernel)
  kDtBias,        // linear-attention dt_bias [value heads]
  kALog,          // linear-attention A_log [value heads]
};

struct TensorSpec {
  std::string name;             // canonical name
  std::vector<int64_t> shape;   // row-major, HF order ([out, in] for linears)
  WeightKind kind = WeightKind::kLinear;
  int layer = -1;               // -1 for embed / final norm / lm_head
  int expert = -1;              // routed expert index, -1 otherwise
  int64_t fan_in = 0;           // input width for linears (sets the synthetic init scale)

  // A quantized linear is stored as several tensors, one spec each (engine/quant/layout.h):
  // its codes (part kData; `shape` is the stored shape, the logical one is [shape[0], fan_in])
  // and its scales. Dense tensors keep quant == kNone.
  QuantFormat quant = QuantFormat::kNone;
  QuantPart part = QuantPart::kData;
  std::string linear;          // the logical weight's canonical name ("...q_proj.weight")
  std::vector<DType> dtypes;   // stored dtypes accepted; empty: F32, F16 or BF16
  bool optional = false;       // may be absent from a checkpoint
  std::string rule;            // how the shape follows from [N, K], for messages

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Every weight the forward pass reads, in a stable order (all dense).
std::vector<TensorSpec> ModelTensorSpecs(const ModelConfig& config);

// Linears that may be quantized: attention q/k/v/o (gated q_proj included), dense MLPs, routed
// and shared experts, and Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj. The embeddings,
// norms, biases, router, shared-expert gate, lm_head, and Gated DeltaNet's in_proj_a, in_proj_b,
// conv1d, dt_bias and A_log always stay dense (ModelOpt's default exclusions).
bool IsQuantizable(const TensorSpec& spec);

// The stored tensors when each linear takes `format_of(spec)` (kNone: stays dense; the caller
// decides, e.g. IsQuantizable for --quantize, the stored tensors for a checkpoint):
// such a linear's spec is replaced by its parts, in layout order. Errors name the tensor (e.g.
// nvfp4 on an input width that is not a multiple of 16).
absl::StatusOr<std::vector<TensorSpec>> QuantizedTensorSpecs(
    const std::vector<TensorSpec>& dense,
    const std::function<QuantFormat(const TensorSpec&)>& format_of);

}  // namespace infersweep
