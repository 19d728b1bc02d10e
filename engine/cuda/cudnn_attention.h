// attention=cudnn: cuDNN's fused flash attention (SDPA), built through its graph API
// (engine/cuda/cudnn_graph.h) as the graph cuDNN's fused-attention engines recognise:
//   S = Q . K^T (rows and columns bounded by each sequence's lengths, padding reads 0)
//   S = S * 1/sqrt(d); padding mask; bottom-right causal mask; P = softmax(S) (bf16); O = P . V
// on the engine's own KV cache, read in place: a layer's cache is [batch][capacity][kv_heads][d]
// bf16, which is the graph's K and V with strides, so nothing is copied or repacked. GQA: K/V
// have kv_heads heads and Q q_heads (a multiple), which cuDNN broadcasts. Q and O are bf16
// [batch][s_q][q_heads][d]. Each sequence's lengths come from device int32 tensors (s_q, and
// its KV length = position + s_q), so one plan serves every decode step of a batch and its
// graph replays. A plan is kept per (batch, s_q).
//
// Napkin math, qwen3-30b-a3b decode at batch 64, 4k context: K and V reads 64 x 4096 x 2 x 512
// x 2 B = 537 MB a layer, 0.12 ms at 4.4 TB/s; the fused kernel's FLOPs (4 x 64 x 32 x 4096 x
// 128 = 4.3 GFLOP) are far below the tensor rate, so it is bandwidth-bound like attention=flash.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/cudnn_graph.h"

namespace infersweep {

// The oldest cuDNN whose fused attention takes the graph below (padding + bottom-right causal
// masks with device sequence lengths, GQA, s_q = 1).
constexpr size_t kCudnnAttentionMinVersion = 90500;

class CudnnAttention {
 public:
  struct Shape {
    int q_heads = 0, kv_heads = 0, head_dim = 0;
    int capacity = 0;  // tokens a sequence's KV cache holds (the graph's s_kv)
  };
  // Unimplemented with cuDNN's words when cuDNN is missing, too old, or takes no plan for a
  // batch-1 decode step of `shape` on this GPU.
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(const Shape& shape,
                                                                cudaStream_t stream);
  ~CudnnAttention();

  // Builds the plan of `batch` sequences of `s_q` new tokens (and grows the workspace) now,
  // outside any graph capture.
  absl::Status Prepare(int batch, int s_q);

  // out[batch, s_q, q_heads, d] = attention of q (same layout) over one layer's K and V caches,
  // each sequence's lengths in seq_q[batch] and seq_kv[batch] (device int32).
  absl::Status Run(const uint16_t* q, const void* k_cache, const void* v_cache,
                   const int32_t* seq_q, const int32_t* seq_kv, int batch, int s_q,
                   uint16_t* out);

 private:
  CudnnAttention(const Shape& shape, cudaStream_t stream,
                 std::unique_ptr<cudnn::Handle> handle)
      : shape_(shape), stream_(stream), handle_(std::move(handle)) {}
  absl::StatusOr<const cudnn::Plan*> PlanFor(int batch, int s_q);

  const Shape shape_;
  cudaStream_t stream_;
  std::unique_ptr<cudnn::Handle> handle_;
  std::map<std::pair<int, int>, cudnn::Plan> plans_;
  cudnn::Workspace workspace_;
};

}  // namespace infersweep
