// The collective seam of a CUDA model's step (engine/cuda/communicator.h): with a communicator
// (tp > 1, or a named all-reduce at tp=1) a block writes its output into partial() instead of
// the residual stream, and ReduceIntoResidual adds the ranks' sum, as row-parallel o and down
// projections need; a rank's lm_head writes its vocabulary shard into shard_logits(), which
// GatherLogits makes full rows on every rank. Owns the communicator (made on demand, unless a
// rank process's was given) and those buffers.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "engine/cuda/communicator.h"
#include "engine/cuda/device_util.h"
#include "engine/cuda/runner_context.h"

namespace infersweep {

class CollectiveRunner {
 public:
  // `rank_comm`: a rank process's communicator (shared with the process's later models), taking
  // messages of at most `max_message_bytes` (0: any); null at tp=1. `vocab_begin`, `lm_rows`:
  // this rank's rows of the lm_head.
  CollectiveRunner(const RunnerContext& context, std::shared_ptr<Communicator> rank_comm,
                   int64_t max_message_bytes, int64_t vocab_begin, int64_t lm_rows);

  // A communicator runs the seam: blocks write into partial().
  bool active() const { return comm_ != nullptr; }
  // This rank's lm_head holds a shard of the vocabulary (tp > 1: a rank's model).
  bool sharded_vocab() const { return rank_comm_; }
  // The elements of `out_rows` rows of logits, padded (tp > 1) to a multiple of 4 fp32 values.
  int64_t LogitsCount(int out_rows) const;

  // partial() for `rows` rows, shard_logits() for `out_rows`, and the communicator.
  absl::Status AllocateScratch(int rows, int out_rows);
  void FreeScratch();
  float* partial() const { return partial_.get(); }
  float* shard_logits() const { return shard_logits_.get(); }

  void ClearPartial(int rows);
  // x += the ranks' sum of partial() (nothing without a communicator).
  absl::Status ReduceIntoResidual(float* x, int rows);
  // The full logits [out_rows, vocab] on every rank: zeros, this rank's shard written at its
  // vocabulary columns, then summed over the ranks. Each logit is one rank's value plus exact
  // zeros, so every rank holds the same bits. The message is padded to whole 16-byte packs.
  absl::Status GatherLogits(float* logits, int out_rows);
  // Rank 0's `value` on every rank (tp > 1; Model::RankZeroValue): its 64 bits as four 16-bit
  // pieces in fp32, zeros from the other ranks, summed over the ranks (exact), outside any graph.
  absl::StatusOr<double> RankZeroValue(double value);

 private:
  // data[count] (fp32) summed over the ranks, in calls of at most max_message_bytes_ each.
  absl::Status SumOverRanks(float* data, int64_t count);
  // A named all-reduce's communicator at tp=1: nccl's once, a single-rank communicator on this
  // GPU; custom's peer buffer sized for `rows` rows, made again when the rows grow.
  absl::Status EnsureCommunicator(int rows);

  const ModelConfig& config_;
  const CudaOptions& options_;
  cudaStream_t stream_;
  std::shared_ptr<Communicator> comm_;
  const bool rank_comm_;
  const int64_t max_message_bytes_;
  int64_t comm_bytes_ = 0;  // the message the communicator was made for
  const int64_t vocab_begin_;
  const int64_t lm_rows_;
  DeviceBuffer<float> partial_;       // [rows, hidden]: a block's output before the all-reduce
  DeviceBuffer<float> shard_logits_;  // [rows, lm_rows_]: a rank's vocabulary shard (tp > 1)
  DeviceBuffer<float> agreed_;        // [4]: RankZeroValue's pieces
};

}  // namespace infersweep
