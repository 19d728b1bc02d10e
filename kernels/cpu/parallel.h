// A fixed pool of worker threads for the CPU kernels.
#pragma once

#include <cstdint>
#include <functional>

namespace infersweep::cpu {

// Sets the number of threads used by ParallelFor (0 = hardware concurrency). Not thread-safe
// against concurrent ParallelFor calls; call it before running a model.
void SetNumThreads(int threads);
int NumThreads();

// Splits [0, n) into contiguous chunks of at least `min_chunk` and runs fn(begin, end) on the
// pool; returns when every chunk is done. Runs inline when one chunk suffices.
void ParallelFor(int64_t n, int64_t min_chunk, const std::function<void(int64_t, int64_t)>& fn);

// While one is alive, ParallelFor on the thread that made it runs inline. A tensor-parallel
// rank's thread is its own worker: the pool serves one caller at a time, and ranks call at once.
class ScopedInlineParallelFor {
 public:
  ScopedInlineParallelFor();
  ~ScopedInlineParallelFor();
  ScopedInlineParallelFor(const ScopedInlineParallelFor&) = delete;
  ScopedInlineParallelFor& operator=(const ScopedInlineParallelFor&) = delete;

 private:
  bool previous_;
};

}  // namespace infersweep::cpu
