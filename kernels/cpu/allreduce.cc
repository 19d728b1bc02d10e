#include "kernels/cpu/allreduce.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace infersweep::cpu {

ThreadAllReduce::ThreadAllReduce(int ranks)
    : ranks_(ranks), barrier_(ranks), buffers_(ranks, nullptr), lengths_(ranks, 0) {}

void ThreadAllReduce::Sum(int rank, float* data, int64_t n) {
  buffers_[rank] = data;
  lengths_[rank] = n;
  // Rank 0 sizes the sum before anyone writes to it; the others reach it past the barrier.
  if (rank == 0 && static_cast<int64_t>(sum_.size()) < n) sum_.resize(n);
  barrier_.arrive_and_wait();
  for (int r = 0; r < ranks_; ++r)
    if (lengths_[r] != n) {
      std::fprintf(stderr, "ThreadAllReduce: rank %d reduces %lld elements, rank %d %lld\n", rank,
                   static_cast<long long>(n), r, static_cast<long long>(lengths_[r]));
      std::abort();
    }
  // Reduce-scatter: this rank's contiguous share, each element summed in rank order.
  const int64_t share = (n + ranks_ - 1) / ranks_;
  const int64_t begin = std::min(n, rank * share), end = std::min(n, begin + share);
  for (int64_t i = begin; i < end; ++i) {
    float acc = buffers_[0][i];
    for (int r = 1; r < ranks_; ++r) acc += buffers_[r][i];
    sum_[i] = acc;
  }
  barrier_.arrive_and_wait();
  // All-gather: every rank takes the whole sum; no rank may start the next Sum (and overwrite
  // the shared sum or its buffer pointer) before all have copied.
  std::copy_n(sum_.data(), n, data);
  barrier_.arrive_and_wait();
}

}  // namespace infersweep::cpu
