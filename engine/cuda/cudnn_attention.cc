#include "engine/cuda/cudnn_attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"

namespace infersweep {
namespace {

// The real tensors' unique ids (bound in the variant pack); virtual ones count from kVirtual.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kSeqQ,
  kSeqKv,
  kScale,
  kNegativeInfinity,
  kVirtual = 100,
};

// The SDPA graph for `batch` sequences of `s_q` new tokens over caches of shape.capacity.
absl::StatusOr<cudnn::Plan> BuildPlan(const cudnn::Handle& handle,
                                      const CudnnAttention::Shape& shape, int batch, int s_q) {
  const int64_t b = batch, hq = shape.q_heads, hk = shape.kv_heads, d = shape.head_dim, sq = s_q,
                skv = shape.capacity;
  cudnn::GraphBuilder g(handle);
  int64_t next_virtual = kVirtual;
  auto real = [&](int64_t uid, cudnnDataType_t type, std::vector<int64_t> dims,
                  std::vector<int64_t> strides) {
    return g.Tensor({uid, type, std::move(dims), std::move(strides)});
  };
  auto scalar = [&](int64_t uid) {
    return g.Tensor({uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true});
  };
  auto virt = [&](cudnnDataType_t type, std::vector<int64_t> dims) {
    std::vector<int64_t> strides = cudnn::PackedStrides(dims);
    return g.Tensor({next_virtual++, type, std::move(dims), std::move(strides), true});
  };
  const std::vector<int64_t> scores = {b, hq, sq, skv}, per_row = {b, hq, sq, 1};
  // Q and O: [b][s_q][heads][d]; K^T and V: one layer's cache, [b][capacity][kv_heads][d].
  absl::StatusOr<int> q =
      real(kQ, CUDNN_DATA_BFLOAT16, {b, hq, sq, d}, {sq * hq * d, d, hq * d, 1});
  absl::StatusOr<int> kt =
      real(kK, CUDNN_DATA_BFLOAT16, {b, hk, d, skv}, {skv * hk * d, d, 1, hk * d});
  absl::StatusOr<int> v =
      real(kV, CUDNN_DATA_BFLOAT16, {b, hk, skv, d}, {skv * hk * d, d, hk * d, 1});
  absl::StatusOr<int> o =
      real(kO, CUDNN_DATA_BFLOAT16, {b, hq, sq, d}, {sq * hq * d, d, hq * d, 1});
  absl::StatusOr<int> seq_q = real(kSeqQ, CUDNN_DATA_INT32, {b, 1, 1, 1}, {1, 1, 1, 1});
  absl::StatusOr<int> seq_kv = real(kSeqKv, CUDNN_DATA_INT32, {b, 1, 1, 1}, {1, 1, 1, 1});
  absl::StatusOr<int> scale = scalar(kScale);
  absl::StatusOr<int> negative_infinity = scalar(kNegativeInfinity);
  for (const absl::StatusOr<int>* t :
       {&q, &kt, &v, &o, &seq_q, &seq_kv, &scale, &negative_infinity})
    if (!t->ok()) return t->status();

  // Each step's output is a new virtual tensor; `Step` chains them and stops at the first error.
  absl::Status status;
  auto tensor = [&](cudnnDataType_t type, const std::vector<int64_t>& dims) {
    if (!status.ok()) return -1;
    absl::StatusOr<int> t = virt(type, dims);
    if (!t.ok()) status = t.status();
    return t.ok() ? *t : -1;
  };
  auto pointwise = [&](cudnnPointwiseMode_t mode, cudnnDataType_t math, cudnnDataType_t out_type,
                       const std::vector<int64_t>& dims, int x, int in_b = -1, int in_t = -1,
                       int64_t axis = -1) {
    const int y = tensor(out_type, dims);
    if (status.ok()) status = g.Pointwise(mode, math, x, y, in_b, in_t, axis);
    return y;
  };
  const int s = tensor(CUDNN_DATA_FLOAT, scores);
  if (status.ok()) status = g.Matmul(*q, *kt, s, *seq_q, *seq_kv, -1, /*padded=*/true);
  int x = pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, scores, s, *scale);
  // Padding: rows past the sequence's s_q and columns past its KV length read -inf.
  {
    const int row = pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, CUDNN_DATA_INT32, scores,
                              x, -1, -1, 2);
    const int col = pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, CUDNN_DATA_INT32, scores,
                              x, -1, -1, 3);
    const int row_in = pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, CUDNN_DATA_BOOLEAN,
                                 scores, row, *seq_q);
    const int col_in = pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, CUDNN_DATA_BOOLEAN,
                                 scores, col, *seq_kv);
    const int keep = pointwise(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, CUDNN_DATA_BOOLEAN,
                               scores, row_in, col_in);
    x = pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, scores, x,
                  *negative_infinity, keep);
  }
  // Bottom-right causal: new token `row` sits at position KV length - s_q + row and sees the
  // columns up to it (row + s_kv - s_q >= col).
  {
    const int row = pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, CUDNN_DATA_INT32, scores,
                              x, -1, -1, 2);
    const int col = pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, CUDNN_DATA_INT32, scores,
                              x, -1, -1, 3);
    const int shifted = pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_INT32, CUDNN_DATA_INT32, scores,
                                  row, *seq_kv, -1, 3);
    const int diagonal = pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_INT32, CUDNN_DATA_INT32, scores,
                                   shifted, *seq_q, -1, 3);
    const int keep = pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, CUDNN_DATA_BOOLEAN,
                               scores, diagonal, col);
    x = pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, scores, x,
                  *negative_infinity, keep);
  }
  // Softmax: max, exp(x - max), its sum; the log-sum-exp statistics stay virtual.
  const int max = tensor(CUDNN_DATA_FLOAT, per_row);
  if (status.ok()) status = g.Reduction(CUDNN_REDUCE_TENSOR_MAX, x, max);
  const int centred =
      pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, scores, x, max);
  const int e = pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, scores, centred);
  const int sum = tensor(CUDNN_DATA_FLOAT, per_row);
  if (status.ok()) status = g.Reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const int log_sum =
      pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, per_row, sum);
  pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, per_row, max, log_sum);
  const int p =
      pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, CUDNN_DATA_BFLOAT16, scores, e, sum);
  if (status.ok()) status = g.Matmul(p, *v, *o, *seq_q, -1, *seq_kv);
  if (!status.ok())
    return absl::Status(status.code(), absl::StrCat("attention=cudnn graph: ", status.message()));
  return g.Build(absl::StrCat("attention=cudnn (batch ", b, ", s_q ", sq, ", s_kv ", skv,
                              ", heads ", hq, "/", hk, ", head_dim ", d, ", bf16)"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(const Shape& shape,
                                                                       cudaStream_t stream) {
  absl::StatusOr<const cudnn::Api*> api = cudnn::LoadApi(kCudnnAttentionMinVersion);
  if (!api.ok())
    return absl::Status(api.status().code(),
                        absl::StrCat("attention=cudnn: ", api.status().message()));
  ASSIGN_OR_RETURN(std::unique_ptr<cudnn::Handle> handle, cudnn::Handle::Create(*api, stream));
  std::unique_ptr<CudnnAttention> attention(new CudnnAttention(shape, stream, std::move(handle)));
  RETURN_IF_ERROR(attention->Prepare(1, 1));
  return attention;
}

CudnnAttention::~CudnnAttention() = default;

absl::StatusOr<const cudnn::Plan*> CudnnAttention::PlanFor(int batch, int s_q) {
  auto it = plans_.find({batch, s_q});
  if (it != plans_.end()) return &it->second;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream_, &capturing);
  if (capturing != cudaStreamCaptureStatusNone)
    return absl::InternalError(absl::StrCat("attention=cudnn: no plan for batch ", batch, ", s_q ",
                                            s_q, " before the graph capture"));
  ASSIGN_OR_RETURN(cudnn::Plan plan, BuildPlan(*handle_, shape_, batch, s_q));
  RETURN_IF_ERROR(workspace_.Reserve(plan));
  return &plans_.emplace(std::make_pair(batch, s_q), std::move(plan)).first->second;
}

absl::Status CudnnAttention::Prepare(int batch, int s_q) { return PlanFor(batch, s_q).status(); }

absl::Status CudnnAttention::Run(const uint16_t* q, const void* k_cache, const void* v_cache,
                                 const int32_t* seq_q, const int32_t* seq_kv, int batch, int s_q,
                                 uint16_t* out) {
  ASSIGN_OR_RETURN(const cudnn::Plan* plan, PlanFor(batch, s_q));
  float scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
  float negative_infinity = -std::numeric_limits<float>::infinity();
  const std::vector<int64_t> uids = {kQ, kK, kV, kO, kSeqQ, kSeqKv, kScale, kNegativeInfinity};
  const std::vector<void*> pointers = {const_cast<uint16_t*>(q),
                                       const_cast<void*>(k_cache),
                                       const_cast<void*>(v_cache),
                                       out,
                                       const_cast<int32_t*>(seq_q),
                                       const_cast<int32_t*>(seq_kv),
                                       &scale,
                                       &negative_infinity};
  RecordLaunch("cudnn:sdpa fprop (bf16)");
  return cudnn::Execute(*handle_, *plan, uids, pointers, workspace_.data());
}

}  // namespace infersweep
