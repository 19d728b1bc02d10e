// allreduce-bench: the all-reduce that tensor-parallel ranks sum through, timed per message size
// the way nccl-tests times NCCL's, with a known-answer check of every element on every rank in
// the same row. On the CPU, the ranks as threads (kernels/cpu/allreduce.h); on CUDA, each
// allreduce value of the collective seam (engine/cuda/communicator.h), one rank a GPU, eagerly
// and as CUDA graph replays.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace infersweep {

struct AllReduceBenchOptions {
  int ranks = 2;
  int64_t min_bytes = 4 << 10;
  int64_t max_bytes = 64 << 20;
  int size_factor = 4;  // each size is the previous one times this
  int iterations = 5;   // timed, after one warm-up
  // --device cuda: the seam's values to time (nccl, custom, fused) and the fused kernel's row
  // width (its message is rows of this many fp32 elements; under a row, one row of the message).
  std::vector<std::string> allreduce = {"nccl", "custom", "fused"};
  int fused_row = 4096;
};

struct AllReduceBenchRow {
  int64_t bytes = 0;      // per rank
  int64_t count = 0;      // fp32 elements per rank
  double time_us = 0;     // per all-reduce, the mean over the timed iterations
  double algbw_gb_s = 0;  // bytes / time
  double busbw_gb_s = 0;  // algbw * 2 (ranks - 1) / ranks: each rank's share of the link traffic
  int64_t wrong = 0;      // elements, over every rank, that differ from the known sum
  std::string allreduce = "reference";
  bool graph = false;  // CUDA: the timed all-reduces captured in one CUDA graph and replayed
};

// InvalidArgument naming the option for ranks < 1, sizes out of order or under 4 bytes, a factor
// under 2 or iterations < 1.
absl::StatusOr<std::vector<AllReduceBenchRow>> RunCpuAllReduceBench(
    const AllReduceBenchOptions& options);

// The table: '#' metadata lines, then one row per size with units in the header.
std::string FormatAllReduceBench(const AllReduceBenchOptions& options,
                                 const std::vector<AllReduceBenchRow>& rows);

// --device cuda: options.ranks GPUs (0..ranks-1), one rank a GPU driven by its own thread; for
// each allreduce value, every size eagerly, then every size as a CUDA graph of the timed
// all-reduces. InvalidArgument naming the option as on the CPU, or an unknown allreduce value;
// FailedPrecondition when this build has no CUDA or the machine has fewer GPUs than ranks.
absl::StatusOr<std::vector<AllReduceBenchRow>> RunCudaAllReduceBench(
    const AllReduceBenchOptions& options);
std::string FormatCudaAllReduceBench(const AllReduceBenchOptions& options,
                                     const std::vector<AllReduceBenchRow>& rows);

// The checks both devices share: InvalidArgument naming the option.
absl::Status ValidateAllReduceBenchOptions(const AllReduceBenchOptions& options);

}  // namespace infersweep
