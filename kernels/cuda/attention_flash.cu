// Flash attention: tiled online softmax over the KV cache, split across blocks along the keys
// (split-KV) so that batch-1 decode still fills the GPU, then a small combine kernel. Head sizes
// 32, 64, 128 and 256 take the tensor-core kernels (attention_decode.cu, attention_prefill.cu);
// this file's CUDA-core partial kernel serves the others (multiples of 8 up to 256).
//
// The cache is fp32 or bf16 (KvCache, kv_cache=; fp8 takes the tensor-core kernels only); tiles
// are fp32 in shared memory.
//
// Napkin math, qwen3-30b-a3b decode at batch 1, context 576: K and V of one layer are
// 2 x 576 x 512 bf16 = 1.2 MB (2.4 MB in fp32); 48 layers = 57 MB -> 13 us at 4.46 TB/s. Batch
// 64 at context 544: 71 MB a layer in bf16, 16 us (the fp32 cache's 142 MB, 32 us). The naive
// kernel re-reads K and V once per q head (x8) with uncoalesced per-thread strides.
//
// Napkin math for the build above 128 (LaunchFlashPartial<256>), at qwen3-next's shapes (16 q
// and 2 kv heads of 256) and context 4096, one layer: K and V are 4096 x 2 x 512 x 2 B = 8 MB in
// bf16 a sequence -> 1.9 us at 4.46 TB/s at batch 1, and 512 MB -> 115 us at batch 64. Each of a
// group's 8 warps reads the whole K and V tile from shared memory as fp32: 8 x 4096 x 2 KB =
// 67 MB a (row, kv head), 8.6 GB at batch 64 -> ~260 us at 132 SMs x 128 B a clock, twice the
// DRAM time; FLOPs (4 x 16 x 4096 x 256 = 67 MFLOP a row) are no limit. That is why head_dim 256
// takes the tensor-core decode kernel, which reads each tile from shared memory once a block.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

constexpr int kTile = 32;  // keys per shared-memory tile
// The partial kernel is built twice: for head sizes up to 128 (four accumulators a lane, shared
// memory under the 48 KB default) and up to kFlashMaxHeadDim (eight, shared memory opted into).
constexpr int kSmallHeadDim = 128;

// Dynamic shared memory of the partial kernel: K and V tiles of padded fp32 rows, and the group's
// scaled q rows. At head_dim 256 and a group of 16: 82 KB.
constexpr size_t FlashPartialSharedBytes(int head_dim, int group) {
  return (2 * kTile * (head_dim + 1) + group * head_dim) * sizeof(float);
}

// Eight cache elements from a 16-byte-aligned address to eight floats.
__device__ __forceinline__ void Load8AsFloat(const __nv_bfloat16* p, float* out) {
  const uint4 packed = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void Load8AsFloat(const float* p, float* out) { LoadFloat8(p, out); }

// grid (rows, kv_heads, splits); block = group warps (one warp per q head of this kv head).
// Each block walks its slice of keys [begin, end) in tiles: K and V tiles are loaded once into
// shared memory and used by every q head of the group (GQA sharing). Lane i owns head dims
// i, i+32, ... of the accumulator (kMaxHeadDim / 32 of them; head_dim <= kMaxHeadDim). Writes
// partial (max, sum, acc) per (row, q head, split).
template <int kMaxHeadDim, typename CacheT>
__global__ void FlashPartialKernel(const float* q, const CacheT* k_cache, const CacheT* v_cache,
                                   int n, int q_heads, int kv_heads, int head_dim,
                                   const int* position, const int2* ragged, int capacity,
                                   int splits, float* partial_acc, float* partial_max,
                                   float* partial_sum) {
  extern __shared__ float smem[];
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int row = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int group = q_heads / kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int head = kv_head * group + warp;
  const int2 sequence_position = RowSequencePosition(row, n, position, ragged);
  const int batch = sequence_position.x, pos = sequence_position.y;
  const int keys = pos + 1;
  const int per_split = (keys + splits - 1) / splits;
  const int begin = split * per_split, end = min(keys, begin + per_split);
  const int kv_dim = kv_heads * head_dim;
  const int stride = head_dim + 1;  // padded rows: lanes reading different keys hit different banks
  float* k_tile = smem;
  float* v_tile = smem + kTile * stride;
  float* q_all = v_tile + kTile * stride;  // [group][head_dim]

  const float scale = rsqrtf(static_cast<float>(head_dim));
  const float* qh = q + (static_cast<int64_t>(row) * q_heads + head) * head_dim;
  for (int d = lane; d < head_dim; d += 32) q_all[warp * head_dim + d] = qh[d] * scale;
  const CacheT* keys_base =
      k_cache + static_cast<int64_t>(batch) * capacity * kv_dim + kv_head * head_dim;
  const CacheT* values_base =
      v_cache + static_cast<int64_t>(batch) * capacity * kv_dim + kv_head * head_dim;

  float acc[kMaxHeadDim / 32];
#pragma unroll
  for (int i = 0; i < kMaxHeadDim / 32; ++i) acc[i] = 0.f;
  float running_max = -INFINITY, running_sum = 0.f;

  for (int t0 = begin; t0 < end; t0 += kTile) {
    const int count = min(kTile, end - t0);
    __syncthreads();  // previous tile fully consumed (and q_all written, first time)
    // 16-byte loads (8 elements), unrolled so a thread's share of the tile is in flight at once:
    // scalar loads in a rolled loop would wait out ~16 round trips per tile.
    const int octs = head_dim / 8;
#pragma unroll 4
    for (int i = threadIdx.x; i < count * octs; i += blockDim.x) {
      const int j = i / octs, d = (i % octs) * 8;
      const int64_t at = static_cast<int64_t>(t0 + j) * kv_dim + d;
      float kv[2][8];
      Load8AsFloat(keys_base + at, kv[0]);
      Load8AsFloat(values_base + at, kv[1]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        k_tile[j * stride + d + e] = kv[0][e];
        v_tile[j * stride + d + e] = kv[1][e];
      }
    }
    __syncthreads();
    // Lane j scores key t0 + j (kTile == 32: one key per lane).
    float score = -INFINITY;
    if (lane < count) {
      // Four partial sums: one chain of head_dim dependent FMAs would stall each warp on every
      // FMA's latency.
      float dot[4] = {0.f, 0.f, 0.f, 0.f};
      const float* kj = k_tile + lane * stride;
      const float* qw = q_all + warp * head_dim;
#pragma unroll 4
      for (int d = 0; d < head_dim; d += 4) {
        dot[0] += qw[d] * kj[d];
        dot[1] += qw[d + 1] * kj[d + 1];
        dot[2] += qw[d + 2] * kj[d + 2];
        dot[3] += qw[d + 3] * kj[d + 3];
      }
      score = (dot[0] + dot[1]) + (dot[2] + dot[3]);
    }
    const float tile_max = WarpMax(score);
    const float new_max = fmaxf(running_max, tile_max);
    const float p = lane < count ? expf(score - new_max) : 0.f;
    const float correction = expf(running_max - new_max);  // 0 on the first tile
    running_sum = running_sum * correction + WarpSum(p);
    running_max = new_max;
#pragma unroll
    for (int i = 0; i < kMaxHeadDim / 32; ++i) acc[i] *= correction;
    for (int j = 0; j < count; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
      for (int i = 0; i < kMaxHeadDim / 32; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) acc[i] += pj * v_tile[j * stride + d];
      }
    }
  }
  const int64_t slot = (static_cast<int64_t>(row) * q_heads + head) * splits + split;
#pragma unroll
  for (int i = 0; i < kMaxHeadDim / 32; ++i) {
    const int d = lane + 32 * i;
    if (d < head_dim) partial_acc[slot * head_dim + d] = acc[i];
  }
  if (lane == 0) {
    partial_max[slot] = running_max;  // -inf for an empty split
    partial_sum[slot] = running_sum;
  }
}

// One block per (row, q head), 128 threads (>= kMaxFlashSplits): merges the splits' partial
// softmaxes. Each split's weight exp(max_s - max) / denom is computed once, in parallel, so the
// per-dimension sums are independent loads (a loop that re-reads each split's max per step
// makes them one dependent chain).
__global__ void __launch_bounds__(128)
    FlashCombineKernel(const float* partial_acc, const float* partial_max, const float* partial_sum,
                       int splits, int head_dim, float* out) {
  __shared__ float weight[kMaxFlashSplits];
  __shared__ float scratch[32];
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int64_t rh = blockIdx.x;  // row * q_heads + head
  const int s = threadIdx.x;
  const float pm = s < splits ? partial_max[rh * splits + s] : -INFINITY;
  const float m = BlockMax(pm, scratch);  // finite: every row has a key, so some split does
  const float w = pm != -INFINITY ? expf(pm - m) : 0.f;  // an empty split weighs nothing
  const float denom = BlockSum(s < splits ? w * partial_sum[rh * splits + s] : 0.f, scratch);
  if (s < splits) weight[s] = w / denom;
  __syncthreads();
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
#pragma unroll 8
    for (int i = 0; i < splits; ++i)
      acc += weight[i] * partial_acc[(rh * splits + i) * head_dim + d];
    out[rh * head_dim + d] = acc;
  }
}

// Launches the partial kernel built for head sizes up to kMaxHeadDim; above 128 its shared memory
// limit is raised (once per device) to what head_dim 256 with a group of 16 takes.
template <int kMaxHeadDim, typename CacheT>
void LaunchFlashPartial(dim3 grid, dim3 block, size_t shared, cudaStream_t stream, const float* q,
                        const KvCache& cache, int n, int q_heads, int kv_heads, int head_dim,
                        const int* position, const int2* ragged, int splits, float* partial_acc,
                        float* partial_max, float* partial_sum) {
  if constexpr (kMaxHeadDim > kSmallHeadDim) {
    static PerDeviceOnce configure;  // the attribute is per device
    configure([] {
      cudaFuncSetAttribute(FlashPartialKernel<kMaxHeadDim, CacheT>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                           FlashPartialSharedBytes(kMaxHeadDim, kFlashMaxGroup));
    });
  }
  Launch(FlashPartialKernel<kMaxHeadDim, CacheT>, grid, block, shared, stream, q,
         static_cast<const CacheT*>(cache.k), static_cast<const CacheT*>(cache.v), n, q_heads,
         kv_heads, head_dim, position, ragged, cache.capacity, splits, partial_acc, partial_max,
         partial_sum);
}

// The partial kernel on a bf16 or fp32 cache, built for head_dim's range.
template <typename CacheT>
void LaunchFlashPartial(dim3 grid, dim3 block, size_t shared, cudaStream_t stream, const float* q,
                        const KvCache& cache, int n, int q_heads, int kv_heads, int head_dim,
                        const int* position, const int2* ragged, int splits, float* partial_acc,
                        float* partial_max, float* partial_sum) {
  if (head_dim <= kSmallHeadDim)
    LaunchFlashPartial<kSmallHeadDim, CacheT>(grid, block, shared, stream, q, cache, n, q_heads,
                                              kv_heads, head_dim, position, ragged, splits,
                                              partial_acc, partial_max, partial_sum);
  else
    LaunchFlashPartial<kFlashMaxHeadDim, CacheT>(grid, block, shared, stream, q, cache, n, q_heads,
                                                 kv_heads, head_dim, position, ragged, splits,
                                                 partial_acc, partial_max, partial_sum);
}

}  // namespace

int FlashSplits(int rows, int kv_heads, int capacity) {
  // Enough blocks for ~8 per SM on 132 SMs, but at least a tile of keys per split.
  // rows * splits <= rows + kFlashBlockTarget / kv_heads + 1: the bound `partial` is sized by.
  const int blocks = rows * kv_heads;
  const int want = CeilDiv(kFlashBlockTarget, blocks);
  const int splits = std::min(std::min(want, CeilDiv(capacity, kTile)), kMaxFlashSplits);
  return std::max(1, splits);
}

void AttentionFlash(const float* q, const KvCache& cache, int rows, int n, int q_heads,
                    int kv_heads, int head_dim, const int* position, int splits, float* partial,
                    float* out, cudaStream_t stream, const int2* ragged) {
  if (!ragged && n >= kFlashPrefillMinTokens && FlashPrefillSupports(head_dim)) {
    AttentionFlashPrefill(q, cache, rows, n, q_heads, kv_heads, head_dim, position, out, stream);
    return;
  }
  const int group = q_heads / kv_heads;
  const int64_t slots = static_cast<int64_t>(rows) * q_heads * splits;
  float* partial_acc = partial;
  float* partial_max = partial + slots * head_dim;
  float* partial_sum = partial_max + slots;
  const size_t shared = FlashPartialSharedBytes(head_dim, group);
  const dim3 grid(rows, kv_heads, splits), block(32 * group);
  if (!FlashDecodeMmaSupports(head_dim) && LaunchRecording())  // the launch log's fallbacks
    RecordFallback("attention=flash: head_dim " + std::to_string(head_dim) +
                   ": the fp32 CUDA-core split-KV kernel, not the tensor-core kernels (head_dim "
                   "32, 64, 128 or 256)");
  if (FlashDecodeMmaSupports(head_dim)) {  // tensor cores (attention_decode.cu)
    AttentionFlashDecodeMma(q, cache, rows, n, q_heads, kv_heads, head_dim, position, splits,
                            partial_acc, partial_max, partial_sum, stream, ragged);
  } else if (cache.dtype == KvDtype::kFp8) {
    // CudaModelRefusal refuses kv_cache=fp8 at these head sizes before anything loads.
    std::fprintf(stderr, "AttentionFlash: an fp8 KV cache at head_dim %d has no kernel\n",
                 head_dim);
    std::abort();
  } else if (cache.dtype == KvDtype::kBf16) {
    LaunchFlashPartial<__nv_bfloat16>(grid, block, shared, stream, q, cache, n, q_heads, kv_heads,
                                      head_dim, position, ragged, splits, partial_acc, partial_max,
                                      partial_sum);
  } else {
    LaunchFlashPartial<float>(grid, block, shared, stream, q, cache, n, q_heads, kv_heads, head_dim,
                              position, ragged, splits, partial_acc, partial_max, partial_sum);
  }
  Launch(FlashCombineKernel, dim3(rows * q_heads), dim3(128), 0, stream, partial_acc, partial_max,
         partial_sum, splits, head_dim, out);
}

}  // namespace infersweep::cuda
