// The device memory a CUDA config needs for a model and a workload, pool by pool, computed on the
// host before any weight loads: from the same sizes the allocation sites use (the tensor table
// and the quantized layouts for the weights, the attention plan for the KV cache and the score
// scratch, the MoE plan for the prefill expert copies). The harness compares the total with the
// device's free memory and refuses a config that cannot fit, with the breakdown in words.
// Figures are one rank's at tp > 1 (rank 0, the largest: it holds the lm_head's extra row).
// docs/MEMORY.md defines each pool. Host code: built and tested without CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "api/model_config.h"
#include "core/quant/format.h"
#include "engine/options.h"

namespace infersweep {

// A lockstep step's most rows: a longer prefill runs as chunks of whole tokens per sequence,
// kMaxLockstepStepRows / batch tokens each (CudaModel::ChunkedPrefill).
inline constexpr int kMaxLockstepStepRows = 32768;

// Tokens a sequence per lockstep prefill step of `prompt_tokens` at `batch` sequences.
inline int LockstepPrefillChunkTokens(int batch, int prompt_tokens) {
  if (static_cast<int64_t>(batch) * prompt_tokens <= kMaxLockstepStepRows) return prompt_tokens;
  return kMaxLockstepStepRows / batch > 1 ? kMaxLockstepStepRows / batch : 1;
}

// What the model is asked to hold and run.
struct MemoryWorkload {
  int batch = 1;  // lockstep sequences, or serving's KV slots
  int prompt_tokens = 0;
  int generated_tokens = 0;
  // Tokens a sequence per prefill step; 0: the whole prompt (still cut at kMaxLockstepStepRows
  // rows, as the engine cuts it).
  int prefill_chunk_tokens = 0;
  // A prefill step returns every row's logits (teacher-forced logits, LogitsMode::kAll), not
  // only each sequence's last.
  bool all_logits = false;
  // StartServing: the KV cache holds batch slots and one spare (padding rows of a graph bucket).
  bool serving = false;
  // Serving: the largest ragged step's rows (LargestRaggedStepRows: decode rows and the prompt
  // tokens one step takes), which size the scratch in place of the lockstep prefill's.
  int64_t ragged_step_rows = 0;

  int context_tokens() const { return prompt_tokens + generated_tokens; }
};

enum class MemoryPool {
  kWeights,         // the weights as stored on the device, scales included
  kCopies,          // copies of weights a config makes (each named)
  kKvCache,         // K and V of the full-attention layers, with fp8's scales
  kRecurrentState,  // Gated DeltaNet's conv and recurrent states
  kScratch,         // activations and step buffers at the largest step
  kWorkspaces,      // library workspaces (cuBLASLt, cuBLAS, cuDNN) and collective buffers
  kGraphPools,      // captured CUDA graphs (an allowance)
};
inline constexpr MemoryPool kMemoryPools[] = {MemoryPool::kWeights,   MemoryPool::kCopies,
                                              MemoryPool::kKvCache,   MemoryPool::kRecurrentState,
                                              MemoryPool::kScratch,   MemoryPool::kWorkspaces,
                                              MemoryPool::kGraphPools};

// "weights", "copies", "KV", "recurrent state", "scratch", "workspaces", "graph pools".
const char* MemoryPoolName(MemoryPool pool);

// One allocation (or a family of like ones), named by what holds it.
struct MemoryItem {
  MemoryPool pool = MemoryPool::kScratch;
  std::string name;
  int64_t bytes = 0;
  // A documented allowance where the size is a library's or the driver's decision, not ours.
  bool allowance = false;
};

struct MemoryPlan {
  int tp = 1;
  int kv_sequences = 0;     // sequences the KV cache holds (serving: slots + 1)
  int capacity_tokens = 0;  // KV capacity a sequence
  int step_rows = 0;        // the largest step's rows (scratch is sized by them)
  int logit_rows = 0;       // the largest step's rows of logits
  std::vector<MemoryItem> items;

  int64_t bytes(MemoryPool pool) const;
  int64_t total_bytes() const;
  // The item of that name in that pool, 0 when there is none.
  int64_t item_bytes(MemoryPool pool, std::string_view name) const;
};

// Allowances where the size is not ours to compute (docs/MEMORY.md says why each is this).
// cuBLAS sizes its default workspace by the GPU; 32 MiB is its largest (Hopper and later).
inline constexpr int64_t kCublasHandleWorkspaceBytes = int64_t{32} << 20;
// cuDNN reports a plan's workspace only once the plan is built on the GPU.
inline constexpr int64_t kCudnnWorkspaceAllowanceBytes = int64_t{256} << 20;
// NCCL's channel buffers (NCCL_BUFFSIZE 4 MiB a channel, send and receive, per peer).
inline constexpr int64_t kNcclAllowanceBytes = int64_t{512} << 20;
// One instantiated decode graph: its kernel nodes and the driver's upload of their parameters.
// No allocation happens inside a capture (every buffer is reserved first), so no memory pool.
inline constexpr int64_t kGraphAllowanceBytes = int64_t{16} << 20;

// The plan for `model` with `weights`-format weights (kNone: dense, stored as the model's
// torch_dtype) under `options`. Errors: InvalidArgument for a workload without tokens or
// sequences, the tensor table's errors (a format whose groups do not divide K), and the
// attention plan's refusal (Unimplemented).
absl::StatusOr<MemoryPlan> PlanMemory(const CudaOptions& options, const ModelConfig& model,
                                      QuantFormat weights, const MemoryWorkload& workload);

// The same from the harness's inputs: a normalized backend config and the weight format
// preflight declares ("" or "bf16": dense).
absl::StatusOr<MemoryPlan> PlanMemory(const BackendConfig& normalized, const ModelConfig& model,
                                      std::string_view weight_format,
                                      const MemoryWorkload& workload);

// Whether the plan's total fits in `free_bytes`.
bool Fits(const MemoryPlan& plan, int64_t free_bytes);

// "needs 61.5 GiB on the device (weights 56.9 GiB, copies 0 B, KV 384.0 MiB, recurrent state
// 0 B, scratch 1.2 GiB, workspaces 32.0 MiB, graph pools 0 B)": the total and each pool.
std::string MemoryNeedsText(const MemoryPlan& plan);
// MemoryNeedsText and what it is held against: "needs ... (..., graph pools 0 B), 139.2 GiB free".
std::string MemoryVerdictText(const MemoryPlan& plan, int64_t free_bytes);

// Bytes in the unit that reads best: "0 B", "512 B", "3.0 KiB", "384.0 MiB", "56.88 GiB".
std::string FormatMemoryBytes(int64_t bytes);

// The shapes rank `rank` of `tp` runs (ShardHostModel's config, engine/tp_model.cc): heads and
// intermediate sizes divided, KV heads fewer than the ranks replicated one per rank.
ModelConfig RankModelConfig(const ModelConfig& model, int tp, bool expert_parallel);

}  // namespace infersweep
