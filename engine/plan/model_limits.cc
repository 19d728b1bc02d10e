#include "engine/plan/model_limits.h"

#include "absl/strings/str_cat.h"
#include "engine/plan/attention_plan.h"
#include "engine/plan/linear_attention_plan.h"
#include "engine/plan/moe_plan.h"
#include "kernels/cuda/limits.h"

namespace infersweep {

std::vector<std::string> CudaModelLimitRefusals(const ModelConfig& c, const CudaOptions& o) {
  std::vector<std::string> why;
  // The collective: the custom all-reduce moves 16-byte packs of fp32.
  switch (o.parallel.allreduce) {
    case AllReduce::kCustom:
      if (c.hidden_size % 4 != 0)
        why.push_back(absl::StrCat("allreduce=custom moves 16-byte packs: hidden_size ",
                                   c.hidden_size, " must be a multiple of 4"));
      break;
    case AllReduce::kReference:
    case AllReduce::kAuto:
    case AllReduce::kNccl:
    case AllReduce::kFused:
      break;
  }
  // Linear attention (Gated DeltaNet layers).
  for (std::string& reason : LinearAttentionRefusals(o, c)) why.push_back(std::move(reason));
  // Attention and the KV cache.
  for (std::string& reason : AttentionRefusals(o, {c.num_q_heads, c.num_kv_heads, c.head_dim}))
    why.push_back(std::move(reason));
  // The MoE block.
  if (c.is_moe())
    for (std::string& reason : MoeRefusals(
             o, {c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size}))
      why.push_back(std::move(reason));
  return why;
}

}  // namespace infersweep
