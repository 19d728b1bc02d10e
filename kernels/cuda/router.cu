// The MoE router for many rows (batched decode, prefill): logits = x . Wr^T with fp32 x and fp32
// accumulation, as every config computes it (a bf16 input would flip near-tied routing choices).
// The reference GEMM gives each expert one warp that walks the rows, re-reading x from L2 for
// every expert; the kernels below reuse each x element over several experts.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

constexpr int kRows = 8;  // rows per warp in the GEMV

// Many rows (prefill): tiles of 32 rows x 64 experts, 256 threads, each thread 2 rows x 4
// experts (8 accumulators; a float2 of x and a float4 of Wr from shared memory per 8 FMAs).
// k tiles of 32 are staged k-major; the next tile's global loads are issued into registers
// before the current tile is consumed, so load latency overlaps the FMAs. Each output is summed
// over k in order by one thread (deterministic). Prefill 2048, qwen3-30b-a3b (N 128, K 2048):
// 128 blocks x 2 M FMA: tiles reuse each x element over 64 experts, where a warp
// per expert re-reads x from L2 for every expert.
constexpr int kTileRows = 32, kTileExperts = 64, kTileK = 32;

template <typename W>
__global__ void __launch_bounds__(256)
    RouterGemmKernel(const float* x, int M, int K, const W* w, int N, float* y) {
  __shared__ __align__(16) float xs[kTileK][kTileRows + 4];
  __shared__ __align__(16) float ws[kTileK][kTileExperts + 4];
  const int row0 = blockIdx.x * kTileRows, e0 = blockIdx.y * kTileExperts;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;  // experts 4 tx.., rows 2 ty..
  // Staging: thread t loads k = t % 32 of rows (t / 32) + 8 i (4 values) and of experts
  // (t / 32) + 8 i (8 values): 32 consecutive k per warp (coalesced).
  const int kk = threadIdx.x % kTileK, lead = threadIdx.x / kTileK;
  float x_next[kTileRows / 8], w_next[kTileExperts / 8];
  auto load = [&](int k0) {
    const int k = k0 + kk;
#pragma unroll
    for (int i = 0; i < kTileRows / 8; ++i) {
      const int r = row0 + lead + 8 * i;
      x_next[i] = r < M && k < K ? x[static_cast<int64_t>(r) * K + k] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kTileExperts / 8; ++i) {
      const int e = e0 + lead + 8 * i;
      w_next[i] = e < N && k < K ? ToFloat(w[static_cast<int64_t>(e) * K + k]) : 0.f;
    }
  };
  float acc[2][4] = {};
  load(0);
  for (int k0 = 0; k0 < K; k0 += kTileK) {
    __syncthreads();  // the previous tile is consumed
#pragma unroll
    for (int i = 0; i < kTileRows / 8; ++i) xs[kk][lead + 8 * i] = x_next[i];
#pragma unroll
    for (int i = 0; i < kTileExperts / 8; ++i) ws[kk][lead + 8 * i] = w_next[i];
    __syncthreads();
    if (k0 + kTileK < K) load(k0 + kTileK);
#pragma unroll 8
    for (int k = 0; k < kTileK; ++k) {
      const float2 xv = *reinterpret_cast<const float2*>(&xs[k][2 * ty]);
      const float4 wv = *reinterpret_cast<const float4*>(&ws[k][4 * tx]);
      const float xr[2] = {xv.x, xv.y}, wr[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][e] += xr[r] * wr[e];
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = row0 + 2 * ty + r;
    if (m >= M) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e0 + 4 * tx + e < N) y[static_cast<int64_t>(m) * N + e0 + 4 * tx + e] = acc[r][e];
  }
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
  // The tiled kernel needs many rows to fill the GPU; below that, the GEMV.
  if (M <= 256)
    LaunchPlain(RouterGemvKernel<W>, dim3(CeilDiv(N, 8), CeilDiv(M, kRows)), 256, 0, stream, x, M,
                K, w, N, y);
  else
    LaunchPlain(RouterGemmKernel<W>, dim3(CeilDiv(M, kTileRows), CeilDiv(N, kTileExperts)), 256, 0,
                stream, x, M, K, w, N, y);
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
