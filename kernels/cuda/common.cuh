// Shared device helpers for the CUDA kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace infersweep::cuda {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); `scratch` holds 32 floats.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? scratch[lane] : 0.f;  // every warp sums all partials: a broadcast
  return WarpSum(v);
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// Eight floats from a 16-byte-aligned address through the read-only path (two 16-byte loads).
__device__ __forceinline__ void LoadFloat8(const float* p, float* v) {
  const float4 lo = __ldg(reinterpret_cast<const float4*>(p));
  const float4 hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

// Copies n floats (n % 4 == 0, 16-byte aligned) into shared memory with 16-byte loads, unrolled
// so that a block's loads are all in flight together: one L2 round trip, not one per element.
__device__ __forceinline__ void StageFloats(const float* src, int n, float* dst) {
#pragma unroll 4
  for (int q = threadIdx.x; q < n / 4; q += blockDim.x)
    reinterpret_cast<float4*>(dst)[q] = __ldg(reinterpret_cast<const float4*>(src) + q);
}

// Dot product of 8 bf16 weights (one 16-byte load) with 8 floats, fp32 accumulate.
__device__ __forceinline__ float Dot8Bf16(const uint4 packed, const float* x) {
  const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(&packed);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(w[i]);
    acc += f.x * x[2 * i] + f.y * x[2 * i + 1];
  }
  return acc;
}

inline int CeilDiv(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace infersweep::cuda
