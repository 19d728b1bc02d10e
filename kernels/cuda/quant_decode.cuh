// In-register dequantization shared by the quantized GEMV (gemm_fused_quant.cu) and the quantized
// MoE expert kernels (moe_fused_quant.cu). A lane reads its weights 16 bytes at a time (one
// "chunk": 32 FP4 codes or 16 FP8 codes) and dots them with activations staged in shared memory.
//
// Exactness: every decoded weight is the exact value of its code (E2M1 via fp16 bit patterns,
// E4M3 via the sm_89+ cvt to f16x2, both exact), and the scales of DequantizeElement
// (core/quant/dequantize.h) multiply partial sums instead of single weights: per group of 16
// (nvfp4) or 32 (mxfp4) or per chunk (fp8 block-128), and per row at the end (nvfp4's scale_2,
// fp8 tensor and channel scales). That is the same real number as the reference's sum of
// x * w; only the fp32 rounding of the sums differs, so results match the exact-dequant
// reference to a few ulps of sum |x * w|, not bit for bit. It keeps the work per weight at one
// decode step plus one fp32 FMA: at batch 1 an H200 streams ~8 T FP4 weights a second, and
// a multiply per weight more would make these kernels ALU-bound.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/quant/codecs.h"
#include "core/tensor_ref.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/quant.h"

namespace infersweep::cuda {

// Weights per 16-byte chunk of codes.
template <QuantFormat F>
constexpr int ChunkElements() {
  return IsFp4(F) ? 32 : 16;
}

// Staged activations are padded with 4 floats after every 32, so that the 32 lanes of a warp,
// each reading its own chunk's activations with 16-byte loads (lanes 128 or 64 bytes apart),
// hit distinct banks: without it 8 lanes of a quarter-warp land on the same 4 banks.
__host__ __device__ constexpr int PaddedIndex(int e) { return e + 4 * (e >> 5); }
__host__ __device__ constexpr int PaddedFloats(int k) { return QuantGemvPaddedFloats(k); }

// The raw scale bits of one chunk, loaded with the codes (before the PDL wait) and decoded once
// the loads are in flight: nvfp4 two E4M3 bytes, mxfp4 one E8M0 byte, fp8 block-128 the
// block's scale (f32 / bf16 / f16 bits); fp8 tensor and channel have none per chunk.
template <QuantFormat F>
__device__ __forceinline__ uint32_t LoadChunkScaleBits(const void* scales, DType scale_dtype,
                                                       int64_t row, int64_t chunk, int64_t k) {
  if constexpr (F == QuantFormat::kNvfp4) {  // groups 2c and 2c + 1: one aligned 16-bit load
    return __ldg(static_cast<const uint16_t*>(scales) + (row * (k / 16) + 2 * chunk) / 2);
  } else if constexpr (F == QuantFormat::kMxfp4) {
    return __ldg(static_cast<const uint8_t*>(scales) + row * (k / 32) + chunk);
  } else if constexpr (F == QuantFormat::kFp8Block128) {
    const int64_t i = (row / kFp8BlockSize) * CeilDiv64(k, kFp8BlockSize) + chunk / 8;
    if (scale_dtype == DType::kF32)
      return __float_as_uint(__ldg(static_cast<const float*>(scales) + i));
    return __ldg(static_cast<const uint16_t*>(scales) + i);
  } else {
    return 0;
  }
}

// A chunk's scales as floats: lo for its first 16 weights, hi for the next 16 (nvfp4); one
// scale for the chunk otherwise (fp8 tensor / channel: 1, applied per row).
struct ChunkScale {
  float lo = 1.f, hi = 1.f;
};

template <QuantFormat F>
__device__ __forceinline__ ChunkScale DecodeChunkScale(uint32_t bits, DType scale_dtype) {
  ChunkScale s;
  if constexpr (F == QuantFormat::kNvfp4) {
    s.lo = E4M3ToFloat(static_cast<uint8_t>(bits & 0xffu));
    s.hi = E4M3ToFloat(static_cast<uint8_t>(bits >> 8));
  } else if constexpr (F == QuantFormat::kMxfp4) {
    s.lo = s.hi = E8M0ToFloat(static_cast<uint8_t>(bits));
  } else if constexpr (F == QuantFormat::kFp8Block128) {
    s.lo = s.hi = scale_dtype == DType::kF32    ? __uint_as_float(bits)
                  : scale_dtype == DType::kBF16 ? Bf16ToFloat(static_cast<uint16_t>(bits))
                                                : F16ToFloat(static_cast<uint16_t>(bits));
  }
  return s;
}

// What multiplies a whole row's sum: nvfp4 scale_2 (and the 2^14 of the fp16 decode), mxfp4 the
// 2^14, fp8 tensor / channel their scale; fp8 block-128 has it all per chunk. Loaded as bits
// early (a weight, readable before the PDL wait) and decoded at the end, so that the load's
// latency hides under the row's work.
template <QuantFormat F>
__device__ __forceinline__ uint32_t LoadRowFactorBits(const MatrixRef& w, int64_t row) {
  if constexpr (F == QuantFormat::kNvfp4) {
    return __float_as_uint(__ldg(static_cast<const float*>(w.quant.global_scale)));
  } else if constexpr (F == QuantFormat::kFp8Tensor || F == QuantFormat::kFp8Channel) {
    const int64_t i = F == QuantFormat::kFp8Tensor ? 0 : row;
    if (w.quant.scale_dtype == DType::kF32)
      return __float_as_uint(__ldg(static_cast<const float*>(w.quant.scale) + i));
    return __ldg(static_cast<const uint16_t*>(w.quant.scale) + i);
  } else {
    return 0;
  }
}

template <QuantFormat F>
__device__ __forceinline__ float DecodeRowFactor(uint32_t bits, DType scale_dtype) {
  if constexpr (F == QuantFormat::kNvfp4) {
    return __uint_as_float(bits) * kE2M1F16Scale;
  } else if constexpr (F == QuantFormat::kMxfp4) {
    return kE2M1F16Scale;
  } else if constexpr (F == QuantFormat::kFp8Tensor || F == QuantFormat::kFp8Channel) {
    return scale_dtype == DType::kF32    ? __uint_as_float(bits)
           : scale_dtype == DType::kBF16 ? Bf16ToFloat(static_cast<uint16_t>(bits))
                                         : F16ToFloat(static_cast<uint16_t>(bits));
  } else {
    return 1.f;
  }
}

__device__ __forceinline__ float2 HalfBitsToFloat2(uint32_t bits) {
  __half2 h;
  memcpy(&h, &bits, sizeof h);
  return __half22float2(h);
}

// Two E4M3 codes (bits [0, 8) and [8, 16) of `codes`; higher bits ignored) as exact floats: the
// sm_89+ cvt to f16x2, NaN included.
__device__ __forceinline__ float2 E4M3PairToFloat2(uint32_t codes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xffffu), __NV_E4M3);
  return HalfBitsToFloat2(static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16));
}

// acc[m] += scales * sum over the chunk's weights w[i] * x[m * x_stride + i] for m < rows, where
// x points at the chunk's first activation (a chunk never straddles a padding gap: 32 and 16
// divide 32). One decode serves every row.
template <QuantFormat F, int kRows>
__device__ __forceinline__ void ChunkDot(const uint4& codes, const ChunkScale& scale,
                                         const float* x, int x_stride, int rows, float* acc) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  if constexpr (IsFp4(F)) {
    float part[kRows][2] = {};  // nvfp4: per group of 16 (words 0-1, 2-3)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 w[4];  // w[s] = elements 8i + s (.x) and 8i + s + 4 (.y), times 2^-14
#pragma unroll
      for (int s = 0; s < 4; ++s) w[s] = HalfBitsToFloat2(E2M1PairToF16x2Bits(words[i] >> (4 * s)));
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m >= rows) break;
        const float4 a = *reinterpret_cast<const float4*>(x + m * x_stride + 8 * i);
        const float4 b = *reinterpret_cast<const float4*>(x + m * x_stride + 8 * i + 4);
        float p = part[m][i / 2];
        p += w[0].x * a.x + w[1].x * a.y + w[2].x * a.z + w[3].x * a.w;
        p += w[0].y * b.x + w[1].y * b.y + w[2].y * b.z + w[3].y * b.w;
        part[m][i / 2] = p;
      }
    }
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      if (m >= rows) break;
      if constexpr (F == QuantFormat::kNvfp4)
        acc[m] += part[m][0] * scale.lo + part[m][1] * scale.hi;
      else
        acc[m] += (part[m][0] + part[m][1]) * scale.lo;
    }
  } else {
    float part[kRows] = {};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // word i: elements 4i .. 4i + 3, one per byte
      const float2 w01 = E4M3PairToFloat2(words[i]), w23 = E4M3PairToFloat2(words[i] >> 16);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m >= rows) break;
        const float4 a = *reinterpret_cast<const float4*>(x + m * x_stride + 4 * i);
        part[m] += w01.x * a.x + w01.y * a.y + w23.x * a.z + w23.y * a.w;
      }
    }
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      if (m >= rows) break;
      if constexpr (F == QuantFormat::kFp8Block128)
        acc[m] += part[m] * scale.lo;
      else
        acc[m] += part[m];
    }
  }
}

// Stages rows x k floats of x (times the norm gain when there is one) into padded shared memory
// (16-byte loads, all in flight), computes each row's RMSNorm factor 1/rms(x) into inv (1
// without a norm), and writes the normalised input to normed_out (the same rows) from the
// blocks with blockIdx.x == 0 when asked. Ends with a barrier. k % 4 == 0.
template <int kMaxRows>
__device__ __forceinline__ void StagePaddedInput(const float* x, int rows, int k,
                                                 const void* norm_gain, DType norm_dtype,
                                                 float norm_eps, float* normed_out, float* xs,
                                                 float* scratch, float* inv) {
  const int quads = rows * (k / 4), ld = PaddedFloats(k);
#pragma unroll 4
  for (int q = threadIdx.x; q < quads; q += blockDim.x) {
    const int r = q / (k / 4), i = (q % (k / 4)) * 4;
    float4 v = __ldg(reinterpret_cast<const float4*>(x + static_cast<int64_t>(r) * k + i));
    if (norm_gain) {
      v.x *= LoadAsFloat(norm_gain, norm_dtype, i);
      v.y *= LoadAsFloat(norm_gain, norm_dtype, i + 1);
      v.z *= LoadAsFloat(norm_gain, norm_dtype, i + 2);
      v.w *= LoadAsFloat(norm_gain, norm_dtype, i + 3);
    }
    *reinterpret_cast<float4*>(xs + r * ld + PaddedIndex(i)) = v;
  }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) inv[r] = 1.f;
  if (norm_gain) {  // the sum of squares of x itself (re-read: L1-hot)
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= rows) break;
      float sum_sq = 0.f;
      const float4* x4 = reinterpret_cast<const float4*>(x + static_cast<int64_t>(r) * k);
#pragma unroll 4
      for (int q = threadIdx.x; q < k / 4; q += blockDim.x) {
        const float4 v = __ldg(x4 + q);
        sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
      inv[r] = rsqrtf(BlockSum(sum_sq, scratch) / k + norm_eps);  // BlockSum has barriers
    }
  }
  __syncthreads();
  if (normed_out && blockIdx.x == 0) {
    for (int r = 0; r < rows; ++r)
      for (int i = threadIdx.x; i < k; i += blockDim.x)
        normed_out[static_cast<int64_t>(r) * k + i] = xs[r * ld + PaddedIndex(i)] * inv[r];
  }
}

// The tensor-core expert kernels' decode (moe_fused_mma.cu's mma.sync tiles, sm90a/moe_wgmma.cu's
// shared-memory tiles, quant.cu's bf16 copies): 8 codes at a time into 8 exact bf16 weights.

// a * b on two bf16 lanes, rounded once (fma with -0, which leaves every product as it is;
// sm_80+). bf16 keeps fp32's exponent range, and these products are exact in it.
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// What multiplies an FP4 unit's runs, as bf16x2 with both lanes alike: `lo` for runs 0 and 1,
// `hi` for runs 2 and 3. NVFP4: the two E4M3 group scales (bits [0, 8) and [8, 16)) times
// 2^118, exact (E4M3's 4 significant bits; 2^-9 .. 448 times 2^118 stays below bf16's largest
// power, 2^127), NaN kept; the decoded weights come out times 2^-8 (QuantRowFactor gives it back
// per row, as for FP8). MXFP4: the E8M0 scale 2^(c - 127) itself (c = 0 is bf16's subnormal
// 2^-127, 255 NaN). FP8: unused.
struct RunScales {
  uint32_t lo = 0, hi = 0;
};
template <QuantFormat F>
__device__ __forceinline__ RunScales RunScalesOf(uint32_t scale_bits) {
  RunScales r;
  if constexpr (F == QuantFormat::kNvfp4) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(scale_bits & 0xffffu), __NV_E4M3);
    const float2 f =
        HalfBitsToFloat2(static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16));
    const uint32_t both = PackBf16x2(f.x * 0x1p118f, f.y * 0x1p118f);
    r.lo = __byte_perm(both, 0, 0x1010);
    r.hi = __byte_perm(both, 0, 0x3232);
  } else if constexpr (F == QuantFormat::kMxfp4) {
    const uint32_t c = scale_bits & 0xffu;
    const uint32_t bits = c == 0 ? 0x0040u : c == 0xff ? 0x7fc0u : c << 7;
    r.lo = r.hi = bits * 0x10001u;
  }
  return r;
}

// Run s (0 <= s < 2 for FP8, < 4 for FP4) of 16 bytes of codes as 8 bf16 weights, element i in half
// i of the result.
// FP8: bytes 0 and 2 (then 1 and 3) of a word straight to bf16 bit patterns by shifts: the E4M3
// sign to bit 15 (31), exponent and mantissa to bits [4, 11) ([20, 27)), bf16's four lowest
// exponent bits and its first three mantissa bits: the value times 2^-120 exactly, E4M3's
// subnormals on bf16's (the NaN code is not a weight a checkpoint holds). One bf16x2 multiply by
// 2^112 makes it the value times 2^-8 (QuantRowFactor gives the 2^8 back), and byte permutes
// put the bytes back in order. 9 instructions for 4 weights, no conversion.
// FP4: word s's 8 codes straight to bf16 bit patterns, two at a time: codes p and p + 4 (bits
// [4p, 4p + 4) and [16 + 4p, 20 + 4p)) take one shift for their signs (to bits 15 and 31) and one
// for their exponent and mantissa (to bits [6, 9) and [22, 25), bf16's two lowest exponent bits
// and its first mantissa bit). That is the code's value times 2^-126 exactly: E2M1's subnormal
// 0.5 lands on bf16's subnormal 2^-127, which bf16 arithmetic keeps. One bf16x2 multiply by the
// run's scale (RunScalesOf; MXFP4 first times 2^126) gives the weights, and byte permutes put
// the pairs (p, p + 4) back in element order. About 5 instructions for 2 weights, no conversion.
template <QuantFormat F>
__device__ __forceinline__ uint4 DecodeRun(const uint4& codes, const RunScales& scales, int s) {
  if constexpr (IsFp4(F)) {
    const uint32_t word = s == 0 ? codes.x : s == 1 ? codes.y : s == 2 ? codes.z : codes.w;
    const uint32_t scale = s < 2 ? scales.lo : scales.hi;
    constexpr uint32_t kMagnitude = 0x01c001c0u, kSign = 0x80008000u;
    uint32_t v[4] = {((word << 6) & kMagnitude) | ((word << 12) & kSign),
                     ((word << 2) & kMagnitude) | ((word << 8) & kSign),
                     ((word >> 2) & kMagnitude) | ((word << 4) & kSign),
                     ((word >> 6) & kMagnitude) | (word & kSign)};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if constexpr (F == QuantFormat::kMxfp4) v[p] = MulBf16x2(v[p], 0x7e807e80u);  // 2^126
      v[p] = MulBf16x2(v[p], scale);
    }
    return make_uint4(__byte_perm(v[0], v[1], 0x5410), __byte_perm(v[2], v[3], 0x5410),
                      __byte_perm(v[0], v[1], 0x7632), __byte_perm(v[2], v[3], 0x7632));
  } else {
    constexpr uint32_t kMagnitude = 0x07f007f0u, kSign = 0x80008000u;
    constexpr uint32_t kTwo112 = 0x77807780u;  // bf16 2^112, both lanes
    uint32_t out[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // word h of the run: elements 4h .. 4h + 3, one per byte
      const uint32_t w = h == 0 ? (s == 0 ? codes.x : codes.z) : (s == 0 ? codes.y : codes.w);
      const uint32_t even = MulBf16x2(((w << 4) & kMagnitude) | ((w << 8) & kSign), kTwo112);
      const uint32_t odd = MulBf16x2(((w >> 4) & kMagnitude) | (w & kSign), kTwo112);
      out[2 * h] = __byte_perm(even, odd, 0x5410);      // bytes 0, 1
      out[2 * h + 1] = __byte_perm(even, odd, 0x7632);  // bytes 2, 3
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// Expert e's codes, scales and global scale (the one matrix when the table has no codes table).
__device__ __forceinline__ const void* TableCodes(const QuantExpertTable& t, int e) {
  return t.codes ? t.codes[e] : t.matrix_codes;
}
__device__ __forceinline__ const void* TableScales(const QuantExpertTable& t, int e) {
  return t.codes ? t.scales[e] : t.matrix_scales;
}
__device__ __forceinline__ const void* TableGlobalScale(const QuantExpertTable& t, int e) {
  return t.codes ? t.global_scales[e] : t.matrix_global_scale;
}

// What multiplies row `row` of expert e's sums (DecodeRun's weights): FP8 its tensor or channel
// scale times 2^8, NVFP4 its scale_2 times 2^8, MXFP4 1.
template <QuantFormat F>
__device__ __forceinline__ float QuantRowFactor(const QuantExpertTable& t, int e, int64_t row) {
  if constexpr (F == QuantFormat::kNvfp4) {
    return __ldg(static_cast<const float*>(TableGlobalScale(t, e))) * 256.f;
  } else if constexpr (F == QuantFormat::kMxfp4) {
    return 1.f;
  } else {
    const int64_t i = F == QuantFormat::kFp8Tensor ? 0 : row;
    const void* s = TableScales(t, e);
    const float scale = t.scale_dtype == DType::kF32 ? __ldg(static_cast<const float*>(s) + i)
                        : t.scale_dtype == DType::kBF16
                            ? Bf16ToFloat(__ldg(static_cast<const uint16_t*>(s) + i))
                            : F16ToFloat(__ldg(static_cast<const uint16_t*>(s) + i));
    return scale * 256.f;
  }
}

}  // namespace infersweep::cuda
