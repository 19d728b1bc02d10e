// Expert-grouped MoE on tensor cores (moe=fused, rows >= kMoeGroupedMinRows): the routed pairs
// are bucketed by expert on the device, then every expert's weights are streamed once and
// applied to all of its pairs with bf16 mma.sync (m16n8k16, fp32 accumulate): at batch 64, ~126
// expert reads a layer where moe.cu's per-pair kernels make 512 (ncu: gate/up 208 us + down
// 109 us a layer at 3.0 TB/s). No host sync, so decode steps stay capturable.
// Weights are re-read for every 64 pairs of an expert, so long prefill chunks (more than 16 pairs
// per expert) go to cuBLAS's grouped GEMMs instead (engine/cuda/moe_runner.cc).
#include <algorithm>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sm90a/moe_wgmma.h"

namespace infersweep::cuda {
namespace {

constexpr int kWarps = 4;                // per block; a warp owns 16 output features
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
// on both operands leaves every dot product unchanged, and no lane needs a shuffle or a 4-byte load.
__device__ __forceinline__ void MmaChunk(float* c, const uint4& lo, const uint4& hi, const uint4& b) {
  Mma16816(c, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  Mma16816(c, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

// Buckets the pairs by expert: offsets[e] = the pairs of experts before e, and
// sorted_pairs[offsets[e] + i] = the i-th pair (in pair order) routed to e. Pairs routed to
// skip_expert (TEST ONLY zero-expert fault; -1 in production), or to an id outside
// [0, num_experts), are left out. One block; the pairs go in parts of kBucketPart, warp w taking
// the w-th run of 32 x rounds pairs of a part, 32 a round. Every id is read once, all of a
// thread's loads in flight together. __match_any_sync groups a round's lanes by expert; the
// lowest lane of each group adds the group to the warp's row of a count table (and remembers
// what the warp's earlier rounds held), a scan down each expert's column gives the pairs of that
// expert in earlier warps, and a block scan of the totals gives the offsets. A pair's slot is
// then next[e] + earlier warps + earlier rounds + lower lanes of its group: pair order within
// each expert, so the bucketing (and every sum after it) is deterministic without sorting.
// Four barriers for one part (up to 8,192 pairs), four more a further part.
// Measured alone (ncu, H200, top-8 routing): 512 pairs / 128 experts (batch 64) 4.5 us, 2,048 /
// 128 7.5 us, 16,384 / 128 38 us, 16,384 / 1024 50 us. An empty 1024-thread kernel takes 1.5 us
// and one that only copies the 512 ids 2.2 us, so batch 64 is near the floor of a one-block
// kernel.
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
                      int* offsets, int* sorted_pairs) {
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
          first_pair + 32 * r < pairs && e >= 0 && e < num_experts && e != skip_expert;
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
    if (e >= 0 && e < num_experts && e != skip_expert) atomicAdd(&total[e], 1);
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
template <int kTiles>
__device__ __forceinline__ void PairRows(const int* sorted, int first, int count, int base,
                                         const uint16_t* rows, int64_t row_stride, int row_div,
                                         int g, int t, const uint4** out) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const int s = base + 8 * j + g;
    out[j] = s < count ? reinterpret_cast<const uint4*>(rows + (sorted[first + s] / row_div) * row_stride) + t
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
template <int kMats, int kTiles, int kUnroll>
__device__ __forceinline__ void StreamExpert(const uint4* const (&w)[2 * kMats],
                                             const uint4* const (&rows)[kTiles], int tiles,
                                             int chunks, uint4 (&a)[kUnroll][2 * kMats],
                                             float (&acc)[kMats][kTiles][4]) {
  uint4 b[kUnroll][2 * kMats];
  auto compute = [&](const uint4 (&stage)[kUnroll][2 * kMats], int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (c0 + u >= chunks) break;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        if (j >= tiles) break;  // warp-uniform
        const uint4 x = rows[j] ? __ldg(rows[j] + 4 * (c0 + u)) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int m = 0; m < kMats; ++m) MmaChunk(acc[m][j], stage[u][2 * m], stage[u][2 * m + 1], x);
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
    if (s < count) put(sorted[first + s], c[q], c[2 + q]);
  }
}

// grid (ceil(inter / 64), experts), 128 threads. Warp w of block (b, e) computes features
// f = 64 b + 16 w + [0, 16) of expert e's gate and up projections for every pair routed to e,
// kTiles x 8 pairs a pass, and writes h = silu(gate) * up in bf16 at [pair, f] (the down
// projection's input). x is the normalised input in bf16, [rows, hidden]; pair p reads row p / k.
// Batch 64, qwen3-30b-a3b: 126 of 128 experts, 2 x 768 x 2048 x 2 B each = 793 MB a layer,
// 178 us at 4.46 TB/s; 512 pairs x 6.3 MFLOP = 3.2 GFLOP on tensor cores (~5 us of MMA).
template <int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    GroupedGateUpKernel(const uint16_t* x, int k, const int* offsets, const int* sorted,
                        const uint16_t* const* gate, const uint16_t* const* up, int hidden,
                        int inter, uint16_t* h) {
  const int e = blockIdx.y, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int f0 = blockIdx.x * kBlockFeatures + (threadIdx.x >> 5) * 16;
  const int chunks = hidden / 32;
  const int64_t lo_row = min(f0 + g, inter - 1), hi_row = min(f0 + g + 8, inter - 1);
  const uint4* const w[4] = {reinterpret_cast<const uint4*>(gate[e] + lo_row * hidden) + t,
                             reinterpret_cast<const uint4*>(gate[e] + hi_row * hidden) + t,
                             reinterpret_cast<const uint4*>(up[e] + lo_row * hidden) + t,
                             reinterpret_cast<const uint4*>(up[e] + hi_row * hidden) + t};
  uint4 a[kUnroll][4];
  LoadStage<2, kUnroll>(w, 0, chunks, a);  // the weights do not depend on the routing: before the wait
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

// grid (ceil(hidden / 64), experts), 128 threads: out[pair, f] = Wd[e][f] . h[pair] in fp32 for
// the pairs of expert e, as above with one weight matrix and h as the input.
// Batch 64: 126 experts x 2048 x 768 x 2 B = 396 MB a layer, 89 us at 4.46 TB/s.
template <int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    GroupedDownKernel(const uint16_t* h, const int* offsets, const int* sorted,
                      const uint16_t* const* down, int hidden, int inter, float* out) {
  const int e = blockIdx.y, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
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

// One block per row: y[r] += sum over slots (in slot order: deterministic) of w[r, slot] *
// out[r * k + slot], skipping pairs of skip_expert. Batch 64: 4 MB read, measured 5.4 us.
__global__ void CombineExpertOutputsKernel(const float* out, const int* expert_ids,
                                           const float* weights, int skip_expert, int k,
                                           int hidden, float* y) {
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int row = blockIdx.x, quads = hidden / 4;
  float4* y4 = reinterpret_cast<float4*>(y + static_cast<int64_t>(row) * hidden);
  for (int j = threadIdx.x; j < quads; j += blockDim.x) {
    float4 acc = y4[j];
    for (int slot = 0; slot < k; ++slot) {
      const int pair = row * k + slot;
      if (expert_ids[pair] == skip_expert) continue;
      const float wt = weights[pair];
      const float4 v = reinterpret_cast<const float4*>(out + static_cast<int64_t>(pair) * hidden)[j];
      acc.x += wt * v.x;
      acc.y += wt * v.y;
      acc.z += wt * v.z;
      acc.w += wt * v.w;
    }
    y4[j] = acc;
  }
}

template <int kTiles>
void LaunchExperts(const MoeGroupedArgs& a, cudaStream_t stream) {
  Launch(GroupedGateUpKernel<kTiles, 2>, dim3(CeilDiv(a.inter, kBlockFeatures), a.num_experts),
         dim3(kWarps * 32), 0, stream, a.x_bf16, a.k, a.offsets, a.sorted_pairs, a.gate, a.up,
         a.hidden, a.inter, a.h);
  Launch(GroupedDownKernel<kTiles, 4>, dim3(CeilDiv(a.hidden, kBlockFeatures), a.num_experts),
         dim3(kWarps * 32), 0, stream, static_cast<const uint16_t*>(a.h), a.offsets,
         static_cast<const int*>(a.sorted_pairs), a.down, a.hidden, a.inter, a.out);
}

}  // namespace

bool MoeGroupedSupports(int num_experts, int hidden, int inter) {
  return num_experts >= 1 && num_experts <= 1024 && hidden % 32 == 0 && inter % 32 == 0;
}

void BucketPairs(const int* expert_ids, int pairs, int num_experts, int skip_expert, int* offsets,
                 int* sorted_pairs, cudaStream_t stream) {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {  // up to 64 KB of count table for 1024 experts
    cudaFuncSetAttribute(BucketPairsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         BucketTableBytes(kBucketMaxExperts));
  });
  Launch(BucketPairsKernel, dim3(1), dim3(kBucketThreads), BucketTableBytes(num_experts), stream,
         expert_ids, pairs, num_experts, skip_expert, offsets, sorted_pairs);
}

void MoeGrouped(const MoeGroupedArgs& a, cudaStream_t stream) {
  const int pairs = a.rows * a.k;
  BucketPairs(a.expert_ids, pairs, a.num_experts, a.skip_expert, a.offsets, a.sorted_pairs, stream);
  // Many pairs per expert (prefill): 64 pairs a pass, so the weights are re-read less often;
  // decode batches average a few pairs per expert and keep the lighter 32-pair kernel.
  if (a.wgmma && !MoeWgmmaSupports(a.hidden, a.inter) && LaunchRecording())
    RecordFallback("moe=wgmma: hidden " + std::to_string(a.hidden) + ", inter " +
                   std::to_string(a.inter) +
                   " (the wgmma tiles take hidden % 128 == 0, inter % 64 == 0): the mma.sync "
                   "grouped kernels");
  if (a.wgmma && MoeWgmmaSupports(a.hidden, a.inter))
    MoeWgmmaExperts(a, stream);
  else if (pairs > 24 * a.num_experts)
    LaunchExperts<8>(a, stream);
  else
    LaunchExperts<4>(a, stream);
  Launch(CombineExpertOutputsKernel, dim3(a.rows), dim3(256), 0, stream,
         static_cast<const float*>(a.out), a.expert_ids, a.expert_weights, a.skip_expert, a.k,
         a.hidden, a.y);
}

}  // namespace infersweep::cuda
