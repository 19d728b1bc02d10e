#include "engine/cuda/cudnn_matmul.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "engine/cuda/device_util.h"
#include "kernels/cuda/scaled_quant.h"

namespace infersweep {
namespace {

enum Uid : int64_t { kA = 1, kB, kAScale, kBScale, kY, kVirtual = 100 };

// Y[m, n] = (A[m, k] . B[k, n]) * a_scale[m] * b_scale[n], A and B E4M3, fp32 math and out.
absl::StatusOr<cudnn::Plan> BuildFp8Plan(const cudnn::Handle& handle, int m, int n, int k) {
  cudnn::GraphBuilder g(handle);
  const int64_t M = m, N = n, K = k;
  std::vector<absl::StatusOr<int>> t;
  t.push_back(g.Tensor({kA, CUDNN_DATA_FP8_E4M3, {1, M, K}, {M * K, K, 1}}));
  t.push_back(g.Tensor({kB, CUDNN_DATA_FP8_E4M3, {1, K, N}, {N * K, 1, K}}));
  t.push_back(g.Tensor({kAScale, CUDNN_DATA_FLOAT, {1, M, 1}, {M, 1, 1}}));
  t.push_back(g.Tensor({kBScale, CUDNN_DATA_FLOAT, {1, 1, N}, {N, N, 1}}));
  t.push_back(g.Tensor({kY, CUDNN_DATA_FLOAT, {1, M, N}, {M * N, N, 1}}));
  t.push_back(g.Tensor({kVirtual, CUDNN_DATA_FLOAT, {1, M, N}, {M * N, N, 1}, true}));
  t.push_back(g.Tensor({kVirtual + 1, CUDNN_DATA_FLOAT, {1, M, N}, {M * N, N, 1}, true}));
  for (const absl::StatusOr<int>& x : t)
    if (!x.ok()) return x.status();
  const int a = *t[0], b = *t[1], a_scale = *t[2], b_scale = *t[3], y = *t[4], c = *t[5],
            c_scaled = *t[6];
  absl::Status s = g.Matmul(a, b, c);
  if (s.ok()) s = g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, c, c_scaled, a_scale);
  if (s.ok()) s = g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, c_scaled, y, b_scale);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("qgemm=cudnn graph: ", s.message()));
  return g.Build(absl::StrCat("qgemm=cudnn (FP8 E4M3 x E4M3, M ", m, ", N ", n, ", K ", k, ")"));
}

// The block-scaled FP4 graph for an [n, k] weight and 128 rows (one tile of cuDNN's scale
// layout): E2M1 codes, one E4M3 (nvfp4, 16 wide) or E8M0 (mxfp4, 32 wide) scale a block.
absl::StatusOr<cudnn::Plan> BuildFp4Plan(const cudnn::Handle& handle, QuantFormat format, int n,
                                         int k) {
  const bool nvfp4 = format == QuantFormat::kNvfp4;
  const int64_t block = nvfp4 ? 16 : 32, M = 128, K = k, N = (n + 127) / 128 * 128;
  const int64_t blocks_k = (K / block + 3) / 4 * 4;
  const cudnnDataType_t scale_type = nvfp4 ? CUDNN_DATA_FP8_E4M3 : CUDNN_DATA_FP8_E8M0;
  cudnn::GraphBuilder g(handle);
  std::vector<absl::StatusOr<int>> t;
  t.push_back(g.Tensor({kA, CUDNN_DATA_FP4_E2M1, {1, M, K}, {M * K, K, 1}}));
  t.push_back(g.Tensor({kB, CUDNN_DATA_FP4_E2M1, {1, K, N}, {N * K, 1, K}}));
  cudnn::TensorSpec a_scale{kAScale, scale_type, {1, M, blocks_k}, {M * blocks_k, blocks_k, 1}};
  a_scale.reordering = CUDNN_TENSOR_REORDERING_F8_128x4;
  cudnn::TensorSpec b_scale{kBScale, scale_type, {1, blocks_k, N}, {N * blocks_k, 1, blocks_k}};
  b_scale.reordering = CUDNN_TENSOR_REORDERING_F8_128x4;
  t.push_back(g.Tensor(a_scale));
  t.push_back(g.Tensor(b_scale));
  t.push_back(g.Tensor({kY, CUDNN_DATA_FLOAT, {1, M, N}, {M * N, N, 1}}));
  t.push_back(g.Tensor({kVirtual, CUDNN_DATA_FLOAT, {1, M, K}, {M * K, K, 1}, true}));
  t.push_back(g.Tensor({kVirtual + 1, CUDNN_DATA_FLOAT, {1, K, N}, {N * K, 1, K}, true}));
  for (const absl::StatusOr<int>& x : t)
    if (!x.ok()) return x.status();
  absl::Status s = g.BlockScaleDequantize(*t[0], *t[2], *t[5], {1, static_cast<int32_t>(block)});
  if (s.ok()) s = g.BlockScaleDequantize(*t[1], *t[3], *t[6], {static_cast<int32_t>(block), 1});
  if (s.ok()) s = g.Matmul(*t[5], *t[6], *t[4]);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("qgemm=cudnn graph: ", s.message()));
  return g.Build(absl::StrCat("qgemm=cudnn (", QuantFormatName(format), " block-scaled, M ", M,
                              ", N ", N, ", K ", K, ")"));
}

// The FP4 answer: cuDNN's refusal, or (where it offers a plan) the part not built here.
absl::Status Fp4Answer(const cudnn::Handle& handle, QuantFormat format, int n, int k) {
  ASSIGN_OR_RETURN(cudnn::Plan plan, BuildFp4Plan(handle, format, n, k));
  return absl::UnimplementedError(
      absl::StrCat("qgemm=cudnn: cuDNN offers a block-scaled ", QuantFormatName(format),
                   " plan here (", plan.engine,
                   "), but running it (FP4 activations quantized into cuDNN's F8_128x4 scale "
                   "tiles) is not built"));
}

absl::Status Fp8Layout(const MatrixRef& w) {
  if (w.quant.format == QuantFormat::kFp8Block128 && w.cols > 128)
    return absl::UnimplementedError(
        absl::StrCat("qgemm=cudnn takes fp8_tensor and fp8_channel weights (one scale a row): "
                     "fp8_block128's 128 x 128 blocks along K = ",
                     w.cols, " have no graph here"));
  if (w.cols % 16 != 0 || w.rows % 4 != 0)
    return absl::UnimplementedError(absl::StrCat(
        "qgemm=cudnn needs K % 16 == 0 and N % 4 == 0 (16-byte rows): ", w.rows, " x ", w.cols));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudnnQuantGemm>> CudnnQuantGemm::Create() {
  absl::StatusOr<const cudnn::Api*> api = cudnn::LoadApi(kCudnnMatmulMinVersion);
  if (!api.ok())
    return absl::Status(api.status().code(), absl::StrCat("qgemm=cudnn: ", api.status().message()));
  ASSIGN_OR_RETURN(std::unique_ptr<cudnn::Handle> handle, cudnn::Handle::Create(*api, nullptr));
  return std::unique_ptr<CudnnQuantGemm>(new CudnnQuantGemm(std::move(handle)));
}

absl::Status CudnnQuantGemm::Prepare(const MatrixRef& w) {
  if (IsFp4(w.quant.format))
    return Fp4Answer(*handle_, w.quant.format, static_cast<int>(w.rows), static_cast<int>(w.cols));
  RETURN_IF_ERROR(Fp8Layout(w));
  if (weights_.count(w.data)) return absl::OkStatus();
  DeviceBuffer<float> scales;
  RETURN_IF_ERROR(scales.Allocate(w.rows));
  cuda::PrepareFp8WeightScales(w, cuda::Fp8ScaleLayout::kPerRow, scales.get(), nullptr);
  weights_[w.data] = {static_cast<int>(w.rows), static_cast<int>(w.cols), std::move(scales)};
  return PlanFor(1, static_cast<int>(w.rows), static_cast<int>(w.cols)).status();
}

absl::StatusOr<const cudnn::Plan*> CudnnQuantGemm::PlanFor(int m, int n, int k) {
  auto it = plans_.find({m, n, k});
  if (it != plans_.end()) return &it->second;
  ASSIGN_OR_RETURN(cudnn::Plan plan, BuildFp8Plan(*handle_, m, n, k));
  RETURN_IF_ERROR(workspace_.Reserve(plan));
  return &plans_.emplace(std::make_tuple(m, n, k), std::move(plan)).first->second;
}

absl::Status CudnnQuantGemm::Grow(int rows, int k) {
  if (rows <= scratch_rows_ && k <= scratch_k_) return absl::OkStatus();
  const int64_t new_rows = std::max<int64_t>(rows, scratch_rows_),
                new_k = std::max<int64_t>(k, scratch_k_);
  // The old scratch goes first: the new may need its memory.
  codes_.reset();
  scales_.reset();
  scratch_rows_ = scratch_k_ = 0;
  RETURN_IF_ERROR(codes_.Allocate(new_rows * new_k));
  RETURN_IF_ERROR(scales_.Allocate(new_rows));
  scratch_rows_ = new_rows;
  scratch_k_ = new_k;
  return absl::OkStatus();
}

absl::Status CudnnQuantGemm::PrepareRows(int rows) {
  int max_k = 0;
  for (const auto& [code, weight] : weights_) {
    RETURN_IF_ERROR(PlanFor(rows, weight.n, weight.k).status());
    max_k = std::max(max_k, weight.k);
  }
  return Grow(rows, max_k);
}

absl::Status CudnnQuantGemm::Run(const float* x, int rows, const MatrixRef& w, float* y,
                                 cudaStream_t stream) {
  auto it = weights_.find(w.data);
  if (it == weights_.end())
    return absl::InternalError("qgemm=cudnn: a weight that was not prepared");
  const Weight& weight = it->second;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream, &capturing);
  const bool in_capture = capturing != cudaStreamCaptureStatusNone;
  if (in_capture &&
      (!plans_.count({rows, weight.n, weight.k}) || rows > scratch_rows_ || weight.k > scratch_k_))
    return absl::InternalError(absl::StrCat("qgemm=cudnn: no plan or scratch for ", rows,
                                            " rows made before the graph capture"));
  RETURN_IF_ERROR(Grow(rows, weight.k));
  ASSIGN_OR_RETURN(const cudnn::Plan* plan, PlanFor(rows, weight.n, weight.k));
  cuda::QuantizeFp8RowGroups(x, rows, weight.k, weight.k, codes_.get(), scales_.get(), stream);
  RETURN_IF_ERROR(handle_->SetStream(stream));
  RecordLaunch("cudnn:fp8 matmul (E4M3 x E4M3, row x column scales)");
  return cudnn::Execute(
      *handle_, *plan, {kA, kB, kAScale, kBScale, kY},
      {codes_.get(), const_cast<void*>(w.data), scales_.get(), weight.row_scales.get(), y},
      workspace_.data());
}

absl::Status ProbeCudnnQuantGemm(QuantFormat format, int n, int k) {
  ASSIGN_OR_RETURN(std::unique_ptr<CudnnQuantGemm> gemm, CudnnQuantGemm::Create());
  if (IsFp4(format)) return Fp4Answer(*gemm->handle_, format, n, k);
  return BuildFp8Plan(*gemm->handle_, 1, n, k).status();
}

}  // namespace infersweep
