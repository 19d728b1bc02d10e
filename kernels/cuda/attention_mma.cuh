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

// Issues the copies of keys k0 + [0, kKeys) that lie in [from, to] into one stage (bf16
// [key][d] rows), and zeros for keys past last_key when zero_tail. bf16 caches go through
// cp.async (the copy lands while the warps compute the other stage); fp32 caches are rounded on
// the way, synchronously.
template <int D, int kKeys, int kStride>
__device__ __forceinline__ void IssueKvRows(const __nv_bfloat16* kb, const __nv_bfloat16* vb,
                                            int kv_dim, int k0, int from, int to, int last_key,
                                            bool zero_tail, __nv_bfloat16* k_s,
                                            __nv_bfloat16* v_s) {
#pragma unroll 4
  for (int idx = threadIdx.x; idx < kKeys * D / 8; idx += blockDim.x) {
    const int key = idx / (D / 8), d = (idx % (D / 8)) * 8, at = k0 + key;
    const bool copy = at >= from && at <= to && at <= last_key;
    if (!copy && !(zero_tail && at > last_key)) continue;
    const int64_t offset = copy ? static_cast<int64_t>(at) * kv_dim + d : 0;
    const uint32_t bytes = copy ? 16 : 0;  // 0: cp.async fills the 16 bytes with zeros
    const uint32_t k_dst = static_cast<uint32_t>(__cvta_generic_to_shared(k_s + key * kStride + d));
    const uint32_t v_dst = static_cast<uint32_t>(__cvta_generic_to_shared(v_s + key * kStride + d));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(k_dst), "l"(kb + offset),
                 "r"(bytes));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(v_dst), "l"(vb + offset),
                 "r"(bytes));
  }
}
template <int D, int kKeys, int kStride>
__device__ __forceinline__ void IssueKvRows(const float* kb, const float* vb, int kv_dim, int k0,
                                            int from, int to, int last_key, bool zero_tail,
                                            __nv_bfloat16* k_s, __nv_bfloat16* v_s) {
  for (int idx = threadIdx.x; idx < kKeys * D / 8; idx += blockDim.x) {
    const int key = idx / (D / 8), d = (idx % (D / 8)) * 8, at = k0 + key;
    const bool copy = at >= from && at <= to && at <= last_key;
    if (!copy && !(zero_tail && at > last_key)) continue;
    const uint4 z = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(k_s + key * kStride + d) =
        copy ? LoadBf16x8(kb + static_cast<int64_t>(at) * kv_dim + d) : z;
    *reinterpret_cast<uint4*>(v_s + key * kStride + d) =
        copy ? LoadBf16x8(vb + static_cast<int64_t>(at) * kv_dim + d) : z;
  }
}
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
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
