// CUDA launchers for quantized weights (docs/QUANTIZATION.md). Plain functions, asynchronous on
// `stream`; callers check cudaGetLastError. A quantized weight is a MatrixRef whose `data`
// (codes) and `quant` scale pointers are device pointers, laid out exactly as on disk:
//   nvfp4: codes u8 [N, K/2] (low nibble = even k), scales E4M3 [N, K/16], scale_2 fp32 [1]
//   mxfp4: codes u8 [N, K/32, 16] (= [N, K/2]), scales E8M0 [N, K/32]
//   fp8_*: codes E4M3 [N, K], scales fp32/bf16: [1] | [N] | [ceil(N/128), ceil(K/128)]
// Napkin math is for an H200 (4.46 TB/s read, measured) at Qwen3-30B-A3B expert shapes:
// gate/up [768, 2048] and down [2048, 768], 1.57M weights each.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor_ref.h"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {

// ---- dequantization (qgemm=dequant_bf16 at upload; qgemm=reference; tests)
// out[n, k] = the exact fp32 weight (core/quant/dequantize.h, the CPU's formula), rounded to
// bf16 (nearest even) for the bf16 variant. Eight elements a thread (cols % 8 == 0), grid-stride;
// the bf16 copy of FP8 tensor/channel, NVFP4 and MXFP4 matrices with 16-byte code rows decodes
// a 16-byte chunk of codes a thread instead (the same bits).
// Expert [768, 2048] nvfp4 -> bf16: reads 0.88 MB, writes 3.1 MB: ~0.9 us of bandwidth (+ launch).
void DequantizeToBf16(const MatrixRef& w, uint16_t* out, cudaStream_t stream);
void DequantizeToF32(const MatrixRef& w, float* out, cudaStream_t stream);
// `count` matrices of one shape [rows, cols] in one launch, matrix i into out + i * rows * cols
// (bf16); `matrices` is a device array. A layer's 384 experts for a quantized prefill chunk:
// 384 launches of DequantizeToBf16 cost more in launch overhead than in bandwidth.
void DequantizeManyToBf16(const MatrixRef* matrices, int count, int64_t rows, int64_t cols,
                          uint16_t* out, cudaStream_t stream);

// ---- w4a16 GEMV (qgemm=w4a16): y[m, n] = sum_k x[m, k] * w[n, k] for m < rows, w nvfp4 or
// mxfp4, fp32 accumulate. Dequantizes in registers: one warp per output row n, each lane loads
// 16 bytes (32 codes) per step with one vector load, plus that chunk's scales (2 E4M3 bytes for
// nvfp4, 1 E8M0 byte for mxfp4) into registers; the decoded chunk is reused for up to 4 rows of
// x (more rows: another pass over w in grid.y). Sums are formed per group and scaled once per
// group, so results match the exact-dequant reference to fp32 rounding, not bit for bit.
//
// Napkin math, nvfp4, batch 1 (rows = 1):
//   [768, 2048]: codes 786,432 B + scales 98,304 B = 0.88 MB; 3.1 MFLOP (2NK).
//     DRAM time 0.88 MB / 4.46 TB/s = 0.20 us; 192 blocks of 4 warps, each lane 2 chunks.
//     At this size launch latency (~2-3 us) dominates: expect ~3 us alone, ~0.3-0.5 us of
//     bandwidth when experts are launched back to back or captured in a graph.
//   [2048, 768]: the same 0.88 MB and 3.1 MFLOP; 24 chunks per row, so 24 of 32 lanes work.
//   A decode step of one MoE layer (8 experts x gate/up/down) reads 21 MB: ~4.8 us at roofline
//   vs 75 MB / 17 us for the same experts in bf16 (3.55x fewer bytes).
//   mxfp4: codes 786,432 B + scales 49,152 B = 0.84 MB (0.19 us).
// ptxas (sm_90): 72-86 registers, no spills, so 128-thread blocks keep several resident per SM.
// Needs cols % 32 == 0 and 16-byte aligned codes (W4A16Supports); x is [rows, cols] row-major
// fp32 or bf16, y is [rows, w.rows] fp32 (overwritten).
bool W4A16Supports(const MatrixRef& w);
void GemvW4A16(const float* x, int rows, const MatrixRef& w, float* y, cudaStream_t stream);
void GemvW4A16Bf16(const uint16_t* x, int rows, const MatrixRef& w, float* y, cudaStream_t stream);

// ---- fused quantized GEMV (gemm=fused with qgemm=w4a16 / w8a16; gemm_fused_quant.cu):
// gemm_fused.cu's GemvArgs contract (up to kGemvMaxSegments segments, optional RMSNorm of x, bias,
// residual add, scale) with quantized weights: segment s reads weights.w[s] (its rows are seg[s].n;
// GemvSegment::w is unused). Every segment has the same format, nvfp4, mxfp4 or any fp8 layout.
// Dequantized in registers, fp32 activations and accumulate (quant_decode.cuh: matches the
// exact-dequant reference to fp32 rounding of the sums). Any rows (4 per block, grid.y over the
// rest). Napkin math for qwen3-30b-a3b in gemm_fused_quant.cu: q+k+v nvfp4 5.9 MB -> 1.3 us at 4.46
// TB/s.
struct QuantGemvWeights {
  MatrixRef w[kGemvMaxSegments];
};
// cols % 32 (FP4) or % 16 (FP8), 16-byte aligned codes, one padded row of x in shared memory.
bool QuantGemvSupports(const MatrixRef& w);
void GemvQuant(const GemvArgs& args, const QuantGemvWeights& weights, cudaStream_t stream);

// ---- w8a16 GEMV (qgemm=w8a16): y[m, n] = sum_k x[m, k] * w[n, k], w any fp8 layout, x fp32
// [rows, K], y fp32 [rows, N] (overwritten); GemvQuant with one segment.
// Napkin math: an FP8 expert [768, 2048] is 1.57 MB (+ 6 KB of channel or 0.4 KB of block
// scales): 0.35 us at 4.46 TB/s; [2048, 768] the same. 3.1 MFLOP each.
void GemvW8A16(const float* x, int rows, const MatrixRef& w, float* y, cudaStream_t stream);

// ---- quantized experts for moe=fused (moe_fused_quant.cu): the twins of MoeGateUp /
// MoeDownCombine (ops.h) reading each expert's codes and scales through device pointer tables. One
// projection's experts: codes[e], scales[e] and (nvfp4) global_scales[e] are device pointers (the
// tables themselves live on the device); every expert is [rows, cols] in one format with one scale
// dtype. With codes null the table is one dense matrix, whose parts are the matrix_ pointers
// (GemmQuantMma).
struct QuantExpertTable {
  const void* const* codes = nullptr;
  const void* const* scales = nullptr;
  const void* const* global_scales = nullptr;  // nvfp4 scale_2 (fp32 [1]); null otherwise
  const void* matrix_codes = nullptr;
  const void* matrix_scales = nullptr;
  const void* matrix_global_scale = nullptr;
  QuantFormat format = QuantFormat::kNone;
  DType scale_dtype = DType::kF32;
  int rows = 0;
  int cols = 0;
};
// A table's format and shape, as the shape limits (kernels/cuda/limits.h) read them.
inline QuantMatrixShape ShapeOf(const QuantExpertTable& t) { return {t.format, t.rows, t.cols}; }
inline bool MoeGroupedQuantSupports(const QuantExpertTable& gate, const QuantExpertTable& up,
                                    const QuantExpertTable& down) {
  return MoeGroupedQuantSupports(ShapeOf(gate), ShapeOf(up), ShapeOf(down));
}
inline bool MoeWgmmaQuantSupports(const QuantExpertTable& gate, const QuantExpertTable& up,
                                  const QuantExpertTable& down, int hidden, int inter) {
  return MoeWgmmaQuantSupports(ShapeOf(gate), ShapeOf(up), ShapeOf(down), hidden, inter);
}
// The table of one quantized matrix (no per-expert tables: the matrix_* fields).
inline QuantExpertTable MatrixQuantTable(const MatrixRef& w) {
  QuantExpertTable t;
  t.matrix_codes = w.data;
  t.matrix_scales = w.quant.scale;
  t.matrix_global_scale = w.quant.global_scale;
  t.format = w.quant.format;
  t.scale_dtype = w.quant.scale_dtype;
  t.rows = static_cast<int>(w.rows);
  t.cols = static_cast<int>(w.cols);
  return t;
}
// The format is quantized, cols % 32 (FP4) or % 16 (FP8), and `slots` rows of staged
// activations ([slots, cols] floats, padded) fit in shared memory.
bool MoeQuantSupports(const QuantExpertTable& t, int slots);
// h[p] = silu(Wg[e] . x[p / k]) * (Wu[e] . x[p / k]) for pairs p < rows * k, e = expert_ids[p];
// gate and up [inter, hidden]; h[p] = 0 for a pair of an expert outside [expert_begin,
// expert_end), whose table entries are not read (ops.h's MoeGateUp). grid (ceil(inter / 16),
// pairs), 8 warps of 2 outputs each.
// Batch-1 decode of qwen3-30b-a3b: 8 pairs x 2 x 0.88 MB = 14 MB nvfp4 -> 3.2 us (fp8 25 MB ->
// 5.6 us; bf16 50 MB -> 11 us).
void MoeGateUpQuant(const float* x, int rows, int k, const int* expert_ids, int expert_begin,
                    int expert_end, const QuantExpertTable& gate, const QuantExpertTable& up,
                    float* h, cudaStream_t stream);
// y[r] += sum_slot weights[r, slot] * Wd[e] . h[r, slot] in a fixed order (deterministic), into
// the residual stream; Wd [hidden, inter]; pairs whose expert is `skip_expert` (TEST ONLY
// zero-expert fault; -1 in production) or outside [expert_begin, expert_end) are left out. Each
// block stages its row's k slots of h in shared memory (k * inter * 4 bytes, padded: 27 KB for
// qwen3-30b-a3b).
// Batch 1, qwen3-30b-a3b: 8 x 0.88 MB = 7 MB nvfp4 -> 1.6 us (fp8 12.6 MB -> 2.8 us).
void MoeDownCombineQuant(const float* h, int rows, int k, const int* expert_ids,
                         const float* weights, int skip_expert, int expert_begin, int expert_end,
                         const QuantExpertTable& down, float* y, cudaStream_t stream);

}  // namespace infersweep::cuda
