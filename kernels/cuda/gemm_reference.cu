#include <cuda_fp8.h>

#include "core/quant/dequantize.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/scaled_layout.h"

namespace infersweep::cuda {
namespace {

constexpr int kRowsPerBlock = 16;

// One warp per (output feature n, chunk of kRowsPerBlock rows); lanes stride over K (coalesced
// weight loads); the chunk's rows re-read the weight row from L1. Chunking the rows keeps
// prefill parallel (unchunked, a 2048-row, N=128 router would run as 16 blocks).
// Each input element as the GEMM reads it: itself, or (the yardsticks) rounded to bf16.
__device__ __forceinline__ float Input(float v, bool bf16) {
  return bf16 ? __bfloat162float(__float2bfloat16(v)) : v;
}

// The E4M3 yardstick's element: E4M3(v / scale) x scale, the row's scale amax / 448
// (Fp8ActivationScale), as qgemm=w8a8 quantizes a row (QuantizeRowsE4m3).
__device__ __forceinline__ float E4m3Input(float v, float scale) {
  return static_cast<float>(__nv_fp8_e4m3(v / scale)) * scale;
}

template <typename W>
__global__ void GemmReferenceKernel(const float* x, int M, int K, const W* w, int N, float* y,
                                    bool bf16_inputs) {
  const int warps_per_block = blockDim.x / 32;
  const int n = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (n >= N) return;
  const W* wr = w + static_cast<int64_t>(n) * K;
  const int m_end = min(M, static_cast<int>(blockIdx.y + 1) * kRowsPerBlock);
  for (int m = blockIdx.y * kRowsPerBlock; m < m_end; ++m) {
    const float* xr = x + static_cast<int64_t>(m) * K;
    float acc = 0.f;
    for (int k = lane; k < K; k += 32) acc += Input(xr[k], bf16_inputs) * ToFloat(wr[k]);
    acc = WarpSum(acc);
    if (lane == 0) y[static_cast<int64_t>(m) * N + n] = acc;
  }
}

// Quantized weights (qgemm=reference): each element is dequantized exactly as it is read
// (DequantizeElement, the CPU's formula), in the order above, so the result is bit-identical to
// this kernel on DequantizeToF32's copy, without the copy (4 bytes a weight: 122 GB for
// qwen3-30b-a3b, more than an H200 holds next to the codes).
__global__ void GemmReferenceQuantKernel(const float* x, int M, MatrixRef w, float* y,
                                         GemmInputs inputs) {
  const int warps_per_block = blockDim.x / 32;
  const int n = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols);
  if (n >= N) return;
  const bool bf16 = inputs == GemmInputs::kBf16;
  const int m_end = min(M, static_cast<int>(blockIdx.y + 1) * kRowsPerBlock);
  for (int m = blockIdx.y * kRowsPerBlock; m < m_end; ++m) {
    const float* xr = x + static_cast<int64_t>(m) * K;
    float acc = 0.f;
    if (inputs == GemmInputs::kE4m3Rows) {
      float amax = 0.f;
      for (int k = lane; k < K; k += 32) amax = fmaxf(amax, fabsf(xr[k]));
      const float scale = Fp8ActivationScale(WarpMax(amax));
      for (int k = lane; k < K; k += 32)
        acc += E4m3Input(xr[k], scale) * DequantizeElement(w, n, k);
    } else {
      for (int k = lane; k < K; k += 32) acc += Input(xr[k], bf16) * DequantizeElement(w, n, k);
    }
    acc = WarpSum(acc);
    if (lane == 0) y[static_cast<int64_t>(m) * N + n] = acc;
  }
}

}  // namespace

void GemmReference(const float* x, int M, const MatrixRef& w, const MatrixRef& bias, float* y,
                   cudaStream_t stream, GemmInputs inputs) {
  const bool bf16_inputs = inputs != GemmInputs::kExact;  // a dense W under either yardstick
  const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols);
  const dim3 blocks(CeilDiv(N, 8), CeilDiv(M, kRowsPerBlock));
  if (w.quantized()) {
    LaunchPlain(GemmReferenceQuantKernel, blocks, 256, 0, stream, x, M, w, y, inputs);
    if (!bias.empty()) AddBias(y, M, bias, stream);
    return;
  }
  switch (w.dtype) {
    case DType::kBF16:
      LaunchPlain(GemmReferenceKernel<__nv_bfloat16>, blocks, 256, 0, stream, x, M, K,
                  static_cast<const __nv_bfloat16*>(w.data), N, y, bf16_inputs);
      break;
    case DType::kF16:
      LaunchPlain(GemmReferenceKernel<__half>, blocks, 256, 0, stream, x, M, K,
                  static_cast<const __half*>(w.data), N, y, bf16_inputs);
      break;
    default:
      LaunchPlain(GemmReferenceKernel<float>, blocks, 256, 0, stream, x, M, K,
                  static_cast<const float*>(w.data), N, y, bf16_inputs);
  }
  if (!bias.empty()) AddBias(y, M, bias, stream);
}

}  // namespace infersweep::cuda
