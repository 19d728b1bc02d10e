// The attention block of a CUDA model's step: input RMSNorm and the q/k/v projections (through
// the linear runner), q/k norm + RoPE + KV-cache append, the naive or flash attention kernel,
// and the o projection added into the residual stream. Owns the KV cache, the RoPE table and
// the attention activations.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/cuda/cudnn_attention.h"
#include "engine/cuda/device_util.h"
#include "engine/cuda/linear_runner.h"
#include "engine/cuda/runner_context.h"
#include "engine/plan/attention_plan.h"
#include "kernels/cuda/ops.h"

namespace infersweep {

class AttentionRunner {
 public:
  AttentionRunner(const RunnerContext& context, LinearRunner& linear);
  AttentionRunner(const AttentionRunner&) = delete;
  AttentionRunner& operator=(const AttentionRunner&) = delete;

  // A KV cache of `batch` sequences of `max_tokens` and its RoPE table, in place of the last.
  absl::Status AllocateCache(int batch, int max_tokens);
  // Scratch for `rows` rows over a cache of `capacity` tokens (freed first by FreeScratch).
  absl::Status AllocateScratch(int rows, int capacity);
  void FreeScratch();

  // Layer l's attention over `rows` rows (`n` tokens a sequence) of the residual stream x, its
  // output added into `out` (x itself, or a partial that the collective seam reduces first).
  // `gemv`: the fused GEMV path (gemm=fused|tma, decode rows). `d_position`: the sequences'
  // position on the device. With `ragged` (serving), the rows sit where it says instead: the decode
  // rows go to the attention kernels together, each prefill chunk on its own as a lockstep chunk of
  // its slot.
  absl::Status Run(int l, int rows, int n, bool gemv, float* x, float* out, const int* d_position,
                   const RaggedRows* ragged = nullptr);

  // The plan every choice below reads (engine/plan/attention_plan.h).
  const AttentionPlan& plan() const { return plan_; }
  // The KV cache's element type, and its bytes per element: 4 for fp32, 2 for bf16, 1 for fp8
  // (whose per-head scales add 8 bytes a token and kv head, K and V together).
  cuda::KvDtype kv_dtype() const;
  int kv_cache_bytes_per_element() const { return plan_.kv_bytes_per_element; }
  // What decode attention reads per element: the above, plus fp8's scales (one fp32 a head row).
  double kv_read_bytes_per_element() const {
    return plan_.kv_bytes_per_element + (plan_.kv_scales ? 4.0 / config_.head_dim : 0.0);
  }
  char* k_cache() const { return k_cache_.get(); }
  char* v_cache() const { return v_cache_.get(); }
  const float2* rope() const { return rope_.get(); }
  float* qkv() const { return qkv_.get(); }
  float* attn() const { return attn_.get(); }

 private:
  // Layer l's cache, or (serving) one KV slot of it.
  cuda::KvCache LayerCache(int l) const;
  cuda::KvCache SlotCache(const cuda::KvCache& layer, int slot) const;
  // The attention kernel over rows [first_row, first_row + rows) of q_ into attn_.
  absl::Status Attend(const cuda::KvCache& cache, int first_row, int rows, int n,
                      const int* d_position, const int2* ragged);

  const ModelConfig& config_;
  const ModelWeights& w_;
  const CudaOptions& options_;
  const FaultInjection& fault_;
  cudaStream_t stream_;
  LinearRunner& linear_;
  const AttentionHeads heads_;
  const AttentionPlan plan_;
  const std::vector<int>
      cache_index_;         // layer -> its slot in the KV cache, -1 for linear attention
  const int cache_layers_;  // full-attention layers
  int batch_ = 0, capacity_ = 0;
  std::unique_ptr<CudnnAttention> cudnn_;  // attention=cudnn: its plans, made with the cache
  DeviceBuffer<int32_t> seq_lens_;         // attention=cudnn: [2, batch] s_q and KV lengths
  DeviceBuffer<float> slot_io_;  // attention=cudnn serving: bf16 Q and O, [batch, q_dim] each
  DeviceBuffer<char> k_cache_, v_cache_;   // [cache layers, batch, capacity, kv_dim]
  DeviceBuffer<float> k_scale_, v_scale_;  // kv_cache=fp8: [.., batch, capacity, kv_heads]
  DeviceBuffer<float2> rope_;              // [capacity, rotary_dim / 2] cos/sin
  DeviceBuffer<float> q_, k_, v_;
  DeviceBuffer<float> qkv_;  // [rows, q | k | v]: the fused q/k/v GEMM's output
  DeviceBuffer<float> attn_;
  DeviceBuffer<float> scores_;   // naive: materialised scores; flash: the splits' partial softmaxes
  DeviceBuffer<float> q_gated_;  // gated attention: [rows, 2 q_dim], q_proj's [q_h | gate_h] rows
  DeviceBuffer<float> cudnn_io_;  // attention=cudnn: bf16 Q and O, [rows, q_dim] each
};

}  // namespace infersweep
