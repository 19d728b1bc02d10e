// Decode GEMV (gemm=fused): a few activation rows against bf16 weights, with the RMSNorm before
// it, the bias and the residual add after it fused into the one launch.
//
// Napkin math, qwen3-30b-a3b batch-1 decode, per layer: q+k+v = 5120 x 2048 bf16 = 21 MB ->
// 4.7 us at 4.46 TB/s; o = 2048 x 4096 = 16.8 MB -> 3.8 us; router 128 x 2048 = 0.5 MB -> a
// latency-bound ~2 us. FLOPs are 2 per weight per row: 0.5 FLOP/byte at batch 1, so the bound is
// bandwidth. cuBLASLt measured 8.4 us (q), 6.6 us (k), 6.7 us (v) and 8.3 + 3.2 us (o + split-K
// reduce) on the H200, plus the ToBf16, RMSNorm and residual kernels this one absorbs.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

constexpr int kGemvMaxThreads = 512;  // 16 warps, one output feature each
constexpr int kGemvUnroll = 8;     // 16-byte weight loads in flight per lane

__device__ __forceinline__ void AccumulateChunk(const uint4 packed, const float* xs, int k,
                                                int chunk, int rows, float* acc) {
  const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&packed);
  float w[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(w2[i]);
    w[2 * i] = f.x;
    w[2 * i + 1] = f.y;
  }
#pragma unroll
  for (int r = 0; r < kGemvMaxRows; ++r) {
    if (r >= rows) break;
    const float4* x4 = reinterpret_cast<const float4*>(xs + static_cast<int64_t>(r) * k + chunk * 8);
    const float4 a = x4[0], b = x4[1];
    acc[r] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y +
              w[6] * b.z + w[7] * b.w;
  }
}

// One output feature per warp (the grid covers every output: no warp does two rows while others
// idle). The warp's first kGemvUnroll weight loads are issued before x is staged and normalised,
// so that prologue (an L2 round trip, two block reductions) hides under their DRAM latency.
__global__ void __launch_bounds__(kGemvMaxThreads) GemvKernel(GemvArgs a) {
  extern __shared__ float xs[];  // [rows][k]
  __shared__ float scratch[32];
  const int k = a.k;
  const int lane = threadIdx.x & 31;
  const int chunks = k / 8;
  int total = 0;
  for (int s = 0; s < a.segments; ++s) total += a.seg[s].n;
  const int out = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const bool active = out < total;
  int s = 0, local = active ? out : 0;
  while (s + 1 < a.segments && local >= a.seg[s].n) local -= a.seg[s++].n;
  const GemvSegment& seg = a.seg[s];
  const uint4* wrow = reinterpret_cast<const uint4*>(seg.w + static_cast<int64_t>(local) * k);
  uint4 packed[kGemvUnroll];
#pragma unroll
  for (int u = 0; u < kGemvUnroll; ++u)
    if (active && lane + 32 * u < chunks) packed[u] = __ldcs(wrow + lane + 32 * u);  // streamed

  for (int i = threadIdx.x; i < a.rows * k; i += blockDim.x) xs[i] = a.x[i];
  if (a.norm_gain) {
    __syncthreads();
    for (int r = 0; r < a.rows; ++r) {
      float sum_sq = 0.f;
      for (int i = threadIdx.x; i < k; i += blockDim.x) sum_sq += xs[r * k + i] * xs[r * k + i];
      sum_sq = BlockSum(sum_sq, scratch);
      const float inv = rsqrtf(sum_sq / k + a.norm_eps);
      for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const float v = xs[r * k + i] * inv * LoadAsFloat(a.norm_gain, a.norm_dtype, i);
        xs[r * k + i] = v;
        if (a.normed_out && blockIdx.x == 0) a.normed_out[static_cast<int64_t>(r) * k + i] = v;
      }
    }
  }
  __syncthreads();
  if (!active) return;

  float acc[kGemvMaxRows] = {};
  for (int c0 = lane; c0 < chunks; c0 += 32 * kGemvUnroll) {
    if (c0 != lane) {
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u)
        if (c0 + 32 * u < chunks) packed[u] = __ldcs(wrow + c0 + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u)
      if (c0 + 32 * u < chunks) AccumulateChunk(packed[u], xs, k, c0 + 32 * u, a.rows, acc);
  }
#pragma unroll
  for (int r = 0; r < kGemvMaxRows; ++r) {
    if (r >= a.rows) break;
    const float dot = WarpSum(acc[r]);
    if (lane == 0) {
      float* y = seg.y + static_cast<int64_t>(r) * seg.ld + local;
      float v = a.scale * dot;
      if (seg.bias) v += LoadAsFloat(seg.bias, seg.bias_dtype, local);
      *y = a.accumulate ? *y + v : v;
    }
  }
}

int SmCount() {
  static const int count = [] {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return std::max(sms, 1);
  }();
  return count;
}

}  // namespace

bool GemvSupports(int rows, int k) {
  return rows >= 1 && rows <= kGemvMaxRows && k % 8 == 0 &&
         static_cast<int64_t>(rows) * k * sizeof(float) <= kGemvMaxSharedBytes;
}

void Gemv(const GemvArgs& args, cudaStream_t stream) {
  static const bool configured = [] {
    cudaFuncSetAttribute(GemvKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemvMaxSharedBytes);
    return true;
  }();
  (void)configured;
  int total = 0;
  for (int s = 0; s < args.segments; ++s) total += args.seg[s].n;
  // 16 warps a block, fewer when that would leave SMs idle (the 128-row router: 32 blocks of 4).
  int warps = 16;
  while (warps > 4 && CeilDiv(total, warps) < SmCount()) warps /= 2;
  GemvKernel<<<CeilDiv(total, warps), warps * 32,
               static_cast<size_t>(args.rows) * args.k * sizeof(float), stream>>>(args);
}

}  // namespace infersweep::cuda
