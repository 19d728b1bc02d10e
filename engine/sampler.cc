#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "engine/synthetic.h"

namespace infersweep {

int32_t Greedy(std::span<const float> logits) {
  int32_t best = 0;
  float best_value = -INFINITY;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] > best_value) {  // false for NaN
      best_value = logits[i];
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

int32_t SampleToken(std::span<const float> logits, const SamplingParams& params, int sequence,
                    int step) {
  if (params.temperature <= 0.f) return Greedy(logits);
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  size_t keep = logits.size();
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < keep) {
    keep = params.top_k;
    std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
  }
  float max_logit = -INFINITY;
  for (size_t i = 0; i < keep; ++i) max_logit = std::max(max_logit, logits[ids[i]]);
  std::vector<double> cumulative(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) {
    const float l = logits[ids[i]];
    total += std::isfinite(l) ? std::exp((l - max_logit) / params.temperature) : 0.0;
    cumulative[i] = total;
  }
  if (!(total > 0)) return Greedy(logits);
  const uint64_t draw = Mix64(params.seed ^ Mix64((static_cast<uint64_t>(sequence) << 32) ^
                                                  static_cast<uint32_t>(step)));
  const double u = static_cast<double>(draw >> 11) * (1.0 / 9007199254740992.0) * total;
  const size_t i = std::upper_bound(cumulative.begin(), cumulative.end(), u) - cumulative.begin();
  return ids[std::min(i, keep - 1)];
}

}  // namespace infersweep
