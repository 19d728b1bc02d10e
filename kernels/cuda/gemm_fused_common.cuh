// Pieces shared by the decode GEMV kernels (gemm_fused.cu: register-streamed; sm90a/gemm_tma.cu:
// TMA-streamed): the staged, optionally RMS-normalised input and the fused epilogue.
#pragma once

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {

// Stages rows x k floats of x, times the norm gain when there is one, into shared memory with
// 16-byte loads all in flight at once (one L2 round trip), then computes each row's RMSNorm
// factor 1/rms(x) into inv (1 without a norm) and writes the normalised input to
// args.normed_out from block 0 when asked. Ends with a barrier: xs is ready for every warp.
template <int kMaxRows>
__device__ __forceinline__ void StageGemvInput(const GemvArgs& a, float* xs, float* scratch,
                                               float* inv) {
  const int k = a.k, quads = a.rows * k / 4;
#pragma unroll 4
  for (int q = threadIdx.x; q < quads; q += blockDim.x) {
    float4 v = __ldg(reinterpret_cast<const float4*>(a.x) + q);
    if (a.norm_gain) {
      const int i = (q * 4) % k;
      v.x *= LoadAsFloat(a.norm_gain, a.norm_dtype, i);
      v.y *= LoadAsFloat(a.norm_gain, a.norm_dtype, i + 1);
      v.z *= LoadAsFloat(a.norm_gain, a.norm_dtype, i + 2);
      v.w *= LoadAsFloat(a.norm_gain, a.norm_dtype, i + 3);
    }
    reinterpret_cast<float4*>(xs)[q] = v;
  }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) inv[r] = 1.f;
  if (a.norm_gain) {  // the sum of squares of x itself (re-read: L1-hot)
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= a.rows) break;
      float sum_sq = 0.f;
      const float4* x4 = reinterpret_cast<const float4*>(a.x + static_cast<int64_t>(r) * k);
#pragma unroll 4
      for (int q = threadIdx.x; q < k / 4; q += blockDim.x) {
        const float4 v = __ldg(x4 + q);
        sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
      inv[r] = rsqrtf(BlockSum(sum_sq, scratch) / k + a.norm_eps);  // BlockSum has barriers
    }
  }
  __syncthreads();
  if (a.normed_out && blockIdx.x == 0) {
    for (int r = 0; r < a.rows; ++r)
      for (int i = threadIdx.x; i < k; i += blockDim.x)
        a.normed_out[static_cast<int64_t>(r) * k + i] = xs[r * k + i] * inv[r];
  }
}

// The fused epilogue of output `local` of segment `seg`, activation row r (lane 0 calls it).
__device__ __forceinline__ void StoreGemvOutput(const GemvArgs& a, const GemvSegment& seg,
                                                int local, int r, float dot) {
  float* y = seg.y + static_cast<int64_t>(r) * seg.ld + local;
  float v = a.scale * dot;
  if (seg.bias) v += LoadAsFloat(seg.bias, seg.bias_dtype, local);
  *y = a.accumulate ? *y + v : v;
}

}  // namespace infersweep::cuda
