#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_cache.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

// table[p * half + i] = (cos, sin)(p * theta^(-2i/d)), angles in double as the CPU reference
// computes them. Built once per batch shape, so the per-step kernel does no transcendental math
// (double-precision sin/cos per step would cost tens of us a layer at batch 1).
__global__ void RopeTableKernel(int capacity, int half, int head_dim, double theta, float2* table) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<int64_t>(capacity) * half) return;
  const int pos = static_cast<int>(i / half), pair = static_cast<int>(i % half);
  const double angle = static_cast<double>(pos) * pow(theta, -2.0 * pair / head_dim);
  table[i] = make_float2(static_cast<float>(cos(angle)), static_cast<float>(sin(angle)));
}

// grid (rows, ceil((q_heads + kv_heads) / kWarps)), one warp per head vector. Optional RMSNorm
// over the head (qwen3 q_norm/k_norm), RoPE (HF rotate_half), then k heads go to the cache with
// their v head: a warp, not a block, per head vector, so the sums need no block barriers
// (prefill 2048 has 73,728 head vectors a layer).
// At batch 1 the kernel is pure latency, so everything not produced by the previous kernel (the
// position, copied at the step's start; the norm gains; the RoPE table) is read before the wait,
// and after it one round of loads brings the head's q or k and v into registers: one dependent L2
// round trip, not four.
constexpr int kRopeWarps = 4;
constexpr int kRopePerLane = 4;  // pairs (i, i + half) a lane holds: head_dim <= 256
template <typename CacheT>
__global__ void __launch_bounds__(kRopeWarps * 32)
    QkNormRopeAppendKernel(const float* q, int q_stride, int q_head_stride, const float* k,
                           const float* v, int kv_stride, float* q_out, int n, int q_heads,
                           int kv_heads, int head_dim, const void* q_norm, const void* k_norm,
                           DType norm_dtype, float eps, const float2* rope, const int* position,
                           const int2* ragged, const KvCache cache) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x, head = blockIdx.y * kRopeWarps + threadIdx.x / 32;
  const bool active = head < q_heads + kv_heads;
  const int2 sequence_position = RowSequencePosition(row, n, position, ragged);
  const int batch = sequence_position.x, pos = sequence_position.y;
  const int half = head_dim / 2;
  const bool is_q = head < q_heads;
  const void* gain = is_q ? q_norm : k_norm;
  float gain1[kRopePerLane], gain2[kRopePerLane];
  float2 cs[kRopePerLane];
#pragma unroll
  for (int j = 0; j < kRopePerLane; ++j) {
    const int i = lane + 32 * j;
    gain1[j] = gain2[j] = 1.f;
    cs[j] = make_float2(1.f, 0.f);
    if (!active || i >= half) continue;
    cs[j] = rope[static_cast<int64_t>(pos) * half + i];
    if (gain) {
      gain1[j] = LoadAsFloat(gain, norm_dtype, i);
      gain2[j] = LoadAsFloat(gain, norm_dtype, i + half);
    }
  }
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  if (!active) return;
  const int kv_head = head - q_heads;
  const int kv_dim = kv_heads * head_dim;
  const float* vec = is_q ? q + static_cast<int64_t>(row) * q_stride + head * q_head_stride
                          : k + static_cast<int64_t>(row) * kv_stride + kv_head * head_dim;
  const float* vh = v + static_cast<int64_t>(row) * kv_stride + kv_head * head_dim;
  float x1[kRopePerLane], x2[kRopePerLane], v1[kRopePerLane], v2[kRopePerLane];
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < kRopePerLane; ++j) {
    const int i = lane + 32 * j;
    x1[j] = x2[j] = v1[j] = v2[j] = 0.f;
    if (i >= half) continue;
    x1[j] = vec[i];
    x2[j] = vec[i + half];
    if (!is_q) v1[j] = vh[i], v2[j] = vh[i + half];
    sum_sq += x1[j] * x1[j] + x2[j] * x2[j];
  }
  constexpr int kHeld = 32 * kRopePerLane;  // pairs past it (head_dim > 256) are read late
  for (int i = kHeld + lane; i < half; i += 32)
    sum_sq += vec[i] * vec[i] + vec[i + half] * vec[i + half];
  const float inv = gain ? rsqrtf(WarpSum(sum_sq) / head_dim + eps) : 1.f;
  // Pair (i, i + half), normalised, rotated.
  auto rotate = [](float a, float b, float2 c) {
    return make_float2(a * c.x - b * c.y, b * c.x + a * c.y);
  };
  float2 r[kRopePerLane];
#pragma unroll
  for (int j = 0; j < kRopePerLane; ++j)
    r[j] = rotate(x1[j] * inv * gain1[j], x2[j] * inv * gain2[j], cs[j]);  // 0 past half
  auto late_pair = [&](int i) {
    const float g1 = gain ? LoadAsFloat(gain, norm_dtype, i) : 1.f;
    const float g2 = gain ? LoadAsFloat(gain, norm_dtype, i + half) : 1.f;
    return rotate(vec[i] * inv * g1, vec[i + half] * inv * g2,
                  rope[static_cast<int64_t>(pos) * half + i]);
  };
  if (is_q) {  // in place when q_out is q: each lane rewrites only the elements it read
    float* rotated_q = q_out + (static_cast<int64_t>(row) * q_heads + head) * head_dim;
#pragma unroll
    for (int j = 0; j < kRopePerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < half) rotated_q[i] = r[j].x, rotated_q[i + half] = r[j].y;
    }
    for (int i = kHeld + lane; i < half; i += 32) {
      const float2 p = late_pair(i);
      rotated_q[i] = p.x, rotated_q[i + half] = p.y;
    }
    return;
  }
  CacheT* const k_cache = static_cast<CacheT*>(cache.k);
  CacheT* const v_cache = static_cast<CacheT*>(cache.v);
  const int64_t slot =
      (static_cast<int64_t>(batch) * cache.capacity + pos) * kv_dim + kv_head * head_dim;
  // An fp8 cache stores the head under its scales (the (scale, 1 / scale) pairs); CudaModelRefusal
  // keeps its head_dim <= 256 (the tensor-core kernels' sizes), so every pair is held and none is
  // read late.
  float2 k_scale = make_float2(1.f, 1.f), v_scale = k_scale;
  if constexpr (kIsFp8Cache<CacheT>) {
    float k_amax = 0.f, v_amax = 0.f;
#pragma unroll
    for (int j = 0; j < kRopePerLane; ++j) {
      k_amax = fmaxf(k_amax, fmaxf(fabsf(r[j].x), fabsf(r[j].y)));
      v_amax = fmaxf(v_amax, fmaxf(fabsf(v1[j]), fabsf(v2[j])));
    }
    StoreHeadScales(cache, static_cast<int64_t>(batch) * cache.capacity + pos, kv_heads, kv_head,
                    k_amax, v_amax, &k_scale, &v_scale);
  }
#pragma unroll
  for (int j = 0; j < kRopePerLane; ++j) {
    const int i = lane + 32 * j;
    if (i >= half) continue;
    StoreKv(k_cache + slot + i, r[j].x * k_scale.y);
    StoreKv(k_cache + slot + i + half, r[j].y * k_scale.y);
    StoreKv(v_cache + slot + i, v1[j] * v_scale.y);
    StoreKv(v_cache + slot + i + half, v2[j] * v_scale.y);
  }
  for (int i = kHeld + lane; i < half; i += 32) {
    const float2 p = late_pair(i);
    StoreKv(k_cache + slot + i, p.x);
    StoreKv(k_cache + slot + i + half, p.y);
    StoreKv(v_cache + slot + i, vh[i]);
    StoreKv(v_cache + slot + i + half, vh[i + half]);
  }
}

// Partial RoPE (qwen3_next, qwen3_5): the same norm as QkNormRopeAppendKernel over the whole head,
// then pairs (i, i + rotary_dim / 2) of the first rotary_dim dims rotated, the rest passed
// through. A warp a head vector, staged in shared memory ([kRopeWarps][head_dim]) because a
// lane's pair partner is not its own element. q heads sit q_head_stride floats apart in a row
// (2 head_dim for gated attention's [q_h | gate_h], read in place).
// As QkNormRopeAppendKernel, a batch-1 launch is pure latency: the gains and RoPE factors are
// read before the wait, then one round of loads brings the head (and its v) into registers.
// Looping over the head with loads and stores interleaved costs a dependent L2 round trip a
// 32-element slice: 8 of them for a 256-wide head.
constexpr int kPartialHeld = 8;  // elements a lane holds: head_dim <= 256 in one round of loads
template <typename CacheT>
__global__ void __launch_bounds__(kRopeWarps * 32)
    QkNormPartialRopeAppendKernel(const float* q, int q_stride, int q_head_stride, const float* k,
                                  const float* v, int kv_stride, float* q_out, int n, int q_heads,
                                  int kv_heads, int head_dim, int rotary_dim, const void* q_norm,
                                  const void* k_norm, DType norm_dtype, float eps,
                                  const float2* rope, const int* position, const int2* ragged,
                                  const KvCache cache) {
  extern __shared__ float staged[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int row = blockIdx.x, head = blockIdx.y * kRopeWarps + warp;
  const bool active = head < q_heads + kv_heads;
  const int2 sequence_position = RowSequencePosition(row, n, position, ragged);
  const int batch = sequence_position.x, pos = sequence_position.y;
  const bool is_q = head < q_heads;
  const void* gain = is_q ? q_norm : k_norm;
  const int half = rotary_dim / 2;
  auto factors = [&](int i) {  // element i's RoPE (cos, sin); identity past rotary_dim
    return i < rotary_dim ? rope[static_cast<int64_t>(pos) * half + i % half]
                          : make_float2(1.f, 0.f);
  };
  float g[kPartialHeld];
  float2 cs[kPartialHeld];
#pragma unroll
  for (int j = 0; j < kPartialHeld; ++j) {
    const int i = lane + 32 * j;
    g[j] = 1.f;
    cs[j] = make_float2(1.f, 0.f);
    if (!active || i >= head_dim) continue;
    if (gain) g[j] = LoadAsFloat(gain, norm_dtype, i);
    cs[j] = factors(i);
  }
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  if (!active) return;  // a whole warp; the kernel has no block barriers
  const int kv_head = head - q_heads;
  const float* vec = is_q ? q + static_cast<int64_t>(row) * q_stride + head * q_head_stride
                          : k + static_cast<int64_t>(row) * kv_stride + kv_head * head_dim;
  const float* vh = v + static_cast<int64_t>(row) * kv_stride + kv_head * head_dim;
  float x[kPartialHeld], vx[kPartialHeld];
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < kPartialHeld; ++j) {
    const int i = lane + 32 * j;
    x[j] = vx[j] = 0.f;
    if (i >= head_dim) continue;
    x[j] = vec[i];
    if (!is_q) vx[j] = vh[i];
    sum_sq += x[j] * x[j];
  }
  constexpr int kHeld = 32 * kPartialHeld;  // elements past it (head_dim > 256) are read late
  for (int i = kHeld + lane; i < head_dim; i += 32) sum_sq += vec[i] * vec[i];
  const float inv = gain ? rsqrtf(WarpSum(sum_sq) / head_dim + eps) : 1.f;
  float* normed = staged + warp * head_dim;
#pragma unroll
  for (int j = 0; j < kPartialHeld; ++j)
    if (lane + 32 * j < head_dim) normed[lane + 32 * j] = x[j] * inv * g[j];
  for (int i = kHeld + lane; i < head_dim; i += 32)
    normed[i] = vec[i] * inv * (gain ? LoadAsFloat(gain, norm_dtype, i) : 1.f);
  __syncwarp();
  auto rotated = [&](int i, float2 c) {
    if (i >= rotary_dim) return normed[i];
    return i < half ? normed[i] * c.x - normed[i + half] * c.y
                    : normed[i] * c.x + normed[i - half] * c.y;
  };
  if (is_q) {
    float* const q_row = q_out + (static_cast<int64_t>(row) * q_heads + head) * head_dim;
#pragma unroll
    for (int j = 0; j < kPartialHeld; ++j)
      if (lane + 32 * j < head_dim) q_row[lane + 32 * j] = rotated(lane + 32 * j, cs[j]);
    for (int i = kHeld + lane; i < head_dim; i += 32) q_row[i] = rotated(i, factors(i));
    return;
  }
  float r[kPartialHeld];
#pragma unroll
  for (int j = 0; j < kPartialHeld; ++j)
    r[j] = lane + 32 * j < head_dim ? rotated(lane + 32 * j, cs[j]) : 0.f;
  const int64_t cache_row = static_cast<int64_t>(batch) * cache.capacity + pos;
  // An fp8 cache stores the head under its scales (the (scale, 1 / scale) pairs); CudaModelRefusal
  // keeps its head_dim <= 256, so every element is held and none is read late.
  float2 k_scale = make_float2(1.f, 1.f), v_scale = k_scale;
  if constexpr (kIsFp8Cache<CacheT>) {
    float k_amax = 0.f, v_amax = 0.f;
#pragma unroll
    for (int j = 0; j < kPartialHeld; ++j) {
      k_amax = fmaxf(k_amax, fabsf(r[j]));
      v_amax = fmaxf(v_amax, fabsf(vx[j]));
    }
    StoreHeadScales(cache, cache_row, kv_heads, kv_head, k_amax, v_amax, &k_scale, &v_scale);
  }
  const int kv_dim = kv_heads * head_dim;
  CacheT* const k_row = static_cast<CacheT*>(cache.k) + cache_row * kv_dim + kv_head * head_dim;
  CacheT* const v_row = static_cast<CacheT*>(cache.v) + cache_row * kv_dim + kv_head * head_dim;
#pragma unroll
  for (int j = 0; j < kPartialHeld; ++j) {
    const int i = lane + 32 * j;
    if (i >= head_dim) continue;
    StoreKv(k_row + i, r[j] * k_scale.y);
    StoreKv(v_row + i, vx[j] * v_scale.y);
  }
  for (int i = kHeld + lane; i < head_dim; i += 32) {
    StoreKv(k_row + i, rotated(i, factors(i)) * k_scale.y);
    StoreKv(v_row + i, vh[i] * v_scale.y);
  }
}

// grid (rows, q_heads), 128 threads. Scores are written to global memory (materialised).
__global__ void AttentionNaiveKernel(const float* q, const float* k_cache, const float* v_cache,
                                     int n, int q_heads, int kv_heads, int head_dim,
                                     const int* position, const int2* ragged, int capacity,
                                     float* scores, float* out) {
  extern __shared__ float q_shared[];
  __shared__ float scratch[32];
  const int row = blockIdx.x, head = blockIdx.y;
  const int2 sequence_position = RowSequencePosition(row, n, position, ragged);
  const int batch = sequence_position.x, pos = sequence_position.y;
  const int kv_head = head / (q_heads / kv_heads);
  const int kv_dim = kv_heads * head_dim;
  const float scale = rsqrtf(static_cast<float>(head_dim));
  const float* qh = q + (static_cast<int64_t>(row) * q_heads + head) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_shared[d] = qh[d];
  __syncthreads();
  const float* keys =
      k_cache + static_cast<int64_t>(batch) * capacity * kv_dim + kv_head * head_dim;
  const float* values =
      v_cache + static_cast<int64_t>(batch) * capacity * kv_dim + kv_head * head_dim;
  float* s = scores + (static_cast<int64_t>(row) * q_heads + head) * capacity;
  float local_max = -INFINITY;
  for (int j = threadIdx.x; j <= pos; j += blockDim.x) {
    float dot = 0.f;
    for (int d = 0; d < head_dim; ++d)
      dot += q_shared[d] * keys[static_cast<int64_t>(j) * kv_dim + d];
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

void BuildRopeTable(int capacity, int head_dim, double theta, float2* table, cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(capacity) * (head_dim / 2);
  LaunchPlain(RopeTableKernel, CeilDiv(count, 256), 256, 0, stream, capacity, head_dim / 2,
              head_dim, theta, table);
}

void QkNormRopeAppend(const QkvRows& in, float* q_out, int rows, int n, int q_heads, int kv_heads,
                      int head_dim, const MatrixRef& q_norm, const MatrixRef& k_norm, float eps,
                      const float2* rope, const int* position, const KvCache& cache,
                      cudaStream_t stream, const int2* ragged) {
  const dim3 grid(rows, CeilDiv(q_heads + kv_heads, kRopeWarps)), block(kRopeWarps * 32);
  WithCacheType(cache.dtype, [&](auto type) {
    Launch(QkNormRopeAppendKernel<decltype(type)>, grid, block, 0, stream, in.q, in.q_stride,
           in.q_head_stride > 0 ? in.q_head_stride : head_dim, in.k, in.v, in.kv_stride, q_out, n,
           q_heads, kv_heads, head_dim, q_norm.data, k_norm.data, q_norm.dtype, eps, rope, position,
           ragged, cache);
  });
}

void QkNormPartialRopeAppend(const QkvRows& in, float* q_out, int rows, int n, int q_heads,
                             int kv_heads, int head_dim, int rotary_dim, const MatrixRef& q_norm,
                             const MatrixRef& k_norm, float eps, const float2* rope,
                             const int* position, const KvCache& cache, cudaStream_t stream,
                             const int2* ragged) {
  const dim3 grid(rows, CeilDiv(q_heads + kv_heads, kRopeWarps)), block(kRopeWarps * 32);
  const size_t smem = sizeof(float) * kRopeWarps * head_dim;
  WithCacheType(cache.dtype, [&](auto type) {
    Launch(QkNormPartialRopeAppendKernel<decltype(type)>, grid, block, smem, stream, in.q,
           in.q_stride, in.q_head_stride > 0 ? in.q_head_stride : head_dim, in.k, in.v,
           in.kv_stride, q_out, n, q_heads, kv_heads, head_dim, rotary_dim, q_norm.data,
           k_norm.data, q_norm.dtype, eps, rope, position, ragged, cache);
  });
}

void AttentionNaive(const float* q, const float* k_cache, const float* v_cache, int rows, int n,
                    int q_heads, int kv_heads, int head_dim, const int* position, int capacity,
                    float* scores, float* out, cudaStream_t stream, const int2* ragged) {
  LaunchPlain(AttentionNaiveKernel, dim3(rows, q_heads), 128, head_dim * sizeof(float), stream, q,
              k_cache, v_cache, n, q_heads, kv_heads, head_dim, position, ragged, capacity, scores,
              out);
}

}  // namespace infersweep::cuda
