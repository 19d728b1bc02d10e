// Pieces shared by the tensor-core attention kernels (attention_prefill.cu, attention_decode.cu):
// the m16n8k16 MMA, K/V tile staging from any cache type, Q staged in shared memory at head size
// 256, the transposed V fragments and the launch per head size. Fragment layouts are PTX's for
// mma.m16n8k16 (.row.col): lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of A and C,
// and column g of B.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_cache.cuh"

namespace infersweep::cuda {

// c += a . b, fp32 accumulators, bf16 or (TileT __half) f16 inputs.
template <typename TileT>
__device__ __forceinline__ void Mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<TileT, __half>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <typename TileT>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  if constexpr (std::is_same_v<TileT, __half>)
    return PackF16x2(lo, hi);
  else
    return PackBf16x2(lo, hi);
}

__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}
// `bytes` (<= the copy's size) from global to shared memory, asynchronously; the rest of the
// destination is zero-filled (bytes 0: all of it).
__device__ __forceinline__ void CopyAsync16(void* shared, const void* global, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global), "r"(bytes));
}
__device__ __forceinline__ void CopyAsync4(void* shared, const void* global, uint32_t bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global), "r"(bytes));
}

// Shared memory of two K/V stages of kKeys keys at head size head_dim (bf16, padded rows).
template <int kKeys>
constexpr size_t KvStagesBytes(int head_dim) {
  return 2 * 2 * kKeys * (head_dim + 8) * sizeof(__nv_bfloat16);
}

// A block's K/V tiles in shared memory (KvStagesBytes), two stages deep so that tile t + 1's
// copies land while tile t is computed; the kernels read every tile as TileT [key][d] rows,
// kStride apart (padded by 8: the fragment loads hit 32 distinct banks), and run their MMAs on
// TileT.
//   bf16 cache: bf16 tiles, cp.async straight into the stage's rows.
//   fp32 cache: bf16 tiles, rounded on the way, synchronously.
//   fp8 cache: f16 tiles. cp.async copies the raw codes and row scales into the stage (the
//     copies stay asynchronous: converting on the way left a step's loads exposed); once they
//     land, Ready converts them into the one f16 tile, codes times row scale (HeadScale's powers
//     of two: exact in f16). One cvt and one multiply a pair: a bf16 tile takes six
//     instructions a pair, enough to make the kernel instruction-bound.
// Issue(tile, ...) copies keys k0 + [0, kKeys) that lie in [from, to], and zeros for keys past
// last_key when zero_tail; keys outside both are left as they were.
template <int D, int kKeys, typename CacheT>
struct KvTiles {
  static constexpr int kStride = D + 8;
  static constexpr bool kRaw = kIsFp8Cache<CacheT>;
  using TileT = std::conditional_t<kRaw, __half, __nv_bfloat16>;
  static constexpr int kTileElems = kKeys * kStride;  // K or V
  // fp8: a stage is K codes, V codes ([kKeys][D] bytes each), then K and V scales ([kKeys] each).
  static constexpr int kRawStageBytes = 2 * kKeys * D + 2 * kKeys * 4;
  static_assert(!kRaw || 2 * kRawStageBytes + 2 * kTileElems * 2 <= KvStagesBytes<kKeys>(D),
                "the fp8 stages and their bf16 tile fit the bf16 stages' shared memory");
  uint8_t* base;

  __device__ __forceinline__ TileT* K(int tile) const {
    TileT* tiles = reinterpret_cast<TileT*>(base + (kRaw ? 2 * kRawStageBytes : 0));
    return kRaw ? tiles : tiles + (tile & 1) * 2 * kTileElems;
  }
  __device__ __forceinline__ TileT* V(int tile) const { return K(tile) + kTileElems; }

  __device__ __forceinline__ void Issue(const KvHeadRows<CacheT>& rows, int tile, int k0, int from,
                                        int to, int last_key, bool zero_tail) const {
    constexpr int kPiece = kRaw ? 16 : 8;  // elements a copy moves
#pragma unroll 8
    for (int idx = threadIdx.x; idx < kKeys * D / kPiece; idx += blockDim.x) {
      const int key = idx / (D / kPiece), d = (idx % (D / kPiece)) * kPiece, at = k0 + key;
      const bool copy = at >= from && at <= to && at <= last_key;
      if (!copy && !(zero_tail && at > last_key)) continue;
      const int64_t offset = copy ? static_cast<int64_t>(at) * rows.kv_dim + d : 0;
      if constexpr (kRaw) {
        uint8_t* stage = base + (tile & 1) * kRawStageBytes;
        CopyAsync16(stage + key * D + d, rows.k + offset, copy ? 16 : 0);
        CopyAsync16(stage + kKeys * D + key * D + d, rows.v + offset, copy ? 16 : 0);
        if (d == 0) {
          const int64_t scale_at = copy ? static_cast<int64_t>(at) * rows.kv_heads : 0;
          float* scales = reinterpret_cast<float*>(stage + 2 * kKeys * D);
          CopyAsync4(scales + key, rows.k_scale + scale_at, copy ? 4 : 0);
          CopyAsync4(scales + kKeys + key, rows.v_scale + scale_at, copy ? 4 : 0);
        }
      } else if constexpr (std::is_same_v<CacheT, __nv_bfloat16>) {
        CopyAsync16(K(tile) + key * kStride + d, rows.k + offset, copy ? 16 : 0);
        CopyAsync16(V(tile) + key * kStride + d, rows.v + offset, copy ? 16 : 0);
      } else {
        const uint4 z = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(K(tile) + key * kStride + d) =
            copy ? LoadBf16x8(rows.k + offset) : z;
        *reinterpret_cast<uint4*>(V(tile) + key * kStride + d) =
            copy ? LoadBf16x8(rows.v + offset) : z;
      }
    }
  }

  // Called by every thread once tile `tile`'s copies have landed and a barrier has passed; the
  // tile is readable after it.
  __device__ __forceinline__ void Ready(int tile) const {
    if constexpr (kRaw) {
      const uint8_t* stage = base + (tile & 1) * kRawStageBytes;
      const float* scales = reinterpret_cast<const float*>(stage + 2 * kKeys * D);
      for (int idx = threadIdx.x; idx < kKeys * D / 8; idx += blockDim.x) {
        const int key = idx / (D / 8), d = (idx % (D / 8)) * 8;
        const uint2 k_codes = *reinterpret_cast<const uint2*>(stage + key * D + d);
        const uint2 v_codes = *reinterpret_cast<const uint2*>(stage + kKeys * D + key * D + d);
        *reinterpret_cast<uint4*>(K(tile) + key * kStride + d) =
            Fp8x8ToF16(k_codes, __float2half2_rn(scales[key]));
        *reinterpret_cast<uint4*>(V(tile) + key * kStride + d) =
            Fp8x8ToF16(v_codes, __float2half2_rn(scales[kKeys + key]));
      }
      __syncthreads();
    }
  }
};

// B fragments of P V for 16 keys starting at row `key0` of the staged V tile and d tiles j, j + 1
// (8 d each): ldmatrix.x4.trans, lanes 0-15 addressing keys key0 + (lane & 15) at d 8 j, lanes
// 16-31 the same keys at d 8 j + 8. b[0], b[1] feed d tile j; b[2], b[3] d tile j + 1.
template <int kStride, typename TileT>
__device__ __forceinline__ void LoadVFragments(const TileT* v_s, int key0, int j, int lane,
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
template <int D, int kTiles, int kStride, typename TileT>
__device__ __forceinline__ void SoftmaxAccumulate(float (&s)[kTiles][4], const TileT* v_s, int key0,
                                                  int lane, float& m_lo, float& m_hi, float& l_lo,
                                                  float& l_hi, float (&o)[D / 8][4]) {
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
    const uint32_t pa[4] = {Pack<TileT>(s[2 * ks][0], s[2 * ks][1]),
                            Pack<TileT>(s[2 * ks][2], s[2 * ks][3]),
                            Pack<TileT>(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                            Pack<TileT>(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
    for (int j = 0; j < D / 8; j += 2) {
      uint32_t b[4];
      LoadVFragments<kStride>(v_s, key0 + 16 * ks, j, lane, b);
      Mma<TileT>(o[j], pa, b[0], b[1]);
      Mma<TileT>(o[j + 1], pa, b[2], b[3]);
    }
  }
}

// Head sizes above 128 keep Q in shared memory rather than in registers: the output
// accumulators alone take D / 2 registers a lane (128 at D = 256), and Q's A fragments would add
// D / 4 more, past what a thread holds without spilling. Each MMA step then loads its A fragment
// from the staged tile (four 32-bit shared loads).
template <int D>
constexpr bool kQInShared = D > 128;

// Bytes of a staged Q tile of `rows` rows at head size D (none where Q stays in registers): bf16
// or f16 rows padded by 8 elements like the K/V rows, so the fragment loads hit 32 distinct banks.
template <int D>
constexpr size_t QTileBytes(int rows) {
  return kQInShared<D> ? static_cast<size_t>(rows) * (D + 8) * sizeof(__nv_bfloat16) : 0;
}

// Stages `rows` rows of Q into q_s as TileT [row][d] (row stride D + 8), each element times
// `scale`: row r is the D floats at row_of(r), or zeros where that is nullptr. The block's
// threads share the rows; a barrier must pass before any fragment is read.
template <int D, typename TileT, typename RowOf>
__device__ __forceinline__ void StageQ(TileT* q_s, int rows, float scale, RowOf row_of) {
  for (int idx = threadIdx.x; idx < rows * (D / 8); idx += blockDim.x) {
    const int r = idx / (D / 8), d = (idx % (D / 8)) * 8;
    const float* src = row_of(r);
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (src) {
      const float4 lo = *reinterpret_cast<const float4*>(src + d);
      const float4 hi = *reinterpret_cast<const float4*>(src + d + 4);
      packed = make_uint4(
          Pack<TileT>(lo.x * scale, lo.y * scale), Pack<TileT>(lo.z * scale, lo.w * scale),
          Pack<TileT>(hi.x * scale, hi.y * scale), Pack<TileT>(hi.z * scale, hi.w * scale));
    }
    *reinterpret_cast<uint4*>(q_s + r * (D + 8) + d) = packed;
  }
}

// The A fragment of staged Q rows row0 + [0, 16) at d [16 ks, 16 ks + 16): a[0], a[2] row
// row0 + g at d 16 ks + 2t (+8), a[1], a[3] row row0 + g + 8 (the layout the register-held
// fragments have).
template <int D, typename TileT>
__device__ __forceinline__ void LoadQFragment(const TileT* q_s, int row0, int ks, int g, int t,
                                              uint32_t* a) {
  constexpr int kStride = D + 8;
  const uint32_t* lo =
      reinterpret_cast<const uint32_t*>(q_s + (row0 + g) * kStride + 16 * ks + 2 * t);
  const uint32_t* hi = lo + 4 * kStride;  // 8 rows on: 8 x kStride elements, 2 a word
  a[0] = lo[0];
  a[1] = hi[0];
  a[2] = lo[4];
  a[3] = hi[4];
}

// A tensor-core kernel's launch shape at one head size: threads a block and dynamic shared
// memory.
struct HeadDimShape {
  int threads;
  size_t smem;
};

// Launches kernel_of(D) for head_dim D = 32, 64, 128 or 256 (the callers' Supports functions)
// with shape_of(D)'s threads and dynamic shared memory. D = 128 and 256 need more than the 48 KB
// default, raised once per kernel and device before its first launch there.
template <typename KernelOf, typename ShapeOf, typename... Args>
void LaunchForHeadDim(KernelOf kernel_of, ShapeOf shape_of, int head_dim, dim3 grid,
                      cudaStream_t stream, Args... args) {
  static PerDeviceOnce configure_128, configure_256;  // the attribute is per device
  auto launch = [&](auto d, PerDeviceOnce* configure) {
    const HeadDimShape shape = shape_of(d);
    if (configure)
      (*configure)([&] {
        cudaFuncSetAttribute(kernel_of(d), cudaFuncAttributeMaxDynamicSharedMemorySize, shape.smem);
      });
    Launch(kernel_of(d), grid, dim3(shape.threads), shape.smem, stream, args...);
  };
  switch (head_dim) {
    case 32:
      launch(std::integral_constant<int, 32>{}, nullptr);
      break;
    case 64:
      launch(std::integral_constant<int, 64>{}, nullptr);
      break;
    case 128:
      launch(std::integral_constant<int, 128>{}, &configure_128);
      break;
    default:
      launch(std::integral_constant<int, 256>{}, &configure_256);
  }
}

}  // namespace infersweep::cuda
