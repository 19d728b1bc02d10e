#include "kernels/cpu/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/elementwise.h"

namespace infersweep::cpu {

void CausalConvSilu(const float* in, int64_t n, int64_t channels, const MatrixRef& weight,
                    float* state, float* out) {
  const int64_t kernel = weight.cols, history = kernel - 1;
  // window = state rows then the new rows: window[history + t] is input t.
  std::vector<float> window((history + n) * channels);
  std::copy_n(state, history * channels, window.data());
  std::copy_n(in, n * channels, window.data() + history * channels);
  std::vector<float> w(kernel);
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t j = 0; j < kernel; ++j)
      w[j] = LoadAsFloat(weight.data, weight.dtype, c * kernel + j);
    for (int64_t t = 0; t < n; ++t) {
      float acc = 0.f;
      for (int64_t j = 0; j < kernel; ++j) acc += w[j] * window[(t + j) * channels + c];
      out[t * channels + c] = acc * Sigmoid(acc);
    }
  }
  std::copy_n(window.data() + n * channels, history * channels, state);
}

void L2NormalizeRows(float* x, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    float sum_sq = 0.f;
    for (int64_t i = 0; i < dim; ++i) sum_sq += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sum_sq + 1e-6f);
    for (int64_t i = 0; i < dim; ++i) xr[i] *= inv;
  }
}

void GatedDeltaRecurrent(const float* q, const float* k, const float* v, const float* g,
                         const float* beta, int64_t n, int dk, int dv, float* state, float* out) {
  std::vector<float> d(dv);
  for (int64_t t = 0; t < n; ++t) {
    const float* qt = q + t * dk;
    const float* kt = k + t * dk;
    const float* vt = v + t * dv;
    const float decay = std::exp(g[t]);
    for (int64_t i = 0; i < static_cast<int64_t>(dk) * dv; ++i) state[i] *= decay;
    // d = beta (v - S^T k)
    for (int j = 0; j < dv; ++j) d[j] = 0.f;
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < dv; ++j) d[j] += state[i * dv + j] * kt[i];
    for (int j = 0; j < dv; ++j) d[j] = beta[t] * (vt[j] - d[j]);
    // S += k d^T; o = S^T q
    float* ot = out + t * dv;
    for (int j = 0; j < dv; ++j) ot[j] = 0.f;
    for (int i = 0; i < dk; ++i) {
      float* si = state + i * dv;
      for (int j = 0; j < dv; ++j) {
        si[j] += kt[i] * d[j];
        ot[j] += si[j] * qt[i];
      }
    }
  }
}

void GatedDeltaChunked(const float* q, const float* k, const float* v, const float* g,
                       const float* beta, int64_t n, int dk, int dv, int chunk, float* state,
                       float* out) {
  std::vector<float> cum(chunk), decay(chunk), inv(chunk * chunk), qk(chunk * chunk), w(chunk * dk),
      u(chunk * dv), d(chunk * dv);
  for (int64_t t0 = 0; t0 < n; t0 += chunk) {
    const int c = static_cast<int>(std::min<int64_t>(chunk, n - t0));
    const float* qc = q + t0 * dk;
    const float* kc = k + t0 * dk;
    const float* vc = v + t0 * dv;
    const float* bc = beta + t0;
    float* oc = out + t0 * dv;
    float acc = 0.f;
    for (int t = 0; t < c; ++t) {
      acc += g[t0 + t];
      cum[t] = acc;
      decay[t] = std::exp(acc);
    }
    auto dot_k = [&](const float* a, int s) {
      float sum = 0.f;
      for (int i = 0; i < dk; ++i) sum += a[i] * kc[s * dk + i];
      return sum;
    };
    // A[t,s] = beta_t exp(G_t - G_s) k_t.k_s for s < t; inv = (I + A)^-1 by rows: inv[t,s] =
    // -sum_{m=s}^{t-1} A[t,m] inv[m,s], inv[t,t] = 1.
    std::vector<float> a(c * c, 0.f);
    for (int t = 0; t < c; ++t)
      for (int s = 0; s < t; ++s)
        a[t * c + s] = bc[t] * std::exp(cum[t] - cum[s]) * dot_k(kc + t * dk, s);
    for (int t = 0; t < c; ++t) {
      for (int s = 0; s < t; ++s) {
        float sum = 0.f;
        for (int m = s; m < t; ++m) sum += a[t * c + m] * inv[m * chunk + s];
        inv[t * chunk + s] = -sum;
      }
      inv[t * chunk + t] = 1.f;
    }
    // W = inv (beta exp(G) K), U = inv (beta V); D = U - W S0.
    for (int t = 0; t < c; ++t) {
      for (int i = 0; i < dk; ++i) w[t * dk + i] = 0.f;
      for (int j = 0; j < dv; ++j) u[t * dv + j] = 0.f;
      for (int s = 0; s <= t; ++s) {
        const float ts = inv[t * chunk + s] * bc[s];
        for (int i = 0; i < dk; ++i) w[t * dk + i] += ts * decay[s] * kc[s * dk + i];
        for (int j = 0; j < dv; ++j) u[t * dv + j] += ts * vc[s * dv + j];
      }
    }
    for (int t = 0; t < c; ++t) {
      for (int j = 0; j < dv; ++j) d[t * dv + j] = u[t * dv + j];
      for (int i = 0; i < dk; ++i) {
        const float wi = w[t * dk + i];
        for (int j = 0; j < dv; ++j) d[t * dv + j] -= wi * state[i * dv + j];
      }
    }
    // O = exp(G) Q S0 + (M o Q K^T) D.
    for (int t = 0; t < c; ++t)
      for (int s = 0; s <= t; ++s)
        qk[t * chunk + s] = std::exp(cum[t] - cum[s]) * dot_k(qc + t * dk, s);
    for (int t = 0; t < c; ++t) {
      float* ot = oc + t * dv;
      for (int j = 0; j < dv; ++j) ot[j] = 0.f;
      for (int i = 0; i < dk; ++i) {
        const float qi = decay[t] * qc[t * dk + i];
        for (int j = 0; j < dv; ++j) ot[j] += qi * state[i * dv + j];
      }
      for (int s = 0; s <= t; ++s) {
        const float m = qk[t * chunk + s];
        for (int j = 0; j < dv; ++j) ot[j] += m * d[s * dv + j];
      }
    }
    // S = exp(G_last) S0 + K^T (exp(G_last - G) D).
    const float last = cum[c - 1];
    for (int64_t i = 0; i < static_cast<int64_t>(dk) * dv; ++i) state[i] *= decay[c - 1];
    for (int s = 0; s < c; ++s) {
      const float fade = std::exp(last - cum[s]);
      for (int i = 0; i < dk; ++i) {
        const float ki = fade * kc[s * dk + i];
        float* si = state + i * dv;
        for (int j = 0; j < dv; ++j) si[j] += ki * d[s * dv + j];
      }
    }
  }
}

}  // namespace infersweep::cpu
