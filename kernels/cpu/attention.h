// Causal grouped-query attention for one query vector against a KV history, fp32.
#pragma once

#include <cstdint>

namespace infersweep::cpu {

// q: [num_q_heads, head_dim] of the token at `position`; keys/values: [>= position+1, kv_dim]
// rows (kv_dim = num_kv_heads * head_dim), key j attended iff j <= position.
// out: [num_q_heads, head_dim]. `scores` is scratch of at least position+1 floats.
void AttendCausal(const float* q, const float* keys, const float* values, int64_t position,
                  int num_q_heads, int num_kv_heads, int head_dim, float* scores, float* out);

}  // namespace infersweep::cpu
