// Decode GEMV (gemm=fused): a few activation rows against bf16 weights, with the RMSNorm before
// it, the bias and the residual add after it fused into the one launch.
//
// Napkin math, qwen3-30b-a3b batch-1 decode, per layer: q+k+v = 5120 x 2048 bf16 = 21 MB ->
// 4.7 us at 4.46 TB/s; o = 2048 x 4096 = 16.8 MB -> 3.8 us; router 128 x 2048 = 0.5 MB -> a
// latency-bound ~2 us. FLOPs are 2 per weight per row: 0.5 FLOP/byte at batch 1, so the bound is
// bandwidth. At this size cuBLASLt is launch- and latency-bound: a GEMM each for q, k, v and o
// (+ a split-K reduce), plus the ToBf16, RMSNorm and residual kernels this one absorbs.
//
// A matrix this small is only ~2 DRAM latencies long, so the design goal is one wave: every warp
// issues all its weight loads at once, before anything else, and the x staging (16-byte loads,
// all in flight) hides under them. Staging x first with scalar loads would put an L2 round
// trip per 512 floats in front of every block.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "kernels/cuda/gemm_fused_common.cuh"
#include "kernels/cuda/probe_kernels.h"
#include "kernels/cuda/routing.cuh"

namespace infersweep::cuda {
namespace {

constexpr int kGemvUnroll = 8;  // 16-byte weight loads per lane per row in flight: 4 KB a row

// The segment that output *row (counted over all segments) is in; *row becomes its row there.
__device__ __forceinline__ int SegmentOfRow(const GemvArgs& a, int* row) {
  int s = 0;
  while (s + 1 < a.segments && *row >= a.seg[s].n) *row -= a.seg[s++].n;
  return s;
}

// The row's top-k of the logits at segment 0's output (WarpTopK, as RouterTopK): lane s < k
// writes slot s, lane k the folded shared expert's slot when there is one (StoreRouting).
template <int kPerLane>
__device__ __forceinline__ void RouterTopKRow(const GemvArgs& a, int r, int lane) {
  const GemvTopK& t = a.topk;
  int id;
  float weight;
  WarpTopK<kPerLane>(a.seg[0].y + static_cast<int64_t>(r) * a.seg[0].ld, t.num_experts, t.k,
                     t.renormalize, &id, &weight);
  StoreRouting(r, lane, t.k, t.num_experts, id, weight, t.shared_logit, t.expert_ids,
               t.expert_weights);
}

// Called by every thread of a block once its warps have stored their logits: every thread fences
// its stores device-wide, the block counts itself in (an atomic add), and the last block of the
// grid picks the top-k, warp r row r, reading every block's logits through L2 (WarpTopK's
// __ldcg), then zeroes the count for the next launch.
__device__ __forceinline__ void RouterTopKTail(const GemvArgs& a, int lane) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.topk.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int r = threadIdx.x >> 5;
  if (r < a.rows) {
    const int e = a.topk.num_experts;
    if (e <= 128)
      RouterTopKRow<4>(a, r, lane);
    else if (e <= 256)
      RouterTopKRow<8>(a, r, lane);
    else  // e <= kGemvTopKMaxExperts (Gemv)
      RouterTopKRow<16>(a, r, lane);
  }
  if (threadIdx.x == 0) *a.topk.counter = 0;
}

// Warp w owns outputs [w * kRowsPerWarp, +kRowsPerWarp) across the segments. The warp's weight
// loads are issued first; x (times the gain) is staged in shared memory under their latency, and
// the RMSNorm factor 1/rms(x) is applied to the finished dot product.
// kMaxRows: activation rows compiled for (1 for batch-1 decode keeps registers low).
// kTopK: the router's GEMV with its top-k (GemvTopK) in the same launch.
template <int kRowsPerWarp, int kMaxRows, bool kTopK = false>
__global__ void __launch_bounds__(256) GemvKernel(GemvArgs a) {
  extern __shared__ float xs[];  // [rows][k]: x * gain
  __shared__ float scratch[32];
  const int lane = threadIdx.x & 31;
  const int k = a.k, chunks = k / 8;
  int total = 0;
  for (int s = 0; s < a.segments; ++s) total += a.seg[s].n;
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int first = warp * kRowsPerWarp;
  const bool active = first < total;

  int seg_of[kRowsPerWarp], local[kRowsPerWarp];
  const uint4* wrow[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    int l = min(first + rr, total - 1);
    const int s = SegmentOfRow(a, &l);
    seg_of[rr] = s;
    local[rr] = l;
    wrow[rr] = reinterpret_cast<const uint4*>(a.seg[s].w + static_cast<int64_t>(l) * k);
  }
  uint4 packed[kRowsPerWarp][kGemvUnroll];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr)
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u)
      if (active && lane + 32 * u < chunks) packed[rr][u] = __ldcs(wrow[rr] + lane + 32 * u);

  WaitForPrerequisites();  // x is the previous kernel's output; the weights were not
  AllowDependentsToLaunch();
  float inv[kMaxRows];
  StageGemvInput<kMaxRows>(a, xs, scratch, inv);
  if constexpr (!kTopK) {
    if (!active) return;
  }
  // With kTopK every thread goes on to the tail's barriers; inactive warps skip the sums.
  if (active) {
    float acc[kRowsPerWarp][kMaxRows] = {};
    for (int c0 = lane; c0 < chunks; c0 += 32 * kGemvUnroll) {
      if (c0 != lane) {
#pragma unroll
        for (int rr = 0; rr < kRowsPerWarp; ++rr)
#pragma unroll
          for (int u = 0; u < kGemvUnroll; ++u)
            if (c0 + 32 * u < chunks) packed[rr][u] = __ldcs(wrow[rr] + c0 + 32 * u);
      }
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u) {
        const int c = c0 + 32 * u;
        if (c >= chunks) break;
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r >= a.rows) break;
#pragma unroll
          for (int rr = 0; rr < kRowsPerWarp; ++rr)
            acc[rr][r] += Dot8Bf16(packed[rr][u], xs + static_cast<int64_t>(r) * k + c * 8);
        }
      }
    }
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      if (first + rr >= total) break;
      const GemvSegment& seg = a.seg[seg_of[rr]];
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= a.rows) break;
        const float dot = WarpSum(acc[rr][r]) * inv[r];
        if (lane == 0) StoreGemvOutput(a, seg, local[rr], r, dot);
      }
    }
  }
  if constexpr (kTopK) RouterTopKTail(a, lane);
}

// Matrices of many more rows than the GPU holds warps, the lm_head above all (qwen3-30b-a3b:
// 151,936 x 2048 bf16 = 622 MB -> 139 us at 4.46 TB/s, 0.6 GFLOP: bandwidth-bound). GemvKernel's
// one-wave design would launch 9,496 blocks there, each staging x and its norm again; here a
// grid of kStreamBlocksPerSm blocks an SM stages x once, and each warp walks the rows grid-stride
// in 4 KB batches (8 16-byte loads a lane), the next batch's loads in flight while it sums the
// current one: 16 warps x 4 KB = 64 KB in flight an SM, 8.4 MB over 132 SMs, about the
// bandwidth-latency product. Registers: two batches (64) + sums; 2 blocks of 256 an SM.
// It streams as fast as cuBLASLt's GEMM on the same shape (docs/PERFORMANCE.md), with the norm
// fused in.
constexpr int kStreamBlocksPerSm = 2;

template <int kMaxRows>
__global__ void __launch_bounds__(256, kStreamBlocksPerSm) GemvStreamKernel(GemvArgs a) {
  extern __shared__ float xs[];  // [rows][k]: x * gain
  __shared__ float scratch[32];
  const int lane = threadIdx.x & 31;
  const int k = a.k, chunks = k / 8;
  int total = 0;
  for (int s = 0; s < a.segments; ++s) total += a.seg[s].n;
  const int warps = gridDim.x * (blockDim.x / 32);
  // The warp's batch: row `row` (over the segments), chunks c0 + 32 u.
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, c0 = lane;
  auto row_weights = [&](int r) {
    const int s = SegmentOfRow(a, &r);
    return reinterpret_cast<const uint4*>(a.seg[s].w + static_cast<int64_t>(r) * k);
  };
  auto load = [&](const uint4* w, int c, uint4(&dst)[kGemvUnroll]) {
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u)
      if (c + 32 * u < chunks) dst[u] = __ldcs(w + c + 32 * u);
  };
  uint4 cur[kGemvUnroll], next[kGemvUnroll];
  const uint4* w = row < total ? row_weights(row) : nullptr;
  if (w) load(w, c0, cur);  // the weights are not the previous kernel's output

  WaitForPrerequisites();
  AllowDependentsToLaunch();
  float inv[kMaxRows];
  StageGemvInput<kMaxRows>(a, xs, scratch, inv);

  float acc[kMaxRows] = {};
  while (row < total) {
    int next_row = row, next_c0 = c0 + 32 * kGemvUnroll;
    const uint4* next_w = w;
    if (next_c0 >= chunks) {
      next_row += warps;
      next_c0 = lane;
      next_w = next_row < total ? row_weights(next_row) : nullptr;
    }
    if (next_w) load(next_w, next_c0, next);
      // GemvKernel's batch loop, written out again on purpose: sharing one helper moves the
      // one-wave kernel's generated code and slows the bf16 graphs=on step.
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= a.rows) break;
        acc[r] += Dot8Bf16(cur[u], xs + static_cast<int64_t>(r) * k + c * 8);
      }
    }
    if (next_row != row) {  // the row is summed
      int local = row;
      const int s = SegmentOfRow(a, &local);
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= a.rows) break;
        const float dot = WarpSum(acc[r]) * inv[r];
        if (lane == 0) StoreGemvOutput(a, a.seg[s], local, r, dot);
        acc[r] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) cur[u] = next[u];
    row = next_row;
    c0 = next_c0;
    w = next_w;
  }
}

int TotalRows(const GemvArgs& a) {
  int total = 0;
  for (int s = 0; s < a.segments; ++s) total += a.seg[s].n;
  return total;
}

}  // namespace

// Programmatic dependent launch needs sm_90; before it the launches stay plain. TEST ONLY:
// INFERSWEEP_PLAIN_LAUNCHES=1 keeps them plain everywhere, so a fault that goes away with it is
// an ordering one (a kernel reading before its wait what an earlier kernel writes).
void SetProgrammaticLaunch(bool on) {
  static const bool supported = [] {
    const char* plain = std::getenv("INFERSWEEP_PLAIN_LAUNCHES");
    if (plain != nullptr && plain[0] != '\0' && std::string(plain) != "0") return false;
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    return major >= 9;
  }();
  ProgrammaticLaunchFlag() = on && supported;
}

bool GemvStreams(const GemvArgs& args) {
  return TotalRows(args) > kGemvStreamRowsPerSm * MultiprocessorCount();
}

void Gemv(const GemvArgs& args, cudaStream_t stream) {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {
    for (const void* kernel : {reinterpret_cast<const void*>(GemvKernel<1, 1>),
                               reinterpret_cast<const void*>(GemvKernel<2, 1>),
                               reinterpret_cast<const void*>(GemvKernel<1, kGemvMaxRows>),
                               reinterpret_cast<const void*>(GemvKernel<2, kGemvMaxRows>),
                               reinterpret_cast<const void*>(GemvKernel<1, 1, true>),
                               reinterpret_cast<const void*>(GemvKernel<1, kGemvMaxRows, true>),
                               reinterpret_cast<const void*>(GemvStreamKernel<1>),
                               reinterpret_cast<const void*>(GemvStreamKernel<kGemvMaxRows>)})
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kGemvMaxSharedBytes);
  });
  const size_t smem = static_cast<size_t>(args.rows) * args.k * sizeof(float);
  const int total = TotalRows(args);
  // A top-k the launch below does not fuse: its own kernel after it.
  auto separate_topk = [&] {
    if (args.topk.counter)
      RouterTopK(args.seg[0].y, args.rows, args.topk.num_experts, args.topk.k,
                 args.topk.renormalize, args.topk.expert_ids, args.topk.expert_weights, stream,
                 args.topk.shared_logit);
  };
  if (GemvStreams(args)) {
    const dim3 grid(kStreamBlocksPerSm * MultiprocessorCount()), block(256);
    if (args.rows == 1)
      Launch(GemvStreamKernel<1>, grid, block, smem, stream, args);
    else
      Launch(GemvStreamKernel<kGemvMaxRows>, grid, block, smem, stream, args);
    separate_topk();
    return;
  }
  // Two rows a warp once there are more rows than ~24 resident warps per SM can take one each
  // (q+k+v: 2560 warps). Blocks are 8 warps even for small matrices: staging x (and its norm)
  // after the wait is the kernel's critical path, and 8 warps share it four times finer than 2.
  // So the 128-row router runs as 16 blocks of 8 warps, not 64 blocks of 2.
  const int rows_per_warp = total > 24 * MultiprocessorCount() ? 2 : 1;
  const int warps_needed = CeilDiv(total, rows_per_warp);
  constexpr int kWarpsPerBlock = 8;
  const int blocks = CeilDiv(warps_needed, kWarpsPerBlock);
  const dim3 grid(blocks), block(kWarpsPerBlock * 32);
  if (args.topk.counter && rows_per_warp == 1 &&
      args.topk.num_experts <= kGemvTopKMaxExperts) {  // the router: its top-k in the same launch
    if (args.rows == 1)
      Launch(GemvKernel<1, 1, true>, grid, block, smem, stream, args);
    else
      Launch(GemvKernel<1, kGemvMaxRows, true>, grid, block, smem, stream, args);
    return;
  }
  if (args.rows == 1) {
    if (rows_per_warp == 2)
      Launch(GemvKernel<2, 1>, grid, block, smem, stream, args);
    else
      Launch(GemvKernel<1, 1>, grid, block, smem, stream, args);
  } else if (rows_per_warp == 2) {
    Launch(GemvKernel<2, kGemvMaxRows>, grid, block, smem, stream, args);
  } else {
    Launch(GemvKernel<1, kGemvMaxRows>, grid, block, smem, stream, args);
  }
  separate_topk();
}

ProbeKernel FusedGemvProbeKernel() {
  return {"GemvKernel<1, 1>", reinterpret_cast<const void*>(GemvKernel<1, 1>)};
}

}  // namespace infersweep::cuda
