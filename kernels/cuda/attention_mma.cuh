// Pieces shared by the tensor-core attention kernels (attention_prefill.cu, attention_decode.cu):
// bf16 packing, the m16n8k16 MMA, K/V tile staging from either cache type, and the transposed
// V fragments. Fragment layouts are PTX's for mma.m16n8k16 (.row.col): lane (g, t) = (lane / 4,
// lane % 4) holds rows g and g + 8 of A and C, and column g of B.
#pragma once

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace infersweep::cuda {

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}

// c += a . b, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void MmaBf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Eight cache elements from a 16-byte-aligned address, as eight bf16 (one 16-byte word).
__device__ __forceinline__ uint4 LoadBf16x8(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 LoadBf16x8(const float* p) {
  const float4 lo = __ldg(reinterpret_cast<const float4*>(p));
  const float4 hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
  return make_uint4(PackBf16x2(lo.x, lo.y), PackBf16x2(lo.z, lo.w), PackBf16x2(hi.x, hi.y),
                    PackBf16x2(hi.z, hi.w));
}

// Keys [k0, k0 + kKeys) of one kv head into shared memory as bf16 [key][d] rows of stride
// kStride (zeros past last_key), K and V alike; kb/vb point at key 0 of the head, kv_dim apart.
// Consecutive threads take consecutive 8-element pieces (coalesced), unrolled so a thread's
// loads are in flight together. No barrier: the caller syncs before and after.
template <int D, int kKeys, int kStride, typename CacheT>
__device__ __forceinline__ void StageKvTile(const CacheT* kb, const CacheT* vb, int kv_dim, int k0,
                                            int last_key, __nv_bfloat16* k_s, __nv_bfloat16* v_s) {
#pragma unroll 8
  for (int idx = threadIdx.x; idx < kKeys * D / 8; idx += blockDim.x) {
    const int key = idx / (D / 8), d = (idx % (D / 8)) * 8;
    uint4 kq = make_uint4(0, 0, 0, 0), vq = kq;
    if (k0 + key <= last_key) {
      kq = LoadBf16x8(kb + static_cast<int64_t>(k0 + key) * kv_dim + d);
      vq = LoadBf16x8(vb + static_cast<int64_t>(k0 + key) * kv_dim + d);
    }
    *reinterpret_cast<uint4*>(k_s + key * kStride + d) = kq;
    *reinterpret_cast<uint4*>(v_s + key * kStride + d) = vq;
  }
}

// B fragments of P V for 16 keys starting at row `key0` of the staged V tile and d tiles j, j + 1
// (8 d each): ldmatrix.x4.trans, lanes 0-15 addressing keys key0 + (lane & 15) at d 8 j, lanes
// 16-31 the same keys at d 8 j + 8. b[0], b[1] feed d tile j; b[2], b[3] d tile j + 1.
template <int kStride>
__device__ __forceinline__ void LoadVFragments(const __nv_bfloat16* v_s, int key0, int j, int lane,
                                               uint32_t* b) {
  const uint32_t address = static_cast<uint32_t>(
      __cvta_generic_to_shared(v_s + (key0 + (lane & 15)) * kStride + 8 * j + (lane >> 4) * 8));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(address));
}

}  // namespace infersweep::cuda
