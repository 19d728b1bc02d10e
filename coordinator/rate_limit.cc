#include "coordinator/rate_limit.h"

#include <algorithm>

namespace infersweep {

RateLimiter::RateLimiter(RateLimit limit, size_t max_keys)
    : limit_{limit.rate_per_s, std::max(1.0, limit.burst)},
      max_keys_(std::max<size_t>(1, max_keys)) {}

double RateLimiter::Refill(const Bucket& b, Clock::time_point now) const {
  const double elapsed_s = std::chrono::duration<double>(now - b.last).count();
  return std::min(limit_.burst, b.tokens + std::max(0.0, elapsed_s) * limit_.rate_per_s);
}

bool RateLimiter::Allow(const std::string& key, Clock::time_point now) {
  if (!limit_.enabled()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buckets_.find(key);
  if (it == buckets_.end()) {
    if (buckets_.size() >= max_keys_) {
      for (auto b = buckets_.begin(); b != buckets_.end();) {
        if (Refill(b->second, now) >= limit_.burst) {
          b = buckets_.erase(b);
        } else {
          ++b;
        }
      }
      if (buckets_.size() >= max_keys_) return true;  // a crowd: let it through untracked
    }
    it = buckets_.emplace(key, Bucket{limit_.burst, now}).first;
  }
  Bucket& b = it->second;
  b.tokens = Refill(b, now);
  b.last = std::max(b.last, now);
  if (b.tokens < 1) return false;
  b.tokens -= 1;
  return true;
}

size_t RateLimiter::tracked() {
  std::lock_guard<std::mutex> lock(mu_);
  return buckets_.size();
}

std::string PeerHost(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  if (colon == std::string::npos) return peer;
  const std::string_view port(peer.data() + colon + 1, peer.size() - colon - 1);
  const bool numeric = !port.empty() && std::all_of(port.begin(), port.end(),
                                                    [](char c) { return c >= '0' && c <= '9'; });
  // "ipv4:1.2.3.4:80" has two colons; "unix:/path" or "ipv6:[::1]" (no port) must stay whole.
  if (!numeric || peer.find(':') == colon) return peer;
  return peer.substr(0, colon);
}

}  // namespace infersweep
