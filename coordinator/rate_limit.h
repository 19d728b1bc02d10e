// Token buckets per caller (docs/SECURITY.md "Limits"): the coordinator keys one by agent id for
// agent messages, and one by peer address for stream opens and user-API calls.
//
// Each key may make `rate_per_s` calls a second on average and `burst` at once; its bucket starts
// full. Buckets that have refilled completely carry no information and are forgotten when the
// table reaches `max_keys`. If every tracked key is still draining at that point (calls from more
// than max_keys distinct callers inside one refill period), a new key is let through untracked:
// the table's memory stays bounded, at the price of not limiting such a crowd.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>

namespace infersweep {

struct RateLimit {
  double rate_per_s = 0;  // <= 0: unlimited
  double burst = 0;       // bucket size; < 1 is taken as 1
  bool enabled() const { return rate_per_s > 0; }
};

class RateLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  explicit RateLimiter(RateLimit limit, size_t max_keys = 100'000);
  RateLimiter(const RateLimiter&) = delete;
  RateLimiter& operator=(const RateLimiter&) = delete;

  // True when `key` may make one more call at `now` (and takes its token); always true when the
  // limit is disabled.
  bool Allow(const std::string& key, Clock::time_point now = Clock::now());
  const RateLimit& limit() const { return limit_; }
  // Keys tracked now (for tests).
  size_t tracked();

 private:
  struct Bucket {
    double tokens = 0;
    Clock::time_point last;
  };
  // Tokens in `b` at `now`, capped at the burst.
  double Refill(const Bucket& b, Clock::time_point now) const;

  const RateLimit limit_;
  const size_t max_keys_;
  std::mutex mu_;
  std::unordered_map<std::string, Bucket> buckets_;
};

// The caller part of a gRPC peer string: "ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7",
// "ipv6:[::1]:51234" -> "ipv6:[::1]"; a string without a port is returned as it is.
std::string PeerHost(const std::string& peer);

}  // namespace infersweep
