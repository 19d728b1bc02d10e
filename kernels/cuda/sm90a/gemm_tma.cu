// Decode GEMV with the weights streamed by the Hopper TMA engine (gemm=tma): bulk asynchronous
// copies (cp.async.bulk) of whole weight tiles into shared memory, completion tracked by
// mbarriers, a ring of stages so that several tiles are in flight per SM while the warps compute
// on the oldest. Same function and fused epilogue as gemm_fused.cu (norm, bias, residual).
//
// Compiled for sm_90a only (this folder's target in kernels/CMakeLists.txt): the fatbin holds
// no code for other archs, so the registry gives gemm=tma the SM range [90, 90] and preflight
// answers UNSUPPORTED elsewhere, before anything loads.
//
// Napkin math, qwen3-30b-a3b batch-1 decode: q+k+v 21 MB over ~133 blocks (one per SM), 3 stages
// of 8 rows x 4 KB = 96 KB in flight per SM -> 12.7 MB in flight chip-wide, above the ~9 MB
// bandwidth x latency product; 21 MB at 4.46 TB/s = 4.7 us. o: 16.8 MB, 64 KB tiles -> 3.8 us.
#include <algorithm>

#include "kernels/cuda/gemm_fused_common.cuh"
#include "kernels/cuda/probe_kernels.h"
#include "kernels/cuda/sm90a/bulk_copy.cuh"
#include "kernels/cuda/sm90a/gemm_tma.h"

namespace infersweep::cuda {
namespace {

constexpr int kTileRows = 8;  // one row per warp
constexpr int kThreads = kTileRows * 32;
constexpr int kMaxStages = 4;
constexpr int kSharedBudget = 200 * 1024;

struct TmaPlan {
  int rows_per_block[kGemvMaxSegments];
  // Segment s owns blocks [first_block[s], first_block[s + 1]).
  int first_block[kGemvMaxSegments + 1];
  int stages;
};

// Block b streams rows [r0, r1) of one segment, kTileRows at a time through `stages` buffers.
template <int kMaxRows>
__global__ void __launch_bounds__(kThreads) GemvTmaKernel(GemvArgs a, TmaPlan plan) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ float scratch[32];
  const int k = a.k;
  const size_t tile_bytes = static_cast<size_t>(kTileRows) * k * sizeof(uint16_t);
  uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);
  float* xs = reinterpret_cast<float*>(smem + plan.stages * tile_bytes);
  int s = 0;
  while (s + 1 < a.segments && static_cast<int>(blockIdx.x) >= plan.first_block[s + 1]) ++s;
  const GemvSegment& seg = a.seg[s];
  const int r0 = (blockIdx.x - plan.first_block[s]) * plan.rows_per_block[s];
  const int r1 = min(seg.n, r0 + plan.rows_per_block[s]);
  const int tiles_total = (r1 - r0 + kTileRows - 1) / kTileRows;
  auto issue = [&](int t) {
    const int first = r0 + t * kTileRows, count = min(kTileRows, r1 - first);
    BulkCopy(tiles + static_cast<size_t>(t % plan.stages) * kTileRows * k,
             seg.w + static_cast<int64_t>(first) * k,
             static_cast<uint32_t>(count) * k * sizeof(uint16_t), &full[t % plan.stages]);
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < plan.stages; ++i) BarrierInit(&full[i], 1);
    FenceBarrierInit();
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int t = 0; t < min(plan.stages, tiles_total); ++t) issue(t);

  float inv[kMaxRows];
  StageGemvInput<kMaxRows>(a, xs, scratch, inv);  // under the first tiles' latency

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int chunks = k / 8;
  for (int t = 0; t < tiles_total; ++t) {
    const int stage = t % plan.stages;
    BarrierWait(&full[stage], (t / plan.stages) & 1);
    const int row = r0 + t * kTileRows + warp;
    if (row < r1) {
      const uint4* w = reinterpret_cast<const uint4*>(tiles + (static_cast<size_t>(stage) * kTileRows + warp) * k);
      float acc[kMaxRows] = {};
      for (int c = lane; c < chunks; c += 32) {
        const uint4 packed = w[c];
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r)
          if (r < a.rows) acc[r] += Dot8Bf16(packed, xs + static_cast<int64_t>(r) * k + c * 8);
      }
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= a.rows) break;
        const float dot = WarpSum(acc[r]) * inv[r];
        if (lane == 0) StoreGemvOutput(a, seg, row, r, dot);
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    if (threadIdx.x == 0 && t + plan.stages < tiles_total) issue(t + plan.stages);
  }
#endif
}

}  // namespace

bool GemvTmaSupports(int rows, int k) {
  const size_t tile_bytes = static_cast<size_t>(kTileRows) * k * sizeof(uint16_t);
  return rows >= 1 && rows <= kGemvMaxRows && k % 8 == 0 &&
         2 * tile_bytes + static_cast<size_t>(rows) * k * sizeof(float) <= kSharedBudget;
}

void GemvTma(const GemvArgs& args, cudaStream_t stream) {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {
    cudaFuncSetAttribute(GemvTmaKernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBudget);
    cudaFuncSetAttribute(GemvTmaKernel<kGemvMaxRows>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         kSharedBudget);
  });
  const size_t tile_bytes = static_cast<size_t>(kTileRows) * args.k * sizeof(uint16_t);
  const size_t x_bytes = static_cast<size_t>(args.rows) * args.k * sizeof(float);
  TmaPlan plan{};
  plan.stages = static_cast<int>(std::min<size_t>(kMaxStages, (kSharedBudget - x_bytes) / tile_bytes));
  int total = 0;
  for (int s = 0; s < args.segments; ++s) total += args.seg[s].n;
  // About one block per SM, each a whole number of tiles.
  const int rows_per_block =
      std::max(kTileRows, CeilDiv(CeilDiv(total, MultiprocessorCount()), kTileRows) * kTileRows);
  int blocks = 0;
  for (int s = 0; s < args.segments; ++s) {
    plan.rows_per_block[s] = rows_per_block;
    plan.first_block[s] = blocks;
    blocks += CeilDiv(args.seg[s].n, rows_per_block);
  }
  plan.first_block[args.segments] = blocks;
  const size_t smem = plan.stages * tile_bytes + x_bytes;
  if (args.rows == 1)
    LaunchPlain(GemvTmaKernel<1>, blocks, kThreads, smem, stream, args, plan);
  else
    LaunchPlain(GemvTmaKernel<kGemvMaxRows>, blocks, kThreads, smem, stream, args, plan);
}

ProbeKernel GemvTmaProbeKernel() {
  return {"GemvTmaKernel<1>", reinterpret_cast<const void*>(GemvTmaKernel<1>)};
}

}  // namespace infersweep::cuda
