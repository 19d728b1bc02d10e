#include "kernels/cpu/parallel.h"

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace infersweep::cpu {
namespace {

// Workers wait for a generation counter to move; each job is split into `chunks` pieces taken
// from an atomic-free shared cursor under the mutex (chunks are coarse, so contention is low).
class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int threads() const { return threads_; }

  void Run(int64_t chunks, const std::function<void(int64_t)>& task) {
    std::unique_lock<std::mutex> lock(mu_);
    task_ = &task;
    next_ = 0;
    total_ = chunks;
    done_ = 0;
    ++generation_;
    wake_.notify_all();
    DrainLocked(lock);
    finished_.wait(lock, [&] { return done_ == total_; });
    task_ = nullptr;
  }

 private:
  void DrainLocked(std::unique_lock<std::mutex>& lock) {
    while (task_ != nullptr && next_ < total_) {
      const int64_t chunk = next_++;
      const auto* task = task_;
      lock.unlock();
      (*task)(chunk);
      lock.lock();
      if (++done_ == total_) finished_.notify_all();
    }
  }
  void WorkerLoop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      DrainLocked(lock);
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, finished_;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t next_ = 0, total_ = 0, done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

std::unique_ptr<Pool>& GlobalPool() {
  static std::unique_ptr<Pool> pool;
  return pool;
}

Pool& GetPool() {
  auto& pool = GlobalPool();
  if (!pool) pool = std::make_unique<Pool>(std::max(1u, std::thread::hardware_concurrency()));
  return *pool;
}

thread_local bool inline_parallel_for = false;

}  // namespace

ScopedInlineParallelFor::ScopedInlineParallelFor() : previous_(inline_parallel_for) {
  inline_parallel_for = true;
}
ScopedInlineParallelFor::~ScopedInlineParallelFor() { inline_parallel_for = previous_; }

void SetNumThreads(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto& pool = GlobalPool();
  if (pool && pool->threads() == threads) return;
  pool = std::make_unique<Pool>(threads);
}

int NumThreads() { return GetPool().threads(); }

void ParallelFor(int64_t n, int64_t min_chunk, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (inline_parallel_for) {
    fn(0, n);
    return;
  }
  Pool& pool = GetPool();
  const int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(1, min_chunk));
  const int64_t chunks = std::min<int64_t>(max_chunks, pool.threads() * 4);
  if (chunks <= 1 || pool.threads() == 1) {
    fn(0, n);
    return;
  }
  const int64_t step = (n + chunks - 1) / chunks;
  pool.Run(chunks, [&](int64_t c) {
    const int64_t begin = c * step;
    const int64_t end = std::min(n, begin + step);
    if (begin < end) fn(begin, end);
  });
}

}  // namespace infersweep::cpu
