#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>

namespace infersweep::cpu {

void AttendCausal(const float* q, const float* keys, const float* values, int64_t position,
                  int num_q_heads, int num_kv_heads, int head_dim, float* scores, float* out) {
  const int group = num_q_heads / num_kv_heads;
  const int64_t kv_dim = static_cast<int64_t>(num_kv_heads) * head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  for (int h = 0; h < num_q_heads; ++h) {
    const int kvh = h / group;
    const float* qh = q + static_cast<int64_t>(h) * head_dim;
    float max_score = -INFINITY;
    for (int64_t j = 0; j <= position; ++j) {
      const float* kj = keys + j * kv_dim + static_cast<int64_t>(kvh) * head_dim;
      float s = 0.f;
      for (int d = 0; d < head_dim; ++d) s += qh[d] * kj[d];
      scores[j] = s * scale;
      max_score = std::max(max_score, scores[j]);
    }
    float denom = 0.f;
    for (int64_t j = 0; j <= position; ++j) {
      scores[j] = std::exp(scores[j] - max_score);
      denom += scores[j];
    }
    float* oh = out + static_cast<int64_t>(h) * head_dim;
    std::fill(oh, oh + head_dim, 0.f);
    for (int64_t j = 0; j <= position; ++j) {
      const float p = scores[j] / denom;
      const float* vj = values + j * kv_dim + static_cast<int64_t>(kvh) * head_dim;
      for (int d = 0; d < head_dim; ++d) oh[d] += p * vj[d];
    }
  }
}

}  // namespace infersweep::cpu
