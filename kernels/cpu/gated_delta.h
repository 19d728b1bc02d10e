// Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) on the CPU, fp32: the causal depthwise
// conv in front of it, and the gated delta rule itself in its recurrent and chunked forms.
#pragma once

#include <cstdint>

#include "core/tensor_ref.h"

namespace infersweep::cpu {

// Causal depthwise conv1d + SiLU over `n` new rows of `channels`: out[t, c] =
// silu(sum_j w[c, j] * in[t - (K-1) + j, c]), where rows before the first new one come from
// `state` ([K-1, channels], the previous inputs, oldest first; zeros for a fresh sequence).
// `weight` is [channels, K]. `state` is advanced to the last K-1 inputs.
void CausalConvSilu(const float* in, int64_t n, int64_t channels, const MatrixRef& weight,
                    float* state, float* out);

// q, k: [x / sqrt(sum x^2 + 1e-6)] in place over each row of `dim`.
void L2NormalizeRows(float* x, int64_t rows, int64_t dim);

// The gated delta rule for one value head over `n` tokens. q, k: [n, dk] (normalised and q
// scaled already); v: [n, dv]; g: [n] log decays; beta: [n]; state: [dk, dv], carried in and
// out; out: [n, dv]. Per token: S *= exp(g); d = beta (v - S^T k); S += k d^T; o = S^T q.
void GatedDeltaRecurrent(const float* q, const float* k, const float* v, const float* g,
                         const float* beta, int64_t n, int dk, int dv, float* state, float* out);

// The same recurrence evaluated a chunk of `chunk` tokens at a time. Within a chunk with
// cumulative log decay G and entering state S0, the updates D = [d_t] solve the unit lower
// triangular system (I + A) D = beta (V - exp(G) K S0) with A[t,s] = beta_t exp(G_t - G_s)
// k_t.k_s (s < t); then O = exp(G) Q S0 + (M o Q K^T) D with M[t,s] = exp(G_t - G_s) (s <= t),
// and S = exp(G_last) S0 + K^T (exp(G_last - G) D).
void GatedDeltaChunked(const float* q, const float* k, const float* v, const float* g,
                       const float* beta, int64_t n, int dk, int dv, int chunk, float* state,
                       float* out);

}  // namespace infersweep::cpu
