// The CUDA kernels' shape limits as host-only constexpr predicates: the kernels are built to
// them, and the engine's plans (engine/plan/) read them to decide what runs, in every build,
// CUDA or not (no CUDA header here).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/quant/format.h"

namespace infersweep::cuda {

// ---- Attention (attention_flash.cu, attention_decode.cu, attention_prefill.cu).
// The CUDA-core kernel's accumulators are head_dim / 32 floats a lane, its shared memory 82 KB at
// head_dim 256 (opted into above the 48 KB default).
constexpr int kFlashMaxHeadDim = 256;
constexpr int kFlashMaxGroup = 16;  // q heads per kv head
constexpr int kMaxFlashSplits = 64;
constexpr int kFlashBlockTarget = 1056;  // 8 blocks per SM: each walks its keys serially
// Prefill chunks of kFlashPrefillMinTokens+ tokens take the tensor-core prefill kernel.
constexpr int kFlashPrefillMinTokens = 16;

constexpr bool FlashSupports(int q_heads, int kv_heads, int head_dim) {
  return kv_heads > 0 && head_dim <= kFlashMaxHeadDim && head_dim % 8 == 0 &&
         q_heads % kv_heads == 0 && q_heads / kv_heads <= kFlashMaxGroup;
}
// The tensor-core split-KV decode kernel.
constexpr bool FlashDecodeMmaSupports(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}
// The tensor-core prefill kernel.
constexpr bool FlashPrefillSupports(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}
// Floats the flash kernels' partials need for `rows` rows (any split count FlashSplits picks).
constexpr int64_t FlashPartialFloats(int rows, int q_heads, int kv_heads, int head_dim) {
  return (static_cast<int64_t>(rows) + kFlashBlockTarget / kv_heads + 1) * q_heads * (head_dim + 2);
}

// ---- Fused GEMV (gemm_fused.cu): rows * k floats of staged input in shared memory.
constexpr int kGemvMaxRows = 4;
constexpr int kGemvMaxSharedBytes = 64 * 1024;
constexpr bool GemvSupports(int rows, int k) {
  return rows >= 1 && rows <= kGemvMaxRows && k % 8 == 0 &&
         static_cast<int64_t>(rows) * k * static_cast<int64_t>(sizeof(float)) <=
             kGemvMaxSharedBytes;
}

// ---- Quantized dense linears (quant.cu, gemm_fused_quant.cu, moe_fused_mma.cu): the shape
// half of each kernel's Supports (the other half is the codes' and scales' alignment).
// qgemm=w4a16's GEMV: FP4 codes, 32 a 16-byte load.
constexpr int kW4A16Chunk = 32;
constexpr bool W4A16ShapeSupports(QuantFormat f, int64_t cols) {
  return IsFp4(f) && cols % kW4A16Chunk == 0;
}
// The quantized GEMV (w8a16, and w4a16 with a norm fused): a 16-byte load of codes per lane
// step, up to 4 rows of the padded input staged in 200 KB of shared memory.
constexpr int kQuantGemvMaxSharedBytes = 200 * 1024;
constexpr int QuantGemvPaddedFloats(int64_t k) { return static_cast<int>(k + 4 * ((k + 31) >> 5)); }
constexpr bool QuantGemvShapeSupports(QuantFormat f, int64_t rows, int64_t cols) {
  if (f == QuantFormat::kNone || rows <= 0 || cols <= 0 || rows > (int64_t{1} << 30)) return false;
  return cols % (IsFp4(f) ? 32 : 16) == 0 &&
         QuantGemvPaddedFloats(cols) * int64_t{4} <= kQuantGemvMaxSharedBytes;
}
// The quantized mma.sync GEMM (GemmQuantMma): FP8 tensor / channel, NVFP4 or MXFP4, K in whole
// 64 (FP8) or 128 (FP4) element tiles; FP4 dense linears take it from kQuantMmaMinRows rows.
constexpr int kQuantMmaMinRows = 8;
constexpr bool QuantMmaShapeSupports(QuantFormat f, int64_t rows, int64_t cols) {
  if (f != QuantFormat::kFp8Tensor && f != QuantFormat::kFp8Channel && !IsFp4(f)) return false;
  return rows >= 1 && cols % (IsFp4(f) ? 128 : 64) == 0;
}

// ---- graphs=persistent (sm90a/decode_persistent.cu). Where a format's scales run along K (FP4's
// groups, fp8 block-128's blocks), each row's scales stream behind its codes, in rows padded to
// 16 bytes (the bulk copies' granule): nvfp4 one E4M3 byte per 16 weights, mxfp4 one E8M0 byte
// per 32, fp8 block-128 one fp32 per 128 (its blocks expanded to a row each at model build).
constexpr bool PersistentStreamsGroupScales(QuantFormat f) {
  return IsFp4(f) || f == QuantFormat::kFp8Block128;
}
// The weights one streamed group scale covers (1 where none stream).
constexpr int PersistentGroupWeights(QuantFormat f) {
  return f == QuantFormat::kNvfp4         ? static_cast<int>(kNvfp4GroupSize)
         : f == QuantFormat::kMxfp4       ? static_cast<int>(kMxfp4GroupSize)
         : f == QuantFormat::kFp8Block128 ? static_cast<int>(kFp8BlockSize)
                                          : 1;
}
// Bytes of the streamed group scales of a row of `cols` weights (0 where none stream).
template <typename Int>
constexpr Int PersistentGroupRowBytes(QuantFormat f, Int cols) {
  if (!PersistentStreamsGroupScales(f)) return 0;
  const Int weights = PersistentGroupWeights(f), bytes = f == QuantFormat::kFp8Block128 ? 4 : 1;
  return ((cols + weights - 1) / weights * bytes + 15) / 16 * 16;
}

// ---- MoE (moe_fused.cu, moe_fused_mma.cu).
constexpr int kMoeMaxSharedBytes = 200 * 1024;  // the per-pair kernels' staged x
constexpr int kMoeMaxExperts = 1024;
constexpr int kMoeMaxTopK = 32;
// The expert-grouped tensor-core kernels take batches of this many rows and more.
constexpr int kMoeGroupedMinRows = 4;
// moe=fused|wgmma's per-pair kernels: their shapes.
constexpr bool MoeDeviceRoutingSupports(int num_experts, int top_k, int hidden, int inter) {
  return num_experts <= kMoeMaxExperts && top_k <= kMoeMaxTopK && hidden % 8 == 0 &&
         inter % 8 == 0 && int64_t{4} * hidden <= kMoeMaxSharedBytes;
}
// The bf16 expert-grouped MMA kernels.
constexpr bool MoeGroupedSupports(int num_experts, int hidden, int inter) {
  return num_experts >= 1 && num_experts <= kMoeMaxExperts && hidden % 32 == 0 && inter % 32 == 0;
}
// One quantized expert matrix as the grouped quantized kernels see it.
struct QuantMatrixShape {
  QuantFormat format = QuantFormat::kNone;
  int64_t rows = 0, cols = 0;
};
// The quantized expert-grouped MMA kernels: gate and up [inter, hidden], down [hidden, inter],
// one format they decode, rows of whole 16-byte lane loads.
constexpr bool MoeGroupedQuantSupports(const QuantMatrixShape& gate, const QuantMatrixShape& up,
                                       const QuantMatrixShape& down) {
  const QuantFormat f = gate.format;
  if (f != up.format || f != down.format) return false;
  if (f != QuantFormat::kFp8Tensor && f != QuantFormat::kFp8Channel && f != QuantFormat::kNvfp4 &&
      f != QuantFormat::kMxfp4)
    return false;
  const int unit = (f == QuantFormat::kNvfp4 || f == QuantFormat::kMxfp4) ? 128 : 64;
  return gate.cols % unit == 0 && down.cols % unit == 0 && gate.rows == up.rows &&
         gate.cols == up.cols && down.rows == gate.cols && down.cols == gate.rows &&
         gate.cols % 8 == 0 && down.cols % 8 == 0;
}

// moe=wgmma's sm_90a expert GEMMs (sm90a/moe_wgmma.cu): 128 weight rows a block, 64-element K
// chunks (one 128-byte row a stage).
constexpr int kMoeWgmmaRowsPerTile = 128;
constexpr int kMoeWgmmaChunk = 64;
constexpr bool MoeWgmmaSupports(int hidden, int inter) {
  return hidden >= kMoeWgmmaRowsPerTile && hidden % kMoeWgmmaRowsPerTile == 0 &&
         inter >= kMoeWgmmaChunk && inter % kMoeWgmmaChunk == 0;
}
// Quantized experts on wgmma: one format of FP8 tensor / channel, NVFP4 or MXFP4 (whose scale
// rows, K / 32 bytes, are read 4 bytes at a time: inter % 128).
constexpr bool MoeWgmmaQuantSupports(const QuantMatrixShape& gate, const QuantMatrixShape& up,
                                     const QuantMatrixShape& down, int hidden, int inter) {
  const QuantFormat f = gate.format;
  if (up.format != f || down.format != f || !MoeWgmmaSupports(hidden, inter)) return false;
  if (f == QuantFormat::kMxfp4) return inter % 128 == 0;
  return f == QuantFormat::kFp8Tensor || f == QuantFormat::kFp8Channel || f == QuantFormat::kNvfp4;
}
// qgemm=w8a8's experts on wgmma (kFp8Wgmma): FP8 tensor / channel codes and E4M3 inputs straight
// into wgmma k32, 128 of them (one 128-byte row) a K chunk: hidden and inter whole chunks.
constexpr int kMoeWgmmaFp8Chunk = 128;
constexpr bool MoeWgmmaFp8Supports(const QuantMatrixShape& gate, const QuantMatrixShape& up,
                                   const QuantMatrixShape& down, int hidden, int inter) {
  const QuantFormat f = gate.format;
  return up.format == f && down.format == f &&
         (f == QuantFormat::kFp8Tensor || f == QuantFormat::kFp8Channel) &&
         MoeWgmmaSupports(hidden, inter) && hidden % kMoeWgmmaFp8Chunk == 0 &&
         inter % kMoeWgmmaFp8Chunk == 0;
}
// qgemm=w8a8's dense linears on the same tiles (GemmFp8Wgmma): FP8 tensor / channel codes,
// features in whole 128-row tiles and K in whole chunks.
constexpr bool Fp8WgmmaShapeSupports(QuantFormat f, int64_t rows, int64_t cols) {
  return (f == QuantFormat::kFp8Tensor || f == QuantFormat::kFp8Channel) && rows > 0 &&
         rows % kMoeWgmmaRowsPerTile == 0 && cols > 0 && cols % kMoeWgmmaFp8Chunk == 0;
}
// The grouped kernels' variants, chosen by the MoE plan (engine/plan/moe_plan.h): mma.sync over
// 32 (x4) or 64 (x8) pairs a pass, or wgmma; bf16 experts or quantized ones decoded in registers;
// or FP8 experts' E4M3 codes straight onto E4M3 x E4M3 mma.sync, or wgmma, with E4M3 inputs
// (qgemm=w8a8).
enum class MoeGroupedKernel {
  kMma4,
  kMma8,
  kWgmma,
  kQuantMma4,
  kQuantMma8,
  kQuantWgmma,
  kFp8Mma4,
  kFp8Mma8,
  kFp8Wgmma
};
// E4M3 x E4M3 mma.sync (m16n8k32) needs sm_89.
constexpr int kFp8MmaMinSm = 89;
// qgemm=w8a8's tensor-core kernels: FP8 tensor or channel scales with K in whole 64-element
// units, or block-128 scales with K in whole 128-element blocks (each block's products are summed
// apart, then scaled).
constexpr bool Fp8MmaShapeSupports(QuantFormat f, int64_t rows, int64_t cols) {
  if (rows < 1 || cols < 1) return false;
  if (f == QuantFormat::kFp8Block128) return cols % 128 == 0;
  return (f == QuantFormat::kFp8Tensor || f == QuantFormat::kFp8Channel) && cols % 64 == 0;
}
// qgemm=w8a8's grouped expert kernels (kFp8Mma4 / kFp8Mma8): gate and up [inter, hidden] and
// down [hidden, inter] in one FP8 format that Fp8MmaShapeSupports takes.
constexpr bool MoeGroupedFp8Supports(const QuantMatrixShape& gate, const QuantMatrixShape& up,
                                     const QuantMatrixShape& down) {
  return gate.format == up.format && gate.format == down.format && gate.rows == up.rows &&
         gate.cols == up.cols && down.rows == gate.cols && down.cols == gate.rows &&
         Fp8MmaShapeSupports(gate.format, gate.rows, gate.cols) &&
         Fp8MmaShapeSupports(down.format, down.rows, down.cols);
}
// More pairs an expert than this (on average) take the 64-pair mma.sync passes.
constexpr int kMoeWidePairsPerExpert = 24;
// The grouped variant for `pairs` routed (row, expert) pairs over `experts`: wgmma when chosen,
// else the 64-pair mma.sync passes when the experts are wide, the 32-pair ones when not.
constexpr MoeGroupedKernel MoeGroupedKernelFor(bool quantized, bool wgmma, int pairs, int experts) {
  const bool wide = pairs > kMoeWidePairsPerExpert * experts;
  if (quantized)
    return wgmma  ? MoeGroupedKernel::kQuantWgmma
           : wide ? MoeGroupedKernel::kQuantMma8
                  : MoeGroupedKernel::kQuantMma4;
  return wgmma  ? MoeGroupedKernel::kWgmma
         : wide ? MoeGroupedKernel::kMma8
                : MoeGroupedKernel::kMma4;
}

// ---- Gated DeltaNet (gated_delta.cu): a state column held in 8 lanes' registers.
constexpr int kGatedDeltaLanesPerColumn = 8;
constexpr int kGatedDeltaMaxRowsPerLane = 32;  // key head dim <= 256
constexpr bool GatedDeltaFusedSupports(int key_dim) {
  return key_dim % kGatedDeltaLanesPerColumn == 0 &&
         key_dim <= kGatedDeltaLanesPerColumn * kGatedDeltaMaxRowsPerLane;
}
// The decode kernel (GatedDeltaDecode): a block holds a whole value head's [dk, dv] state, 8 lanes
// a column and dk / 8 rows a lane, so the gated RMSNorm over the head's dv outputs is a block
// reduction: dk <= 128 keeps a lane's slice at 16 registers, dv <= 128 the block at 1024 threads.
constexpr int kGatedDeltaDecodeMaxRowsPerLane = 16;
constexpr int kGatedDeltaDecodeMaxColumns = 128;
constexpr bool GatedDeltaDecodeSupports(int key_dim, int value_dim) {
  return key_dim % kGatedDeltaLanesPerColumn == 0 &&
         key_dim <= kGatedDeltaLanesPerColumn * kGatedDeltaDecodeMaxRowsPerLane && value_dim > 0 &&
         value_dim <= kGatedDeltaDecodeMaxColumns;
}
constexpr int kCausalConvMaxTaps = 8;
// The chunked form (gated_delta_chunked.cu): chunks of 32 tokens, a warp's lanes; head sizes in
// whole 16-row MMA tiles up to 128, which keeps its two passes' shared memory under 80 KB.
// Sequences of kGatedDeltaChunkedMinTokens+ rows take it, shorter ones the recurrent kernel.
constexpr int kGatedDeltaChunk = 32;
constexpr int kGatedDeltaChunkedMaxHeadDim = 128;
constexpr int kGatedDeltaChunkedMinTokens = 16;
constexpr bool GatedDeltaChunkedSupports(int key_dim, int value_dim) {
  return key_dim > 0 && value_dim > 0 && key_dim % 16 == 0 && value_dim % 16 == 0 &&
         key_dim <= kGatedDeltaChunkedMaxHeadDim && value_dim <= kGatedDeltaChunkedMaxHeadDim;
}
constexpr int64_t GatedDeltaChunkedScratchFloats(int64_t rows, int value_heads, int key_dim,
                                                 int value_dim) {
  return rows * value_heads * (2 * int64_t{key_dim} + value_dim + 1);
}

}  // namespace infersweep::cuda
