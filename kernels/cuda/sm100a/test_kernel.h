// TEST ONLY: a kernel built for sm_100a alone (test_kernel=sm100a), so every other GPU lacks its
// image. It exercises the capability probe's refusal of a missing kernel image and, past the
// probe, the launch error a missing image gives.
#pragma once

#include <cuda_runtime.h>

namespace infersweep::cuda {

// Writes 100 to *out on an sm_100a GPU; elsewhere returns the launch's error
// (cudaErrorNoKernelImageForDevice) and writes nothing.
cudaError_t LaunchSm100aTestKernel(int* out, cudaStream_t stream);

}  // namespace infersweep::cuda
