// Memory-bound decode roofline (docs/METRICS.md): the bytes one decode step must read.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "api/model_config.h"

namespace infersweep {

struct DecodeTraffic {
  double weight_bytes = 0;  // attention + router + dense MLPs + distinct experts + lm_head
  double kv_bytes = 0;      // K and V read for every sequence at `context` tokens
  double state_bytes = 0;   // hybrids: each sequence's fp32 conv and recurrent states read
  double distinct_experts_per_layer = 0;
  double total() const { return weight_bytes + kv_bytes + state_bytes; }
};

// One decode step for `batch` sequences at `context` tokens each. Distinct experts touched at
// batch B: E * (1 - (1 - k/E)^B) (uniform routing). With quantized weights, the quantizable
// linears (attention, MLPs, experts) take `quantized_bytes_per_weight` (scales included) and the
// router, shared-expert gate and lm_head stay at `bytes_per_weight`; 0 means not quantized.
// Hybrids: linear-attention layers read their (always dense) weights and each sequence's state
// instead of a KV cache.
DecodeTraffic DecodeBytesPerStep(const ModelConfig& c, int batch, int64_t context,
                                 double bytes_per_weight, double bytes_per_kv_element,
                                 double quantized_bytes_per_weight = 0);

// Measured read bandwidth of known devices in GB/s (docs/PERFORMANCE.md), by GPU name substring;
// nullopt when unknown (the CPU, unlisted GPUs).
std::optional<double> KnownReadBandwidthGbs(std::string_view device_name);

// Compute-bound prefill roofline (docs/METRICS.md): the FLOPs of prefilling `prompt_len` tokens
// of each of `batch` sequences. 2 per weight per token for the linears a token uses (attention
// projections, router, its k experts, the shared expert and its gate, dense MLPs); the causal
// attention products, QK^T and PV, 4 * q_heads * head_dim per (query, key) pair with
// prompt_len (prompt_len + 1) / 2 pairs a sequence and full-attention layer; for a
// linear-attention layer its projections and conv, and 8 * dk * dv per token and value head for
// the delta rule (decay, S^T k, the rank-1 update, S^T q); lm_head for the last position of each
// sequence only (what prefill computes logits for).
double PrefillFlops(const ModelConfig& c, int batch, int64_t prompt_len);

// Measured dense bf16 tensor-core GEMM rate of known devices in TFLOP/s, by GPU name substring;
// nullopt when unknown.
std::optional<double> KnownBf16Tflops(std::string_view device_name);

}  // namespace infersweep
