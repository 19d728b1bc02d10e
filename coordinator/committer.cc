#include "coordinator/committer.h"

#include <utility>
#include <vector>

namespace infersweep::coordinator {

Committer::Committer(const CoordinatorServices& services, AnswerFn answer)
    : services_(services), answer_(std::move(answer)) {}

Committer::~Committer() { Stop(); }

void Committer::Start() {
  thread_ = std::thread([this] { Loop(); });
}

bool Committer::Submit(PendingResult pending) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(pending));
  }
  cv_.notify_one();
  return true;
}

void Committer::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Committer::Loop() {
  // At most this many results a transaction: a commit stays short (a few ms) while the queue
  // behind it fills for the next one.
  constexpr size_t kMaxGroup = 512;
  for (;;) {
    std::vector<PendingResult> group;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything is stored
      while (!queue_.empty() && group.size() < kMaxGroup) {
        group.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    std::vector<ResultSubmission> submissions;
    submissions.reserve(group.size());
    for (const PendingResult& p : group) submissions.push_back(p.submission);
    const std::vector<absl::Status> stored = services_.store.RecordResultsEach(submissions);
    services_.metrics.ObserveCommitGroup(static_cast<double>(group.size()));
    for (size_t i = 0; i < group.size(); ++i) answer_(group[i], stored[i]);
    services_.wake();
  }
}

}  // namespace infersweep::coordinator
