// The expert GEMMs of the grouped MoE on Hopper warpgroup MMAs (moe=wgmma): sm_90a only.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"

namespace infersweep::cuda {

// The shapes the kernels take (no ragged edges): MoeWgmmaSupports and MoeWgmmaQuantSupports in
// kernels/cuda/limits.h.
// MoeGrouped's expert step after BucketPairs (offsets and sorted pairs written): args.h gets
// silu(gate) * up in bf16 in bucketed order ([offsets[e] + i, inter]), args.out every pair's down
// projection in fp32 at its pair index ([row * k + slot, hidden]), as MoeGrouped's combine reads.
// Quantized experts (args.quant): FP8 tensor / channel, NVFP4 or MXFP4 codes, one format for the
// three tables, decoded to bf16 in shared memory each K chunk; or, with args.kernel kFp8Wgmma
// (qgemm=w8a8), FP8 tensor / channel codes straight into E4M3 wgmma beside E4M3 inputs (args.x_f32
// and then h quantized a row at a time into args.x_fp8 / h_fp8, scales x_scale / h_scale).
void MoeWgmmaExperts(const MoeGroupedArgs& args, cudaStream_t stream);

// qgemm=w8a8's dense linears on sm_90a (Fp8WgmmaShapeSupports in kernels/cuda/limits.h, codes
// 16-byte aligned): y [rows, w.rows] = x [rows, w.cols] . W^T, x quantized to E4M3 a row at a time
// into x_codes [rows, w.cols] / x_scales [rows], then the experts' E4M3 wgmma tiles over the one
// matrix: a block 128 features by 128 rows, K in 128-byte chunks through the cp.async ring.
// Napkin math, qwen3-30b-a3b's q_proj [4096, 2048] over a 2048-token prefill chunk: 34 GFLOP at
// an H200's ~990 dense FP8 TFLOP/s is 35 us; 8 MB of codes re-read by 16 row tiles is 134 MB of
// L2 traffic, under the tensor time; 32 x 16 = 512 blocks, two an SM.
void GemmFp8Wgmma(const float* x, int rows, const MatrixRef& w, uint8_t* x_codes, float* x_scales,
                  float* y, cudaStream_t stream);

}  // namespace infersweep::cuda
