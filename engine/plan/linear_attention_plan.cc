#include "engine/plan/linear_attention_plan.h"

#include "absl/strings/str_cat.h"
#include "core/unreachable.h"
#include "kernels/cuda/limits.h"

namespace infersweep {

LinearAttentionPlan PlanLinearAttention(const CudaOptions& o) {
  switch (o.linear_attn) {
    case LinearAttn::kReference:
      return {DeltaRulePath::kReference, /*silu_in_conv=*/false};
    case LinearAttn::kFused:
      return {DeltaRulePath::kFused, /*silu_in_conv=*/true};
    case LinearAttn::kFusedDecode:
      return {DeltaRulePath::kFused, /*silu_in_conv=*/true, /*decode_fused=*/true};
    case LinearAttn::kChunked:
      return {DeltaRulePath::kChunked, /*silu_in_conv=*/true, /*decode_fused=*/true};
  }
  Unreachable("PlanLinearAttention: a value outside LinearAttn");
}

std::vector<std::string> LinearAttentionRefusals(const CudaOptions& o, const ModelConfig& c) {
  std::vector<std::string> why;
  const LinearAttentionPlan plan = PlanLinearAttention(o);
  switch (plan.delta_rule) {
    case DeltaRulePath::kReference:
      break;
    case DeltaRulePath::kFused:
    case DeltaRulePath::kChunked:
      if (!c.has_linear_attention())
        why.push_back(absl::StrCat("linear_attn=", AxisValueName(o.linear_attn),
                                   ": the model has no linear-attention layers (linear_attn="
                                   "reference stands for every value)"));
      else if (!cuda::GatedDeltaFusedSupports(c.linear_key_head_dim))
        why.push_back(absl::StrCat(
            "linear_attn=", AxisValueName(o.linear_attn), " holds a state column in ",
            cuda::kGatedDeltaLanesPerColumn, " lanes' registers: key head dim ",
            c.linear_key_head_dim, " must be a multiple of ", cuda::kGatedDeltaLanesPerColumn,
            " and <= ", cuda::kGatedDeltaLanesPerColumn * cuda::kGatedDeltaMaxRowsPerLane));
      if (plan.delta_rule == DeltaRulePath::kChunked && c.has_linear_attention() &&
          !cuda::GatedDeltaChunkedSupports(c.linear_key_head_dim, c.linear_value_head_dim))
        why.push_back(
            absl::StrCat("linear_attn=", AxisValueName(o.linear_attn),
                         " runs its products in 16-row MMA tiles: key head dim ",
                         c.linear_key_head_dim, " and value head dim ", c.linear_value_head_dim,
                         " must be multiples of 16 and <= ", cuda::kGatedDeltaChunkedMaxHeadDim));
      break;
  }
  if (plan.decode_fused && c.has_linear_attention() &&
      !cuda::GatedDeltaDecodeSupports(c.linear_key_head_dim, c.linear_value_head_dim))
    why.push_back(absl::StrCat(
        "linear_attn=", AxisValueName(o.linear_attn), " holds a value head's whole state in one ",
        "block of ", cuda::kGatedDeltaLanesPerColumn, " lanes a column: key head dim ",
        c.linear_key_head_dim,
        " must be <= ", cuda::kGatedDeltaLanesPerColumn * cuda::kGatedDeltaDecodeMaxRowsPerLane,
        " and value head dim ", c.linear_value_head_dim,
        " <= ", cuda::kGatedDeltaDecodeMaxColumns));
  if (c.has_linear_attention() && c.linear_conv_kernel_dim > cuda::kCausalConvMaxTaps)
    why.push_back(absl::StrCat("device=cuda: the causal conv takes <= ", cuda::kCausalConvMaxTaps,
                               " taps, not ", c.linear_conv_kernel_dim));
  return why;
}

}  // namespace infersweep
