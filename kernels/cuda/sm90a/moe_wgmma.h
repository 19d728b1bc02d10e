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

}  // namespace infersweep::cuda
