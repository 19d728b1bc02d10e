#include "kernels/cpu/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace infersweep::cpu {

void TopKRouting(const float* logits, int num_experts, int k, bool renormalize, int* experts,
                 float* weights) {
  std::vector<float> probs(logits, logits + num_experts);
  const float max_logit = *std::max_element(probs.begin(), probs.end());
  float sum = 0.f;
  for (float& p : probs) {
    p = std::exp(p - max_logit);
    sum += p;
  }
  for (float& p : probs) p = std::isnan(p / sum) ? -INFINITY : p / sum;  // NaN breaks ordering
  std::vector<int> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
    return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
  });
  float chosen_sum = 0.f;
  for (int i = 0; i < k; ++i) {
    experts[i] = order[i];
    weights[i] = probs[order[i]];
    chosen_sum += weights[i];
  }
  if (renormalize)
    for (int i = 0; i < k; ++i) weights[i] /= chosen_sum;
}

}  // namespace infersweep::cpu
