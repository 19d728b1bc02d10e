// Decode GEMV (gemm=fused): a few activation rows against bf16 weights, with the RMSNorm before
// it, the bias and the residual add after it fused into the one launch.
//
// Napkin math, qwen3-30b-a3b batch-1 decode, per layer: q+k+v = 5120 x 2048 bf16 = 21 MB ->
// 4.7 us at 4.46 TB/s; o = 2048 x 4096 = 16.8 MB -> 3.8 us; router 128 x 2048 = 0.5 MB -> a
// latency-bound ~2 us. FLOPs are 2 per weight per row: 0.5 FLOP/byte at batch 1, so the bound is
// bandwidth. cuBLASLt measured 8.4 us (q), 6.6 us (k), 6.7 us (v) and 8.3 + 3.2 us (o + split-K
// reduce) on the H200, plus the ToBf16, RMSNorm and residual kernels this one absorbs.
//
// A matrix this small is only ~2 DRAM latencies long, so the design goal is one wave: every warp
// issues all its weight loads at once, before anything else, and the x staging (16-byte loads,
// all in flight) hides under them. A version that staged x first with scalar loads paid an L2
// round trip per 512 floats in front of every block: 14-17 us for q+k+v on the H200.
#include <algorithm>

#include "kernels/cuda/gemv_common.cuh"

namespace infersweep::cuda {
namespace {

constexpr int kGemvUnroll = 8;  // 16-byte weight loads per lane per row in flight: 4 KB a row

// Warp w owns outputs [w * kRowsPerWarp, +kRowsPerWarp) across the segments. The warp's weight
// loads are issued first; x (times the gain) is staged in shared memory under their latency, and
// the RMSNorm factor 1/rms(x) is applied to the finished dot product.
// kMaxRows: activation rows compiled for (1 for batch-1 decode keeps registers low).
template <int kRowsPerWarp, int kMaxRows>
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
    int s = 0, l = min(first + rr, total - 1);
    while (s + 1 < a.segments && l >= a.seg[s].n) l -= a.seg[s++].n;
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
  if (!active) return;

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

}  // namespace

void SetProgrammaticLaunch(bool on) { ProgrammaticLaunchFlag() = on; }

bool GemvSupports(int rows, int k) {
  return rows >= 1 && rows <= kGemvMaxRows && k % 8 == 0 &&
         static_cast<int64_t>(rows) * k * sizeof(float) <= kGemvMaxSharedBytes;
}

void Gemv(const GemvArgs& args, cudaStream_t stream) {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {
    for (const void* kernel : {reinterpret_cast<const void*>(GemvKernel<1, 1>),
                               reinterpret_cast<const void*>(GemvKernel<2, 1>),
                               reinterpret_cast<const void*>(GemvKernel<1, kGemvMaxRows>),
                               reinterpret_cast<const void*>(GemvKernel<2, kGemvMaxRows>)})
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemvMaxSharedBytes);
  });
  const size_t smem = static_cast<size_t>(args.rows) * args.k * sizeof(float);
  int total = 0;
  for (int s = 0; s < args.segments; ++s) total += args.seg[s].n;
  // Two rows a warp once there are more rows than ~24 resident warps per SM can take one each
  // (q+k+v: 2560 warps). Blocks are 8 warps even for small matrices: staging x (and its norm)
  // after the wait is the kernel's critical path, and 8 warps share it four times finer than 2.
  // The 128-row router in 64 blocks of 2 warps cost 8 us a layer in the batch-1 decode graph;
  // in 16 blocks of 8, 4 us less (H200, TPOT 3.345 -> 3.147 ms).
  const int rows_per_warp = total > 24 * MultiprocessorCount() ? 2 : 1;
  const int warps_needed = CeilDiv(total, rows_per_warp);
  constexpr int kWarpsPerBlock = 8;
  const int blocks = CeilDiv(warps_needed, kWarpsPerBlock);
  const dim3 grid(blocks), block(kWarpsPerBlock * 32);
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
}

}  // namespace infersweep::cuda
