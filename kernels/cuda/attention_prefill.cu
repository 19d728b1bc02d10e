// Prefill attention on tensor cores (attention=flash, chunks of kFlashPrefillMinTokens+ tokens):
// FlashAttention-2 style, bf16 mma.sync m16n8k16 with fp32 accumulators and an online softmax
// in exp2. The split-KV kernel (attention_flash.cu) gives each query row its own block and
// re-reads every key per row on CUDA cores; this kernel stages each K/V tile once per 64
// queries. On the fp32 cache the K/V
// conversion and staging dominate; with kv_cache=bf16 (KvCache) tiles are plain 16-byte copies;
// fp8 codes are converted (times their row's scale) as they are staged.
//
// Napkin math, qwen3-30b-a3b prefill of 2048 tokens, one layer: QK^T and PV over the causal
// half, 32 heads x 2048^2 / 2 x 128 x 2 x 2 = 34 GFLOP -> ~0.1 ms at 400 TFLOP/s of mma.sync;
// the K/V tiles are re-read from L2 by each of the 8 q heads of a kv head and each 64-query
// tile: ~0.55 GB of L2 reads with a bf16 cache (~0.08 ms), twice that with fp32.
//
// Napkin math at head_dim 256, qwen3-next prefill of 4096 tokens (16 q and 2 kv heads), one
// layer: 16 heads x 4096^2 / 2 x 256 x 2 x 2 = 137 GFLOP -> ~0.34 ms at 400 TFLOP/s of mma.sync,
// ~4 ms over the 12 full-attention layers; each (q head, 64-query tile) block reads its causal
// prefix of K and V (1 KB a key in bf16) from L2: 16 x 64 x 2048 x 1 KB = 2.1 GB (~0.3 ms at the
// rate above), so L2 and the tensor cores both bound it. Decode (fewer than 16 tokens) never
// reaches this kernel.
#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/probe_kernels.h"

namespace infersweep::cuda {
namespace {

constexpr int kQueries = 64;  // per block: 4 warps x 16
// Keys a shared-memory tile at head size D: 64, and 32 at D = 256, where two K/V stages of 32 keys
// (67.5 KB) and the staged Q (33 KB, kQInShared) come to 99 KB: two blocks an H200 SM, and within
// the 99 KB a block may opt into on sm_86 and sm_89.
template <int D>
constexpr int kPrefillKeys = D > 128 ? 32 : 64;

// grid (q_heads, ceil(n / 64), batch), 128 threads; query tiles run last first (the causal
// mask makes them the longest, so the short ones fill the tail). Warp w owns queries
// 64 x + 16 w + [0, 16) of one head; lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of
// every fragment. K and V are staged as [key][d] in bf16, kPrefillKeys<D> keys a tile, two stages
// deep (the next tile's copies land while this one is computed), rows padded by 8 elements so the
// fragment loads (8 rows x 4 words, or ldmatrix's 8 rows x 16 bytes) hit 32 distinct banks. At
// D = 256 the block's 64 Q rows are staged after the K/V stages (kQInShared). Query i of batch
// row b sits at position *position + i and sees keys [0, that position].
template <int D, typename CacheT>
__global__ void __launch_bounds__(128)
    FlashPrefillKernel(const float* q, const KvCache cache, int n, int q_heads, int kv_heads,
                       const int* position, float* out) {
  constexpr int kKeys = kPrefillKeys<D>;
  using Tiles = KvTiles<D, kKeys, CacheT>;
  using TileT = typename Tiles::TileT;
  constexpr int kKStride = Tiles::kStride;  // bf16 per K and V row: 16-byte aligned, conflict-free
  extern __shared__ __align__(16) uint8_t kv_stages[];
  const Tiles tiles{kv_stages};
  TileT* const q_s = reinterpret_cast<TileT*>(kv_stages + KvStagesBytes<kKeys>(D));  // kQInShared
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int head = blockIdx.x, batch = blockIdx.z;
  const int tile = gridDim.y - 1 - blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kv_head = head / (q_heads / kv_heads);
  const int pos0 = *position;
  // Rows past the chunk's end compute as copies of its last row and are not written.
  const int i_lo = tile * kQueries + warp * 16 + g, i_hi = i_lo + 8;
  const int qpos_lo = pos0 + min(i_lo, n - 1), qpos_hi = pos0 + min(i_hi, n - 1);
  const int last_key = pos0 + min(tile * kQueries + kQueries - 1, n - 1);
  const KvHeadRows<CacheT> kv = HeadRows<CacheT>(cache, batch, kv_head, kv_heads, D);
  tiles.Issue(kv, 0, 0, 0, last_key, last_key, true);
  CommitCopies();

  // Q as A fragments, scaled by log2(e) / sqrt(D) so the softmax runs on exp2: held in registers,
  // or (kQInShared) staged once and loaded a fragment at a time into qf[0].
  const float qscale = 1.4426950408889634f * rsqrtf(static_cast<float>(D));
  uint32_t qf[kQInShared<D> ? 1 : D / 16][4];
  if constexpr (kQInShared<D>) {
    StageQ<D>(q_s, kQueries, qscale, [&](int r) {
      const int i = min(tile * kQueries + r, n - 1);
      return q + (static_cast<int64_t>(batch) * n + i) * q_heads * D + head * D;
    });
  } else {
    const float* q_lo =
        q + (static_cast<int64_t>(batch) * n + min(i_lo, n - 1)) * q_heads * D + head * D;
    const float* q_hi =
        q + (static_cast<int64_t>(batch) * n + min(i_hi, n - 1)) * q_heads * D + head * D;
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      const int d = 16 * s + 2 * t;
      qf[s][0] = Pack<TileT>(q_lo[d] * qscale, q_lo[d + 1] * qscale);
      qf[s][1] = Pack<TileT>(q_hi[d] * qscale, q_hi[d + 1] * qscale);
      qf[s][2] = Pack<TileT>(q_lo[d + 8] * qscale, q_lo[d + 9] * qscale);
      qf[s][3] = Pack<TileT>(q_hi[d + 8] * qscale, q_hi[d + 9] * qscale);
    }
  }
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;  // l: this lane's part

  for (int k0 = 0, step = 0; k0 <= last_key; k0 += kKeys, ++step) {
    if (k0 + kKeys <= last_key) {  // the next tile into the other stage (consumed a step ago)
      tiles.Issue(kv, step + 1, k0 + kKeys, k0 + kKeys, last_key, last_key, true);
      CommitCopies();
      WaitCopies<1>();
    } else {
      WaitCopies<0>();
    }
    __syncthreads();  // this tile's copies (and the staged Q), from every thread, have landed
    tiles.Ready(step);
    // K and V rows alike, [key][d] in bf16: the PV fragments come from ldmatrix.trans, so V
    // needs no transposed copy.
    const TileT* k_s = tiles.K(step);
    const TileT* v_s = tiles.V(step);

    // S = Q K^T (16 x 64 per warp): B fragment (k = d, n = key) from K rows.
    float s[kKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      if constexpr (kQInShared<D>) LoadQFragment<D>(q_s, 16 * warp, ks, g, t, qf[0]);
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        const uint32_t* kr =
            reinterpret_cast<const uint32_t*>(k_s + (8 * j + g) * kKStride + 16 * ks + 2 * t);
        Mma<TileT>(s[j], qf[kQInShared<D> ? 0 : ks], kr[0], kr[4]);
      }
    }
    // Causal mask, then the online softmax update for rows g (lo) and g + 8 (hi). Key 0 is in
    // every row's first tile, so the running max is finite from then on.
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int key = k0 + 8 * j + 2 * t + c;
        if (key > qpos_lo) s[j][c] = -INFINITY;
        if (key > qpos_hi) s[j][2 + c] = -INFINITY;
      }
    SoftmaxAccumulate<D, kKeys / 8, kKStride, TileT>(s, v_s, 0, lane, m_lo, m_hi, l_lo, l_hi, o);
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  const float inv_lo = 1.f / QuadSum(l_lo), inv_hi = 1.f / QuadSum(l_hi);
  float* out_lo = out + (static_cast<int64_t>(batch) * n + i_lo) * q_heads * D + head * D;
  float* out_hi = out + (static_cast<int64_t>(batch) * n + i_hi) * q_heads * D + head * D;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int d = 8 * j + 2 * t;
    if (i_lo < n)
      *reinterpret_cast<float2*>(out_lo + d) = make_float2(o[j][0] * inv_lo, o[j][1] * inv_lo);
    if (i_hi < n)
      *reinterpret_cast<float2*>(out_hi + d) = make_float2(o[j][2] * inv_hi, o[j][3] * inv_hi);
  }
}

template <typename CacheT>
void LaunchFlashPrefill(const float* q, const KvCache& cache, int rows, int n, int q_heads,
                        int kv_heads, int head_dim, const int* position, float* out,
                        cudaStream_t stream) {
  const dim3 grid(q_heads, CeilDiv(n, kQueries), rows / n);
  LaunchForHeadDim(
      [](auto d) { return FlashPrefillKernel<decltype(d)::value, CacheT>; },
      [](auto d) {
        constexpr int D = decltype(d)::value;
        return HeadDimShape{128, KvStagesBytes<kPrefillKeys<D>>(D) + QTileBytes<D>(kQueries)};
      },
      head_dim, grid, stream, q, cache, n, q_heads, kv_heads, position, out);
}

}  // namespace

void AttentionFlashPrefill(const float* q, const KvCache& cache, int rows, int n, int q_heads,
                           int kv_heads, int head_dim, const int* position, float* out,
                           cudaStream_t stream) {
  WithCacheType(cache.dtype, [&](auto type) {
    LaunchFlashPrefill<decltype(type)>(q, cache, rows, n, q_heads, kv_heads, head_dim, position,
                                       out, stream);
  });
}

ProbeKernel FlashPrefillProbeKernel() {
  return {"FlashPrefillKernel<128, bf16>",
          reinterpret_cast<const void*>(FlashPrefillKernel<128, __nv_bfloat16>)};
}

}  // namespace infersweep::cuda
