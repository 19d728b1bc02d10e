// Tensor and expert parallelism on the CPU reference: `tp` ranks as threads of this process, each
// a CPU model (engine/cpu_model.h) on its shard of the host's weights, summing partial results
// through an all-reduce that adds the ranks in a fixed order (kernels/cpu/allreduce.h).
//
// The shards are vLLM's and SGLang's: q/k/v column-parallel by heads (KV heads replicated when
// there are fewer of them than ranks), o row-parallel, then all-reduce; the dense MLP's gate/up
// column-parallel and down row-parallel, then all-reduce; the router replicated, each expert
// sharded on its intermediate dimension (ep=off) or whole experts per rank (ep=on), then
// all-reduce; Gated DeltaNet layers by key and value heads, out_proj row-parallel; the lm_head
// by vocabulary, its shards gathered. Embeddings and norms are replicated.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu_model.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace infersweep {

struct TensorParallelOptions {
  int tp = 2;
  bool expert_parallel = false;  // ep=on
  cpu::MatmulVariant matmul = cpu::MatmulVariant::kNaive;
  // The process-level faults (segv, abort, hang) strike rank 0; weight and numeric faults belong
  // to tp=1 models. TEST ONLY.
  FaultInjection fault;
};

// One rank's shard of a host model: a host model of its own whose config has the rank's head
// counts and sizes and whose weights view the host's (row slices) or own copies (column slices,
// stacked row ranges). A quantized matrix stays quantized in its format, its codes and scales
// sliced alike (group scales with their K columns, per-channel scales with their rows, per-tensor,
// global and input scales shared), wherever the cut falls on its scale grid; a cut inside an
// NVFP4 / MXFP4 group or an FP8 128-block is decoded exactly to fp32 instead and named in
// off_grid. Either way each shard row decodes bit-identically to the host's.
struct RankShard {
  int rank = 0;
  int64_t vocab_begin = 0;  // the first vocabulary row of its lm_head shard
  std::unique_ptr<HostModel> host;
  std::vector<std::vector<uint8_t>> owned;  // the copies its weights point into
  // The quantized weights this shard holds decoded to fp32, one line each: canonical name,
  // format and shape, and the cut that falls inside a scale group or block.
  std::vector<std::string> off_grid;
};

// Rank `rank` of `tp`'s shard of `host` (materialized). InvalidArgument when the model cannot be
// sharded so (TensorParallelRefusal's reason).
absl::StatusOr<std::unique_ptr<RankShard>> ShardHostModel(const HostModel& host, int tp, int rank,
                                                          bool expert_parallel);

// Why the ranks' shards of `host` cannot all keep its quantized weights quantized: every rank's
// cuts inside a scale group or block (RankShard::off_grid; the first few named, and a count),
// for engines that take quantized shards only (CUDA). Empty when every cut of every rank falls
// on its weight's scale grid, or the weights are dense. Errors as ShardHostModel's. Copies no
// weights.
absl::StatusOr<std::string> QuantizedShardRefusal(const HostModel& host, int tp,
                                                  bool expert_parallel);

// `host` (materialized) must outlive the model. Unimplemented with TensorParallelRefusal's reason
// when the model's shapes cannot be sharded over tp ranks.
absl::StatusOr<std::unique_ptr<Model>> MakeTensorParallelCpuModel(
    const HostModel& host, const TensorParallelOptions& options);

}  // namespace infersweep
