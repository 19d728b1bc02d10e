// Decode GEMV on quantized weights (qgemm=w4a16 / w8a16 under gemm=fused): the quantized twin
// of gemm_fused.cu's kernel, with the same fused RMSNorm, bias, residual add and segments, reading
// FP4 or FP8 codes and their scales and dequantizing them in registers (quant_decode.cuh).
//
// Napkin math, qwen3-30b-a3b batch-1 decode, per layer (H200, 4.46 TB/s):
//   q+k+v [5120, 2048]: nvfp4 5.9 MB -> 1.3 us; fp8 10.5 MB -> 2.4 us (bf16: 21 MB, 4.7 us).
//   o [2048, 4096]:     nvfp4 4.7 MB -> 1.1 us; fp8 8.4 MB -> 1.9 us.
//   FLOPs stay 2 per weight: 21 + 17 MFLOP. The work per weight (one decode step, one FMA, and
//   a 4-byte activation read from shared memory per weight and output row) is why a warp
//   computes two output rows: they share each activation read, halving the shared-memory
//   traffic (FP4 at full DRAM speed would otherwise need 36 TB/s of it, more than an H200's
//   ~30 TB/s).
// As in gemm_fused.cu, every warp issues its first weight and scale loads before the PDL wait and the
// staging of x, so the staging hides under their DRAM latency.
#include <algorithm>

#include "kernels/cuda/gemm_fused_common.cuh"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/quant_decode.cuh"

namespace infersweep::cuda {
namespace {

constexpr int kRowsPerWarp = 2;  // output rows per warp: they share each activation read
constexpr int kUnroll = 4;       // 16-byte code loads per lane per output row in flight
constexpr int kWarpsPerBlock = 8;
constexpr int kMaxBlockRows = 4;  // activation rows staged per block; grid.y covers the rest
constexpr int kMaxSharedBytes = 200 * 1024;

// grid (ceil(N_total / 16), ceil(rows / kBlockRows)), 256 threads. Warp w computes outputs
// [2w, 2w + 2) of the segments (concatenated) for activation rows [kBlockRows * blockIdx.y, +
// kBlockRows); lane l walks chunks l, l + 32, ... of both rows.
template <QuantFormat F, int kBlockRows>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    GemvQuantKernel(GemvArgs a, QuantGemvWeights qw) {
  extern __shared__ float xs[];  // [kBlockRows][PaddedFloats(k)]: x * gain
  __shared__ float scratch[32];
  constexpr int kChunk = ChunkElements<F>();
  constexpr int kBytesPerWeight2 = IsFp4(F) ? 1 : 2;  // bytes per 2 weights
  const int lane = threadIdx.x & 31;
  const int k = a.k, chunks = k / kChunk;
  int total = 0;
  for (int s = 0; s < a.segments; ++s) total += static_cast<int>(qw.w[s].rows);
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int first = warp * kRowsPerWarp;
  const bool active = first < total;
  const int m0 = blockIdx.y * kBlockRows;
  const int rows = min(kBlockRows, a.rows - m0);

  int seg_of[kRowsPerWarp], local[kRowsPerWarp];
  const uint4* wrow[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    int s = 0, l = min(first + rr, total - 1);
    while (s + 1 < a.segments && l >= qw.w[s].rows) l -= static_cast<int>(qw.w[s++].rows);
    seg_of[rr] = s;
    local[rr] = l;
    wrow[rr] = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(qw.w[s].data) +
                                              static_cast<int64_t>(l) * k * kBytesPerWeight2 / 2);
  }
  uint4 packed[kRowsPerWarp][kUnroll];
  uint32_t scale_bits[kRowsPerWarp][kUnroll], row_bits[kRowsPerWarp];
  auto load = [&](int c0) {
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (active && c0 + 32 * u < chunks) {
          const MatrixRef& w = qw.w[seg_of[rr]];
          packed[rr][u] = __ldcs(wrow[rr] + c0 + 32 * u);
          scale_bits[rr][u] =
              LoadChunkScaleBits<F>(w.quant.scale, w.quant.scale_dtype, local[rr], c0 + 32 * u, k);
        }
  };
  load(lane);
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr)
    row_bits[rr] = active ? LoadRowFactorBits<F>(qw.w[seg_of[rr]], local[rr]) : 0;

  WaitForPrerequisites();  // x is the previous kernel's output; the weights were not
  AllowDependentsToLaunch();
  float inv[kBlockRows];
  StagePaddedInput<kBlockRows>(
      a.x + static_cast<int64_t>(m0) * k, rows, k, a.norm_gain, a.norm_dtype, a.norm_eps,
      a.normed_out ? a.normed_out + static_cast<int64_t>(m0) * k : nullptr, xs, scratch, inv);
  if (!active) return;

  const int ld = PaddedFloats(k);
  float acc[kRowsPerWarp][kBlockRows] = {};
  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    if (c0 != lane) load(c0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      const float* x = xs + PaddedIndex(c * kChunk);
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr)
        ChunkDot<F, kBlockRows>(
            packed[rr][u],
            DecodeChunkScale<F>(scale_bits[rr][u], qw.w[seg_of[rr]].quant.scale_dtype), x, ld, rows,
            acc[rr]);
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    if (first + rr >= total) break;
    const MatrixRef& w = qw.w[seg_of[rr]];
    const float factor = DecodeRowFactor<F>(row_bits[rr], w.quant.scale_dtype);
#pragma unroll
    for (int r = 0; r < kBlockRows; ++r) {
      if (r >= rows) break;
      const float dot = WarpSum(acc[rr][r]) * factor * inv[r];
      if (lane == 0) StoreGemvOutput(a, a.seg[seg_of[rr]], local[rr], m0 + r, dot);
    }
  }
}

template <QuantFormat F>
void ConfigureShared() {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {
    cudaFuncSetAttribute(GemvQuantKernel<F, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         kMaxSharedBytes);
    cudaFuncSetAttribute(GemvQuantKernel<F, kMaxBlockRows>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSharedBytes);
  });
}

// Activation rows a block stages: 4 when they fit in shared memory, else 1.
int BlockRows(int rows, int64_t k) {
  const int64_t row_bytes = static_cast<int64_t>(PaddedFloats(static_cast<int>(k))) * 4;
  return rows > 1 && kMaxBlockRows * row_bytes <= kMaxSharedBytes ? kMaxBlockRows : 1;
}

template <QuantFormat F>
void LaunchGemvQuant(const GemvArgs& a, const QuantGemvWeights& qw, cudaStream_t stream) {
  ConfigureShared<F>();
  int total = 0;
  for (int s = 0; s < a.segments; ++s) total += static_cast<int>(qw.w[s].rows);
  const int block_rows = BlockRows(a.rows, a.k);
  const dim3 grid(CeilDiv(total, kWarpsPerBlock * kRowsPerWarp), CeilDiv(a.rows, block_rows));
  const size_t smem = static_cast<size_t>(block_rows) * PaddedFloats(a.k) * sizeof(float);
  if (block_rows == 1)
    Launch(GemvQuantKernel<F, 1>, grid, dim3(kWarpsPerBlock * 32), smem, stream, a, qw);
  else
    Launch(GemvQuantKernel<F, kMaxBlockRows>, grid, dim3(kWarpsPerBlock * 32), smem, stream, a, qw);
}

}  // namespace

bool QuantGemvSupports(const MatrixRef& w) {
  const QuantFormat f = w.quant.format;
  static_assert(kQuantGemvMaxSharedBytes == kMaxSharedBytes);
  return QuantGemvShapeSupports(f, w.rows, w.cols) && reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
         (f != QuantFormat::kNvfp4 || reinterpret_cast<uintptr_t>(w.quant.scale) % 2 == 0);
}

void GemvQuant(const GemvArgs& a, const QuantGemvWeights& qw, cudaStream_t stream) {
  if (a.rows <= 0 || a.segments <= 0) return;  // an empty grid is a launch error
  switch (qw.w[0].quant.format) {
    case QuantFormat::kNvfp4:
      return LaunchGemvQuant<QuantFormat::kNvfp4>(a, qw, stream);
    case QuantFormat::kMxfp4:
      return LaunchGemvQuant<QuantFormat::kMxfp4>(a, qw, stream);
    case QuantFormat::kFp8Tensor:
      return LaunchGemvQuant<QuantFormat::kFp8Tensor>(a, qw, stream);
    case QuantFormat::kFp8Channel:
      return LaunchGemvQuant<QuantFormat::kFp8Channel>(a, qw, stream);
    case QuantFormat::kFp8Block128:
      return LaunchGemvQuant<QuantFormat::kFp8Block128>(a, qw, stream);
    case QuantFormat::kNone:
      return;
  }
}

void GemvW8A16(const float* x, int rows, const MatrixRef& w, float* y, cudaStream_t stream) {
  GemvArgs a;
  a.x = x;
  a.rows = rows;
  a.k = static_cast<int>(w.cols);
  a.segments = 1;
  a.seg[0].y = y;
  a.seg[0].n = static_cast<int>(w.rows);
  a.seg[0].ld = static_cast<int>(w.rows);
  QuantGemvWeights qw;
  qw.w[0] = w;
  GemvQuant(a, qw, stream);
}

}  // namespace infersweep::cuda
