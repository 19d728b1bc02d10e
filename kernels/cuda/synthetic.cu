#include "core/synthetic.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

// Same arithmetic as GenerateSyntheticBf16 on the CPU: the multiply and the add are each
// rounded (no fma contraction), then round-to-nearest-even to bf16.
__global__ void SyntheticKernel(uint64_t stream_key, float scale, float offset, int64_t n,
                                uint16_t* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u = SyntheticUniform(stream_key, static_cast<uint64_t>(i));
    out[i] = FloatToBf16(__fadd_rn(__fmul_rn(scale, u), offset));
  }
}

}  // namespace

void GenerateSyntheticBf16(uint64_t stream_key, float scale, float offset, int64_t n,
                           uint16_t* out, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(CeilDiv(n, 256), 132 * 32));
  LaunchPlain(SyntheticKernel, blocks, 256, 0, stream, stream_key, scale, offset, n, out);
}

}  // namespace infersweep::cuda
