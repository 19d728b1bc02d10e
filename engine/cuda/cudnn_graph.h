// cuDNN's graph (backend) API, reached through the cuDNN that engine/cudnn_loader.h dlopens:
// binaries never link cuDNN. A graph is tensors (real ones the caller binds to device memory
// by unique id, virtual ones that live inside the fused kernel, by-value scalars) and operations
// (matmul, pointwise, reduction) over them; cuDNN's heuristics offer engine configs for the
// whole graph and the first whose execution plan finalizes runs it. Every failure carries
// cuDNN's own words (cudnnGetLastErrorString) and the step that failed.
#pragma once

#include <cudnn_graph.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/device_util.h"

namespace infersweep::cudnn {

// The entry points this file uses, from the process's cuDNN (ProcessCudnn). Unimplemented,
// naming the library and the version found, when cuDNN is missing or older than `min_version`.
struct Api;
absl::StatusOr<const Api*> LoadApi(size_t min_version);

// One backend descriptor, destroyed with its owner.
class Descriptor {
 public:
  Descriptor() = default;
  Descriptor(const Api* api, cudnnBackendDescriptor_t raw) : api_(api), raw_(raw) {}
  Descriptor(Descriptor&& other) noexcept { *this = std::move(other); }
  Descriptor& operator=(Descriptor&& other) noexcept;
  ~Descriptor();
  cudnnBackendDescriptor_t raw() const { return raw_; }

 private:
  const Api* api_ = nullptr;
  cudnnBackendDescriptor_t raw_ = nullptr;
};

// A cuDNN handle bound to one stream.
class Handle {
 public:
  static absl::StatusOr<std::unique_ptr<Handle>> Create(const Api* api, cudaStream_t stream);
  ~Handle();
  cudnnHandle_t raw() const { return raw_; }
  const Api* api() const { return api_; }
  absl::Status SetStream(cudaStream_t stream) const;

 private:
  Handle(const Api* api, cudnnHandle_t raw) : api_(api), raw_(raw) {}
  const Api* api_;
  cudnnHandle_t raw_;
};

struct TensorSpec {
  int64_t uid = 0;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  std::vector<int64_t> dims, strides;
  bool is_virtual = false;
  bool by_value = false;  // a host scalar, passed in the variant pack by address
  cudnnBackendTensorReordering_t reordering = CUDNN_TENSOR_REORDERING_NONE;  // F8_128x4: block
                                                                           // scales' tiles
};

// Strides of a packed row-major tensor of `dims`.
std::vector<int64_t> PackedStrides(const std::vector<int64_t>& dims);

// A finalized execution plan and the workspace it needs.
struct Plan {
  std::shared_ptr<Descriptor> plan;
  int64_t workspace_bytes = 0;
  std::string engine;  // how the plan was found ("engine config 0 of 3")
};

// Builds one operation graph, finalizes it and picks its execution plan.
class GraphBuilder {
 public:
  explicit GraphBuilder(const Handle& handle) : handle_(handle), api_(handle.api()) {}

  // A tensor; its uid must be unique in the graph. Returns its index for the operations.
  absl::StatusOr<int> Tensor(const TensorSpec& spec);
  // C = A . B over the last two dims (batched over the others, broadcast where 1), fp32 math.
  // Optional overrides: device int32 tensors [b,1,1,1] of the rows / columns / depth each batch
  // really has (-1: none); `padding` sets what the rows and columns past them read as.
  absl::Status Matmul(int a, int b, int c, int m_override = -1, int n_override = -1,
                      int k_override = -1, bool padded = false);
  // y = mode(x[, b[, t]]) elementwise, `math` the arithmetic's type; `axis` for GEN_INDEX.
  absl::Status Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, int x, int y, int b = -1,
                         int t = -1, int64_t axis = -1);
  // y = reduce(x) over the dims where y has size 1, fp32 math.
  absl::Status Reduction(cudnnReduceTensorOp_t op, int x, int y);
  // y = x dequantized by `scale`, one scale a block of `block` elements (per dim), fp32 math.
  absl::Status BlockScaleDequantize(int x, int scale, int y, const std::vector<int32_t>& block);

  // Finalizes the graph and the first engine config that heuristics mode A offers whose plan
  // finalizes. Unimplemented with cuDNN's words when none does (what the graph asks is not
  // supported here: arch, shapes, types), naming `what`.
  absl::StatusOr<Plan> Build(const std::string& what);

 private:
  absl::Status Check(cudnnStatus_t status, const char* step) const;
  absl::StatusOr<Descriptor> Make(cudnnBackendDescriptorType_t type, const char* step) const;

  const Handle& handle_;
  const Api* api_;
  std::vector<Descriptor> tensors_, operations_, helpers_;
};

// Device scratch that plans share, grown (never shrunk) to the largest plan's need.
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  absl::Status Reserve(const Plan& plan);
  void* data() const { return data_.get(); }

 private:
  DeviceBuffer<char> data_;
  int64_t bytes_ = 0;
};

// Runs `plan` on the handle's stream with the device (or, for by-value tensors, host) pointers
// bound by uid. Capturable when the engine is.
absl::Status Execute(const Handle& handle, const Plan& plan, const std::vector<int64_t>& uids,
                     const std::vector<void*>& pointers, void* workspace);

}  // namespace infersweep::cudnn
