#include "kernels/cpu/elementwise.h"

#include <cmath>

namespace infersweep::cpu {

namespace {

// y = x * rsqrt(mean(x^2) + eps) * g, where g is the gain (plain) or 1 + the gain (zero-centred).
template <bool kZeroCentered>
void RmsNormRows(const float* x, int64_t rows, int64_t n, const MatrixRef& gain, float eps,
                 float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float sum_sq = 0.f;
    for (int64_t i = 0; i < n; ++i) sum_sq += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const float g = LoadAsFloat(gain.data, gain.dtype, i);
      o[i] = xr[i] * inv * (kZeroCentered ? 1.f + g : g);
    }
  }
}

}  // namespace

void RmsNorm(const float* x, int64_t rows, int64_t n, const MatrixRef& gain, float eps, float* out) {
  RmsNormRows<false>(x, rows, n, gain, eps, out);
}

void RmsNormZeroCentered(const float* x, int64_t rows, int64_t n, const MatrixRef& gain, float eps,
                         float* out) {
  RmsNormRows<true>(x, rows, n, gain, eps, out);
}

void RmsNormGated(const float* x, const float* z, int64_t rows, int64_t n, const MatrixRef& gain,
                  float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    const float* zr = z + r * n;
    float sum_sq = 0.f;
    for (int64_t i = 0; i < n; ++i) sum_sq += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i)
      o[i] = xr[i] * inv * LoadAsFloat(gain.data, gain.dtype, i) * (zr[i] * Sigmoid(zr[i]));
  }
}

void ApplyRope(float* head, int head_dim, int64_t position, double theta) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * i / head_dim);
    const double angle = static_cast<double>(position) * inv_freq;
    const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    const float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
  }
}

float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

float Softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

void SiluMul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * Sigmoid(gate[i]) * up[i];
}

}  // namespace infersweep::cpu
