// The engine on one NVIDIA GPU: weights resident on the device (synthetic ones generated there),
// a KV cache, and per-axis choices (engine/options.h) of GEMM, attention, MoE runner, CUDA
// graphs and quantized GEMM.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/fault_injection.h"
#include "engine/model.h"
#include "engine/options.h"
#include "engine/weights.h"

namespace infersweep {

class Communicator;  // engine/cuda/communicator.h

// A tensor-parallel rank's place among the ranks (tp > 1): the communicator every rank joined
// (its rank() and ranks()), and the largest message one Sum takes (0: any), which the model
// splits larger all-reduces into.
struct CudaRank {
  std::shared_ptr<Communicator> comm;
  int64_t max_message_bytes = 0;
};

// This process's CudaRank for `parallel` (tp > 1): joined once, through the rank context the
// rank worker set (engine/rank_context.h); nccl (allreduce=auto or nccl) from rank 0's
// ncclUniqueId, custom and fused from every rank's peer buffer handle. Unimplemented outside a
// rank process of tp ranks, and for nccl on a GPU listed twice.
absl::StatusOr<CudaRank> JoinCudaRank(const ParallelOptions& parallel);

// Why `config` with `weights`-format weights cannot run under `options` on this GPU: what the
// kernels need of the model's shapes and layer kinds (flash's head_dim, the device-routed MoE
// runners' sizes, graphs=persistent's layers and shapes); empty when they can. MakeCudaModel
// answers Unimplemented (UNSUPPORTED to the harness) with it. Conflicts between axis values are
// the registry's (RegistryConflict), not repeated here.
std::string CudaModelRefusal(const ModelConfig& config, QuantFormat weights,
                             const CudaOptions& options);

// Uploads (or generates) `host`'s weights once per HostModel; every model built on the same host
// model shares them. `host` must outlive the model. `options` must hold no registry conflict
// (CreateModel refuses those first); the model's own refusals come back as Unimplemented.
// `fault` is TEST ONLY.
// tp > 1 takes `rank` (JoinCudaRank): the model runs the rank's shard of `host`
// (ShardHostModel, engine/tp_model.h; the host copy is materialized for it), its row-parallel
// blocks all-reduced through rank.comm, and its lm_head's vocabulary shard gathered into full
// logits rows on every rank. tp=1 ignores it (a named allreduce makes its own single-rank
// communicator).
absl::StatusOr<std::unique_ptr<Model>> MakeCudaModel(HostModel& host, const CudaOptions& options,
                                                     const FaultInjection& fault = {},
                                                     const CudaRank& rank = {});

// Tests: the raw bytes of tensor `index` (spec order) as resident on the device.
absl::StatusOr<std::vector<uint8_t>> CopyDeviceTensorToHost(HostModel& host, size_t index);

}  // namespace infersweep
