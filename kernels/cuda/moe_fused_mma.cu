// Expert-grouped MoE on tensor cores (moe=fused, rows >= kMoeGroupedMinRows): the routed pairs
// are bucketed by expert on the device, then every expert's weights are streamed once and
// applied to all of its pairs with bf16 mma.sync (m16n8k16, fp32 accumulate): at batch 64, ~126
// expert reads a layer where moe.cu's per-pair kernels make 512. No host sync, so decode steps
// stay capturable.
// Weights are re-read for every 64 pairs of an expert, so long prefill chunks (more than 16 pairs
// per expert) go to cuBLAS's grouped GEMMs instead (engine/cuda/moe_runner.cc).
#include <algorithm>
#include <string>
#include <type_traits>

#include "core/unreachable.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/quant_decode.cuh"
#include "kernels/cuda/sm90a/moe_wgmma.h"

namespace infersweep::cuda {
namespace {

constexpr int kWarps = 4;  // per block; a warp owns 16 output features
constexpr int kBlockFeatures = 16 * kWarps;

__device__ __forceinline__ int CeilDivDevice(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ uint16_t Bf16Bits(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ void Mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The two MMAs of one 32-wide k chunk. Lane (g, t) = (lane / 4, lane % 4) holds physical k
// [8t, 8t + 8) of weight rows g and g + 8 (lo, hi) and of input column g (b), one 16-byte load
// each. m16n8k16 gives that lane logical k {2t, 2t+1, 2t+8, 2t+9} of A and B alike; the first MMA
// maps them to physical [8t, 8t + 4), the second to [8t + 4, 8t + 8). The same permutation of k
// on both operands leaves every dot product unchanged, and no lane needs a shuffle or a 4-byte
// load.
__device__ __forceinline__ void MmaChunk(float* c, const uint4& lo, const uint4& hi,
                                         const uint4& b) {
  Mma16816(c, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  Mma16816(c, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

// E4M3 x E4M3, fp32 accumulate (sm_89+; the registry keeps qgemm=w8a8 off older GPUs, whose
// builds compile a trap here).
__device__ __forceinline__ void Mma16832E4M3(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// MmaChunk's twin over 64 E4M3 codes: lane (g, t) holds physical k [16t, 16t + 16) of weight
// rows g and g + 8 and of input column g, one 16-byte load each (the same 64 bytes a bf16 chunk
// takes). m16n8k32 gives that lane logical k {4t..4t+3} and {16+4t..16+4t+3} of A and B alike;
// the first MMA maps them to physical [16t, 16t + 8), the second to [16t + 8, 16t + 16), the
// same permutation on both operands.
__device__ __forceinline__ void MmaChunkE4M3(float* c, const uint4& lo, const uint4& hi,
                                             const uint4& b) {
  Mma16832E4M3(c, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  Mma16832E4M3(c, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

// Buckets the pairs by expert: offsets[e] = the pairs of experts before e, and
// sorted_pairs[offsets[e] + i] = the i-th pair (in pair order) routed to e. Pairs routed to
// skip_expert (TEST ONLY zero-expert fault; -1 in production), or to an id outside
// [expert_begin, expert_end) (the experts held here, within [0, num_experts)), are left out. One
// block; the pairs go in parts of kBucketPart, warp w taking the w-th run of 32 x rounds pairs of a
// part, 32 a round. Every id is read once, all of a thread's loads in flight together.
// __match_any_sync groups a round's lanes by expert; the lowest lane of each group adds the group
// to the warp's row of a count table (and remembers what the warp's earlier rounds held), a scan
// down each expert's column gives the pairs of that expert in earlier warps, and a block scan of
// the totals gives the offsets. A pair's slot is then next[e] + earlier warps + earlier rounds +
// lower lanes of its group: pair order within each expert, so the bucketing (and every sum after
// it) is deterministic without sorting. Four barriers for one part (up to 8,192 pairs), four more a
// further part. One block: at decode batches (512 pairs at batch 64) its time is close to the floor
// of any one-block kernel (the launch and one pass over the ids); long prefill chunks add parts.
constexpr int kBucketThreads = 1024;
constexpr int kBucketWarps = kBucketThreads / 32;
constexpr int kBucketRounds = 8;                             // 32-pair rounds per warp and part
constexpr int kBucketPart = kBucketThreads * kBucketRounds;  // pairs counted and placed at once
constexpr int kBucketMaxExperts = 1024;

// The count table's rows (one per warp) in 16-bit entries: an odd number of 32-bit words, so one
// expert's column lies in 32 different banks.
__host__ __device__ constexpr int BucketTablePitch(int num_experts) {
  return 2 * (((num_experts + 1) / 2) | 1);
}
constexpr size_t BucketTableBytes(int num_experts) {
  return sizeof(uint16_t) * kBucketWarps * BucketTablePitch(num_experts);
}

__device__ __forceinline__ int WarpInclusiveScan(int v) {
  const int lane = threadIdx.x & 31;
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

__global__ void __launch_bounds__(kBucketThreads)
    BucketPairsKernel(const int* expert_ids, int pairs, int num_experts, int skip_expert,
                      int expert_begin, int expert_end, int* offsets, int* sorted_pairs) {
  __shared__ int total[kBucketMaxExperts];       // per expert: its pairs in all parts
  __shared__ int next[kBucketMaxExperts];        // per expert: the first slot of this part's pairs
  __shared__ int part_count[kBucketMaxExperts];  // per expert: its pairs in this part
  __shared__ int warp_totals[kBucketWarps];
  // table[w * pitch + e]: warp w's pairs of expert e in this part; after the column scan, those
  // of the warps before w. At most kBucketPart: 16 bits.
  extern __shared__ uint16_t table[];
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lower_lanes = (1u << lane) - 1u;
  const int pitch = BucketTablePitch(num_experts);
  uint16_t* const row = table + warp * pitch;

  // The thread's pairs in the current part: first_pair + 32 r for r < rounds (block-uniform).
  int ids[kBucketRounds], earlier[kBucketRounds], rounds = 0, first_pair = 0;
  unsigned peers[kBucketRounds];
  auto load = [&](int base) {
    rounds = (min(kBucketPart, pairs - base) + kBucketThreads - 1) / kBucketThreads;
    first_pair = base + warp * 32 * rounds + lane;
#pragma unroll
    for (int r = 0; r < kBucketRounds; ++r) {  // no use until all are issued: one round trip
      ids[r] = -1;
      if (r < rounds) ids[r] = expert_ids[min(first_pair + 32 * r, pairs - 1)];
    }
  };
  auto zero_table = [&] {
    for (int i = threadIdx.x; i < kBucketWarps * pitch / 2; i += kBucketThreads)
      reinterpret_cast<uint32_t*>(table)[i] = 0;
  };
  // Counts the loaded pairs into the warp's row; earlier[r]: the warp's pairs of the same expert
  // in rounds before r. A group's lowest lane updates the row, so no atomics there.
  auto count = [&](bool add_to_totals) {
#pragma unroll
    for (int r = 0; r < kBucketRounds; ++r) {
      if (r >= rounds) break;
      const int e = ids[r];
      const bool kept =
          first_pair + 32 * r < pairs && e >= expert_begin && e < expert_end && e != skip_expert;
      ids[r] = kept ? e : -1;
      peers[r] = __match_any_sync(0xffffffffu, ids[r]);
    }
#pragma unroll
    for (int r = 0; r < kBucketRounds; ++r) {
      if (r >= rounds) break;
      const int e = ids[r], group = __popc(peers[r]);
      int before = 0;
      if (e >= 0 && (peers[r] & lower_lanes) == 0) {
        before = row[e];
        row[e] = before + group;
        if (add_to_totals) atomicAdd(&total[e], group);
      }
      earlier[r] = __shfl_sync(0xffffffffu, before, __ffs(peers[r]) - 1);
      __syncwarp();  // the next round's lowest lane for e may be another lane
    }
  };
  // Each expert's column -> exclusive prefix over the warps (a warp per expert, a lane per row;
  // unrolled so that a warp's experts overlap their shuffle latencies).
  auto scan_columns = [&] {
#pragma unroll 4
    for (int e = warp; e < num_experts; e += kBucketWarps) {
      const int c = table[lane * pitch + e], inclusive = WarpInclusiveScan(c);
      table[lane * pitch + e] = inclusive - c;
      if (lane == 31) part_count[e] = inclusive;
    }
  };
  auto place = [&] {
#pragma unroll
    for (int r = 0; r < kBucketRounds; ++r) {
      if (r >= rounds) break;
      const int e = ids[r];
      if (e >= 0)
        sorted_pairs[next[e] + row[e] + earlier[r] + __popc(peers[r] & lower_lanes)] =
            first_pair + 32 * r;
    }
  };

  if (pairs > 0) load(0);  // in flight while the shared memory is zeroed
  for (int e = threadIdx.x; e < num_experts; e += kBucketThreads) total[e] = 0;
  zero_table();
  __syncthreads();
  count(true);
  for (int pair = kBucketPart + threadIdx.x; pair < pairs; pair += kBucketThreads) {
    const int e = expert_ids[pair];  // later parts: only their totals for now
    if (e >= expert_begin && e < expert_end && e != skip_expert) atomicAdd(&total[e], 1);
  }
  __syncthreads();
  scan_columns();
  // Totals -> offsets: a scan within each warp, then every warp scans the 32 warp totals itself.
  const int expert_total = threadIdx.x < num_experts ? total[threadIdx.x] : 0;
  const int inclusive = WarpInclusiveScan(expert_total);
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  const int warp_total = warp_totals[lane], warps_inclusive = WarpInclusiveScan(warp_total);
  const int before_warp = __shfl_sync(0xffffffffu, warps_inclusive - warp_total, warp);
  const int placed = __shfl_sync(0xffffffffu, warps_inclusive, 31);
  if (threadIdx.x < num_experts) {
    offsets[threadIdx.x] = next[threadIdx.x] = before_warp + inclusive - expert_total;
  }
  if (threadIdx.x == 0) offsets[num_experts] = placed;
  __syncthreads();
  for (int base = 0; base < pairs;) {
    place();
    base += kBucketPart;
    if (base >= pairs) break;
    __syncthreads();  // every read of next and the table for this part is done
    for (int e = threadIdx.x; e < num_experts; e += kBucketThreads) next[e] += part_count[e];
    zero_table();
    load(base);
    __syncthreads();
    count(false);
    __syncthreads();
    scan_columns();
    __syncthreads();
  }
}

// The input rows of up to kTiles x 8 pairs of expert `e` (columns of the MMA tiles): lane (g, t)
// serves column g of each tile, so it keeps the address of that pair's row, offset by t.
template <int kTiles, typename T>
__device__ __forceinline__ void PairRows(const int* sorted, int first, int count, int base,
                                         const T* rows, int64_t row_stride, int row_div, int g,
                                         int t, const uint4** out) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const int s = base + 8 * j + g;
    const int pair = sorted ? sorted[first + s] : first + s;  // null: dense rows in order
    out[j] = s < count ? reinterpret_cast<const uint4*>(rows + (pair / row_div) * row_stride) + t
                       : nullptr;
  }
}

// kUnroll 32-wide k chunks of kMats weight matrices, from chunk c0: w[2m], w[2m + 1] are the
// lane's rows g and g + 8 of matrix m (offset by t).
template <int kMats, int kUnroll>
__device__ __forceinline__ void LoadStage(const uint4* const (&w)[2 * kMats], int c0, int chunks,
                                          uint4 (&stage)[kUnroll][2 * kMats]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (c0 + u < chunks)
#pragma unroll
      for (int m = 0; m < 2 * kMats; ++m) stage[u][m] = __ldcs(w[m] + 4 * (c0 + u));
}

// One pass of an expert's pairs: acc[m][j] += W_m (16 rows) . the inputs of pair tile j, over all
// `chunks` k chunks, for the first `tiles` tiles (rows[j]: the lane's pair row, null past the
// expert's last pair). Two register stages of kUnroll chunks, so one stage's loads are in flight
// while the other's MMAs run; `a` holds chunks [0, kUnroll) on entry.
// kE4M3: the chunks are 64 E4M3 codes (MmaChunkE4M3), else 32 bf16 values (MmaChunk).
// With block_scale (FP8 block-128 weights, kUnroll 2: a stage is one 128-wide k block), a block's
// products gather apart and are added into acc times block_scale(m, block), matrix m's scale of
// that k block for the warp's 16 rows (one 128-row block).
template <int kMats, int kTiles, int kUnroll, bool kE4M3 = false,
          typename BlockScale = std::nullptr_t>
__device__ __forceinline__ void StreamExpert(const uint4* const (&w)[2 * kMats],
                                             const uint4* const (&rows)[kTiles], int tiles,
                                             int chunks, uint4 (&a)[kUnroll][2 * kMats],
                                             float (&acc)[kMats][kTiles][4],
                                             BlockScale block_scale = nullptr) {
  constexpr bool kBlocks = !std::is_same_v<BlockScale, std::nullptr_t>;
  static_assert(!kBlocks || (kE4M3 && kUnroll * 64 == 128), "a stage is one 128-wide k block");
  uint4 b[kUnroll][2 * kMats];
  auto compute = [&](const uint4(&stage)[kUnroll][2 * kMats], int c0) {
    float part[kBlocks ? kMats : 1][kBlocks ? kTiles : 1][4] = {};
    if constexpr (kBlocks) {
      if (c0 >= chunks) return;  // past the last block: no scale to read
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (c0 + u >= chunks) break;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        if (j >= tiles) break;  // warp-uniform
        const uint4 x = rows[j] ? __ldg(rows[j] + 4 * (c0 + u)) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int m = 0; m < kMats; ++m) {
          if constexpr (kBlocks)
            MmaChunkE4M3(part[m][j], stage[u][2 * m], stage[u][2 * m + 1], x);
          else if constexpr (kE4M3)
            MmaChunkE4M3(acc[m][j], stage[u][2 * m], stage[u][2 * m + 1], x);
          else
            MmaChunk(acc[m][j], stage[u][2 * m], stage[u][2 * m + 1], x);
        }
      }
    }
    if constexpr (kBlocks) {
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
        const float s = block_scale(m, c0 / kUnroll);
#pragma unroll
        for (int j = 0; j < kTiles; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[m][j][i] += s * part[m][j][i];
      }
    }
  };
  for (int c0 = 0; c0 < chunks; c0 += 2 * kUnroll) {
    LoadStage<kMats, kUnroll>(w, c0 + kUnroll, chunks, b);
    compute(a, c0);
    LoadStage<kMats, kUnroll>(w, c0 + 2 * kUnroll, chunks, a);
    compute(b, c0 + kUnroll);
  }
}

// The C fragment of pair tile j: c[0], c[1] are feature f0 + g at the tile's pairs 2t and 2t + 1,
// c[2], c[3] the same pairs at feature f0 + g + 8. Calls put(pair, feature, c0, c1) for the
// lane's in-range pairs; (c0, c1) are the two features' values.
template <typename Put>
__device__ __forceinline__ void ForEachOutput(const int* sorted, int first, int count, int base,
                                              int j, int t, const float* c, Put put) {
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int s = base + 8 * j + 2 * t + q;
    if (s < count) put(sorted ? sorted[first + s] : first + s, c[q], c[2 + q]);
  }
}

// The rows a down-projection block walks: expert e's bucketed pairs [offsets[e],
// offsets[e + 1]), or with offsets null one dense matrix's slab (GemmQuantMma, GemmFp8Mma): its
// dense_rows input rows split into gridDim.y slabs of whole passes of kTiles x 8 rows, slab y.
template <int kTiles>
__device__ __forceinline__ void RowsOf(const int* offsets, int e, int dense_rows, int* first,
                                       int* count) {
  if (offsets) {
    *first = offsets[e];
    *count = offsets[e + 1] - *first;
    return;
  }
  constexpr int kPass = 8 * kTiles;
  const int slab =
      CeilDivDevice(CeilDivDevice(dense_rows, static_cast<int>(gridDim.y)), kPass) * kPass;
  *first = static_cast<int>(blockIdx.y) * slab;
  *count = max(0, min(slab, dense_rows - *first));
}

// grid (ceil(inter / 64), experts held), 128 threads. Warp w of block (b, y) computes features
// f = 64 b + 16 w + [0, 16) of expert e = expert_begin + y's gate and up projections for every
// pair routed to e, kTiles x 8 pairs a pass, and writes h = silu(gate) * up in bf16 at [pair, f]
// (the down projection's input). x is the normalised input in bf16, [rows, hidden]; pair p reads
// row p / k. The experts not held here have no block, so their null table entries are never read.
// Batch 64, qwen3-30b-a3b: 126 of 128 experts, 2 x 768 x 2048 x 2 B each = 793 MB a layer,
// 178 us at 4.46 TB/s; 512 pairs x 6.3 MFLOP = 3.2 GFLOP on tensor cores (~5 us of MMA).
template <int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    GroupedGateUpKernel(const uint16_t* x, int k, const int* offsets, const int* sorted,
                        int expert_begin, const uint16_t* const* gate, const uint16_t* const* up,
                        int hidden, int inter, uint16_t* h) {
  const int e = expert_begin + blockIdx.y, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int f0 = blockIdx.x * kBlockFeatures + (threadIdx.x >> 5) * 16;
  const int chunks = hidden / 32;
  const int64_t lo_row = min(f0 + g, inter - 1), hi_row = min(f0 + g + 8, inter - 1);
  const uint4* const w[4] = {reinterpret_cast<const uint4*>(gate[e] + lo_row * hidden) + t,
                             reinterpret_cast<const uint4*>(gate[e] + hi_row * hidden) + t,
                             reinterpret_cast<const uint4*>(up[e] + lo_row * hidden) + t,
                             reinterpret_cast<const uint4*>(up[e] + hi_row * hidden) + t};
  uint4 a[kUnroll][4];
  LoadStage<2, kUnroll>(w, 0, chunks,
                        a);  // the weights do not depend on the routing: before the wait
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int first = offsets[e], count = offsets[e + 1] - first;
  for (int base = 0; base < count; base += 8 * kTiles) {
    const uint4* rows[kTiles];
    PairRows<kTiles>(sorted, first, count, base, x, hidden, k, g, t, rows);
    float acc[2][kTiles][4] = {};
    if (base > 0) LoadStage<2, kUnroll>(w, 0, chunks, a);
    StreamExpert<2, kTiles, kUnroll>(w, rows, CeilDivDevice(count - base, 8), chunks, a, acc);
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      float silu_mul[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        silu_mul[i] = acc[0][j][i] / (1.f + expf(-acc[0][j][i])) * acc[1][j][i];
      ForEachOutput(sorted, first, count, base, j, t, silu_mul, [&](int pair, float lo, float hi) {
        uint16_t* out = h + static_cast<int64_t>(pair) * inter;
        if (f0 + g < inter) out[f0 + g] = Bf16Bits(lo);
        if (f0 + g + 8 < inter) out[f0 + g + 8] = Bf16Bits(hi);
      });
    }
  }
}

// grid (ceil(hidden / 64), experts held), 128 threads: out[pair, f] = Wd[e][f] . h[pair] in fp32
// for the pairs of expert e = expert_begin + blockIdx.y, as above with one weight matrix and h as
// the input.
// Batch 64: 126 experts x 2048 x 768 x 2 B = 396 MB a layer, 89 us at 4.46 TB/s.
template <int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    GroupedDownKernel(const uint16_t* h, const int* offsets, const int* sorted, int expert_begin,
                      const uint16_t* const* down, int hidden, int inter, float* out) {
  const int e = expert_begin + blockIdx.y, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int f0 = blockIdx.x * kBlockFeatures + (threadIdx.x >> 5) * 16;
  const int chunks = inter / 32;
  const int64_t lo_row = min(f0 + g, hidden - 1), hi_row = min(f0 + g + 8, hidden - 1);
  const uint4* const w[2] = {reinterpret_cast<const uint4*>(down[e] + lo_row * inter) + t,
                             reinterpret_cast<const uint4*>(down[e] + hi_row * inter) + t};
  uint4 a[kUnroll][2];
  LoadStage<1, kUnroll>(w, 0, chunks, a);
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int first = offsets[e], count = offsets[e + 1] - first;
  for (int base = 0; base < count; base += 8 * kTiles) {
    const uint4* rows[kTiles];
    PairRows<kTiles>(sorted, first, count, base, h, inter, 1, g, t, rows);
    float acc[1][kTiles][4] = {};
    if (base > 0) LoadStage<1, kUnroll>(w, 0, chunks, a);
    StreamExpert<1, kTiles, kUnroll>(w, rows, CeilDivDevice(count - base, 8), chunks, a, acc);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
      ForEachOutput(sorted, first, count, base, j, t, acc[0][j], [&](int pair, float lo, float hi) {
        float* o = out + static_cast<int64_t>(pair) * hidden;
        if (f0 + g < hidden) o[f0 + g] = lo;
        if (f0 + g + 8 < hidden) o[f0 + g + 8] = hi;
      });
  }
}

// Quantized experts on the same tensor-core tiles (qgemm=w8a16 / w4a16 at 4+ rows, decode
// batches and prefill chunks alike). A lane's 16-byte load of codes is one "unit" of kRuns runs
// of 8 weights (FP8: 16 codes, 2 runs; FP4: 32 codes, 4 runs): run s of lane t covers k
// [U0 + 8 kRuns t + 8s, +8) of the unit starting at U0 = 32 kRuns U. Each run is decoded into 8
// exact bf16 weights and fed to MmaChunk with the activations of the same k (the order of k
// within a unit is the same permutation for weights and inputs, so every dot product is
// unchanged). What multiplies a whole row (FP8 tensor / channel scales, NVFP4's scale_2, and the
// 2^8 of the FP8 and NVFP4 decodes, QuantRowFactor) scales the fp32 sums at the end; the FP4
// group scales multiply the decoded weights in bf16 (DecodeRun), exactly: E2M1 x E4M3 or x E8M0
// products have at most 6 significant bits, within bf16's 8.
// Napkin math, batch 64 on qwen3-30b-a3b: 126 experts x 3 x 768 x 2048 weights a layer = 595 M
// weights: 335 MB NVFP4 (75 us at 4.46 TB/s), 595 MB FP8 (133 us); the decode is ~3 integer and
// conversion instructions per weight (FP4: shifts, a bf16x2 multiply and a byte permute per
// pair) once per pass (~25 us of issue over 132 SMs), the MMAs the same ~5 us as bf16's.
template <QuantFormat F>
constexpr int QuantRuns() {
  return IsFp4(F) ? 4 : 2;
}

// The scale bits of one unit of a row: NVFP4 its two E4M3 group scales (one 16-bit load), MXFP4
// its E8M0 scale; FP8 tensor / channel have none. `scales` points at the lane's first unit.
template <QuantFormat F>
__device__ __forceinline__ uint32_t LoadUnitScale(const void* scales, int unit) {
  if constexpr (F == QuantFormat::kNvfp4)
    return __ldg(static_cast<const uint16_t*>(scales) + 4 * unit);
  else if constexpr (F == QuantFormat::kMxfp4)
    return __ldg(static_cast<const uint8_t*>(scales) + 4 * unit);
  else
    return 0;
}

// The lane's row `row` of expert e: its codes from the lane's first unit (offset t), its unit
// scales likewise (FP4; null for FP8).
template <QuantFormat F>
__device__ __forceinline__ void QuantRowPointers(const QuantExpertTable& t, int e, int64_t row,
                                                 int lane_t, const uint4** codes,
                                                 const void** scales) {
  const int64_t row_bytes = IsFp4(F) ? t.cols / 2 : t.cols;
  *codes = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(TableCodes(t, e)) +
                                          row * row_bytes) +
           lane_t;
  *scales = nullptr;
  if constexpr (F == QuantFormat::kNvfp4)  // [rows, cols / 16] E4M3, two a 16-bit word
    *scales = static_cast<const uint16_t*>(TableScales(t, e)) + row * (t.cols / 32) + lane_t;
  else if constexpr (F == QuantFormat::kMxfp4)  // [rows, cols / 32] E8M0
    *scales = static_cast<const uint8_t*>(TableScales(t, e)) + row * (t.cols / 32) + lane_t;
}

template <int kMats, int kUnroll>
struct QuantStage {
  uint4 codes[kUnroll][2 * kMats];
  uint32_t scales[kUnroll][2 * kMats];
};

template <QuantFormat F, int kMats, int kUnroll>
__device__ __forceinline__ void LoadQuantStage(const uint4* const (&w)[2 * kMats],
                                               const void* const (&s)[2 * kMats], int u0, int units,
                                               QuantStage<kMats, kUnroll>& stage) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (u0 + u < units)
#pragma unroll
      for (int m = 0; m < 2 * kMats; ++m) {
        stage.codes[u][m] = __ldcs(w[m] + 4 * (u0 + u));
        stage.scales[u][m] = LoadUnitScale<F>(s[m], u0 + u);
      }
}

// StreamExpert's twin over quantized units: each run is decoded once per pass and serves every
// pair tile. rows[j] points at the lane's first run of pair tile j's input (offset kRuns t).
template <QuantFormat F, int kMats, int kTiles, int kUnroll>
__device__ __forceinline__ void StreamQuantExpert(const uint4* const (&w)[2 * kMats],
                                                  const void* const (&s)[2 * kMats],
                                                  const uint4* const (&rows)[kTiles], int tiles,
                                                  int units, QuantStage<kMats, kUnroll>& a,
                                                  float (&acc)[kMats][kTiles][4]) {
  constexpr int kRuns = QuantRuns<F>();
  QuantStage<kMats, kUnroll> b;
  auto compute = [&](const QuantStage<kMats, kUnroll>& stage, int u0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u0 + u >= units) break;
      RunScales scales[2 * kMats];
#pragma unroll
      for (int m = 0; m < 2 * kMats; ++m) scales[m] = RunScalesOf<F>(stage.scales[u][m]);
#pragma unroll
      for (int r = 0; r < kRuns; ++r) {
        uint4 wv[2 * kMats];
#pragma unroll
        for (int m = 0; m < 2 * kMats; ++m) wv[m] = DecodeRun<F>(stage.codes[u][m], scales[m], r);
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          if (j >= tiles) break;  // warp-uniform
          const uint4 x =
              rows[j] ? __ldg(rows[j] + 4 * kRuns * (u0 + u) + r) : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int m = 0; m < kMats; ++m) MmaChunk(acc[m][j], wv[2 * m], wv[2 * m + 1], x);
        }
      }
    }
  };
  for (int u0 = 0; u0 < units; u0 += 2 * kUnroll) {
    LoadQuantStage<F, kMats, kUnroll>(w, s, u0 + kUnroll, units, b);
    compute(a, u0);
    LoadQuantStage<F, kMats, kUnroll>(w, s, u0 + 2 * kUnroll, units, a);
    compute(b, u0 + kUnroll);
  }
}

// GroupedGateUpKernel over quantized gate and up tables (same grid, tiles and output).
// The decode batches' variant (4 tiles) is held to 168 registers, 3 blocks (12 warps) an SM:
// FP4's would take ~200 (2 blocks), and with one block's loads in flight per warp pair the extra
// block covers more of the memory latency than the few spilled registers cost.
template <QuantFormat F, int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32, kTiles == 4 ? 3 : 1)
    GroupedGateUpQuantKernel(const uint16_t* x, int k, const int* offsets, const int* sorted,
                             int expert_begin, QuantExpertTable gate, QuantExpertTable up,
                             uint16_t* h) {
  constexpr int kRuns = QuantRuns<F>();
  const int e = expert_begin + blockIdx.y, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int hidden = gate.cols, inter = gate.rows;
  const int f0 = blockIdx.x * kBlockFeatures + (threadIdx.x >> 5) * 16;
  const int units = hidden / (32 * kRuns);
  const int64_t lo_row = min(f0 + g, inter - 1), hi_row = min(f0 + g + 8, inter - 1);
  const uint4* w[4];
  const void* s[4];
  QuantRowPointers<F>(gate, e, lo_row, t, &w[0], &s[0]);
  QuantRowPointers<F>(gate, e, hi_row, t, &w[1], &s[1]);
  QuantRowPointers<F>(up, e, lo_row, t, &w[2], &s[2]);
  QuantRowPointers<F>(up, e, hi_row, t, &w[3], &s[3]);
  QuantStage<2, kUnroll> a;
  LoadQuantStage<F, 2, kUnroll>(w, s, 0, units, a);  // before the wait: weights only
  const float factor[4] = {QuantRowFactor<F>(gate, e, lo_row), QuantRowFactor<F>(gate, e, hi_row),
                           QuantRowFactor<F>(up, e, lo_row), QuantRowFactor<F>(up, e, hi_row)};
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int first = offsets[e], count = offsets[e + 1] - first;
  for (int base = 0; base < count; base += 8 * kTiles) {
    const uint4* rows[kTiles];
    PairRows<kTiles>(sorted, first, count, base, x, hidden, k, g, kRuns * t, rows);
    float acc[2][kTiles][4] = {};
    if (base > 0) LoadQuantStage<F, 2, kUnroll>(w, s, 0, units, a);
    StreamQuantExpert<F, 2, kTiles, kUnroll>(w, s, rows, CeilDivDevice(count - base, 8), units, a,
                                             acc);
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      float silu_mul[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float gv = acc[0][j][i] * factor[i < 2 ? 0 : 1];
        const float uv = acc[1][j][i] * factor[i < 2 ? 2 : 3];
        silu_mul[i] = gv / (1.f + expf(-gv)) * uv;
      }
      ForEachOutput(sorted, first, count, base, j, t, silu_mul, [&](int pair, float lo, float hi) {
        uint16_t* out = h + static_cast<int64_t>(pair) * inter;
        if (f0 + g < inter) out[f0 + g] = Bf16Bits(lo);
        if (f0 + g + 8 < inter) out[f0 + g + 8] = Bf16Bits(hi);
      });
    }
  }
}

// GroupedDownKernel over a quantized down table.
template <QuantFormat F, int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    GroupedDownQuantKernel(const uint16_t* h, const int* offsets, const int* sorted,
                           int expert_begin, QuantExpertTable down, int dense_rows, float* out) {
  constexpr int kRuns = QuantRuns<F>();
  // offsets null: one dense matrix (expert 0), a slab of its rows a block row (RowsOf)
  const int e = expert_begin + (offsets ? static_cast<int>(blockIdx.y) : 0);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int hidden = down.rows, inter = down.cols;
  const int f0 = blockIdx.x * kBlockFeatures + (threadIdx.x >> 5) * 16;
  const int units = inter / (32 * kRuns);
  const int64_t lo_row = min(f0 + g, hidden - 1), hi_row = min(f0 + g + 8, hidden - 1);
  const uint4* w[2];
  const void* s[2];
  QuantRowPointers<F>(down, e, lo_row, t, &w[0], &s[0]);
  QuantRowPointers<F>(down, e, hi_row, t, &w[1], &s[1]);
  QuantStage<1, kUnroll> a;
  LoadQuantStage<F, 1, kUnroll>(w, s, 0, units, a);
  const float factor[2] = {QuantRowFactor<F>(down, e, lo_row), QuantRowFactor<F>(down, e, hi_row)};
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  int first, count;
  RowsOf<kTiles>(offsets, e, dense_rows, &first, &count);
  for (int base = 0; base < count; base += 8 * kTiles) {
    const uint4* rows[kTiles];
    PairRows<kTiles>(sorted, first, count, base, h, inter, 1, g, kRuns * t, rows);
    float acc[1][kTiles][4] = {};
    if (base > 0) LoadQuantStage<F, 1, kUnroll>(w, s, 0, units, a);
    StreamQuantExpert<F, 1, kTiles, kUnroll>(w, s, rows, CeilDivDevice(count - base, 8), units, a,
                                             acc);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
      ForEachOutput(sorted, first, count, base, j, t, acc[0][j], [&](int pair, float lo, float hi) {
        float* o = out + static_cast<int64_t>(pair) * hidden;
        if (f0 + g < hidden) o[f0 + g] = lo * factor[0];
        if (f0 + g + 8 < hidden) o[f0 + g + 8] = hi * factor[1];
      });
  }
}

// The lane's unit scales `units` units further along its row (LoadUnitScale's stride of 4 a unit).
template <QuantFormat F>
__device__ __forceinline__ const void* AdvanceUnitScales(const void* scales, int units) {
  if constexpr (F == QuantFormat::kNvfp4)
    return static_cast<const uint16_t*>(scales) + 4 * units;
  else if constexpr (F == QuantFormat::kMxfp4)
    return static_cast<const uint8_t*>(scales) + 4 * units;
  else
    return scales;
}

// A dense quantized linear at decode batches (GemmQuantMma): y [rows, n] = x [rows, k] . W^T,
// W's codes decoded in registers onto bf16 mma.sync as in GroupedDownQuantKernel, with K split
// across the block's warps so that narrow projections still fill the GPU: grid (ceil(n / 16), row
// slabs), kSlices warps. Block (b, y) owns features [16 b, 16 b + 16) of slab y's rows; warp w
// streams units [w per, (w + 1) per) of K (per = ceil(units / kSlices)), every warp the same 16
// weight rows, so each weight byte is read once a pass. The warps' partial sums meet in shared
// memory and are added in warp order (deterministic), times the row factor.
// Each block reads all of its rows' inputs from L2 (a warp its slice): n / 16 x rows x k x 2
// bytes a matrix, 16 MB for q_proj of qwen3-30b-a3b at 16 rows, 64 MB at 64, which is why decode
// batches past 32 rows take the bf16 copy instead (engine/plan/linear_plan.h).
// Napkin math, batch 16 on qwen3-30b-a3b, NVFP4: q 4096 x 2048 is 4.7 MB of codes and scales
// (1.1 us at 4.46 TB/s) over 256 blocks of 8 warps, two 128-weight units a warp, and 16 MB of
// inputs from L2 (~3 us); k and v 0.6 MB each over 32 blocks; o 2048 x 4096 over 128 blocks.
// Against the bf16 copy's write and re-read of 2 bytes a weight (~19 MB a layer) and two
// launches a projection.
template <QuantFormat F, int kTiles, int kSlices>
__global__ void __launch_bounds__(kSlices * 32)
    DenseQuantMmaKernel(const uint16_t* x, QuantExpertTable w, int rows, float* y) {
  constexpr int kRuns = QuantRuns<F>(), kUnroll = 2;
  constexpr int kPartials = kTiles * 4 * 32;  // a warp's C fragments
  __shared__ float partial[kSlices][kPartials];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n = w.rows, k = w.cols, f0 = blockIdx.x * 16;
  const int units = k / (32 * kRuns), per = CeilDivDevice(units, kSlices);
  const int unit0 = min(units, warp * per), my_units = min(units, unit0 + per) - unit0;
  const uint4* codes[2];
  const void* scales[2];
  QuantRowPointers<F>(w, 0, min(f0 + g, n - 1), t, &codes[0], &scales[0]);
  QuantRowPointers<F>(w, 0, min(f0 + g + 8, n - 1), t, &codes[1], &scales[1]);
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    codes[m] += 4 * unit0;
    scales[m] = AdvanceUnitScales<F>(scales[m], unit0);
  }
  QuantStage<1, kUnroll> a;
  LoadQuantStage<F, 1, kUnroll>(codes, scales, 0, my_units, a);  // before the wait: weights only
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  int first, count;
  RowsOf<kTiles>(nullptr, 0, rows, &first, &count);
  for (int base = 0; base < count; base += 8 * kTiles) {
    const uint4* in[kTiles];
    PairRows<kTiles>(nullptr, first, count, base, x, k, 1, g, kRuns * t, in);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
      if (in[j]) in[j] += 4 * kRuns * unit0;
    float acc[1][kTiles][4] = {};
    if (base > 0) LoadQuantStage<F, 1, kUnroll>(codes, scales, 0, my_units, a);
    if (my_units > 0)
      StreamQuantExpert<F, 1, kTiles, kUnroll>(codes, scales, in, CeilDivDevice(count - base, 8),
                                               my_units, a, acc);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][(j * 4 + i) * 32 + lane] = acc[0][j][i];
    __syncthreads();
    // Element (j, i, l) is lane l's c[i] of tile j: row 8 j + 2 (l % 4) + i % 2 of the pass,
    // feature f0 + l / 4 + 8 (i / 2) (ForEachOutput's mapping).
    for (int e = threadIdx.x; e < kPartials; e += kSlices * 32) {
      const int l = e % 32, i = (e / 32) % 4, j = e / 128;
      const int row = base + 8 * j + 2 * (l % 4) + i % 2, feature = f0 + l / 4 + 8 * (i / 2);
      if (row >= count || feature >= n) continue;
      float sum = 0.f;
#pragma unroll
      for (int s = 0; s < kSlices; ++s) sum += partial[s][e];
      y[static_cast<int64_t>(first + row) * n + feature] = sum * QuantRowFactor<F>(w, 0, feature);
    }
    __syncthreads();  // the next pass rewrites partial
  }
}

// qgemm=w8a8: FP8 experts (tensor or channel scales) on E4M3 x E4M3 mma.sync, their codes fed to
// the MMAs as loaded, the inputs quantized to E4M3 with one scale a row beforehand
// (QuantizeRowsE4M3). The sums are exact products of the codes accumulated in fp32; the weight
// row's scale (QuantRowFactor's, less its 2^8, which belongs to the bf16 decode) and the input
// row's multiply them.
// Napkin math, batch 64 on qwen3-30b-a3b: the same 595 MB of FP8 codes a layer as the w8a16
// kernels (133 us at 4.46 TB/s), with no decode instructions (theirs, ~45 us of issue, are what
// keeps those kernels below the bandwidth) and a quarter of the bf16 inputs' bytes.
// Block-128 weights have no row scale: their scales multiply each k block's sums (Fp8BlockScale).
template <QuantFormat F>
__device__ __forceinline__ float Fp8RowScale(const QuantExpertTable& t, int e, int64_t row) {
  if constexpr (F == QuantFormat::kFp8Block128)
    return 1.f;
  else
    return QuantRowFactor<F>(t, e, row) * (1.f / 256.f);
}
// Expert e's block-128 scale of the block of rows holding `row` and of k block `block`: scales
// [ceil(rows / 128), ceil(cols / 128)] in fp32, bf16 or f16.
__device__ __forceinline__ float Fp8BlockScale(const QuantExpertTable& t, int e, int64_t row,
                                               int block) {
  constexpr QuantFormat kBlock = QuantFormat::kFp8Block128;
  // LoadChunkScaleBits counts k in 16-element chunks, eight to a 128-wide block.
  const uint32_t bits =
      LoadChunkScaleBits<kBlock>(TableScales(t, e), t.scale_dtype, row, 8 * block, t.cols);
  return DecodeChunkScale<kBlock>(bits, t.scale_dtype).lo;
}
// StreamExpert's block_scale for matrices `tables` (gate, up; or down) of expert e at the warp's
// 16 rows from f0 (within one 128-row block: f0 is a multiple of 16); null (no block scales) for
// tensor and channel scales.
template <QuantFormat F, int kMats>
__device__ __forceinline__ auto Fp8BlockScales(const QuantExpertTable* const (&tables)[kMats],
                                               int e, int64_t f0) {
  if constexpr (F == QuantFormat::kFp8Block128) {
    return [tables, e, f0](int m, int block) {
      return Fp8BlockScale(*tables[m], e, min(f0, static_cast<int64_t>(tables[m]->rows - 1)),
                           block);
    };
  } else {
    return nullptr;
  }
}
// The lane's first 16 bytes of expert e's row `row` of FP8 codes.
template <QuantFormat F>
__device__ __forceinline__ const uint4* Fp8RowCodes(const QuantExpertTable& t, int e, int64_t row,
                                                    int lane_t) {
  const uint4* codes;
  const void* no_scales;
  QuantRowPointers<F>(t, e, row, lane_t, &codes, &no_scales);
  return codes;
}

// GroupedGateUpKernel over FP8 gate and up codes and E4M3 inputs x [rows, hidden] (x_scale a
// row): same grid, tiles and bf16 output.
template <QuantFormat F, int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    GroupedGateUpFp8Kernel(const uint8_t* x, const float* x_scale, int k, const int* offsets,
                           const int* sorted, int expert_begin, QuantExpertTable gate,
                           QuantExpertTable up, uint16_t* h) {
  const int e = expert_begin + blockIdx.y, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int hidden = gate.cols, inter = gate.rows;
  const int f0 = blockIdx.x * kBlockFeatures + (threadIdx.x >> 5) * 16;
  const int chunks = hidden / 64;
  const int64_t lo_row = min(f0 + g, inter - 1), hi_row = min(f0 + g + 8, inter - 1);
  const uint4* const wc[4] = {Fp8RowCodes<F>(gate, e, lo_row, t),
                              Fp8RowCodes<F>(gate, e, hi_row, t), Fp8RowCodes<F>(up, e, lo_row, t),
                              Fp8RowCodes<F>(up, e, hi_row, t)};
  uint4 a[kUnroll][4];
  LoadStage<2, kUnroll>(wc, 0, chunks, a);  // before the wait: weights only
  const float scale[4] = {Fp8RowScale<F>(gate, e, lo_row), Fp8RowScale<F>(gate, e, hi_row),
                          Fp8RowScale<F>(up, e, lo_row), Fp8RowScale<F>(up, e, hi_row)};
  const QuantExpertTable* const mats[2] = {&gate, &up};
  const auto block_scale = Fp8BlockScales<F, 2>(mats, e, f0);
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int first = offsets[e], count = offsets[e + 1] - first;
  for (int base = 0; base < count; base += 8 * kTiles) {
    const uint4* rows[kTiles];
    PairRows<kTiles>(sorted, first, count, base, x, hidden, k, g, t, rows);
    float acc[2][kTiles][4] = {};
    if (base > 0) LoadStage<2, kUnroll>(wc, 0, chunks, a);
    StreamExpert<2, kTiles, kUnroll, /*kE4M3=*/true>(wc, rows, CeilDivDevice(count - base, 8),
                                                     chunks, a, acc, block_scale);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {  // pair 2t + q of tile j: features g (c[q]) and g + 8
        const int s = base + 8 * j + 2 * t + q;
        if (s >= count) continue;
        const int pair = sorted[first + s];
        const float xs = x_scale[pair / k];
        const float gate_lo = acc[0][j][q] * scale[0] * xs,
                    gate_hi = acc[0][j][2 + q] * scale[1] * xs;
        const float up_lo = acc[1][j][q] * scale[2] * xs, up_hi = acc[1][j][2 + q] * scale[3] * xs;
        uint16_t* out = h + static_cast<int64_t>(pair) * inter;
        if (f0 + g < inter) out[f0 + g] = Bf16Bits(gate_lo / (1.f + expf(-gate_lo)) * up_lo);
        if (f0 + g + 8 < inter)
          out[f0 + g + 8] = Bf16Bits(gate_hi / (1.f + expf(-gate_hi)) * up_hi);
      }
  }
}

// GroupedDownKernel over FP8 down codes and E4M3 inputs h [pairs, inter] (h_scale a pair); with
// offsets null, one dense matrix (expert 0) over a slab of its dense_rows input rows a block row
// (GemmFp8Mma).
template <QuantFormat F, int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    GroupedDownFp8Kernel(const uint8_t* h, const float* h_scale, const int* offsets,
                         const int* sorted, int expert_begin, QuantExpertTable down, int dense_rows,
                         float* out) {
  const int e = expert_begin + (offsets ? static_cast<int>(blockIdx.y) : 0);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int hidden = down.rows, inter = down.cols;
  const int f0 = blockIdx.x * kBlockFeatures + (threadIdx.x >> 5) * 16;
  const int chunks = inter / 64;
  const int64_t lo_row = min(f0 + g, hidden - 1), hi_row = min(f0 + g + 8, hidden - 1);
  const uint4* const wc[2] = {Fp8RowCodes<F>(down, e, lo_row, t),
                              Fp8RowCodes<F>(down, e, hi_row, t)};
  uint4 a[kUnroll][2];
  LoadStage<1, kUnroll>(wc, 0, chunks, a);
  const float scale[2] = {Fp8RowScale<F>(down, e, lo_row), Fp8RowScale<F>(down, e, hi_row)};
  const QuantExpertTable* const mats[1] = {&down};
  const auto block_scale = Fp8BlockScales<F, 1>(mats, e, f0);
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  int first, count;
  RowsOf<kTiles>(offsets, e, dense_rows, &first, &count);
  for (int base = 0; base < count; base += 8 * kTiles) {
    const uint4* rows[kTiles];
    PairRows<kTiles>(sorted, first, count, base, h, inter, 1, g, t, rows);
    float acc[1][kTiles][4] = {};
    if (base > 0) LoadStage<1, kUnroll>(wc, 0, chunks, a);
    StreamExpert<1, kTiles, kUnroll, /*kE4M3=*/true>(wc, rows, CeilDivDevice(count - base, 8),
                                                     chunks, a, acc, block_scale);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
      ForEachOutput(sorted, first, count, base, j, t, acc[0][j], [&](int pair, float lo, float hi) {
        const float hs = h_scale[pair];
        float* o = out + static_cast<int64_t>(pair) * hidden;
        if (f0 + g < hidden) o[f0 + g] = lo * scale[0] * hs;
        if (f0 + g + 8 < hidden) o[f0 + g + 8] = hi * scale[1] * hs;
      });
  }
}

// One block per row: y[r] += sum over slots (in slot order: deterministic) of w[r, slot] *
// out[r * k + slot], skipping pairs of skip_expert and of experts outside [expert_begin,
// expert_end) (left out of the buckets: their out rows are never written).
// Batch 64: 4 MB read, ~1 us at 4.46 TB/s.
__global__ void CombineExpertOutputsKernel(const float* out, const int* expert_ids,
                                           const float* weights, int skip_expert, int expert_begin,
                                           int expert_end, int k, int hidden, float* y) {
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int row = blockIdx.x, quads = hidden / 4;
  float4* y4 = reinterpret_cast<float4*>(y + static_cast<int64_t>(row) * hidden);
  for (int j = threadIdx.x; j < quads; j += blockDim.x) {
    float4 acc = y4[j];
    for (int slot = 0; slot < k; ++slot) {
      const int pair = row * k + slot, e = expert_ids[pair];
      if (e == skip_expert || e < expert_begin || e >= expert_end) continue;
      const float wt = weights[pair];
      const float4 v =
          reinterpret_cast<const float4*>(out + static_cast<int64_t>(pair) * hidden)[j];
      acc.x += wt * v.x;
      acc.y += wt * v.y;
      acc.z += wt * v.z;
      acc.w += wt * v.w;
    }
    y4[j] = acc;
  }
}

// The experts' launches take one block row per expert held (MoeGrouped launches none when it
// holds none).
template <int kTiles>
void LaunchExperts(const MoeGroupedArgs& a, cudaStream_t stream) {
  const int held = a.expert_end - a.expert_begin;
  Launch(GroupedGateUpKernel<kTiles, 2>, dim3(CeilDiv(a.inter, kBlockFeatures), held),
         dim3(kWarps * 32), 0, stream, a.x_bf16, a.k, a.offsets, a.sorted_pairs, a.expert_begin,
         a.gate, a.up, a.hidden, a.inter, a.h);
  Launch(GroupedDownKernel<kTiles, 4>, dim3(CeilDiv(a.hidden, kBlockFeatures), held),
         dim3(kWarps * 32), 0, stream, static_cast<const uint16_t*>(a.h), a.offsets,
         static_cast<const int*>(a.sorted_pairs), a.expert_begin, a.down, a.hidden, a.inter, a.out);
}

template <QuantFormat F, int kTiles>
void LaunchQuantExperts(const MoeGroupedArgs& a, cudaStream_t stream) {
  const QuantExpertTable* t = a.quant;
  const int held = a.expert_end - a.expert_begin;
  Launch(GroupedGateUpQuantKernel<F, kTiles, 2>, dim3(CeilDiv(a.inter, kBlockFeatures), held),
         dim3(kWarps * 32), 0, stream, a.x_bf16, a.k, static_cast<const int*>(a.offsets),
         static_cast<const int*>(a.sorted_pairs), a.expert_begin, t[0], t[1], a.h);
  Launch(GroupedDownQuantKernel<F, kTiles, 2>, dim3(CeilDiv(a.hidden, kBlockFeatures), held),
         dim3(kWarps * 32), 0, stream, static_cast<const uint16_t*>(a.h),
         static_cast<const int*>(a.offsets), static_cast<const int*>(a.sorted_pairs),
         a.expert_begin, t[2], 0, a.out);
}

template <QuantFormat F>
void LaunchQuantExperts(const MoeGroupedArgs& a, bool many_pairs, cudaStream_t stream) {
  if (many_pairs)
    LaunchQuantExperts<F, 8>(a, stream);
  else
    LaunchQuantExperts<F, 4>(a, stream);
}

template <QuantFormat F, int kTiles>
void LaunchFp8Experts(const MoeGroupedArgs& a, cudaStream_t stream) {
  const QuantExpertTable* t = a.quant;
  const int held = a.expert_end - a.expert_begin, pairs = a.rows * a.k;
  QuantizeRowsE4M3(a.x_f32, DType::kF32, a.rows, a.hidden, a.x_fp8, a.x_scale, stream);
  Launch(GroupedGateUpFp8Kernel<F, kTiles, 2>, dim3(CeilDiv(a.inter, kBlockFeatures), held),
         dim3(kWarps * 32), 0, stream, static_cast<const uint8_t*>(a.x_fp8),
         static_cast<const float*>(a.x_scale), a.k, static_cast<const int*>(a.offsets),
         static_cast<const int*>(a.sorted_pairs), a.expert_begin, t[0], t[1], a.h);
  // Pairs of experts not held here leave their h rows as they were: quantized too, never read.
  QuantizeRowsE4M3(a.h, DType::kBF16, pairs, a.inter, a.h_fp8, a.h_scale, stream);
  Launch(GroupedDownFp8Kernel<F, kTiles, 2>, dim3(CeilDiv(a.hidden, kBlockFeatures), held),
         dim3(kWarps * 32), 0, stream, static_cast<const uint8_t*>(a.h_fp8),
         static_cast<const float*>(a.h_scale), static_cast<const int*>(a.offsets),
         static_cast<const int*>(a.sorted_pairs), a.expert_begin, t[2], 0, a.out);
}

template <int kTiles>
void LaunchFp8Experts(const MoeGroupedArgs& a, cudaStream_t stream) {
  if (a.quant[0].format == QuantFormat::kFp8Tensor)
    LaunchFp8Experts<QuantFormat::kFp8Tensor, kTiles>(a, stream);
  else if (a.quant[0].format == QuantFormat::kFp8Channel)
    LaunchFp8Experts<QuantFormat::kFp8Channel, kTiles>(a, stream);
  else if (a.quant[0].format == QuantFormat::kFp8Block128)
    LaunchFp8Experts<QuantFormat::kFp8Block128, kTiles>(a, stream);
  else
    Unreachable("MoeGrouped: E4M3 experts of a format Fp8MmaShapeSupports refuses");
}

// MoeGrouped's expert kernels by the plan's variant, over the experts held (at least one).
// 8 tiles (64 pairs a pass) re-read an expert's weights less often when it has many pairs
// (prefill); decode batches average a few pairs an expert and take 4.
void LaunchExpertKernels(const MoeGroupedArgs& a, cudaStream_t stream) {
  switch (a.kernel) {
    case MoeGroupedKernel::kMma4:
      LaunchExperts<4>(a, stream);
      break;
    case MoeGroupedKernel::kMma8:
      LaunchExperts<8>(a, stream);
      break;
    case MoeGroupedKernel::kWgmma:
    case MoeGroupedKernel::kQuantWgmma:
    case MoeGroupedKernel::kFp8Wgmma:
      MoeWgmmaExperts(a, stream);
      break;
    case MoeGroupedKernel::kFp8Mma4:
      LaunchFp8Experts<4>(a, stream);
      break;
    case MoeGroupedKernel::kFp8Mma8:
      LaunchFp8Experts<8>(a, stream);
      break;
    case MoeGroupedKernel::kQuantMma4:
    case MoeGroupedKernel::kQuantMma8: {
      const bool wide = a.kernel == MoeGroupedKernel::kQuantMma8;
      switch (a.quant[0].format) {
        case QuantFormat::kFp8Tensor:
          LaunchQuantExperts<QuantFormat::kFp8Tensor>(a, wide, stream);
          break;
        case QuantFormat::kFp8Channel:
          LaunchQuantExperts<QuantFormat::kFp8Channel>(a, wide, stream);
          break;
        case QuantFormat::kNvfp4:
          LaunchQuantExperts<QuantFormat::kNvfp4>(a, wide, stream);
          break;
        case QuantFormat::kMxfp4:
          LaunchQuantExperts<QuantFormat::kMxfp4>(a, wide, stream);
          break;
        case QuantFormat::kNone:
        case QuantFormat::kFp8Block128:
          Unreachable("MoeGrouped: a quantized kernel on experts MoeGroupedQuantSupports refuses");
      }
      break;
    }
  }
}

}  // namespace

bool GemmQuantMmaSupports(const MatrixRef& w) {
  return QuantMmaShapeSupports(w.quant.format, w.rows, w.cols) &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

// A dense matrix's grid: a block column per block_features output features and, so that narrow
// projections (k and v) and long prefill chunks fill the GPU, its rows split into slabs of whole
// passes until there are ~blocks_per_sm blocks an SM. A block's pass is latency-bound (its loads
// of the rows' codes wait on L2 a chunk at a time), so slabs run side by side, not a block's
// passes in turn: prefill 2048 on qwen3-30b-a3b's k projection is 8 x 32 blocks, not 8 blocks of
// 32 passes.
dim3 DenseGrid(int features, int rows, bool wide, int block_features = kBlockFeatures,
               int blocks_per_sm = 4) {
  const int sms = MultiprocessorCount();
  const int columns = CeilDiv(features, block_features), pass = wide ? 64 : 32;
  const int slabs = std::clamp(CeilDiv(blocks_per_sm * sms, columns), 1, CeilDiv(rows, pass));
  return dim3(columns, slabs);
}

void GemmQuantMma(const uint16_t* x_bf16, int rows, const MatrixRef& w, float* y,
                  cudaStream_t stream) {
  const QuantExpertTable t = MatrixQuantTable(w);
  const bool wide = rows > 32;  // 8 tiles of 8 rows a pass, else 4
  constexpr int kSlices = 8;    // warps a block, each a slice of K
  // Slabs of rows until there are ~2 blocks of 8 warps an SM.
  const dim3 grid = DenseGrid(t.rows, rows, wide, /*block_features=*/16, /*blocks_per_sm=*/2),
             block(kSlices * 32);
  auto launch = [&](auto kernel) { Launch(kernel, grid, block, 0, stream, x_bf16, t, rows, y); };
  switch (t.format) {
    case QuantFormat::kFp8Tensor:
      wide ? launch(DenseQuantMmaKernel<QuantFormat::kFp8Tensor, 8, kSlices>)
           : launch(DenseQuantMmaKernel<QuantFormat::kFp8Tensor, 4, kSlices>);
      break;
    case QuantFormat::kFp8Channel:
      wide ? launch(DenseQuantMmaKernel<QuantFormat::kFp8Channel, 8, kSlices>)
           : launch(DenseQuantMmaKernel<QuantFormat::kFp8Channel, 4, kSlices>);
      break;
    case QuantFormat::kNvfp4:
      wide ? launch(DenseQuantMmaKernel<QuantFormat::kNvfp4, 8, kSlices>)
           : launch(DenseQuantMmaKernel<QuantFormat::kNvfp4, 4, kSlices>);
      break;
    default:  // GemmQuantMmaSupports admits no other format
      wide ? launch(DenseQuantMmaKernel<QuantFormat::kMxfp4, 8, kSlices>)
           : launch(DenseQuantMmaKernel<QuantFormat::kMxfp4, 4, kSlices>);
      break;
  }
}

bool GemmFp8MmaSupports(const MatrixRef& w) {
  return Fp8MmaShapeSupports(w.quant.format, w.rows, w.cols) &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

void GemmFp8Mma(const float* x, int rows, const MatrixRef& w, uint8_t* x_codes, float* x_scales,
                float* y, cudaStream_t stream) {
  const QuantExpertTable t = MatrixQuantTable(w);
  QuantizeRowsE4M3(x, DType::kF32, rows, t.cols, x_codes, x_scales, stream);
  const bool wide = rows > 32;  // 8 tiles of 8 rows a pass, else 4
  const dim3 grid = DenseGrid(t.rows, rows, wide), block(kWarps * 32);
  auto launch = [&](auto kernel) {
    Launch(kernel, grid, block, 0, stream, static_cast<const uint8_t*>(x_codes),
           static_cast<const float*>(x_scales), static_cast<const int*>(nullptr),
           static_cast<const int*>(nullptr), 0, t, rows, y);
  };
  if (t.format == QuantFormat::kFp8Tensor)
    wide ? launch(GroupedDownFp8Kernel<QuantFormat::kFp8Tensor, 8, 2>)
         : launch(GroupedDownFp8Kernel<QuantFormat::kFp8Tensor, 4, 2>);
  else if (t.format == QuantFormat::kFp8Block128)
    wide ? launch(GroupedDownFp8Kernel<QuantFormat::kFp8Block128, 8, 2>)
         : launch(GroupedDownFp8Kernel<QuantFormat::kFp8Block128, 4, 2>);
  else  // GemmFp8MmaSupports admits no other format
    wide ? launch(GroupedDownFp8Kernel<QuantFormat::kFp8Channel, 8, 2>)
         : launch(GroupedDownFp8Kernel<QuantFormat::kFp8Channel, 4, 2>);
}

void BucketPairs(const int* expert_ids, int pairs, int num_experts, int skip_expert,
                 int expert_begin, int expert_end, int* offsets, int* sorted_pairs,
                 cudaStream_t stream) {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {                   // up to 64 KB of count table for 1024 experts
    cudaFuncSetAttribute(BucketPairsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         BucketTableBytes(kBucketMaxExperts));
  });
  Launch(BucketPairsKernel, dim3(1), dim3(kBucketThreads), BucketTableBytes(num_experts), stream,
         expert_ids, pairs, num_experts, skip_expert, std::max(expert_begin, 0),
         std::min(expert_end, num_experts), offsets, sorted_pairs);
}

void MoeGrouped(const MoeGroupedArgs& args, cudaStream_t stream) {
  MoeGroupedArgs a = args;
  a.expert_begin = std::max(args.expert_begin, 0);
  a.expert_end = std::min(args.expert_end, args.num_experts);
  const int pairs = a.rows * a.k;
  BucketPairs(a.expert_ids, pairs, a.num_experts, a.skip_expert, a.expert_begin, a.expert_end,
              a.offsets, a.sorted_pairs, stream);
  // With no expert held every pair's output is another rank's: the combine adds nothing.
  if (a.expert_end > a.expert_begin) LaunchExpertKernels(a, stream);
  Launch(CombineExpertOutputsKernel, dim3(a.rows), dim3(256), 0, stream,
         static_cast<const float*>(a.out), a.expert_ids, a.expert_weights, a.skip_expert,
         a.expert_begin, a.expert_end, a.k, a.hidden, a.y);
}

}  // namespace infersweep::cuda
