// The KV cache's element types on the device (kv_cache=fp32|bf16|fp8): how a value is stored,
// how one kv head's rows of one sequence are addressed, and how elements become bf16 for the
// tensor-core kernels' shared-memory tiles (attention_mma.cuh's KvTiles).
// fp8 rows are E4M3 codes with one fp32 scale per (token, kv head) for K and one for V: a power
// of two just above the head vector's amax / 448 (HeadScale), so a head keeps E4M3's 3-bit
// mantissa whatever its magnitude. At head_dim
// 128 the scales add 4 bytes to 128 (3 %): 66 bytes a K or V head row against bf16's 256.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {

using Fp8E4m3 = __nv_fp8_e4m3;
constexpr float kE4m3Max = 448.f;

template <typename CacheT>
constexpr bool kIsFp8Cache = std::is_same_v<CacheT, Fp8E4m3>;

// Calls f(CacheT{}) with the cache's element type: float, __nv_bfloat16 or Fp8E4m3.
template <typename F>
void WithCacheType(KvDtype dtype, F&& f) {
  switch (dtype) {
    case KvDtype::kBf16:
      f(__nv_bfloat16{});
      return;
    case KvDtype::kFp8:
      f(Fp8E4m3{});
      return;
    case KvDtype::kFp32:
      f(float{});
      return;
  }
}

// One kv head's rows of one sequence: element (key, d) at key * kv_dim + d; with an fp8 cache,
// row key's scales at key * kv_heads.
template <typename CacheT>
struct KvHeadRows {
  const CacheT* k;
  const CacheT* v;
  const float* k_scale;
  const float* v_scale;
  int kv_dim, kv_heads;
};

template <typename CacheT>
__device__ __forceinline__ KvHeadRows<CacheT> HeadRows(const KvCache& cache, int batch, int kv_head,
                                                       int kv_heads, int head_dim) {
  const int kv_dim = kv_heads * head_dim;
  const int64_t first_row = static_cast<int64_t>(batch) * cache.capacity;
  const int64_t scale_at = first_row * kv_heads + kv_head;
  return {static_cast<const CacheT*>(cache.k) + first_row * kv_dim + kv_head * head_dim,
          static_cast<const CacheT*>(cache.v) + first_row * kv_dim + kv_head * head_dim,
          kIsFp8Cache<CacheT> ? cache.k_scale + scale_at : nullptr,
          kIsFp8Cache<CacheT> ? cache.v_scale + scale_at : nullptr,
          kv_dim,
          kv_heads};
}

// Eight fp32 cache elements from a 16-byte-aligned address as eight bf16 (one 16-byte word).
__device__ __forceinline__ uint4 LoadBf16x8(const float* p) {
  const float4 lo = __ldg(reinterpret_cast<const float4*>(p));
  const float4 hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
  return make_uint4(PackBf16x2(lo.x, lo.y), PackBf16x2(lo.z, lo.w), PackBf16x2(hi.x, hi.y),
                    PackBf16x2(hi.z, hi.w));
}
// Eight E4M3 codes (low byte first) times their row's scale, as eight f16: one cvt and one
// multiply a pair, exact for the power-of-two scales HeadScale sets (f16 holds E4M3 exactly).
__device__ __forceinline__ uint4 Fp8x8ToF16(uint2 codes, __half2 scale) {
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = i < 2 ? codes.x : codes.y;
    const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(word >> (16 * (i & 1)));
    const __half2 h = __hmul2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)), scale);
    packed[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

__device__ __forceinline__ void StoreKv(float* p, float v) { *p = v; }
__device__ __forceinline__ void StoreKv(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void StoreKv(Fp8E4m3* p, float v) { *p = Fp8E4m3(v); }  // satfinite

// The scale a head vector of absolute maximum `amax` is stored under (fp8), and its reciprocal:
// the power of two 2^e with amax / 448 <= 2^e (so no code saturates), e in [-14, 15]. A power
// of two keeps code x scale exact in f16, the attention kernels' tile type for fp8 caches
// (values below 2^-14 x 2^-9 lose bits as f16 subnormals; |values| past 32768 would overflow
// f16, far beyond what normed K and V rows hold). Costs at most a factor 2 of the code range at
// the bottom (subnormal codes start at a larger value), none of its 3-bit precision.
__device__ __forceinline__ float2 HeadScale(float amax) {
  int e = 0;
  const float m = frexpf(amax / kE4m3Max, &e);  // amax / 448 = m 2^e, m in [0.5, 1) (0 for 0)
  if (m == 0.5f) --e;                           // exactly a power of two: itself
  e = max(-14, min(15, e));
  return make_float2(ldexpf(1.f, e), ldexpf(1.f, -e));
}

// The (scale, 1 / scale) pairs of a K and a V head vector going into an fp8 cache at row
// `cache_row` ([batch, capacity] flattened) of kv head `kv_head`, from this lane's part of their
// absolute maxima; the whole warp calls it, lane 0 stores the scales.
__device__ __forceinline__ void StoreHeadScales(const KvCache& cache, int64_t cache_row,
                                                int kv_heads, int kv_head, float k_amax,
                                                float v_amax, float2* k_scale, float2* v_scale) {
  *k_scale = HeadScale(WarpMax(k_amax));
  *v_scale = HeadScale(WarpMax(v_amax));
  if ((threadIdx.x & 31) == 0) {
    cache.k_scale[cache_row * kv_heads + kv_head] = k_scale->x;
    cache.v_scale[cache_row * kv_heads + kv_head] = v_scale->x;
  }
}

}  // namespace infersweep::cuda
