// Pieces shared by the tensor-core attention kernels (attention_prefill.cu, attention_decode.cu):
// bf16 packing, the m16n8k16 MMA, K/V tile staging from either cache type, and the transposed
// V fragments. Fragment layouts are PTX's for mma.m16n8k16 (.row.col): lane (g, t) = (lane / 4,
// lane % 4) holds rows g and g + 8 of A and C, and column g of B.
#pragma once

#include <cstdint>
#include <type_traits>

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

// Sum over the 4 lanes (t) that hold one row of a fragment.
__device__ __forceinline__ float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One step of the online softmax over kTiles x 8 keys, on fragments: s[j] holds the masked,
// log2-scaled scores of rows g and g + 8 at keys key0 + 8 j + 2t (+1) of the staged tile. Updates
// the rows' running max m (which must be finite after this step: the callers guarantee a valid
// key per row) and this lane's part of their sums l, rescales o and adds P V, V rows from key0.
// The S accumulators of key tiles 2i and 2i + 1 are exactly the A fragment of 16 keys.
template <int D, int kTiles, int kStride>
__device__ __forceinline__ void SoftmaxAccumulate(float (&s)[kTiles][4], const __nv_bfloat16* v_s,
                                                  int key0, int lane, float& m_lo, float& m_hi,
                                                  float& l_lo, float& l_hi, float (&o)[D / 8][4]) {
  float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
  }
#pragma unroll
  for (int offset = 1; offset <= 2; offset <<= 1) {  // the 4 lanes of a row
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, offset));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, offset));
  }
  const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
  const float corr_lo = exp2f(m_lo - new_lo), corr_hi = exp2f(m_hi - new_hi);  // 0 at first
  m_lo = new_lo;
  m_hi = new_hi;
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      s[j][c] = exp2f(s[j][c] - new_lo);  // a masked score (-inf) gives 0
      s[j][2 + c] = exp2f(s[j][2 + c] - new_hi);
      sum_lo += s[j][c];
      sum_hi += s[j][2 + c];
    }
  l_lo = l_lo * corr_lo + sum_lo;
  l_hi = l_hi * corr_hi + sum_hi;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    o[j][0] *= corr_lo;
    o[j][1] *= corr_lo;
    o[j][2] *= corr_hi;
    o[j][3] *= corr_hi;
  }
#pragma unroll
  for (int ks = 0; ks < kTiles / 2; ++ks) {
    const uint32_t pa[4] = {PackBf16x2(s[2 * ks][0], s[2 * ks][1]),
                            PackBf16x2(s[2 * ks][2], s[2 * ks][3]),
                            PackBf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                            PackBf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
    for (int j = 0; j < D / 8; j += 2) {
      uint32_t b[4];
      LoadVFragments<kStride>(v_s, key0 + 16 * ks, j, lane, b);
      MmaBf16(o[j], pa, b[0], b[1]);
      MmaBf16(o[j + 1], pa, b[2], b[3]);
    }
  }
}

// Shared memory of two K/V stages of kKeys keys at head size head_dim (bf16, padded rows).
template <int kKeys>
constexpr size_t KvStagesBytes(int head_dim) {
  return 2 * 2 * kKeys * (head_dim + 8) * sizeof(__nv_bfloat16);
}

// Launches kernel_of(D) for head_dim D = 32, 64 or 128 (the callers' Supports functions) with
// two K/V stages of dynamic shared memory; D = 128 needs more than the 48 KB default, raised once
// per kernel.
template <int kKeys, typename KernelOf, typename... Args>
void LaunchForHeadDim(KernelOf kernel_of, int head_dim, dim3 grid, dim3 block, cudaStream_t stream,
                      Args... args) {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([&] {
    cudaFuncSetAttribute(kernel_of(std::integral_constant<int, 128>{}),
                         cudaFuncAttributeMaxDynamicSharedMemorySize, KvStagesBytes<kKeys>(128));
  });
  const size_t smem = KvStagesBytes<kKeys>(head_dim);
  switch (head_dim) {
    case 32:
      Launch(kernel_of(std::integral_constant<int, 32>{}), grid, block, smem, stream, args...);
      break;
    case 64:
      Launch(kernel_of(std::integral_constant<int, 64>{}), grid, block, smem, stream, args...);
      break;
    default:
      Launch(kernel_of(std::integral_constant<int, 128>{}), grid, block, smem, stream, args...);
  }
}

}  // namespace infersweep::cuda
