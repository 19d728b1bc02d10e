// The TMA-streamed decode GEMV (gemm=tma): sm_90a only. Same arguments and function as Gemv.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/ops.h"

namespace infersweep::cuda {

bool GemvTmaSupports(int rows, int k);
void GemvTma(const GemvArgs& args, cudaStream_t stream);

}  // namespace infersweep::cuda
