// The Gated DeltaNet block of a CUDA model's step (qwen3_next, qwen3_5 linear-attention layers):
// input RMSNorm and the in_proj linears (through the linear runner), the causal conv, the gates,
// the gated delta rule over each sequence's recurrent state, the gated RMSNorm and out_proj added
// into the residual stream. Owns the per-sequence conv and recurrent states (fp32, beside the KV
// cache of the full-attention layers) and the block's activations.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/cuda/device_util.h"
#include "engine/cuda/linear_runner.h"
#include "engine/cuda/runner_context.h"
#include "kernels/cuda/gated_delta.h"

namespace infersweep {

class LinearAttentionRunner {
 public:
  LinearAttentionRunner(const RunnerContext& context, LinearRunner& linear);
  LinearAttentionRunner(const LinearAttentionRunner&) = delete;
  LinearAttentionRunner& operator=(const LinearAttentionRunner&) = delete;

  // States of `batch` sequences (lockstep) or slots (serving) for every linear-attention layer
  // (none for other models), in place of the last.
  absl::Status AllocateState(int batch);
  // Zeroes every state (a fresh batch), on the model's stream.
  void ResetState();
  // Swaps slots a's and b's recurrent states in every layer (TEST ONLY: state-slot-swap).
  void SwapRecurrentStates(int a, int b);
  // Scratch for `rows` rows (freed first by FreeScratch).
  absl::Status AllocateScratch(int rows);
  void FreeScratch();

  // Layer l's linear attention over `rows` rows (`n` tokens a sequence) of the residual stream x,
  // its output added into `out` (x itself, or a partial that the collective seam reduces first).
  // `gemv`: the fused GEMV path (gemm=fused|tma, decode rows). With `ragged` (serving) the rows
  // are a ragged step's: the decode rows' conv and delta rule run together, each reading and
  // advancing its slot's states; each prefill chunk runs on its own over its slot's states, which
  // carry its sequence from one chunk to the next. With linear_attn=fused_decode the one-row
  // sequences (a lockstep decode step, a ragged step's decode rows) take GatedDeltaDecode.
  absl::Status Run(int l, int rows, int n, bool gemv, float* x, float* out,
                   const RaggedRows* ragged = nullptr);

 private:
  // chunk_terms_ laid out for a launch of `rows` rows.
  cuda::GatedDeltaChunkScratch ChunkTerms(int rows) const;
  const ModelConfig& config_;
  const ModelWeights& w_;
  const CudaOptions& options_;
  const FaultInjection& fault_;
  cudaStream_t stream_;
  LinearRunner& linear_;
  const std::vector<int> state_index_;  // layer -> its slot in the states, -1 for full attention
  const int state_layers_;              // linear-attention layers
  const int first_linear_layer_;        // (num_layers when there is none)
  int batch_ = 0;
  DeviceBuffer<float> conv_state_;       // [linear layers, batch, K - 1, conv channels]
  DeviceBuffer<float> recurrent_state_;  // [linear layers, batch, Hv, dk, dv]
  DeviceBuffer<float> projected_;        // [rows, q | k | v]: in_proj_qkv's output
  DeviceBuffer<float> mixed_;            // [rows, q | k | v]: after the conv (q, k then normalised)
  DeviceBuffer<float> z_;                // [rows, Hv * dv]
  DeviceBuffer<float> a_, b_, g_, beta_;  // [rows, Hv]
  DeviceBuffer<float> out_;               // [rows, Hv * dv]
  // linear_attn=chunked: the chunked form's terms (cuda::GatedDeltaChunkScratch), for `rows`.
  DeviceBuffer<float> chunk_terms_;
  // [rows, Hk]: GatedDeltaDecode's key-head arrival counts, zeroed once; each launch leaves them
  // zero.
  DeviceBuffer<unsigned> arrivals_;
};

}  // namespace infersweep
