#include "kernels/cuda/probe_kernels.h"
#include "kernels/cuda/sm100a/test_kernel.h"

namespace infersweep::cuda {
namespace {

__global__ void Sm100aTestKernel(int* out) { *out = 100; }

}  // namespace

cudaError_t LaunchSm100aTestKernel(int* out, cudaStream_t stream) {
  Sm100aTestKernel<<<1, 1, 0, stream>>>(out);
  return cudaGetLastError();
}

ProbeKernel Sm100aTestProbeKernel() {
  return {"Sm100aTestKernel", reinterpret_cast<const void*>(Sm100aTestKernel)};
}

}  // namespace infersweep::cuda
