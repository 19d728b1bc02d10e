// Model architecture description, read from an HF config.json or from a named synthetic preset.
// The description and its parameter counts are model_config.cc's; config.json is hf_config.cc's,
// validation model_validation.cc's, the presets' table model_presets.cc's.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace infersweep {

// kQwen3Next, kQwen35Moe and kQwen35 are hybrids: Gated DeltaNet linear-attention layers
// between gated full-attention layers (docs/MODELS.md).
enum class ModelArch {
  kLlama,
  kQwen3,
  kQwen2Moe,
  kQwen3Moe,
  kMixtral,
  kQwen3Next,
  kQwen35Moe,
  kQwen35
};

// HF `model_type` spelling of an architecture (the text model's: qwen3_5_moe_text for kQwen35Moe
// is an alias, as is the multimodal wrapper's qwen3_5_moe).
std::string_view ModelArchName(ModelArch arch);

// The token mixer of one decoder layer.
enum class LayerAttention { kFull, kLinear };

struct ModelConfig {
  ModelArch arch = ModelArch::kLlama;
  std::string model_type;  // as in config.json

  int hidden_size = 0;
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;           // explicit `head_dim`, else hidden_size / num_q_heads
  int intermediate_size = 0;  // dense MLP width (dense layers of MoE models too)
  int vocab_size = 0;
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections carry a bias (qwen2_moe always; llama if set)
  bool qk_norm = false;         // per-head RMSNorm on q and k before RoPE (qwen3, qwen3_moe)

  // Mixture of experts. num_experts == 0 means a dense model.
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  int shared_expert_intermediate_size = 0;  // > 0: a shared expert gated by sigmoid(shared_expert_gate(x))

  std::string torch_dtype = "bfloat16";  // `torch_dtype` or `dtype`

  // Hybrid models. layer_attention holds one entry per layer (empty: every layer is full
  // attention). Linear-attention layers are Gated DeltaNet with linear_num_key_heads key heads of
  // linear_key_head_dim and linear_num_value_heads value heads of linear_value_head_dim, after a
  // causal depthwise conv of width linear_conv_kernel_dim.
  std::vector<LayerAttention> layer_attention;
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel_dim = 0;
  // RoPE rotates the first int(head_dim * partial_rotary_factor) dims of each head (NeoX halves).
  double partial_rotary_factor = 1.0;
  // q_proj yields [q_h | gate_h] per head; attention output is multiplied by sigmoid(gate).
  bool attn_output_gate = false;
  // Decoder RMSNorms (input, post-attention, final, q/k norm) scale by (1 + w) instead of w.
  bool zero_centered_norm = false;

  bool is_moe() const { return num_experts > 0; }
  bool is_hybrid() const { return !layer_attention.empty(); }
  LayerAttention AttentionKind(int layer) const {
    return layer_attention.empty() ? LayerAttention::kFull : layer_attention[layer];
  }
  bool has_linear_attention() const {
    for (LayerAttention kind : layer_attention)
      if (kind == LayerAttention::kLinear) return true;
    return false;
  }
  // Each layer's index among the layers of `kind` (its slot in that kind's KV cache or state), -1
  // for the layers of the other kind.
  std::vector<int> LayerSlots(LayerAttention kind) const {
    std::vector<int> slots;
    int next = 0;
    for (int l = 0; l < num_layers; ++l) slots.push_back(AttentionKind(l) == kind ? next++ : -1);
    return slots;
  }
  int rotary_dim() const { return static_cast<int>(head_dim * partial_rotary_factor); }
  // Linear-attention widths: q and k each key_dim, v and z each value_dim; conv over q|k|v.
  int linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }
  // True when layer `layer` uses the sparse MoE block rather than the dense MLP.
  bool IsMoeLayer(int layer) const;
  int q_dim() const { return num_q_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }

  // Total and per-token-active parameter counts (embeddings and lm_head included).
  int64_t TotalParams() const;
  int64_t ActiveParams() const;
};

// Parses the text of a config.json. `source` names the file in error messages.
// Accepts transformers 4.x and 5.x spellings (see docs/MODELS.md).
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source);

// Reads <dir>/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

// Synthetic presets at real shapes: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b,
// qwen3-next-80b-a3b, qwen3.5-397b-a17b, tiny-moe, tiny-dense, tiny-qwen2-moe, tiny-hybrid,
// tiny-hybrid-hd256 (docs/MODELS.md). num_layers_override > 0 truncates (or extends) the layer
// count.
absl::StatusOr<ModelConfig> PresetConfig(std::string_view name, int num_layers_override = 0);
std::vector<std::string> PresetNames();

// Checks internal consistency (positive sizes, heads divide, top-k <= experts, ...).
absl::Status ValidateModelConfig(const ModelConfig& config, std::string_view source);

}  // namespace infersweep
