// Attention's plan: which kernel family runs a model's attention under the options, the KV
// cache it reads, and what that needs. Decided once, from the options and the model's heads;
// the cache allocation, the scratch, the launch, the model refusal and the capability probe all
// read it (engine/cuda/attention_runner.cc, engine/plan/model_limits.cc,
// engine/plan/probe_kernels.cc). Host code: built and tested without CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/options.h"

namespace infersweep {

// The kernel family of attention=naive|flash|cudnn.
enum class AttentionPath {
  kNaive,  // materialised fp32 scores over an fp32 cache
  kFlash,  // tiled online softmax; tensor-core decode and prefill kernels where the heads allow
  kCudnn,  // cuDNN's fused attention graph over the bf16 cache, read in place
};

struct AttentionHeads {
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
};

struct AttentionPlan {
  AttentionPath path = AttentionPath::kNaive;
  KvCache kv = KvCache::kFp32;
  int kv_bytes_per_element = 4;  // 4, 2 or 1
  bool kv_scales = false;        // fp8: a power-of-two scale per token and kv head, K and V
  // cuDNN's kernel loads whole tiles past a sequence's KV length and multiplies their masked
  // (zero) probabilities in: the cache starts zeroed, so 0 x NaN never happens.
  bool zero_cache = false;
  bool cudnn_io = false;  // q and o staged in bf16 for cuDNN
};

// Every reason the heads refuse the options' attention and KV cache (empty: none).
std::vector<std::string> AttentionRefusals(const CudaOptions& options, const AttentionHeads& heads);
// The plan, or Unimplemented naming every reason AttentionRefusals gives.
absl::StatusOr<AttentionPlan> PlanAttention(const CudaOptions& options,
                                            const AttentionHeads& heads);

// Floats of score or partial-sum scratch the plan's kernels need for `rows` rows over a cache of
// `capacity` tokens (cuDNN keeps its scores inside its kernel).
int64_t AttentionScoreFloats(const AttentionPlan& plan, const AttentionHeads& heads, int rows,
                             int capacity);

}  // namespace infersweep
