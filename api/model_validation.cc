// The consistency of a ModelConfig, whatever its source: sizes in range, heads that divide,
// top-k within the experts, the traits each architecture has and has not, and a parameter total
// that the counts can hold.
#include <cmath>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "api/model_config.h"
#include "api/model_config_internal.h"
#include "api/status_macros.h"

namespace infersweep {
namespace {

using model_config_internal::ArchFromModelType;
using model_config_internal::FieldError;
using model_config_internal::IsHybridArch;
using model_config_internal::IsMoeArch;
using model_config_internal::TotalParamsBound;

// Upper bounds that keep every size product (and the parameter totals) well inside int64 and every
// per-dimension product the header computes in `int` (q_dim, kv_dim) inside int32.
constexpr int kMaxHidden = 1 << 20;
constexpr int kMaxVocab = 1 << 24;
constexpr int kMaxLayers = 4096;
constexpr int kMaxExperts = 4096;
constexpr int kMaxHeads = 4096;
constexpr int kMaxHeadDim = 4096;
constexpr int kMaxProjDim = 1 << 20;  // num_heads * head_dim
constexpr int kMaxIntermediate = 1 << 22;
constexpr int kMaxPositions = 1 << 30;
constexpr double kMaxTotalParams = 1e15;  // ~1000x the largest models we know of
constexpr int kMaxConvKernel = 64;

absl::Status CheckRange(std::string_view source, std::string_view field, int64_t value, int64_t lo,
                        int64_t hi) {
  if (value < lo || value > hi) {
    return FieldError(source, field, absl::StrFormat("%d is out of range [%d, %d]", value, lo, hi));
  }
  return absl::OkStatus();
}

// Sizes in range and heads that divide: what every architecture has.
absl::Status ValidateDims(const ModelConfig& c, std::string_view source) {
  RETURN_IF_ERROR(CheckRange(source, "hidden_size", c.hidden_size, 1, kMaxHidden));
  RETURN_IF_ERROR(CheckRange(source, "num_hidden_layers", c.num_layers, 1, kMaxLayers));
  RETURN_IF_ERROR(CheckRange(source, "num_attention_heads", c.num_q_heads, 1, kMaxHeads));
  RETURN_IF_ERROR(CheckRange(source, "num_key_value_heads", c.num_kv_heads, 1, c.num_q_heads));
  if (c.num_q_heads % c.num_kv_heads != 0) {
    return FieldError(source, "num_key_value_heads",
                      absl::StrFormat("num_attention_heads %d is not divisible by "
                                      "num_key_value_heads %d",
                                      c.num_q_heads, c.num_kv_heads));
  }
  RETURN_IF_ERROR(CheckRange(source, "head_dim", c.head_dim, 2, kMaxHeadDim));
  if (c.head_dim % 2 != 0) {
    return FieldError(source, "head_dim",
                      absl::StrFormat("%d must be even (RoPE rotates pairs)", c.head_dim));
  }
  if (static_cast<int64_t>(c.num_q_heads) * c.head_dim > kMaxProjDim) {
    return FieldError(
        source, "head_dim",
        absl::StrFormat("num_attention_heads * head_dim = %d is larger than %d",
                        static_cast<int64_t>(c.num_q_heads) * c.head_dim, kMaxProjDim));
  }
  RETURN_IF_ERROR(
      CheckRange(source, "intermediate_size", c.intermediate_size, 0, kMaxIntermediate));
  RETURN_IF_ERROR(CheckRange(source, "vocab_size", c.vocab_size, 1, kMaxVocab));
  RETURN_IF_ERROR(
      CheckRange(source, "max_position_embeddings", c.max_position_embeddings, 1, kMaxPositions));
  if (!(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0)) {
    return FieldError(source, "rms_norm_eps",
                      absl::StrFormat("%g must be a positive finite number", c.rms_norm_eps));
  }
  if (!(std::isfinite(c.rope_theta) && c.rope_theta > 0)) {
    return FieldError(source, "rope_theta",
                      absl::StrFormat("%g must be a positive finite number", c.rope_theta));
  }
  if (c.torch_dtype.empty()) return FieldError(source, "torch_dtype", "must not be empty");
  RETURN_IF_ERROR(CheckRange(source, "decoder_sparse_step", c.decoder_sparse_step, 1, kMaxLayers));
  return absl::OkStatus();
}

// Experts for the MoE architectures only, their counts in range, and a dense MLP for every layer
// that is not MoE.
absl::Status ValidateExperts(const ModelConfig& c, std::string_view source) {
  if (c.num_experts < 0) {
    return FieldError(source, "num_experts", absl::StrFormat("%d is negative", c.num_experts));
  }
  if (IsMoeArch(c.arch) && c.num_experts == 0) {
    return FieldError(
        source, "num_experts",
        absl::StrFormat("architecture %s needs at least one expert", ModelArchName(c.arch)));
  }
  if (!IsMoeArch(c.arch) && c.num_experts != 0) {
    return FieldError(source, "num_experts",
                      absl::StrFormat("architecture %s is dense but num_experts is %d",
                                      ModelArchName(c.arch), c.num_experts));
  }
  if (c.is_moe()) {
    RETURN_IF_ERROR(CheckRange(source, "num_experts", c.num_experts, 1, kMaxExperts));
    if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts) {
      return FieldError(source, "num_experts_per_tok",
                        absl::StrFormat("top-k %d must be in [1, num_experts = %d]",
                                        c.num_experts_per_tok, c.num_experts));
    }
    RETURN_IF_ERROR(
        CheckRange(source, "moe_intermediate_size", c.moe_intermediate_size, 1, kMaxIntermediate));
    RETURN_IF_ERROR(CheckRange(source, "shared_expert_intermediate_size",
                               c.shared_expert_intermediate_size, 0, kMaxIntermediate));
    for (int layer : c.mlp_only_layers) {
      if (layer < 0 || layer >= c.num_layers) {
        return FieldError(source, "mlp_only_layers",
                          absl::StrFormat("layer %d is out of range [0, %d)", layer, c.num_layers));
      }
    }
  } else if (c.shared_expert_intermediate_size != 0) {
    return FieldError(source, "shared_expert_intermediate_size",
                      "a dense model cannot have a shared expert");
  }

  for (int l = 0; l < c.num_layers; ++l) {
    if (!c.IsMoeLayer(l) && c.intermediate_size <= 0) {
      return FieldError(source, "intermediate_size",
                        absl::StrFormat("must be positive: layer %d uses the dense MLP", l));
    }
  }
  return absl::OkStatus();
}

// The hybrids' linear-attention layers: one kind per layer, their heads and widths in range, and
// a partial RoPE that rotates an even number of dims.
absl::Status ValidateHybrid(const ModelConfig& c, std::string_view source) {
  if (static_cast<int64_t>(c.layer_attention.size()) != c.num_layers) {
    return FieldError(
        source, "layer_types",
        absl::StrFormat("%d layer kinds for %d layers", c.layer_attention.size(), c.num_layers));
  }
  RETURN_IF_ERROR(CheckRange(source, "linear_num_key_heads", c.linear_num_key_heads, 1, kMaxHeads));
  RETURN_IF_ERROR(
      CheckRange(source, "linear_num_value_heads", c.linear_num_value_heads, 1, kMaxHeads));
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    return FieldError(source, "linear_num_value_heads",
                      absl::StrFormat("%d is not a multiple of linear_num_key_heads %d",
                                      c.linear_num_value_heads, c.linear_num_key_heads));
  }
  RETURN_IF_ERROR(CheckRange(source, "linear_key_head_dim", c.linear_key_head_dim, 1, kMaxHeadDim));
  RETURN_IF_ERROR(
      CheckRange(source, "linear_value_head_dim", c.linear_value_head_dim, 1, kMaxHeadDim));
  RETURN_IF_ERROR(
      CheckRange(source, "linear_conv_kernel_dim", c.linear_conv_kernel_dim, 1, kMaxConvKernel));
  const int64_t conv_dim =
      2 * static_cast<int64_t>(c.linear_num_key_heads) * c.linear_key_head_dim +
      static_cast<int64_t>(c.linear_num_value_heads) * c.linear_value_head_dim;
  if (conv_dim > kMaxProjDim) {
    return FieldError(
        source, "linear_num_value_heads",
        absl::StrFormat("the linear-attention width %d is larger than %d", conv_dim, kMaxProjDim));
  }
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1) || c.rotary_dim() < 2 ||
      c.rotary_dim() % 2 != 0) {
    return FieldError(source, "partial_rotary_factor",
                      absl::StrFormat("%g of head_dim %d rotates %d dims; it must be an even "
                                      "number of at least 2",
                                      c.partial_rotary_factor, c.head_dim, c.rotary_dim()));
  }
  return absl::OkStatus();
}

// The other architectures have none of the hybrids' traits.
absl::Status ValidateNotHybrid(const ModelConfig& c, std::string_view source) {
  if (!c.layer_attention.empty()) {
    return FieldError(
        source, "layer_types",
        absl::StrFormat("architecture %s has no linear-attention layers", ModelArchName(c.arch)));
  }
  if (c.partial_rotary_factor != 1.0 || c.attn_output_gate || c.zero_centered_norm) {
    return FieldError(source, "model_type",
                      absl::StrFormat("partial RoPE, gated attention and zero-centred norms "
                                      "belong to the hybrid architectures, not %s",
                                      ModelArchName(c.arch)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateModelConfig(const ModelConfig& c, std::string_view source) {
  if (!c.model_type.empty() && ArchFromModelType(c.model_type) != c.arch) {
    return FieldError(source, "model_type",
                      absl::StrFormat("\"%s\" does not match architecture %s", c.model_type,
                                      ModelArchName(c.arch)));
  }
  RETURN_IF_ERROR(ValidateDims(c, source));
  RETURN_IF_ERROR(ValidateExperts(c, source));
  RETURN_IF_ERROR(IsHybridArch(c.arch) ? ValidateHybrid(c, source) : ValidateNotHybrid(c, source));
  const double total = TotalParamsBound(c);
  if (total > kMaxTotalParams) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the configured model would have %.3g parameters, more than the supported %.3g", source,
        total, kMaxTotalParams));
  }
  return absl::OkStatus();
}

}  // namespace infersweep
