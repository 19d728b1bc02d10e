// The synthetic presets: real models' shapes without their weights (docs/MODELS.md), one row
// each. What an architecture implies (its model_type, q/k norms, biases, the hybrids' traits) is
// derived from the row's architecture, not written in it.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "api/model_config.h"
#include "api/model_config_internal.h"
#include "api/status_macros.h"

namespace infersweep {
namespace {

using model_config_internal::IsHybridArch;
using model_config_internal::LayersFromInterval;

struct PresetAttention {
  int hidden, layers, q_heads, kv_heads, head_dim;
};

// All zero for a dense model.
struct PresetMoe {
  int experts = 0, top_k = 0, intermediate = 0;
  bool norm_topk_prob = false;
  int shared_expert = 0;              // shared_expert_intermediate_size; 0: none
  std::optional<int> mlp_only_layer;  // a layer with the dense MLP instead of the experts
};

// The hybrids' Gated DeltaNet layers; all zero for the other architectures. Layer i is full
// attention when (i + 1) % full_attention_interval == 0.
struct PresetLinear {
  int key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0, full_attention_interval = 0;
};

struct PresetRow {
  std::string_view name;
  ModelArch arch;
  PresetAttention attention;
  int intermediate;  // the dense MLP's width; 0 where every layer is MoE
  PresetMoe moe;
  int vocab;
  double rope_theta;
  float rms_norm_eps;
  int max_positions;
  PresetLinear linear;
};

// Every hybrid preset's linear-attention conv width and rotary fraction.
constexpr int kHybridConvKernel = 4;
constexpr double kHybridPartialRotary = 0.25;

// clang-format off
constexpr PresetRow kPresets[] = {
  // name, arch, {hidden, layers, q heads, kv heads, head_dim}, intermediate,
  //   {experts, top-k, moe intermediate, norm_topk_prob, shared expert, mlp-only layer},
  //   vocab, rope_theta, rms_norm_eps, max positions,
  //   {linear key heads, value heads, key dim, value dim, full-attention interval}
  {"qwen3-30b-a3b", ModelArch::kQwen3Moe, {2048, 48, 32, 4, 128}, 6144,
     {128, 8, 768, true},
     151936, 1e6, 1e-6f, 40960},
  {"qwen3-235b-a22b", ModelArch::kQwen3Moe, {4096, 94, 64, 4, 128}, 12288,
     {128, 8, 1536, true},
     151936, 1e6, 1e-6f, 40960},
  {"mixtral-8x7b", ModelArch::kMixtral, {4096, 32, 32, 8, 128}, 14336,
     {8, 2, 14336, true},
     32000, 1e6, 1e-5f, 32768},
  {"qwen3-next-80b-a3b", ModelArch::kQwen3Next, {2048, 48, 16, 2, 256}, 5120,
     {512, 10, 512, true, 512},
     151936, 1e7, 1e-6f, 262144, {16, 32, 128, 128, 4}},
  {"qwen3.5-397b-a17b", ModelArch::kQwen35Moe, {4096, 60, 32, 2, 256}, 0,
     {512, 10, 1024, true, 1024},
     248320, 1e7, 1e-6f, 262144, {16, 64, 128, 128, 4}},
  {"tiny-moe", ModelArch::kQwen3Moe, {128, 4, 4, 2, 32}, 256,
     {8, 2, 64, true},
     512, 1e6, 1e-6f, 4096},
  {"tiny-dense", ModelArch::kQwen3, {128, 4, 4, 2, 32}, 384,
     {},
     512, 1e6, 1e-6f, 4096},
  {"tiny-qwen2-moe", ModelArch::kQwen2Moe, {128, 4, 4, 2, 32}, 256,
     {8, 2, 64, false, 128, 1},
     512, 1e6, 1e-6f, 4096},
  // Layers alternate linear and full attention; every layer is MoE with a shared expert.
  {"tiny-hybrid", ModelArch::kQwen3Next, {128, 4, 4, 2, 32}, 0,
     {8, 2, 64, true, 64},
     512, 1e6, 1e-6f, 4096, {2, 4, 32, 32, 2}},
  // tiny-hybrid with qwen3-next's full-attention head size (256, partial RoPE over 64 dims) and
  // a GQA group of 4: the flash kernels' head_dim 256 end to end.
  {"tiny-hybrid-hd256", ModelArch::kQwen3Next, {128, 4, 8, 2, 256}, 0,
     {8, 2, 64, true, 64},
     512, 1e6, 1e-6f, 4096, {2, 4, 32, 32, 2}},
};
// clang-format on

const PresetRow* FindPreset(std::string_view name) {
  for (const PresetRow& row : kPresets)
    if (row.name == name) return &row;
  return nullptr;
}

// The row's config at its own layer count.
ModelConfig FromRow(const PresetRow& row) {
  ModelConfig c;
  c.arch = row.arch;
  c.model_type = std::string(ModelArchName(row.arch));
  c.torch_dtype = "bfloat16";
  c.tie_word_embeddings = false;
  c.hidden_size = row.attention.hidden;
  c.num_layers = row.attention.layers;
  c.num_q_heads = row.attention.q_heads;
  c.num_kv_heads = row.attention.kv_heads;
  c.head_dim = row.attention.head_dim;
  c.intermediate_size = row.intermediate;
  c.vocab_size = row.vocab;
  c.rope_theta = row.rope_theta;
  c.rms_norm_eps = row.rms_norm_eps;
  c.max_position_embeddings = row.max_positions;
  c.qk_norm =
      row.arch == ModelArch::kQwen3 || row.arch == ModelArch::kQwen3Moe || IsHybridArch(row.arch);
  c.attention_bias = row.arch == ModelArch::kQwen2Moe;

  c.num_experts = row.moe.experts;
  c.num_experts_per_tok = row.moe.top_k;
  c.moe_intermediate_size = row.moe.intermediate;
  c.norm_topk_prob = row.moe.norm_topk_prob;
  c.shared_expert_intermediate_size = row.moe.shared_expert;
  if (row.moe.mlp_only_layer) c.mlp_only_layers = {*row.moe.mlp_only_layer};

  if (IsHybridArch(row.arch)) {
    c.zero_centered_norm = true;
    c.attn_output_gate = true;
    c.linear_num_key_heads = row.linear.key_heads;
    c.linear_num_value_heads = row.linear.value_heads;
    c.linear_key_head_dim = row.linear.key_dim;
    c.linear_value_head_dim = row.linear.value_dim;
    c.linear_conv_kernel_dim = kHybridConvKernel;
    c.partial_rotary_factor = kHybridPartialRotary;
  }
  return c;
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const PresetRow& row : kPresets) names.emplace_back(row.name);
  return names;
}

absl::StatusOr<ModelConfig> PresetConfig(std::string_view name, int num_layers_override) {
  const PresetRow* row = FindPreset(name);
  if (row == nullptr) {
    return absl::NotFoundError(absl::StrFormat("unknown model preset \"%s\"; known presets: %s",
                                               name, absl::StrJoin(PresetNames(), ", ")));
  }
  const std::string source = absl::StrFormat("preset '%s'", name);
  if (num_layers_override < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: layer override %d is negative", source, num_layers_override));
  }
  ModelConfig c = FromRow(*row);
  if (num_layers_override > 0) {
    c.num_layers = num_layers_override;
    std::erase_if(c.mlp_only_layers, [&c](int l) { return l >= c.num_layers; });
  }
  if (row->linear.full_attention_interval > 0)
    c.layer_attention = LayersFromInterval(c.num_layers, row->linear.full_attention_interval);
  RETURN_IF_ERROR(ValidateModelConfig(c, source));
  return c;
}

}  // namespace infersweep
