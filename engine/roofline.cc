#include "engine/roofline.h"

#include <cmath>

namespace infersweep {
namespace {

// q (with its gate half when gated), o and k, v.
double FullAttentionWeights(const ModelConfig& c) {
  const double h = c.hidden_size;
  return h * c.q_dim() * (c.attn_output_gate ? 3 : 2) + h * c.kv_dim() * 2;
}

// A Gated DeltaNet layer's quantizable projections (in_proj_qkv, in_proj_z, out_proj).
double LinearAttentionProjections(const ModelConfig& c) {
  return static_cast<double>(c.hidden_size) * (c.linear_conv_dim() + 2.0 * c.linear_value_dim());
}
// Its always-dense weights: in_proj_b, in_proj_a and the conv.
double LinearAttentionDenseWeights(const ModelConfig& c) {
  return 2.0 * c.hidden_size * c.linear_num_value_heads +
         static_cast<double>(c.linear_conv_dim()) * c.linear_conv_kernel_dim;
}

}  // namespace

DecodeTraffic DecodeBytesPerStep(const ModelConfig& c, int batch, int64_t context,
                                 double bytes_per_weight, double bytes_per_kv_element,
                                 double quantized_bytes_per_weight) {
  const double h = c.hidden_size;
  const double attention = FullAttentionWeights(c);
  // Per layer, summed: elements of quantizable linears and of the always-dense router/gates.
  double linear_sum = 0, dense_sum = 0, distinct = 0;
  int full_layers = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.AttentionKind(l) == LayerAttention::kLinear) {
      linear_sum += LinearAttentionProjections(c);
      dense_sum += LinearAttentionDenseWeights(c);
    } else {
      linear_sum += attention;
      ++full_layers;
    }
    if (c.IsMoeLayer(l)) {
      const double e = c.num_experts, k = c.num_experts_per_tok;
      distinct = e * (1.0 - std::pow(1.0 - k / e, batch));
      dense_sum += e * h;
      linear_sum += distinct * 3.0 * h * c.moe_intermediate_size;
      if (c.shared_expert_intermediate_size > 0) {
        linear_sum += 3.0 * h * c.shared_expert_intermediate_size;
        dense_sum += h;
      }
    } else {
      linear_sum += 3.0 * h * c.intermediate_size;
    }
  }
  const double linear_bytes =
      quantized_bytes_per_weight > 0 ? quantized_bytes_per_weight : bytes_per_weight;
  DecodeTraffic t;
  t.distinct_experts_per_layer = distinct;
  t.weight_bytes = linear_sum * linear_bytes +
                   (dense_sum + static_cast<double>(c.vocab_size) * h) * bytes_per_weight;
  t.kv_bytes =
      2.0 * full_layers * c.kv_dim() * static_cast<double>(context) * batch * bytes_per_kv_element;
  const double state_elements =
      static_cast<double>(c.linear_num_value_heads) * c.linear_key_head_dim *
          c.linear_value_head_dim +
      static_cast<double>(c.linear_conv_kernel_dim - 1) * c.linear_conv_dim();
  t.state_bytes = (c.num_layers - full_layers) * state_elements * batch * 4.0;
  return t;
}

double PrefillFlops(const ModelConfig& c, int batch, int64_t prompt_len) {
  const double h = c.hidden_size, p = static_cast<double>(prompt_len);
  const double attention = FullAttentionWeights(c);
  double weights_per_token = 0;  // summed over layers
  double rule_flops_per_token = 0;
  int full_layers = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.AttentionKind(l) == LayerAttention::kLinear) {
      weights_per_token += LinearAttentionProjections(c) + LinearAttentionDenseWeights(c);
      rule_flops_per_token +=
          8.0 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
    } else {
      weights_per_token += attention;
      ++full_layers;
    }
    if (c.IsMoeLayer(l)) {
      weights_per_token += static_cast<double>(c.num_experts) * h +
                           c.num_experts_per_tok * 3.0 * h * c.moe_intermediate_size;
      if (c.shared_expert_intermediate_size > 0)
        weights_per_token += 3.0 * h * c.shared_expert_intermediate_size + h;
    } else {
      weights_per_token += 3.0 * h * c.intermediate_size;
    }
  }
  const double linears = 2.0 * weights_per_token * p + rule_flops_per_token * p;
  const double attention_products =
      4.0 * c.num_q_heads * c.head_dim * (p * (p + 1) / 2) * full_layers;
  const double lm_head = 2.0 * static_cast<double>(c.vocab_size) * h;
  return batch * (linears + attention_products + lm_head);
}

std::optional<double> KnownBf16Tflops(std::string_view device_name) {
  // Measured on the lent H200: a large cuBLASLt bf16 GEMM (../shared/BRIEF.md).
  if (device_name.find("H200") != std::string_view::npos) return 794.0;
  return std::nullopt;
}

std::optional<double> KnownReadBandwidthGbs(std::string_view device_name) {
  // Measured on the lent H200 (device-to-device read, docs/PERFORMANCE.md).
  if (device_name.find("H200") != std::string_view::npos) return 4460.0;
  return std::nullopt;
}

}  // namespace infersweep
