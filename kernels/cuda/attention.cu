#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

// One block per row; threads over (head, pair). Angles in double as the CPU reference does.
__global__ void RopeAppendKernel(float* q, float* k, const float* v, int n, int q_heads,
                                 int kv_heads, int head_dim, double theta, const int* position,
                                 int capacity, float* k_cache, float* v_cache) {
  const int row = blockIdx.x;
  const int batch = row / n;
  const int pos = *position + row % n;
  const int half = head_dim / 2;
  const int q_dim = q_heads * head_dim, kv_dim = kv_heads * head_dim;
  for (int t = threadIdx.x; t < (q_heads + kv_heads) * half; t += blockDim.x) {
    const int head = t / half, i = t % half;
    float* vec = head < q_heads ? q + static_cast<int64_t>(row) * q_dim + head * head_dim
                                : k + static_cast<int64_t>(row) * kv_dim + (head - q_heads) * head_dim;
    const double angle = static_cast<double>(pos) * pow(theta, -2.0 * i / head_dim);
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
    const float x1 = vec[i], x2 = vec[i + half];
    vec[i] = x1 * c - x2 * s;
    vec[i + half] = x2 * c + x1 * s;
  }
  __syncthreads();
  const int64_t slot = (static_cast<int64_t>(batch) * capacity + pos) * kv_dim;
  for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
    k_cache[slot + i] = k[static_cast<int64_t>(row) * kv_dim + i];
    v_cache[slot + i] = v[static_cast<int64_t>(row) * kv_dim + i];
  }
}

// grid (rows, q_heads), 128 threads. Scores are written to global memory (materialised).
__global__ void AttentionNaiveKernel(const float* q, const float* k_cache, const float* v_cache,
                                     int n, int q_heads, int kv_heads, int head_dim,
                                     const int* position, int capacity, float* scores, float* out) {
  extern __shared__ float q_shared[];
  __shared__ float scratch[32];
  const int row = blockIdx.x, head = blockIdx.y;
  const int batch = row / n, pos = *position + row % n;
  const int kv_head = head / (q_heads / kv_heads);
  const int kv_dim = kv_heads * head_dim;
  const float scale = rsqrtf(static_cast<float>(head_dim));
  const float* qh = q + (static_cast<int64_t>(row) * q_heads + head) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_shared[d] = qh[d];
  __syncthreads();
  const float* keys = k_cache + static_cast<int64_t>(batch) * capacity * kv_dim + kv_head * head_dim;
  const float* values = v_cache + static_cast<int64_t>(batch) * capacity * kv_dim + kv_head * head_dim;
  float* s = scores + (static_cast<int64_t>(row) * q_heads + head) * capacity;
  float local_max = -INFINITY;
  for (int j = threadIdx.x; j <= pos; j += blockDim.x) {
    float dot = 0.f;
    for (int d = 0; d < head_dim; ++d) dot += q_shared[d] * keys[static_cast<int64_t>(j) * kv_dim + d];
    s[j] = dot * scale;
    local_max = fmaxf(local_max, s[j]);
  }
  const float max_score = BlockMax(local_max, scratch);
  float local_sum = 0.f;
  for (int j = threadIdx.x; j <= pos; j += blockDim.x) {
    s[j] = expf(s[j] - max_score);
    local_sum += s[j];
  }
  const float denom = BlockSum(local_sum, scratch);
  __syncthreads();  // every s[j] is written before any thread reads them all
  float* o = out + (static_cast<int64_t>(row) * q_heads + head) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j <= pos; ++j) acc += s[j] * values[static_cast<int64_t>(j) * kv_dim + d];
    o[d] = acc / denom;
  }
}

}  // namespace

void RopeAndAppendKv(float* q, float* k, const float* v, int rows, int n, int q_heads, int kv_heads,
                     int head_dim, double theta, const int* position, int capacity, float* k_cache,
                     float* v_cache, cudaStream_t stream) {
  RopeAppendKernel<<<rows, 128, 0, stream>>>(q, k, v, n, q_heads, kv_heads, head_dim, theta,
                                             position, capacity, k_cache, v_cache);
}

void AttentionNaive(const float* q, const float* k_cache, const float* v_cache, int rows, int n,
                    int q_heads, int kv_heads, int head_dim, const int* position, int capacity,
                    float* scores, float* out, cudaStream_t stream) {
  AttentionNaiveKernel<<<dim3(rows, q_heads), 128, head_dim * sizeof(float), stream>>>(
      q, k_cache, v_cache, n, q_heads, kv_heads, head_dim, position, capacity, scores, out);
}

}  // namespace infersweep::cuda
