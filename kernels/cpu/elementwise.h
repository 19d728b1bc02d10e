// Row-wise normalisation, rotary embedding and activations, fp32.
#pragma once

#include <cstdint>

#include "core/tensor_ref.h"

namespace infersweep::cpu {

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * gain, for `rows` rows of `n` (in place allowed).
void RmsNorm(const float* x, int64_t rows, int64_t n, const MatrixRef& gain, float eps, float* out);

// Zero-centred gain: out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (1 + gain) (in place allowed).
void RmsNormZeroCentered(const float* x, int64_t rows, int64_t n, const MatrixRef& gain, float eps,
                         float* out);

// Gated norm of the linear-attention output: out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * gain *
// silu(z[r]), for `rows` rows of `n` (in place allowed).
void RmsNormGated(const float* x, const float* z, int64_t rows, int64_t n, const MatrixRef& gain,
                  float eps, float* out);

// HF "rotate_half" RoPE on one head vector of `head_dim` at `position`:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with x1 = x[:d/2], x2 = x[d/2:],
// angle_i = position * theta^(-2i/d).
void ApplyRope(float* head, int head_dim, int64_t position, double theta);

// out[i] = silu(gate[i]) * up[i].
void SiluMul(const float* gate, const float* up, int64_t n, float* out);

float Sigmoid(float x);

// log(1 + exp(x)), and x itself above 20 (torch's threshold).
float Softplus(float x);

}  // namespace infersweep::cpu
