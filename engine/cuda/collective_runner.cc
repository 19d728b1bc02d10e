#include "engine/cuda/collective_runner.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "api/status_macros.h"
#include "engine/plan/collective_plan.h"
#include "kernels/cuda/ops.h"

namespace infersweep {

CollectiveRunner::CollectiveRunner(const RunnerContext& context,
                                   std::shared_ptr<Communicator> rank_comm,
                                   int64_t max_message_bytes, int64_t vocab_begin, int64_t lm_rows)
    : config_(context.config),
      options_(context.options),
      stream_(context.stream),
      comm_(std::move(rank_comm)),
      rank_comm_(comm_ != nullptr),
      max_message_bytes_(max_message_bytes),
      vocab_begin_(vocab_begin),
      lm_rows_(lm_rows) {}

int64_t CollectiveRunner::LogitsCount(int out_rows) const {
  const int64_t count = static_cast<int64_t>(out_rows) * config_.vocab_size;
  return sharded_vocab() ? (count + 3) / 4 * 4 : count;
}

absl::Status CollectiveRunner::AllocateScratch(int rows, int out_rows) {
  if (sharded_vocab())
    RETURN_IF_ERROR(shard_logits_.Allocate(static_cast<size_t>(out_rows) * lm_rows_));
  if (options_.parallel.RunsCollective()) {
    RETURN_IF_ERROR(partial_.Allocate(static_cast<size_t>(rows) * config_.hidden_size));
    RETURN_IF_ERROR(EnsureCommunicator(rows));
  }
  return absl::OkStatus();
}

void CollectiveRunner::FreeScratch() {
  partial_.reset();
  shard_logits_.reset();
}

void CollectiveRunner::ClearPartial(int rows) {
  CUDA_OR_DIE(cudaMemsetAsync(
      partial_.get(), 0, static_cast<size_t>(rows) * config_.hidden_size * sizeof(float), stream_));
}

absl::Status CollectiveRunner::ReduceIntoResidual(float* x, int rows) {
  if (!comm_) return absl::OkStatus();
  const int64_t count = static_cast<int64_t>(rows) * config_.hidden_size;
  RETURN_IF_ERROR(SumOverRanks(partial_.get(), count));
  cuda::AddScaled(x, partial_.get(), 1.f, count, stream_);
  CHECK_LAUNCH();
  return absl::OkStatus();
}

absl::Status CollectiveRunner::GatherLogits(float* logits, int out_rows) {
  const int64_t vocab = config_.vocab_size;
  const int64_t count = LogitsCount(out_rows);
  CUDA_OR_DIE(cudaMemsetAsync(logits, 0, static_cast<size_t>(count) * sizeof(float), stream_));
  CUDA_OR_DIE(cudaMemcpy2DAsync(logits + vocab_begin_, vocab * sizeof(float), shard_logits_.get(),
                                lm_rows_ * sizeof(float), lm_rows_ * sizeof(float), out_rows,
                                cudaMemcpyDeviceToDevice, stream_));
  return SumOverRanks(logits, count);
}

absl::StatusOr<double> CollectiveRunner::RankZeroValue(double value) {
  if (!rank_comm_) return value;
  if (!agreed_) RETURN_IF_ERROR(agreed_.Allocate(4));
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  float pieces[4] = {};
  if (comm_->rank() == 0)
    for (int i = 0; i < 4; ++i) pieces[i] = static_cast<float>((bits >> (16 * i)) & 0xffff);
  CUDA_OR_DIE(
      cudaMemcpyAsync(agreed_.get(), pieces, sizeof pieces, cudaMemcpyHostToDevice, stream_));
  RETURN_IF_ERROR(SumOverRanks(agreed_.get(), 4));
  CUDA_OR_DIE(
      cudaMemcpyAsync(pieces, agreed_.get(), sizeof pieces, cudaMemcpyDeviceToHost, stream_));
  CUDA_OR_DIE(cudaStreamSynchronize(stream_));
  bits = 0;
  for (int i = 0; i < 4; ++i) bits |= static_cast<uint64_t>(pieces[i]) << (16 * i);
  double agreed = 0;
  std::memcpy(&agreed, &bits, sizeof agreed);
  return agreed;
}

absl::Status CollectiveRunner::SumOverRanks(float* data, int64_t count) {
  const int64_t chunk = max_message_bytes_ > 0 ? max_message_bytes_ / 16 * 4 : count;
  for (int64_t done = 0; done < count; done += chunk)
    RETURN_IF_ERROR(
        comm_->Sum(data + done, std::min(chunk, count - done), cuda::ReduceDType::kFp32, stream_));
  return absl::OkStatus();
}

absl::Status CollectiveRunner::EnsureCommunicator(int rows) {
  if (rank_comm_) return absl::OkStatus();
  const int64_t bytes = static_cast<int64_t>(rows) * config_.hidden_size * sizeof(float);
  ASSIGN_OR_RETURN(const CollectivePlan plan,
                   PlanCollective(options_.parallel, /*rank_process=*/false, bytes));
  switch (plan.transport) {
    case CollectiveTransport::kNone:
      return absl::OkStatus();
    case CollectiveTransport::kNccl: {  // made once: NCCL takes messages of any size
      if (comm_) return absl::OkStatus();
      ASSIGN_OR_RETURN(auto id, MakeNcclId());
      ASSIGN_OR_RETURN(comm_, MakeNcclCommunicator(id, 1, 0));
      break;
    }
    case CollectiveTransport::kPeerBuffers: {  // made again when the step's message grows
      if (comm_ && plan.max_message_bytes <= comm_bytes_) return absl::OkStatus();
      comm_.reset();
      int device = 0;
      CUDA_OR_DIE(cudaGetDevice(&device));
      ASSIGN_OR_RETURN(auto made,
                       MakeLocalCommunicators(plan.kind, {device}, plan.max_message_bytes));
      comm_ = std::move(made[0]);
      break;
    }
  }
  comm_bytes_ = plan.max_message_bytes;
  return absl::OkStatus();
}

}  // namespace infersweep
