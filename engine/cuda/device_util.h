// What every file of the CUDA engine uses: dying loudly on a sticky CUDA error, and device
// allocations that report exhaustion as a status.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "kernels/cuda/check.h"

namespace infersweep {

// TEST ONLY: INFERSWEEP_POISON_DEVICE_MEMORY=1 fills every device allocation, and the pinned host
// staging the step kernels read in place, with 0xFF bytes as it is made: NaN floats and bf16, -1
// ints, unmapped pointers. A fresh process's memory reads as zeros, which hides a read before the
// write (a zero index, a zero pointer skipped, a zero logit); memory that earlier models left
// behind does not. Poisoned, such a read shows in any process: a NaN verdict, or an illegal
// address at the kernel that made it. Read at each allocation, so a test can set it for the
// models it builds.
inline bool PoisonsDeviceMemory() {
  const char* v = std::getenv("INFERSWEEP_POISON_DEVICE_MEMORY");
  return v != nullptr && v[0] != '\0' && std::string_view(v) != "0";
}

// `count` elements of T (at least one) on the device; ResourceExhausted naming `what` (by default
// the bytes asked for) when cudaMalloc fails.
template <typename T>
absl::StatusOr<T*> DeviceAlloc(size_t count, std::string_view what = {}) {
  void* p = nullptr;
  if (count == 0) count = 1;
  const std::string label = what.empty()
                                ? absl::StrCat("cudaMalloc of ", count * sizeof(T), " bytes")
                                : std::string(what);
  if (absl::Status s = CudaStatus(cudaMalloc(&p, count * sizeof(T)), label.c_str()); !s.ok())
    return absl::ResourceExhaustedError(s.message());
  if (PoisonsDeviceMemory()) {
    if (absl::Status s = CudaStatus(cudaMemset(p, 0xFF, count * sizeof(T)), label.c_str());
        !s.ok()) {
      cudaFree(p);
      return s;
    }
  }
  return static_cast<T*>(p);
}

// A device allocation that frees itself: the runners own their buffers through it.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `count` elements (at least one), the previous allocation freed first; `what` names the
  // allocation in the error (DeviceAlloc).
  absl::Status Allocate(size_t count, std::string_view what = {}) {
    p_.reset();
    ASSIGN_OR_RETURN(T * p, DeviceAlloc<T>(count, what));
    p_.reset(p);
    return absl::OkStatus();
  }
  T* get() const { return p_.get(); }
  explicit operator bool() const { return p_ != nullptr; }
  void reset() { p_.reset(); }

 private:
  struct Free {
    void operator()(T* p) const { cudaFree(p); }
  };
  std::unique_ptr<T, Free> p_;
};

// Pinned host memory that frees itself, mapped into the device's address space (unified
// addressing): the step kernels read and write it in place.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  absl::Status Allocate(size_t count) {
    p_.reset();
    T* p = nullptr;
    const size_t bytes = std::max<size_t>(count, 1) * sizeof(T);
    RETURN_IF_CUDA_ERROR(cudaMallocHost(&p, bytes));
    if (PoisonsDeviceMemory()) std::memset(static_cast<void*>(p), 0xFF, bytes);  // as DeviceAlloc
    p_.reset(p);
    return absl::OkStatus();
  }
  T* get() const { return p_.get(); }
  void reset() { p_.reset(); }

 private:
  struct Free {
    void operator()(T* p) const { cudaFreeHost(p); }
  };
  std::unique_ptr<T, Free> p_;
};

// Allocates each (buffer, count) pair; 0 counts are skipped (the buffer left empty).
template <typename T>
absl::Status AllocateBuffers(std::initializer_list<std::pair<DeviceBuffer<T>*, size_t>> buffers) {
  for (auto [buffer, count] : buffers)
    if (count > 0) RETURN_IF_ERROR(buffer->Allocate(count));
  return absl::OkStatus();
}

// Device allocations of any element types, each kept until the owner goes: the weights and
// tables a model makes once, piece by piece, and never resizes.
class DeviceAllocations {
 public:
  template <typename T>
  absl::StatusOr<T*> Allocate(size_t count) {
    ASSIGN_OR_RETURN(T * p, DeviceAlloc<T>(count));
    owned_.emplace_back(p);
    return p;
  }

 private:
  struct Free {
    void operator()(void* p) const { cudaFree(p); }
  };
  std::vector<std::unique_ptr<void, Free>> owned_;
};

// Device memory carved at 256-byte boundaries from one allocation sized up front. cudaMalloc
// rounds every allocation up to its 2 MiB granule, so tensors of a few MiB allocated one by one
// waste up to half their size: a MoE layer's 3 MiB experts (qwen3-30b-a3b) would take 4 MiB
// each, 19 GB over the model.
class DeviceArena {
 public:
  static constexpr size_t kAlignment = 256;
  static size_t Aligned(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
  // One allocation of `bytes` (the sum of Aligned() of every Carve to come), owned by `owner`.
  absl::Status Reserve(DeviceAllocations& owner, size_t bytes) {
    ASSIGN_OR_RETURN(base_, owner.Allocate<uint8_t>(bytes > 0 ? bytes : 1));
    size_ = bytes;
    used_ = 0;
    return absl::OkStatus();
  }
  // The next `bytes`; Internal when the reservation is spent (the sizing pass missed a carve).
  absl::StatusOr<uint8_t*> Carve(size_t bytes) {
    const size_t take = Aligned(bytes);
    if (used_ + take > size_)
      return absl::InternalError(absl::StrCat("device arena: ", bytes, " bytes asked with ",
                                              size_ - used_, " of ", size_, " left"));
    uint8_t* p = base_ + used_;
    used_ += take;
    return p;
  }

 private:
  uint8_t* base_ = nullptr;
  size_t size_ = 0, used_ = 0;
};

}  // namespace infersweep
