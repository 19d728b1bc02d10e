// The model description's own logic: the architecture table (HF model_type spellings and what
// each architecture is), which layers are MoE, and the parameter counts.
#include "api/model_config.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "api/model_config_internal.h"

namespace infersweep {
namespace {

struct ArchEntry {
  ModelArch arch;
  std::string_view name;
};
constexpr ArchEntry kArchs[] = {
    {ModelArch::kLlama, "llama"},           {ModelArch::kQwen3, "qwen3"},
    {ModelArch::kQwen2Moe, "qwen2_moe"},    {ModelArch::kQwen3Moe, "qwen3_moe"},
    {ModelArch::kMixtral, "mixtral"},       {ModelArch::kQwen3Next, "qwen3_next"},
    {ModelArch::kQwen35Moe, "qwen3_5_moe"}, {ModelArch::kQwen35Moe, "qwen3_5_moe_text"},
    {ModelArch::kQwen35, "qwen3_5"},        {ModelArch::kQwen35, "qwen3_5_text"},
};

// Parameter count; `active_only` counts only num_experts_per_tok routed experts per MoE layer.
// Instantiated with double by validation (cannot overflow whatever the sizes) and with int64_t for
// the exact counts once validation has bounded the sizes.
template <typename T>
T CountParams(const ModelConfig& c, bool active_only) {
  const T hidden = c.hidden_size;
  const T q_dim = static_cast<T>(c.num_q_heads) * c.head_dim;
  const T kv_dim = static_cast<T>(c.num_kv_heads) * c.head_dim;
  const T vocab = c.vocab_size;

  // q (with its gate half when gated), o, k, v
  T attn = hidden * q_dim * (c.attn_output_gate ? 3 : 2) + hidden * kv_dim * 2;
  if (c.attention_bias) {
    attn += q_dim + 2 * kv_dim;
    // HF Qwen2(-MoE) biases only q/k/v; Llama and Qwen3 put config.attention_bias on o_proj too.
    if (c.arch != ModelArch::kQwen2Moe) attn += hidden;
  }
  if (c.qk_norm) attn += 2 * static_cast<T>(c.head_dim);
  const T norms = 2 * hidden;
  // Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, the conv, dt_bias and
  // A_log, the gated norm and out_proj.
  const T key_dim = static_cast<T>(c.linear_num_key_heads) * c.linear_key_head_dim;
  const T value_dim = static_cast<T>(c.linear_num_value_heads) * c.linear_value_head_dim;
  const T value_heads = c.linear_num_value_heads;
  const T linear = hidden * (2 * key_dim + value_dim) + hidden * value_dim +
                   2 * hidden * value_heads +
                   (2 * key_dim + value_dim) * static_cast<T>(c.linear_conv_kernel_dim) +
                   2 * value_heads + c.linear_value_head_dim + hidden * value_dim;

  const T dense_mlp = 3 * hidden * static_cast<T>(c.intermediate_size);
  const T experts_counted =
      active_only ? std::min(c.num_experts_per_tok, c.num_experts) : c.num_experts;
  T moe_mlp = static_cast<T>(c.num_experts) * hidden  // router
              + experts_counted * 3 * hidden * static_cast<T>(c.moe_intermediate_size);
  if (c.shared_expert_intermediate_size > 0) {
    moe_mlp += 3 * hidden * static_cast<T>(c.shared_expert_intermediate_size) + hidden;
  }

  T total = vocab * hidden + hidden;  // embeddings + final norm
  if (!c.tie_word_embeddings) total += vocab * hidden;
  for (int l = 0; l < c.num_layers; ++l) {
    total += (c.AttentionKind(l) == LayerAttention::kLinear ? linear : attn) + norms +
             (c.IsMoeLayer(l) ? moe_mlp : dense_mlp);
  }
  return total;
}

}  // namespace

namespace model_config_internal {

std::optional<ModelArch> ArchFromModelType(std::string_view model_type) {
  for (const ArchEntry& e : kArchs)
    if (e.name == model_type) return e.arch;
  return std::nullopt;
}

std::string SupportedModelTypes() {
  std::vector<absl::string_view> names;
  for (const ArchEntry& e : kArchs) names.push_back(Sv(e.name));
  return absl::StrJoin(names, ", ");
}

bool IsMoeArch(ModelArch arch) {
  return arch == ModelArch::kQwen2Moe || arch == ModelArch::kQwen3Moe ||
         arch == ModelArch::kMixtral || arch == ModelArch::kQwen3Next ||
         arch == ModelArch::kQwen35Moe;
}

bool IsHybridArch(ModelArch arch) {
  return arch == ModelArch::kQwen3Next || arch == ModelArch::kQwen35Moe ||
         arch == ModelArch::kQwen35;
}

// Layer i is full attention when (i + 1) % interval == 0, linear attention otherwise.
std::vector<LayerAttention> LayersFromInterval(int num_layers, int interval) {
  std::vector<LayerAttention> kinds(num_layers, LayerAttention::kLinear);
  for (int i = 0; i < num_layers; ++i)
    if ((i + 1) % interval == 0) kinds[i] = LayerAttention::kFull;
  return kinds;
}

absl::Status FieldError(std::string_view source, std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrFormat("%s: field '%s': %s", source, field, what));
}

double TotalParamsBound(const ModelConfig& c) { return CountParams<double>(c, false); }

}  // namespace model_config_internal

std::string_view ModelArchName(ModelArch arch) {
  for (const ArchEntry& e : kArchs) {
    if (e.arch == arch) return e.name;
  }
  return "unknown";
}

bool ModelConfig::IsMoeLayer(int layer) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  const int step = decoder_sparse_step > 0 ? decoder_sparse_step : 1;
  return (layer + 1) % step == 0;
}

int64_t ModelConfig::TotalParams() const { return CountParams<int64_t>(*this, false); }
int64_t ModelConfig::ActiveParams() const { return CountParams<int64_t>(*this, true); }

}  // namespace infersweep
