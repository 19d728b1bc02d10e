// Split-KV decode attention on tensor cores (attention=flash, chunks of fewer than
// kFlashPrefillMinTokens tokens, head_dim 32/64/128/256): the q heads of one kv head are the rows
// of an m16n8k16 MMA (a GQA group of up to 16), so each K/V tile is read from shared memory once
// per block, not once per q head. The CUDA-core kernel (attention_flash.cu) gives each q head a
// warp that re-reads the whole tile from shared memory: 8x the tile's bytes, which bounds it at
// batch 64 well before DRAM does.
//
// Napkin math, qwen3-30b-a3b, batch 64, context 544, one layer: K and V are 64 x 544 x 512 x 2 x
// 2 B = 71 MB (bf16 cache; 142 MB fp32) -> 16 us at 4.46 TB/s; 2 x 64 x 32 x 544 x 128 x 2 FLOP
// = 0.57 GFLOP, nothing for tensor cores. Batch 1 is latency: ~4 kv heads x 18 splits = 72 blocks.
//
// Napkin math at head_dim 256, qwen3-next (16 q and 2 kv heads, 12 full-attention layers of 48),
// context 4096, one layer: K and V are 4096 x 2 x 512 x 2 B = 8 MB a sequence in bf16 (4.3 MB
// fp8 with its scales, 16 MB fp32). Batch 1: 8 MB -> 1.9 us at 4.46 TB/s, 22 us a step; the grid
// is 2 kv heads x 64 splits = 128 blocks (one wave), each two 32-key tiles, so it is latency: a
// few dependent DRAM round trips a block. Batch 64: 512 MB (273 MB fp8) -> 115 us (61 us) a
// layer, 1.4 ms a step; 4 x 64 x 16 x 4096 x 256 = 4.3 GFLOP, 8.6 issued with the group of 8
// padded to the MMA's 16 rows: ~20 us at 400 TFLOP/s of mma.sync, under the DRAM time. Grid:
// 64 x 2 x 9 splits = 1152 blocks of 64 threads.
#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/probe_kernels.h"

namespace infersweep::cuda {
namespace {

// Warps a block at head size D, each scoring 16 keys of every staged tile: four, and two at
// D = 256, where a key's K and V rows are twice as long: two stages of 32 keys and the staged Q
// come to 75 KB, so up to three blocks fit an H200 SM's 228 KB (64-key stages would take 144 KB:
// one block).
template <int D>
constexpr int kDecodeWarps = D > 128 ? 2 : 4;
// Keys a staged tile; warp w takes 16 w + [0, 16).
template <int D>
constexpr int kDecodeKeys = 16 * kDecodeWarps<D>;
constexpr float kLn2 = 0.6931471805599453f;

// grid (rows, kv_heads, splits), kDecodeWarps<D> x 32 threads. Block (row, kv head, split) walks
// the split's keys [begin, end) in tiles of kDecodeKeys<D> (64; 32 at D = 256) staged in shared
// memory as bf16 (from any cache type), two stages deep (the next tile's copies are in flight while
// the current one is computed); warp w scores its 16 keys of each tile against the group's q heads
// (A rows g and g + 8 are heads g and g + 8 of the group, zero past it) and keeps its own online
// softmax (exp2, log2-scaled). At D = 256 the group's Q is staged in shared memory after the K/V
// stages (kQInShared). The warps are merged through shared memory at the end, in warp order
// (deterministic), into the partial (max in natural log units, sum, unnormalised acc) of every q
// head of the group that FlashCombineKernel reads. Keys before the chunk's first position were
// appended by earlier steps, so the first tile's copies of those are issued before waiting for the
// kernel that appended this chunk's keys.
template <int D, typename CacheT>
__global__ void __launch_bounds__(kDecodeWarps<D> * 32)
    FlashDecodeKernel(const float* q, const KvCache cache, int n, int q_heads, int kv_heads,
                      const int* position, const int2* ragged, int splits, float* partial_acc,
                      float* partial_max, float* partial_sum) {
  constexpr int kWarps = kDecodeWarps<D>, kKeys = kDecodeKeys<D>;
  using Tiles = KvTiles<D, kKeys, CacheT>;
  using TileT = typename Tiles::TileT;
  constexpr int kStride = Tiles::kStride;
  // The K/V tiles; after the loop, the warps' scaled accumulators [warp][16][D] fp32.
  static_assert(kWarps * 16 * D * 4 <= KvStagesBytes<kKeys>(D), "the accumulators fit the stages");
  extern __shared__ __align__(16) uint8_t kv_s[];
  const Tiles tiles{kv_s};
  // kQInShared: the group's Q rows, after the stages.
  TileT* const q_s = reinterpret_cast<TileT*>(kv_s + KvStagesBytes<kKeys>(D));
  __shared__ float m_s[kWarps][16], l_s[kWarps][16];
  const int row = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int group = q_heads / kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // A lockstep chunk's first new key is its first row's; a ragged row's is its own.
  const int2 sequence_position = RowSequencePosition(row, n, position, ragged);
  const int batch = sequence_position.x, keys = sequence_position.y + 1;
  const int first_new = ragged ? sequence_position.y : *position;
  const int per_split = (keys + splits - 1) / splits;
  const int begin = split * per_split, end = min(keys, begin + per_split);
  const KvHeadRows<CacheT> kv = HeadRows<CacheT>(cache, batch, kv_head, kv_heads, D);
  if (begin < end)  // keys appended by earlier steps: not written by the kernel before this one
    tiles.Issue(kv, 0, begin, begin, first_new - 1, end - 1, true);
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  if (begin < end)  // this chunk's own keys
    tiles.Issue(kv, 0, begin, first_new, end - 1, end - 1, false);
  CommitCopies();

  // Q as A fragments, scaled by log2(e) / sqrt(D) so the softmax runs on exp2: held in registers,
  // or (kQInShared) staged once and loaded a fragment at a time into qf[0].
  const float qscale = 1.4426950408889634f * rsqrtf(static_cast<float>(D));
  const float* q_group = q + (static_cast<int64_t>(row) * q_heads + kv_head * group) * D;
  const float* q_lo = g < group ? q_group + g * D : nullptr;
  const float* q_hi = g + 8 < group ? q_group + (g + 8) * D : nullptr;
  auto q_pair = [qscale](const float* h, int d) {
    return h ? Pack<TileT>(h[d] * qscale, h[d + 1] * qscale) : 0u;
  };
  uint32_t qf[kQInShared<D> ? 1 : D / 16][4];
  if constexpr (kQInShared<D>) {
    StageQ<D>(q_s, 16, qscale, [&](int h) { return h < group ? q_group + h * D : nullptr; });
  } else {
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      const int d = 16 * s + 2 * t;
      qf[s][0] = q_pair(q_lo, d);
      qf[s][1] = q_pair(q_hi, d);
      qf[s][2] = q_pair(q_lo, d + 8);
      qf[s][3] = q_pair(q_hi, d + 8);
    }
  }
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;  // l: this lane's part
  const int key0 = 16 * warp;  // this warp's keys within a tile

  int tile = 0;
  for (int k0 = begin; k0 < end; k0 += kKeys, ++tile) {
    const bool more = k0 + kKeys < end;
    if (more) {  // the next tile into the other stage (consumed two iterations ago)
      tiles.Issue(kv, tile + 1, k0 + kKeys, k0 + kKeys, end - 1, end - 1, true);
      CommitCopies();
      WaitCopies<1>();
    } else {
      WaitCopies<0>();
    }
    __syncthreads();  // this tile's copies (and the staged Q), from every thread, have landed
    tiles.Ready(tile);
    const TileT* k_s = tiles.K(tile);
    const TileT* v_s = tiles.V(tile);
    if (k0 + key0 < end) {  // warp-uniform: some key of this warp is in the tile
      // S = Q K^T (16 heads x 16 keys): B fragment (k = d, n = key) from K rows.
      float s[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        if constexpr (kQInShared<D>) LoadQFragment<D>(q_s, 0, ks, g, t, qf[0]);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t* kr = reinterpret_cast<const uint32_t*>(
              k_s + (key0 + 8 * j + g) * kStride + 16 * ks + 2 * t);
          Mma<TileT>(s[j], qf[kQInShared<D> ? 0 : ks], kr[0], kr[4]);
        }
      }
      // Keys past the split's end are masked; this warp has at least one valid key, so the new
      // running max is finite.
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          if (k0 + key0 + 8 * j + 2 * t + c >= end) s[j][c] = s[j][2 + c] = -INFINITY;
      SoftmaxAccumulate<D, 2, kStride, TileT>(s, v_s, key0, lane, m_lo, m_hi, l_lo, l_hi, o);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  l_lo = QuadSum(l_lo);
  l_hi = QuadSum(l_hi);
  // Merge the warps: each scales its accumulators to the block's running max per head (the
  // stages are free: the loop ends on a barrier).
  if (t == 0) {
    m_s[warp][g] = m_lo, m_s[warp][g + 8] = m_hi;
    l_s[warp][g] = l_lo, l_s[warp][g + 8] = l_hi;
  }
  __syncthreads();
  float block_lo = -INFINITY, block_hi = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    block_lo = fmaxf(block_lo, m_s[w][g]);
    block_hi = fmaxf(block_hi, m_s[w][g + 8]);
  }
  const float f_lo = m_lo == -INFINITY ? 0.f : exp2f(m_lo - block_lo);
  const float f_hi = m_hi == -INFINITY ? 0.f : exp2f(m_hi - block_hi);
  float* o_s = reinterpret_cast<float*>(kv_s);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int d = 8 * j + 2 * t;
    *reinterpret_cast<float2*>(o_s + (warp * 16 + g) * D + d) =
        make_float2(o[j][0] * f_lo, o[j][1] * f_lo);
    *reinterpret_cast<float2*>(o_s + (warp * 16 + g + 8) * D + d) =
        make_float2(o[j][2] * f_hi, o[j][3] * f_hi);
  }
  __syncthreads();
  const int64_t first_slot =
      (static_cast<int64_t>(row) * q_heads + kv_head * group) * splits + split;
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc += o_s[(w * 16 + h) * D + d];
    partial_acc[(first_slot + static_cast<int64_t>(h) * splits) * D + d] = acc;
  }
  if (threadIdx.x < group) {
    const int h = threadIdx.x;
    float block_max = -INFINITY, sum = 0.f;
    for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, m_s[w][h]);
    for (int w = 0; w < kWarps; ++w)
      if (m_s[w][h] != -INFINITY) sum += l_s[w][h] * exp2f(m_s[w][h] - block_max);
    const int64_t slot = first_slot + static_cast<int64_t>(h) * splits;
    partial_max[slot] = block_max == -INFINITY ? -INFINITY : block_max * kLn2;  // an empty split
    partial_sum[slot] = sum;
  }
}

template <typename CacheT>
void LaunchFlashDecode(const float* q, const KvCache& cache, int rows, int n, int q_heads,
                       int kv_heads, int head_dim, const int* position, const int2* ragged,
                       int splits, float* partial_acc, float* partial_max, float* partial_sum,
                       cudaStream_t stream) {
  const dim3 grid(rows, kv_heads, splits);
  LaunchForHeadDim([](auto d) { return FlashDecodeKernel<decltype(d)::value, CacheT>; },
                   [](auto d) {
                     constexpr int D = decltype(d)::value;
                     return HeadDimShape{kDecodeWarps<D> * 32,
                                         KvStagesBytes<kDecodeKeys<D>>(D) + QTileBytes<D>(16)};
                   },
                   head_dim, grid, stream, q, cache, n, q_heads, kv_heads, position, ragged, splits,
                   partial_acc, partial_max, partial_sum);
}

}  // namespace

void AttentionFlashDecodeMma(const float* q, const KvCache& cache, int rows, int n, int q_heads,
                             int kv_heads, int head_dim, const int* position, int splits,
                             float* partial_acc, float* partial_max, float* partial_sum,
                             cudaStream_t stream, const int2* ragged) {
  WithCacheType(cache.dtype, [&](auto type) {
    LaunchFlashDecode<decltype(type)>(q, cache, rows, n, q_heads, kv_heads, head_dim, position,
                                      ragged, splits, partial_acc, partial_max, partial_sum,
                                      stream);
  });
}

ProbeKernel FlashDecodeProbeKernel() {
  return {"FlashDecodeKernel<128, bf16>",
          reinterpret_cast<const void*>(FlashDecodeKernel<128, __nv_bfloat16>)};
}

}  // namespace infersweep::cuda
