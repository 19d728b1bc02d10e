// Readable names of CUDA kernels for the launch log (core/launch_log.h): the name the runtime
// knows the kernel by (cudaFuncGetName), demangled and shortened (SymbolKernelName), so that
// template variants stay distinct ("GemvKernel<2, 1>"). Looked up once per kernel and cached;
// only launches made while something records ask for it.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include "core/launch_log.h"

namespace infersweep::cuda {

// The name of the device entry function `function` (a kernel's host-side address, as passed to
// a launch); "kernel@<address>" when the runtime cannot name it.
inline const std::string& KernelName(const void* function) {
  static std::mutex mutex;
  static std::map<const void*, std::string> names;  // nodes are stable: references stay valid
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = names.find(function); it != names.end()) return it->second;
  std::string name;
  const char* raw = nullptr;
  const cudaError_t pending = cudaPeekAtLastError();
  if (cudaFuncGetName(&raw, function) == cudaSuccess && raw != nullptr) {
    name = SymbolKernelName(raw);
  } else {
    // Not a launch error: leave nothing behind for the caller's launch check to find (an error
    // already pending stays).
    if (pending == cudaSuccess) cudaGetLastError();
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "kernel@%p", function);
    name = buffer;
  }
  return names.emplace(function, std::move(name)).first->second;
}

// Records one launch of `kernel` when something records (core/launch_log.h).
template <typename Kernel>
inline void RecordKernelLaunch(Kernel* kernel) {
  if (LaunchRecording()) RecordLaunch(KernelName(reinterpret_cast<const void*>(kernel)));
}

}  // namespace infersweep::cuda
