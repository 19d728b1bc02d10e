#include "engine/plan/attention_plan.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/limits.h"

namespace infersweep {

std::vector<std::string> AttentionRefusals(const CudaOptions& options, const AttentionHeads& h) {
  std::vector<std::string> why;
  switch (options.attention) {
    case Attention::kNaive:
    case Attention::kCudnn:  // cuDNN says what it cannot plan (the capability probe asks it)
      break;
    case Attention::kFlash:
      if (!cuda::FlashSupports(h.q_heads, h.kv_heads, h.head_dim))
        why.push_back(absl::StrCat("attention=flash supports head_dim <= ", cuda::kFlashMaxHeadDim,
                                   " (a multiple of 8) and <= ", cuda::kFlashMaxGroup,
                                   " q heads per kv head; the model "
                                   "has head_dim ",
                                   h.head_dim, ", ", h.q_heads, " q and ", h.kv_heads,
                                   " kv heads"));
      break;
  }
  switch (options.kv_cache) {
    case KvCache::kFp32:
    case KvCache::kBf16:
      break;
    case KvCache::kFp8:
      if (!cuda::FlashDecodeMmaSupports(h.head_dim))
        why.push_back(
            absl::StrCat("kv_cache=fp8 is read by the tensor-core flash kernels only: head_dim ",
                         h.head_dim, " must be 32, 64, 128 or 256"));
      break;
  }
  return why;
}

absl::StatusOr<AttentionPlan> PlanAttention(const CudaOptions& options, const AttentionHeads& h) {
  if (std::vector<std::string> why = AttentionRefusals(options, h); !why.empty())
    return absl::UnimplementedError(absl::StrJoin(why, "; "));
  AttentionPlan plan;
  plan.kv = options.kv_cache;
  switch (options.kv_cache) {
    case KvCache::kFp32:
      plan.kv_bytes_per_element = 4;
      break;
    case KvCache::kBf16:
      plan.kv_bytes_per_element = 2;
      break;
    case KvCache::kFp8:
      plan.kv_bytes_per_element = 1;
      plan.kv_scales = true;
      break;
  }
  switch (options.attention) {
    case Attention::kNaive:
      plan.path = AttentionPath::kNaive;
      break;
    case Attention::kFlash:
      plan.path = AttentionPath::kFlash;
      break;
    case Attention::kCudnn:
      plan.path = AttentionPath::kCudnn;
      plan.zero_cache = true;
      plan.cudnn_io = true;
      break;
  }
  return plan;
}

int64_t AttentionScoreFloats(const AttentionPlan& plan, const AttentionHeads& h, int rows,
                             int capacity) {
  switch (plan.path) {
    case AttentionPath::kNaive:
      return static_cast<int64_t>(rows) * h.q_heads * capacity;
    case AttentionPath::kFlash:
      return cuda::FlashPartialFloats(rows, h.q_heads, h.kv_heads, h.head_dim);
    case AttentionPath::kCudnn:
      return 0;
  }
  return 0;
}

}  // namespace infersweep
