#include <algorithm>

#include "core/quant/dequantize.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/quant_decode.cuh"

namespace infersweep::cuda {
namespace {

__device__ __forceinline__ void Put(float* out, int64_t i, float v) { out[i] = v; }
__device__ __forceinline__ void Put(uint16_t* out, int64_t i, float v) { out[i] = FloatToBf16(v); }
// Eight values at out + 8 g, 16-byte aligned: vector stores.
__device__ __forceinline__ void PutEight(float* out, int64_t g, const float (&v)[8]) {
  reinterpret_cast<float4*>(out)[2 * g] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(out)[2 * g + 1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void PutEight(uint16_t* out, int64_t g, const float (&v)[8]) {
  uint4 packed;
  uint16_t* h = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
  for (int j = 0; j < 8; ++j) h[j] = FloatToBf16(v[j]);
  reinterpret_cast<uint4*>(out)[g] = packed;
}

// Grid-stride; the formula is the CPU's (DequantizeElement), so the fp32 output is bit-identical
// to the CPU reference's weights. With cols % 8 == 0 a thread takes 8 consecutive elements of a
// row (out 16-byte aligned): one 64-bit index division per 8 elements instead of one per
// element, and 16-byte stores instead of 2-byte ones.
template <typename Out>
__device__ __forceinline__ void DequantizeSpan(const MatrixRef& w, Out* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w.cols % 8 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    for (int64_t i = first; i < w.rows * w.cols; i += stride)
      Put(out, i, DequantizeElement(w, i / w.cols, i % w.cols));
    return;
  }
  const int64_t per_row = w.cols / 8;
  for (int64_t g = first; g < w.rows * per_row; g += stride) {
    const int64_t r = g / per_row, k0 = (g - r * per_row) * 8;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = DequantizeElement(w, r, k0 + j);
    PutEight(out, g, v);
  }
}

template <typename Out>
__global__ void DequantizeKernel(MatrixRef w, Out* out) {
  DequantizeSpan(w, out);
}

// The bf16 copy of an FP8 (tensor or channel scale), NVFP4 or MXFP4 matrix with 16-byte code
// rows: a thread a 16-byte chunk of codes (16 FP8 or 32 FP4 weights), decoded exactly by the
// tensor-core kernels' DecodeRun, times the row's factor in fp32, rounded to bf16: the same
// single rounding of the same product as DequantizeElement, so the same bits, at vector loads
// instead of a byte and a scale load per weight.
// Napkin: a qwen3-30b-a3b layer's q, k, v and o (18.9M weights) in FP8: 19 MB read, 38 MB
// written -> ~13 us at 4.46 TB/s.
template <QuantFormat F>
__global__ void DequantizeRunsKernel(QuantExpertTable t, uint16_t* out) {
  constexpr int kRuns = IsFp4(F) ? 4 : 2;  // 8-weight runs a chunk
  const int64_t chunks_per_row = t.cols / (8 * kRuns);
  const int64_t chunks = t.rows * chunks_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += stride) {
    const int64_t row = c / chunks_per_row;
    const uint4 codes = __ldg(static_cast<const uint4*>(t.matrix_codes) + c);
    uint32_t scale_bits = 0;  // NVFP4: the chunk's two E4M3 group scales; MXFP4: its E8M0 one
    if constexpr (F == QuantFormat::kNvfp4)
      scale_bits = __ldg(static_cast<const uint16_t*>(t.matrix_scales) + c);
    else if constexpr (F == QuantFormat::kMxfp4)
      scale_bits = __ldg(static_cast<const uint8_t*>(t.matrix_scales) + c);
    const float factor = QuantRowFactor<F>(t, 0, row);
    const RunScales scales = RunScalesOf<F>(scale_bits);
    uint4* dst = reinterpret_cast<uint4*>(out) + c * kRuns;
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      const uint4 run = DecodeRun<F>(codes, scales, r);
      uint32_t words[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        words[i] = PackBf16x2(__uint_as_float(words[i] << 16) * factor,
                              __uint_as_float(words[i] & 0xffff0000u) * factor);
      dst[r] = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
}

// Whether DequantizeRunsKernel takes w into out.
bool DequantizeRunsSupports(const MatrixRef& w, const void* out) {
  const QuantFormat f = w.quant.format;
  const bool format = f == QuantFormat::kFp8Tensor || f == QuantFormat::kFp8Channel ||
                      f == QuantFormat::kNvfp4 || f == QuantFormat::kMxfp4;
  return format && w.cols % (IsFp4(f) ? 32 : 16) == 0 &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(out) % 16 == 0;
}

void LaunchDequantizeRuns(const MatrixRef& w, uint16_t* out, cudaStream_t stream) {
  const QuantExpertTable t = MatrixQuantTable(w);
  constexpr int kThreads = 256;
  const int64_t chunks = w.rows * w.cols / (IsFp4(t.format) ? 32 : 16);
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(CeilDiv(chunks, int64_t{kThreads}), 132 * 16)));
  switch (t.format) {
    case QuantFormat::kFp8Tensor:
      LaunchPlain(DequantizeRunsKernel<QuantFormat::kFp8Tensor>, blocks, kThreads, 0, stream, t,
                  out);
      break;
    case QuantFormat::kFp8Channel:
      LaunchPlain(DequantizeRunsKernel<QuantFormat::kFp8Channel>, blocks, kThreads, 0, stream, t,
                  out);
      break;
    case QuantFormat::kNvfp4:
      LaunchPlain(DequantizeRunsKernel<QuantFormat::kNvfp4>, blocks, kThreads, 0, stream, t, out);
      break;
    default:
      LaunchPlain(DequantizeRunsKernel<QuantFormat::kMxfp4>, blocks, kThreads, 0, stream, t, out);
  }
}

// Matrix blockIdx.y of `matrices` (all [rows, cols]) into out + blockIdx.y * rows * cols.
__global__ void DequantizeManyKernel(const MatrixRef* matrices, uint16_t* out) {
  const MatrixRef w = matrices[blockIdx.y];
  DequantizeSpan(w, out + blockIdx.y * w.rows * w.cols);
}

template <typename Out>
void LaunchDequantize(const MatrixRef& w, Out* out, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int blocks = std::max(1, std::min(CeilDiv(w.rows * w.cols / 8, kThreads), 132 * 16));
  LaunchPlain(DequantizeKernel<Out>, blocks, kThreads, 0, stream, w, out);
}

constexpr int kWarpsPerBlock = 4;  // one output row per warp
constexpr int kRowsPerPass = 4;    // rows of x served by one decode of a chunk
constexpr int kChunk = 32;         // codes per 16-byte load

// 32 activations of one chunk into registers: 8 float4 loads, or 4 uint4 loads of bf16.
__device__ __forceinline__ void LoadChunk(const float* x, float* v) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll
  for (int i = 0; i < kChunk / 4; ++i) {
    const float4 f = x4[i];
    v[4 * i] = f.x;
    v[4 * i + 1] = f.y;
    v[4 * i + 2] = f.z;
    v[4 * i + 3] = f.w;
  }
}

__device__ __forceinline__ void LoadChunk(const uint16_t* x, float* v) {
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
#pragma unroll
  for (int i = 0; i < kChunk / 8; ++i) {
    const uint4 u = x4[i];
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[8 * i + 2 * j] = Bf16ToFloat(static_cast<uint16_t>(words[j] & 0xffffu));
      v[8 * i + 2 * j + 1] = Bf16ToFloat(static_cast<uint16_t>(words[j] >> 16));
    }
  }
}

// grid (ceil(N / 4), ceil(rows / 4)), 128 threads. Lane l of the warp for row n walks chunks
// l, l + 32, ...: each is one 16-byte load of codes (consecutive lanes: consecutive 16 bytes, so
// a warp reads 512 contiguous bytes per step) and its group scales.
template <QuantFormat kFormat, typename X>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    GemvW4A16Kernel(const X* x, int rows, MatrixRef w, float* y) {
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= w.rows) return;
  const int64_t K = w.cols, N = w.rows;
  const int m0 = blockIdx.y * kRowsPerPass;
  const uint4* codes =
      reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w.data) + n * (K / 2));
  const uint8_t* scales = static_cast<const uint8_t*>(w.quant.scale);
  float acc[kRowsPerPass] = {};
  for (int64_t c = lane; c < K / kChunk; c += 32) {
    const uint4 packed = __ldg(codes + c);
    // The chunk's group scales, in registers: nvfp4 has two groups of 16, mxfp4 one of 32.
    float scale_lo, scale_hi;
    if constexpr (kFormat == QuantFormat::kNvfp4) {
      const int64_t s = n * (K / kNvfp4GroupSize) + 2 * c;
      scale_lo = E4M3ToFloat(__ldg(scales + s));
      scale_hi = E4M3ToFloat(__ldg(scales + s + 1));
    } else {
      scale_lo = scale_hi = E8M0ToFloat(__ldg(scales + n * (K / kMxfp4GroupSize) + c));
    }
    float wv[kChunk];
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int b = 0; b < 16; ++b) {  // byte b holds elements 2b (low nibble) and 2b + 1
      const uint32_t byte = (words[b / 4] >> (8 * (b % 4))) & 0xffu;
      wv[2 * b] = E2M1ToFloat(static_cast<uint8_t>(byte & 0xfu));
      wv[2 * b + 1] = E2M1ToFloat(static_cast<uint8_t>(byte >> 4));
    }
#pragma unroll
    for (int m = 0; m < kRowsPerPass; ++m) {
      if (m0 + m >= rows) break;
      float xv[kChunk];
      LoadChunk(x + static_cast<int64_t>(m0 + m) * K + c * kChunk, xv);
      float lo = 0.f, hi = 0.f;
#pragma unroll
      for (int i = 0; i < kChunk / 2; ++i) {
        lo += xv[i] * wv[i];
        hi += xv[kChunk / 2 + i] * wv[kChunk / 2 + i];
      }
      acc[m] += lo * scale_lo + hi * scale_hi;
    }
  }
  float global = 1.f;
  if constexpr (kFormat == QuantFormat::kNvfp4)
    global = *static_cast<const float*>(w.quant.global_scale);
#pragma unroll
  for (int m = 0; m < kRowsPerPass; ++m) {
    if (m0 + m >= rows) break;
    const float sum = WarpSum(acc[m]);
    if (lane == 0) y[static_cast<int64_t>(m0 + m) * N + n] = sum * global;
  }
}

template <typename X>
void LaunchGemvW4A16(const X* x, int rows, const MatrixRef& w, float* y, cudaStream_t stream) {
  if (rows <= 0 || w.rows <= 0) return;  // an empty grid is a launch error
  const dim3 grid(CeilDiv(w.rows, kWarpsPerBlock), CeilDiv(rows, kRowsPerPass));
  if (w.quant.format == QuantFormat::kNvfp4) {
    LaunchPlain(GemvW4A16Kernel<QuantFormat::kNvfp4, X>, grid, kWarpsPerBlock * 32, 0, stream, x,
                rows, w, y);
  } else {
    LaunchPlain(GemvW4A16Kernel<QuantFormat::kMxfp4, X>, grid, kWarpsPerBlock * 32, 0, stream, x,
                rows, w, y);
  }
}

// grid rows, 256 threads: the row's largest magnitude (a block reduction), then its E4M3 codes,
// two a thread step (cvt.rn.satfinite.e4m3x2). The row stays in L1/L2 between the two passes.
template <typename In>
__global__ void QuantizeRowsE4M3Kernel(const In* x, int cols, uint8_t* codes, float* scales) {
  __shared__ float scratch[32];
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int64_t row = blockIdx.x;
  const In* xr = x + row * cols;
  float amax = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(ToFloat(xr[c])));
  amax = BlockMax(amax, scratch);
  const float scale = amax > 0.f ? amax / 448.f : 1.f;
  const float inv = 1.f / scale;
  if (threadIdx.x == 0) scales[row] = scale;
  uint16_t* out = reinterpret_cast<uint16_t*>(codes + row * cols);
  for (int c = 2 * threadIdx.x; c < cols; c += 2 * blockDim.x)
    out[c / 2] = __nv_cvt_float2_to_fp8x2(
        make_float2(ToFloat(xr[c]) * inv, ToFloat(xr[c + 1]) * inv), __NV_SATFINITE, __NV_E4M3);
}

}  // namespace

void DequantizeToBf16(const MatrixRef& w, uint16_t* out, cudaStream_t stream) {
  if (DequantizeRunsSupports(w, out))
    LaunchDequantizeRuns(w, out, stream);
  else
    LaunchDequantize(w, out, stream);
}

void DequantizeToF32(const MatrixRef& w, float* out, cudaStream_t stream) {
  LaunchDequantize(w, out, stream);
}

void DequantizeManyToBf16(const MatrixRef* matrices, int count, int64_t rows, int64_t cols,
                          uint16_t* out, cudaStream_t stream) {
  if (count <= 0 || rows * cols <= 0) return;
  constexpr int kThreads = 256;
  const int blocks = std::max(1, std::min(CeilDiv(rows * cols / 8, kThreads), 64));
  LaunchPlain(DequantizeManyKernel, dim3(blocks, count), kThreads, 0, stream, matrices, out);
}

bool W4A16Supports(const MatrixRef& w) {
  static_assert(kW4A16Chunk == kChunk);
  return W4A16ShapeSupports(w.quant.format, w.cols) &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

void GemvW4A16(const float* x, int rows, const MatrixRef& w, float* y, cudaStream_t stream) {
  LaunchGemvW4A16(x, rows, w, y, stream);
}

void GemvW4A16Bf16(const uint16_t* x, int rows, const MatrixRef& w, float* y, cudaStream_t stream) {
  LaunchGemvW4A16(x, rows, w, y, stream);
}

void QuantizeRowsE4M3(const void* x, DType dtype, int rows, int cols, uint8_t* codes, float* scales,
                      cudaStream_t stream) {
  if (rows <= 0) return;
  if (dtype == DType::kBF16)
    Launch(QuantizeRowsE4M3Kernel<__nv_bfloat16>, dim3(rows), dim3(256), 0, stream,
           static_cast<const __nv_bfloat16*>(x), cols, codes, scales);
  else
    Launch(QuantizeRowsE4M3Kernel<float>, dim3(rows), dim3(256), 0, stream,
           static_cast<const float*>(x), cols, codes, scales);
}

}  // namespace infersweep::cuda
