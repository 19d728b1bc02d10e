// The MoE router for many rows (batched decode, prefill): logits = x . Wr^T with fp32 x and fp32
// accumulation, as every config computes it (a bf16 input would flip near-tied routing choices).
// The reference GEMM gives each expert one warp that walks the rows: 87 us a layer at batch 64 and
// 217 us at prefill 2048 on qwen3-30b-a3b (ncu), 4 ms of a 31 ms batch-64 step.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

constexpr int kRows = 8;      // per block: one warp per row
constexpr int kExperts = 32;  // per block: one per lane
constexpr int kChunk = 128;   // k per shared-memory tile

// grid (ceil(M / 8), ceil(N / 32)), 256 threads. Each k tile of x (8 x 128) and of Wr (32 x 128,
// upcast to fp32, stored k-major with a padded row so the transposing stores spread over banks)
// is staged once; lane l of warp r accumulates y[r, e0 + l] over k in order (deterministic).
// Few, long k tiles: the first version (32-wide tiles, 128 experts a block: 8 blocks at batch
// 64) waited out 64 load round trips per block, 194 us a layer. Batch 64, qwen3-30b-a3b
// (N 128, K 2048): 32 blocks, 16 tiles each, 2,048 FMA a thread; Wr 0.5 MB from L2: ~10 us.
template <typename W>
__global__ void __launch_bounds__(256)
    RouterGemmKernel(const float* x, int M, int K, const W* w, int N, float* y) {
  __shared__ float xs[kRows][kChunk];
  __shared__ float ws[kChunk][kExperts + 1];
  const int row0 = blockIdx.x * kRows, e0 = blockIdx.y * kExperts;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += kChunk) {
    __syncthreads();
    {  // x: 4 consecutive k of one row per thread
      const int r = threadIdx.x / 32, c = (threadIdx.x % 32) * 4;
      const float* xr = x + static_cast<int64_t>(row0 + r) * K + k0 + c;
#pragma unroll
      for (int i = 0; i < 4; ++i) xs[r][c + i] = row0 + r < M && k0 + c + i < K ? xr[i] : 0.f;
    }
    {  // Wr: 16 consecutive k of one expert per thread
      const int e = threadIdx.x / 8, c = (threadIdx.x % 8) * 16;
      const W* wr = w + static_cast<int64_t>(e0 + e) * K + k0 + c;
#pragma unroll
      for (int i = 0; i < 16; ++i) ws[c + i][e] = e0 + e < N && k0 + c + i < K ? ToFloat(wr[i]) : 0.f;
    }
    __syncthreads();
#pragma unroll 16
    for (int c = 0; c < kChunk; ++c) acc += xs[warp][c] * ws[c][lane];
  }
  const int m = row0 + warp, e = e0 + lane;
  if (m < M && e < N) y[static_cast<int64_t>(m) * N + e] = acc;
}

// Few rows (decode batches): grid (ceil(N / 8), ceil(M / 8)), 256 threads. Warp w computes
// expert 8 x + w for 8 rows at once: lanes stride over k, each weight element feeds 8 independent
// FMAs (x rows from L1/L2), then one fixed-order warp sum per row (deterministic). Batch 64: 1,024
// warps, 64 k steps each.
template <typename W>
__global__ void __launch_bounds__(256)
    RouterGemvKernel(const float* x, int M, int K, const W* w, int N, float* y) {
  const int n = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int r0 = blockIdx.y * kRows, rows = min(kRows, M - r0);
  if (n >= N) return;
  const W* wr = w + static_cast<int64_t>(n) * K;
  const float* xr = x + static_cast<int64_t>(r0) * K;
  float acc[kRows] = {};
#pragma unroll 4
  for (int k = lane; k < K; k += 32) {
    const float wv = ToFloat(wr[k]);
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (r < rows) acc[r] += __ldg(xr + static_cast<int64_t>(r) * K + k) * wv;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float sum = WarpSum(acc[r]);
    if (lane == 0 && r < rows) y[static_cast<int64_t>(r0 + r) * N + n] = sum;
  }
}

template <typename W>
void LaunchRouter(const float* x, int M, int K, const W* w, int N, float* y, cudaStream_t stream) {
  // The tiled kernel's 32-expert blocks need many rows to fill the GPU; below that, the GEMV.
  if (M <= 256)
    RouterGemvKernel<<<dim3(CeilDiv(N, 8), CeilDiv(M, kRows)), 256, 0, stream>>>(x, M, K, w, N, y);
  else
    RouterGemmKernel<<<dim3(CeilDiv(M, kRows), CeilDiv(N, kExperts)), 256, 0, stream>>>(x, M, K, w, N, y);
}

}  // namespace

void RouterGemm(const float* x, int M, const MatrixRef& w, float* y, cudaStream_t stream) {
  const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols);
  switch (w.dtype) {
    case DType::kBF16:
      LaunchRouter(x, M, K, static_cast<const __nv_bfloat16*>(w.data), N, y, stream);
      break;
    case DType::kF16:
      LaunchRouter(x, M, K, static_cast<const __half*>(w.data), N, y, stream);
      break;
    default:
      LaunchRouter(x, M, K, static_cast<const float*>(w.data), N, y, stream);
  }
}

}  // namespace infersweep::cuda
