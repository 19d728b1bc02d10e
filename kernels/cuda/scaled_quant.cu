#include <algorithm>

#include "core/quant/codecs.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/scaled_layout.h"
#include "kernels/cuda/scaled_quant.h"

namespace infersweep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 132 * 8;  // 8 blocks per SM of an H200 for grid-stride loops
constexpr int kGroupThreads = 128;   // QuantizeFp8RowGroups: one block per (row, group)

int GridFor(int64_t n) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(CeilDiv(n, kThreads), kMaxBlocks)));
}

// |x| as bits. For non-negative floats unsigned order is float order, and every NaN (sign
// cleared) ranks above Inf, so a max over bits propagates NaN where fmaxf would drop it.
__device__ __forceinline__ uint32_t AbsBits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ uint32_t WarpMaxBits(uint32_t v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide max for blockDim.x a multiple of 32; `scratch` holds 32 entries. Every thread
// returns the result.
__device__ __forceinline__ uint32_t BlockMaxBits(uint32_t v, uint32_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpMaxBits(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? scratch[lane] : 0u;
  return WarpMaxBits(v);
}

__global__ void __launch_bounds__(kThreads)
    AmaxKernel(const float* x, int64_t n, uint32_t* amax_bits) {
  __shared__ uint32_t scratch[32];
  uint32_t bits = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    bits = max(bits, AbsBits(x[i]));
  bits = BlockMaxBits(bits, scratch);
  if (threadIdx.x == 0) atomicMax(amax_bits, bits);
}

__global__ void QuantizeFp8TensorKernel(const float* x, int64_t n, const uint32_t* amax_bits,
                                        uint8_t* codes, float* scale_out) {
  const float scale = Fp8ActivationScale(__uint_as_float(*amax_bits));
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = scale;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    codes[i] = FloatToE4M3(x[i] / scale);
}

// grid (rows, groups): block (m, g) quantizes columns [g x group, (g + 1) x group) of row m. The
// second pass re-reads the group from L1/L2.
__global__ void __launch_bounds__(kGroupThreads)
    QuantizeFp8RowGroupsKernel(const float* x, int rows, int cols, int group, uint8_t* codes,
                               float* scales) {
  __shared__ uint32_t scratch[32];
  const int m = blockIdx.x, g = blockIdx.y;
  const int64_t row = static_cast<int64_t>(m) * cols;
  const int k0 = g * group, k1 = min(cols, k0 + group);
  uint32_t bits = 0;
  for (int k = k0 + threadIdx.x; k < k1; k += blockDim.x) bits = max(bits, AbsBits(x[row + k]));
  const float scale = Fp8ActivationScale(__uint_as_float(BlockMaxBits(bits, scratch)));
  for (int k = k0 + threadIdx.x; k < k1; k += blockDim.x)
    codes[row + k] = FloatToE4M3(x[row + k] / scale);
  if (threadIdx.x == 0) scales[Fp8ActivationScaleIndex(rows, m, g)] = scale;
}

// One thread per 16-column group of one row: 16 floats in, 8 bytes of codes and one scale byte
// out.
__global__ void __launch_bounds__(kThreads)
    QuantizeNvfp4Kernel(const float* x, int rows, int cols, const uint32_t* amax_bits,
                        uint8_t* codes, uint8_t* tiled_scales, float* global_out) {
  const int groups = cols / static_cast<int>(kNvfp4GroupSize);
  const float global = Nvfp4GlobalScale(__uint_as_float(*amax_bits));
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t == 0) *global_out = global;
  if (t >= static_cast<int64_t>(rows) * groups) return;
  const int64_t m = t / groups;
  const int g = static_cast<int>(t % groups);
  const float* xg = x + m * cols + g * kNvfp4GroupSize;
  float v[kNvfp4GroupSize];
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < kNvfp4GroupSize; ++i) {
    v[i] = xg[i];
    bits = max(bits, AbsBits(v[i]));
  }
  const uint8_t scale_code = Nvfp4GroupScaleCode(__uint_as_float(bits), global);
  const float scale = E4M3ToFloat(scale_code) * global;
  uint32_t packed[2] = {0u, 0u};  // element i: byte i / 2, low nibble for even i
#pragma unroll
  for (int i = 0; i < kNvfp4GroupSize; ++i) {
    const uint32_t code = scale > 0 ? FloatToE2M1(v[i] / scale) : 0u;
    packed[i / 8] |= code << (4 * (i % 8));
  }
  *reinterpret_cast<uint2*>(codes + m * (cols / 2) + g * 8) = make_uint2(packed[0], packed[1]);
  tiled_scales[TiledScaleIndex(groups, m, g)] = scale_code;
}

// One thread per 32-column group: 32 floats in, 16 bytes of codes and one E8M0 byte out. A group
// holding NaN gets the NaN scale 0xFF: E2M1 has no NaN code to carry it.
__global__ void __launch_bounds__(kThreads)
    QuantizeMxfp4Kernel(const float* x, int rows, int cols, uint8_t* codes, uint8_t* tiled_scales) {
  const int groups = cols / static_cast<int>(kMxfp4GroupSize);
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<int64_t>(rows) * groups) return;
  const int64_t m = t / groups;
  const int g = static_cast<int>(t % groups);
  const float* xg = x + m * cols + g * kMxfp4GroupSize;
  float v[kMxfp4GroupSize];
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < kMxfp4GroupSize; ++i) {
    v[i] = xg[i];
    bits = max(bits, AbsBits(v[i]));
  }
  const int e = MxScaleExponent(__uint_as_float(bits));
  const float scale = ldexpf(1.f, e);
  uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < kMxfp4GroupSize; ++i) {
    const uint32_t code = scale > 0 ? FloatToE2M1(v[i] / scale) : 0u;
    packed[i / 8] |= code << (4 * (i % 8));
  }
  *reinterpret_cast<uint4*>(codes + m * (cols / 2) + g * 16) =
      make_uint4(packed[0], packed[1], packed[2], packed[3]);
  tiled_scales[TiledScaleIndex(groups, m, g)] =
      bits > 0x7f800000u ? 0xffu : static_cast<uint8_t>(e + 127);
}

__global__ void PrepareFp8ScalesKernel(MatrixRef w, Fp8ScaleLayout layout, float* out,
                                       int64_t count) {
  const int64_t kblocks = CeilDiv64(w.cols, kFp8BlockSize), ld = Fp8BlockScaleLd(w.cols);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t source = 0;  // kScalar
    if (layout == Fp8ScaleLayout::kPerRow) {
      source = QuantScaleIndex(w.quant.format, w.cols, i, 0);
    } else if (layout == Fp8ScaleLayout::kBlocks) {
      if (i % ld >= kblocks) {
        out[i] = 0.f;
        continue;
      }
      source = (i / ld) * kblocks + i % ld;
    }
    out[i] = LoadAsFloat(w.quant.scale, w.quant.scale_dtype, source);
  }
}

__global__ void TileFp4ScalesKernel(const uint8_t* scales, int64_t rows, int64_t groups,
                                    uint8_t* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[TiledScaleIndex(groups, i / groups, i % groups)] = scales[i];
}

__global__ void ScaleOutputKernel(float* y, int rows, int cols, const float* row_scale,
                                  const float* col_scale, const float* scalar, float factor) {
  if (scalar) factor *= *scalar;
  const int64_t n = static_cast<int64_t>(rows) * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = factor;
    if (row_scale) s *= row_scale[i / cols];
    if (col_scale) s *= col_scale[i % cols];
    y[i] *= s;
  }
}

}  // namespace

void QuantizeFp8PerTensor(const float* x, int rows, int cols, uint8_t* codes, float* scale,
                          uint32_t* amax_bits, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * cols;
  if (n <= 0) return;
  cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), stream);
  LaunchPlain(AmaxKernel, GridFor(n), kThreads, 0, stream, x, n, amax_bits);
  LaunchPlain(QuantizeFp8TensorKernel, GridFor(n), kThreads, 0, stream, x, n, amax_bits, codes,
              scale);
}

void QuantizeFp8RowGroups(const float* x, int rows, int cols, int group, uint8_t* codes,
                          float* scales, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0 || group <= 0) return;
  const dim3 grid(rows, CeilDiv(cols, group));
  LaunchPlain(QuantizeFp8RowGroupsKernel, grid, kGroupThreads, 0, stream, x, rows, cols, group,
              codes, scales);
}

void QuantizeNvfp4(const float* x, int rows, int cols, uint8_t* codes, uint8_t* tiled_scales,
                   float* global_scale, uint32_t* amax_bits, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * cols;
  if (n <= 0) return;
  const int64_t groups = cols / kNvfp4GroupSize;
  if (groups == 0) return;
  cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), stream);
  cudaMemsetAsync(tiled_scales, 0, TiledScaleCount(rows, groups), stream);
  LaunchPlain(AmaxKernel, GridFor(n), kThreads, 0, stream, x, n, amax_bits);
  LaunchPlain(QuantizeNvfp4Kernel, CeilDiv(rows * groups, kThreads), kThreads, 0, stream, x, rows,
              cols, amax_bits, codes, tiled_scales, global_scale);
}

void QuantizeMxfp4(const float* x, int rows, int cols, uint8_t* codes, uint8_t* tiled_scales,
                   cudaStream_t stream) {
  if (static_cast<int64_t>(rows) * cols <= 0) return;
  const int64_t groups = cols / kMxfp4GroupSize;
  if (groups == 0) return;
  cudaMemsetAsync(tiled_scales, 0, TiledScaleCount(rows, groups), stream);
  LaunchPlain(QuantizeMxfp4Kernel, CeilDiv(rows * groups, kThreads), kThreads, 0, stream, x, rows,
              cols, codes, tiled_scales);
}

void PrepareFp8WeightScales(const MatrixRef& w, Fp8ScaleLayout layout, float* out,
                            cudaStream_t stream) {
  const int64_t count = layout == Fp8ScaleLayout::kScalar   ? 1
                        : layout == Fp8ScaleLayout::kPerRow ? w.rows
                                                            : Fp8BlockScaleCount(w.rows, w.cols);
  LaunchPlain(PrepareFp8ScalesKernel, GridFor(count), kThreads, 0, stream, w, layout, out, count);
}

void TileFp4WeightScales(const MatrixRef& w, uint8_t* out, cudaStream_t stream) {
  const int64_t group = w.quant.format == QuantFormat::kNvfp4 ? kNvfp4GroupSize : kMxfp4GroupSize;
  const int64_t groups = w.cols / group;
  cudaMemsetAsync(out, 0, TiledScaleCount(w.rows, groups), stream);
  if (w.rows * groups <= 0) return;
  LaunchPlain(TileFp4ScalesKernel, GridFor(w.rows * groups), kThreads, 0, stream,
              static_cast<const uint8_t*>(w.quant.scale), w.rows, groups, out);
}

void ScaleOutput(float* y, int rows, int cols, const float* row_scale, const float* col_scale,
                 const float* scalar, float factor, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * cols;
  if (n <= 0) return;
  LaunchPlain(ScaleOutputKernel, GridFor(n), kThreads, 0, stream, y, rows, cols, row_scale,
              col_scale, scalar, factor);
}

}  // namespace infersweep::cuda
