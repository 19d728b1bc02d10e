// The CPU's all-reduce across tensor-parallel ranks that are threads of one process.
//
// Each rank sums its share of the elements over every rank's buffer in rank order 0..n-1 (a
// reduce-scatter), then copies the whole sum back into its own buffer (an all-gather). Every
// element is summed in the same order whichever thread gets there first, so the result is
// deterministic and bitwise the same on every rank.
#pragma once

#include <barrier>
#include <cstdint>
#include <vector>

namespace infersweep::cpu {

class ThreadAllReduce {
 public:
  explicit ThreadAllReduce(int ranks);
  int ranks() const { return ranks_; }

  // Called by every rank `rank` in [0, ranks) at once, each with its own `data` of the same
  // length `n`: on return every rank's data[i] is the sum over ranks of their data[i], added in
  // rank order. A length that differs between ranks is a broken invariant and aborts.
  void Sum(int rank, float* data, int64_t n);

 private:
  const int ranks_;
  std::barrier<> barrier_;
  std::vector<float*> buffers_;   // [ranks]: each rank's data during a Sum
  std::vector<int64_t> lengths_;  // [ranks]
  std::vector<float> sum_;        // the reduced elements, written by their owning ranks
};

}  // namespace infersweep::cpu
