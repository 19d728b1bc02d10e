// allreduce-bench on the CPU: the all-reduce the CPU's tensor-parallel ranks sum through
// (kernels/cpu/allreduce.h), timed per message size the way nccl-tests times NCCL's, with a
// known-answer check of every element on every rank in the same row.
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
};

struct AllReduceBenchRow {
  int64_t bytes = 0;      // per rank
  int64_t count = 0;      // fp32 elements per rank
  double time_us = 0;     // per all-reduce, the mean over the timed iterations
  double algbw_gb_s = 0;  // bytes / time
  double busbw_gb_s = 0;  // algbw * 2 (ranks - 1) / ranks: each rank's share of the link traffic
  int64_t wrong = 0;      // elements, over every rank, that differ from the known sum
};

// InvalidArgument naming the option for ranks < 1, sizes out of order or under 4 bytes, a factor
// under 2 or iterations < 1.
absl::StatusOr<std::vector<AllReduceBenchRow>> RunCpuAllReduceBench(
    const AllReduceBenchOptions& options);

// The table: '#' metadata lines, then one row per size with units in the header.
std::string FormatAllReduceBench(const AllReduceBenchOptions& options,
                                 const std::vector<AllReduceBenchRow>& rows);

}  // namespace infersweep
