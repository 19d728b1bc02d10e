#include "api/model_config.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/tensor_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace infersweep {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using json = nlohmann::json;

// Qwen3-30B-A3B as the Hub ships it (transformers 4.x spellings).
constexpr char kQwen3MoeHub4x[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// The same model as transformers 5.x saves it: rope_parameters and dtype.
constexpr char kQwen3MoeSave5x[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "decoder_sparse_step": 1,
  "dtype": "bfloat16",
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
  "sliding_window": null,
  "tie_word_embeddings": false,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

constexpr char kMixtral[] = R"({
  "architectures": ["MixtralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mixtral",
  "num_attention_heads": 32,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "num_local_experts": 8,
  "output_router_logits": false,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.02,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";

// Qwen1.5-MoE-A2.7B style. Note sliding_window is set but use_sliding_window is false.
constexpr char kQwen2Moe[] = R"({
  "architectures": ["Qwen2MoeForCausalLM"],
  "attention_dropout": 0.0,
  "decoder_sparse_step": 1,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 5632,
  "max_position_embeddings": 8192,
  "max_window_layers": 21,
  "model_type": "qwen2_moe",
  "moe_intermediate_size": 1408,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts": 60,
  "num_experts_per_tok": 4,
  "num_hidden_layers": 24,
  "num_key_value_heads": 16,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "shared_expert_intermediate_size": 5632,
  "sliding_window": 32768,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// TinyLlama-1.1B shapes; rope_theta, max_position_embeddings and dtype left to the defaults.
constexpr char kLlama[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 5632,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 22,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": true,
  "vocab_size": 32000
})";

// Qwen3-0.6B: head_dim (128) differs from hidden_size / num_attention_heads (64).
constexpr char kQwen3Dense[] = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// `text` with top-level `key` set to `value`.
std::string With(const std::string& text, const std::string& key, const json& value) {
  json j = json::parse(text);
  j[key] = value;
  return j.dump();
}
std::string Without(const std::string& text, const std::string& key) {
  json j = json::parse(text);
  j.erase(key);
  return j.dump();
}

ModelConfig MustParse(const std::string& text, const char* source = "config.json") {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(text, source);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

ModelConfig MustPreset(const std::string& name, int layers = 0) {
  absl::StatusOr<ModelConfig> c = PresetConfig(name, layers);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

// Every field that determines the model's computation.
void ExpectSameModel(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_q_heads, b.num_q_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.decoder_sparse_step, b.decoder_sparse_step);
  EXPECT_EQ(a.mlp_only_layers, b.mlp_only_layers);
  EXPECT_EQ(a.shared_expert_intermediate_size, b.shared_expert_intermediate_size);
  EXPECT_EQ(a.torch_dtype, b.torch_dtype);
  EXPECT_EQ(a.TotalParams(), b.TotalParams());
}

int64_t SpecParams(const ModelConfig& c) {
  int64_t n = 0;
  for (const TensorSpec& s : ModelTensorSpecs(c)) n += s.numel();
  return n;
}

// ---------------------------------------------------------------------------------------------
// Parsing real-world configs

TEST(ParseModelConfig, Qwen3MoeHub4x) {
  const ModelConfig c = MustParse(kQwen3MoeHub4x);
  EXPECT_EQ(c.arch, ModelArch::kQwen3Moe);
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_layers, 48);
  EXPECT_EQ(c.num_q_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_dim(), 4096);
  EXPECT_EQ(c.kv_dim(), 512);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_THAT(c.mlp_only_layers, IsEmpty());
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_TRUE(c.is_moe());
  for (int l = 0; l < c.num_layers; ++l) EXPECT_TRUE(c.IsMoeLayer(l)) << l;
}

TEST(ParseModelConfig, Transformers5xSpellingsMatch4x) {
  const ModelConfig v4 = MustParse(kQwen3MoeHub4x);
  const ModelConfig v5 = MustParse(kQwen3MoeSave5x);
  ExpectSameModel(v4, v5);
  // ...and both are exactly the preset.
  ExpectSameModel(v4, MustPreset("qwen3-30b-a3b"));
}

TEST(ParseModelConfig, DtypeSpellings) {
  EXPECT_EQ(MustParse(With(kQwen3MoeHub4x, "torch_dtype", "float16")).torch_dtype, "float16");
  EXPECT_EQ(MustParse(With(kQwen3MoeSave5x, "dtype", "float32")).torch_dtype, "float32");
  // Both spellings present and agreeing is fine; disagreeing is an error.
  EXPECT_EQ(MustParse(With(kQwen3MoeSave5x, "torch_dtype", "bfloat16")).torch_dtype, "bfloat16");
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(With(kQwen3MoeSave5x, "torch_dtype", "float16"), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("torch_dtype"), HasSubstr("dtype")));
  // Neither: bfloat16.
  EXPECT_EQ(MustParse(Without(kQwen3MoeHub4x, "torch_dtype")).torch_dtype, "bfloat16");
}

TEST(ParseModelConfig, RopeThetaSpellingsAndDefault) {
  EXPECT_DOUBLE_EQ(MustParse(Without(kQwen3MoeHub4x, "rope_theta")).rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(
      MustParse(With(kQwen3MoeSave5x, "rope_parameters", {{"rope_theta", 5e5}})).rope_theta, 5e5);
  // 5.x rope_parameters without a theta falls back to the top level, then to the default.
  EXPECT_DOUBLE_EQ(
      MustParse(With(kQwen3MoeSave5x, "rope_parameters", {{"rope_type", "default"}})).rope_theta,
      10000.0);
  EXPECT_DOUBLE_EQ(MustParse(With(kQwen3MoeSave5x, "rope_parameters", nullptr)).rope_theta,
                   10000.0);
  // Both spellings, agreeing.
  EXPECT_DOUBLE_EQ(MustParse(With(kQwen3MoeSave5x, "rope_theta", 1e6)).rope_theta, 1e6);
  // A 4.x rope_scaling that spells out the default type is not scaling.
  EXPECT_DOUBLE_EQ(
      MustParse(With(kQwen3MoeHub4x, "rope_scaling", {{"rope_type", "default"}})).rope_theta, 1e6);
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(With(kQwen3MoeSave5x, "rope_theta", 1e4), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("rope_parameters.rope_theta"));
}

TEST(ParseModelConfig, MixtralWithNumLocalExperts) {
  const ModelConfig c = MustParse(kMixtral);
  EXPECT_EQ(c.arch, ModelArch::kMixtral);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.moe_intermediate_size, 14336);  // experts use intermediate_size
  EXPECT_TRUE(c.norm_topk_prob);              // Mixtral always renormalises
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 128);  // derived: 4096 / 32
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  for (int l = 0; l < c.num_layers; ++l) EXPECT_TRUE(c.IsMoeLayer(l)) << l;
  ExpectSameModel(c, MustPreset("mixtral-8x7b"));
  // Mixtral ignores Qwen-only knobs: every layer stays sparse.
  const ModelConfig odd =
      MustParse(With(With(kMixtral, "decoder_sparse_step", 2), "mlp_only_layers", {0}));
  for (int l = 0; l < odd.num_layers; ++l) EXPECT_TRUE(odd.IsMoeLayer(l)) << l;
  // num_experts is accepted as a spelling for Mixtral too.
  EXPECT_EQ(MustParse(With(Without(kMixtral, "num_local_experts"), "num_experts", 8)).num_experts,
            8);
}

TEST(ParseModelConfig, Qwen2MoeSharedExpertAndQkvBias) {
  const ModelConfig c = MustParse(kQwen2Moe);
  EXPECT_EQ(c.arch, ModelArch::kQwen2Moe);
  EXPECT_TRUE(c.attention_bias);  // without any attention_bias key
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 60);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.head_dim, 128);
  // Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B activated.
  EXPECT_NEAR(static_cast<double>(c.TotalParams()), 14.3e9, 0.01 * 14.3e9);
  EXPECT_NEAR(static_cast<double>(c.ActiveParams()), 2.7e9, 0.02 * 2.7e9);
  // The shared expert and the qkv biases are counted.
  const int64_t h = c.hidden_size;
  const ModelConfig no_shared = MustParse(With(kQwen2Moe, "shared_expert_intermediate_size", 0));
  EXPECT_EQ(c.TotalParams() - no_shared.TotalParams(),
            c.num_layers * (3 * h * 5632 + h));
  EXPECT_EQ(SpecParams(c), c.TotalParams());
  // norm_topk_prob defaults to false (HF default) when absent.
  EXPECT_FALSE(MustParse(Without(kQwen2Moe, "norm_topk_prob")).norm_topk_prob);
  // transformers 5.x writes the bias switch as `qkv_bias`; it is honoured when present.
  EXPECT_TRUE(MustParse(With(kQwen2Moe, "qkv_bias", true)).attention_bias);
  const ModelConfig no_bias = MustParse(With(kQwen2Moe, "qkv_bias", false));
  EXPECT_FALSE(no_bias.attention_bias);
  EXPECT_EQ(c.TotalParams() - no_bias.TotalParams(), c.num_layers * (3 * int64_t{2048}));
}

TEST(ParseModelConfig, LlamaTiedEmbeddingsAndDefaults) {
  const ModelConfig tied = MustParse(kLlama);
  EXPECT_EQ(tied.arch, ModelArch::kLlama);
  EXPECT_TRUE(tied.tie_word_embeddings);
  EXPECT_FALSE(tied.attention_bias);
  EXPECT_FALSE(tied.qk_norm);
  EXPECT_FALSE(tied.is_moe());
  EXPECT_FALSE(tied.IsMoeLayer(0));
  EXPECT_EQ(tied.head_dim, 64);
  EXPECT_EQ(tied.num_kv_heads, 4);
  EXPECT_EQ(tied.max_position_embeddings, 4096);  // default
  EXPECT_DOUBLE_EQ(tied.rope_theta, 10000.0);      // default
  EXPECT_EQ(tied.torch_dtype, "bfloat16");         // default
  const ModelConfig untied = MustParse(With(kLlama, "tie_word_embeddings", false));
  EXPECT_EQ(untied.TotalParams() - tied.TotalParams(), int64_t{32000} * 2048);
  // TinyLlama-1.1B has 1,100,048,384 parameters.
  EXPECT_EQ(untied.TotalParams(), 1100048384);
  EXPECT_EQ(untied.ActiveParams(), untied.TotalParams());

  // num_key_value_heads defaults to num_attention_heads; attention_bias is read for llama and
  // (as in HF) puts a bias on o_proj as well as q/k/v.
  const ModelConfig mha = MustParse(Without(kLlama, "num_key_value_heads"));
  EXPECT_EQ(mha.num_kv_heads, 32);
  const ModelConfig biased = MustParse(With(kLlama, "attention_bias", true));
  EXPECT_TRUE(biased.attention_bias);
  EXPECT_EQ(biased.TotalParams() - tied.TotalParams(),
            int64_t{22} * (2048 + 2 * 256 + 2048));
}

TEST(ParseModelConfig, Qwen3DenseExplicitHeadDim) {
  const ModelConfig c = MustParse(kQwen3Dense);
  EXPECT_EQ(c.arch, ModelArch::kQwen3);
  EXPECT_EQ(c.head_dim, 128);  // not 1024 / 16
  EXPECT_EQ(c.q_dim(), 2048);
  EXPECT_EQ(c.kv_dim(), 1024);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.is_moe());
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);  // integer-valued JSON number
  // Qwen3-0.6B: 0.6B total, 0.44B without embeddings.
  EXPECT_NEAR(static_cast<double>(c.TotalParams()), 0.596e9, 0.005e9);
  EXPECT_NEAR(static_cast<double>(c.TotalParams() - int64_t{151936} * 1024), 0.44e9, 0.005e9);
  // A null head_dim means "derive it".
  EXPECT_EQ(MustParse(With(kQwen3Dense, "head_dim", nullptr)).head_dim, 64);
  EXPECT_EQ(MustParse(Without(kQwen3Dense, "head_dim")).head_dim, 64);
  // All-full-attention layer_types (newer transformers) is accepted.
  EXPECT_EQ(MustParse(With(kQwen3Dense, "layer_types",
                           std::vector<std::string>(28, "full_attention")))
                .num_layers,
            28);
}

TEST(ParseModelConfig, IsMoeLayerWithMlpOnlyLayersAndSparseStep) {
  std::string text = With(kQwen3MoeHub4x, "num_hidden_layers", 8);
  text = With(text, "decoder_sparse_step", 2);
  text = With(text, "mlp_only_layers", {5, 3});
  const ModelConfig c = MustParse(text);
  EXPECT_EQ(c.decoder_sparse_step, 2);
  EXPECT_THAT(c.mlp_only_layers, ElementsAre(3, 5));
  std::vector<int> moe_layers;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.IsMoeLayer(l)) moe_layers.push_back(l);
  }
  // (l + 1) % 2 == 0 -> 1, 3, 5, 7; minus mlp_only_layers 3 and 5.
  EXPECT_THAT(moe_layers, ElementsAre(1, 7));
  EXPECT_EQ(SpecParams(c), c.TotalParams());

  // Dense layers need a dense MLP width.
  absl::StatusOr<ModelConfig> no_width =
      ParseModelConfig(Without(text, "intermediate_size"), "cfg/config.json");
  ASSERT_FALSE(no_width.ok());
  EXPECT_THAT(no_width.status().message(),
              AllOf(HasSubstr("cfg/config.json"), HasSubstr("'intermediate_size'")));
  // ...but an all-MoE model does not.
  EXPECT_EQ(MustParse(Without(kQwen3MoeHub4x, "intermediate_size")).intermediate_size, 0);
}

TEST(ModelConfig, IsMoeLayerOnHandBuiltConfig) {
  ModelConfig c;
  c.num_layers = 6;
  c.num_experts = 4;
  c.decoder_sparse_step = 3;
  c.mlp_only_layers = {5, 0};  // unsorted is fine
  EXPECT_FALSE(c.IsMoeLayer(0));
  EXPECT_FALSE(c.IsMoeLayer(1));
  EXPECT_TRUE(c.IsMoeLayer(2));
  EXPECT_FALSE(c.IsMoeLayer(4));
  EXPECT_FALSE(c.IsMoeLayer(5));  // (5 + 1) % 3 == 0 but listed in mlp_only_layers
  c.num_experts = 0;
  EXPECT_FALSE(c.IsMoeLayer(2));
}

TEST(ModelConfig, ArchNames) {
  EXPECT_EQ(ModelArchName(ModelArch::kLlama), "llama");
  EXPECT_EQ(ModelArchName(ModelArch::kQwen3), "qwen3");
  EXPECT_EQ(ModelArchName(ModelArch::kQwen2Moe), "qwen2_moe");
  EXPECT_EQ(ModelArchName(ModelArch::kQwen3Moe), "qwen3_moe");
  EXPECT_EQ(ModelArchName(ModelArch::kMixtral), "mixtral");
}

// ---------------------------------------------------------------------------------------------
// Errors

absl::Status ParseError(const std::string& text, const char* source = "config.json") {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(text, source);
  EXPECT_FALSE(c.ok()) << "parsed unexpectedly";
  return c.ok() ? absl::OkStatus() : c.status();
}

TEST(ParseModelConfigErrors, MalformedJson) {
  const absl::Status s = ParseError(R"({"model_type": "qwen3", "hidden_size": })", "m/config.json");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("m/config.json"), HasSubstr("malformed JSON"),
                                 HasSubstr("byte 40")));
  EXPECT_THAT(ParseError("").message(), HasSubstr("config.json"));
  EXPECT_THAT(ParseError("[1, 2]").message(), HasSubstr("JSON object"));
}

TEST(ParseModelConfigErrors, ModelType) {
  absl::Status s = ParseError(With(kLlama, "model_type", "gemma2"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("config.json"), HasSubstr("'model_type'"),
                                 HasSubstr("gemma2"), HasSubstr("llama, qwen3, qwen2_moe, "
                                                                "qwen3_moe, mixtral")));
  // Missing model_type is an error even when architectures names a known class.
  s = ParseError(Without(kLlama, "model_type"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("'model_type'"), HasSubstr("'architectures'"),
                                 HasSubstr("LlamaForCausalLM"), HasSubstr("qwen3_moe")));
  s = ParseError(With(kLlama, "model_type", 7));
  EXPECT_THAT(s.message(), HasSubstr("field 'model_type': expected a string, got 7"));
}

TEST(ParseModelConfigErrors, WrongFieldTypeNamesField) {
  absl::Status s = ParseError(With(kQwen3MoeHub4x, "num_attention_heads", "abc"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            R"(config.json: field 'num_attention_heads': expected a positive integer, got "abc")");
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "hidden_size", 20.5)).message(),
              HasSubstr("field 'hidden_size'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "vocab_size", -1)).message(),
              HasSubstr("field 'vocab_size'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "num_hidden_layers", 1e12)).message(),
              HasSubstr("field 'num_hidden_layers'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "tie_word_embeddings", "false")).message(),
              HasSubstr("field 'tie_word_embeddings': expected true or false"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "rms_norm_eps", 0)).message(),
              HasSubstr("field 'rms_norm_eps'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "rope_theta", "1e6")).message(),
              HasSubstr("field 'rope_theta'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "mlp_only_layers", {1, "x"})).message(),
              HasSubstr("field 'mlp_only_layers[1]'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "torch_dtype", 16)).message(),
              HasSubstr("field 'torch_dtype'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeSave5x, "rope_parameters",
                              {{"rope_theta", "big"}, {"rope_type", "default"}}))
                  .message(),
              HasSubstr("field 'rope_parameters.rope_theta'"));
  EXPECT_THAT(ParseError(Without(kQwen3MoeHub4x, "vocab_size")).message(),
              HasSubstr("missing required field 'vocab_size'"));
  // Integral floats are integers.
  EXPECT_EQ(MustParse(With(kQwen3MoeHub4x, "hidden_size", 2048.0)).hidden_size, 2048);
}

TEST(ParseModelConfigErrors, ShapeInconsistencies) {
  absl::Status s = ParseError(With(kQwen3MoeHub4x, "num_key_value_heads", 5));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("config.json"), HasSubstr("'num_key_value_heads'")));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "num_key_value_heads", 64)).message(),
              HasSubstr("'num_key_value_heads'"));

  s = ParseError(With(kQwen3MoeHub4x, "num_experts_per_tok", 129));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("config.json"), HasSubstr("'num_experts_per_tok'")));

  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "head_dim", 127)).message(),
              AllOf(HasSubstr("'head_dim'"), HasSubstr("even")));
  // hidden_size not divisible by heads and no head_dim to fall back on.
  EXPECT_THAT(ParseError(With(Without(kLlama, "head_dim"), "hidden_size", 2050)).message(),
              HasSubstr("'head_dim'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "mlp_only_layers", {48})).message(),
              AllOf(HasSubstr("'mlp_only_layers'"), HasSubstr("48")));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "decoder_sparse_step", 0)).message(),
              HasSubstr("'decoder_sparse_step'"));
  // An MoE architecture without experts is not silently dense.
  EXPECT_THAT(ParseError(Without(kQwen3MoeHub4x, "num_experts")).message(),
              HasSubstr("'num_experts'"));
  EXPECT_THAT(ParseError(Without(kMixtral, "num_local_experts")).message(),
              HasSubstr("'num_local_experts'"));
  EXPECT_THAT(ParseError(With(kMixtral, "num_experts", 4)).message(),
              AllOf(HasSubstr("num_experts"), HasSubstr("num_local_experts")));
  EXPECT_THAT(ParseError(Without(kQwen3MoeHub4x, "moe_intermediate_size")).message(),
              HasSubstr("'moe_intermediate_size'"));
  // Sizes whose products could overflow.
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "vocab_size", 1 << 25)).message(),
              HasSubstr("'vocab_size'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "num_experts", 5000)).message(),
              HasSubstr("'num_experts'"));
  EXPECT_THAT(ParseError(With(kQwen3MoeHub4x, "hidden_size", 2000000000)).message(),
              HasSubstr("'hidden_size'"));
}

TEST(ParseModelConfigErrors, RopeScalingUnimplemented) {
  absl::Status s = ParseError(With(kQwen3MoeHub4x, "rope_scaling",
                                   {{"rope_type", "yarn"}, {"factor", 4.0},
                                    {"original_max_position_embeddings", 32768}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("config.json"), HasSubstr("'rope_scaling'"),
                                 HasSubstr("yarn")));
  // Old spelling of the type key.
  s = ParseError(With(kLlama, "rope_scaling", {{"type", "linear"}, {"factor", 2.0}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("linear"));
  // 5.x spelling.
  s = ParseError(With(kQwen3MoeSave5x, "rope_parameters",
                      {{"rope_theta", 5e5}, {"rope_type", "llama3"}, {"factor", 8.0}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("'rope_parameters.rope_type'"), HasSubstr("llama3")));
}

TEST(ParseModelConfigErrors, SlidingWindowUnimplemented) {
  absl::Status s = ParseError(With(kQwen3MoeHub4x, "use_sliding_window", true));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("config.json"), HasSubstr("'use_sliding_window'")));
  EXPECT_EQ(ParseError(With(kQwen2Moe, "use_sliding_window", true)).code(),
            absl::StatusCode::kUnimplemented);

  s = ParseError(With(kMixtral, "sliding_window", 4096));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("config.json"), HasSubstr("'sliding_window'")));
  // A window covering every position is plain causal attention.
  EXPECT_EQ(MustParse(With(kMixtral, "sliding_window", 32768)).num_experts, 8);
  EXPECT_EQ(ParseError(With(kLlama, "sliding_window", 1024)).code(),
            absl::StatusCode::kUnimplemented);

  s = ParseError(With(kQwen3Dense, "layer_types",
                      {"full_attention", "sliding_attention", "full_attention"}));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("'layer_types[1]'"));
}

TEST(ParseModelConfigErrors, MlpBiasUnimplemented) {
  EXPECT_FALSE(MustParse(With(kLlama, "mlp_bias", false)).is_moe());
  const absl::Status s = ParseError(With(kLlama, "mlp_bias", true));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("config.json"), HasSubstr("'mlp_bias'")));
}

TEST(ParseModelConfigErrors, HiddenActUnimplemented) {
  const absl::Status s = ParseError(With(kQwen3MoeHub4x, "hidden_act", "gelu"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("config.json"), HasSubstr("'hidden_act'"),
                                 HasSubstr("gelu")));
  // Absent means silu.
  EXPECT_EQ(MustParse(Without(kQwen3MoeHub4x, "hidden_act")).num_experts, 128);
}

TEST(ValidateModelConfig, NamesSourceAndField) {
  ModelConfig c = MustPreset("tiny-dense");
  EXPECT_TRUE(ValidateModelConfig(c, "x").ok());
  c.num_kv_heads = 3;
  absl::Status s = ValidateModelConfig(c, "my-source");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("my-source"), HasSubstr("num_key_value_heads")));

  c = MustPreset("tiny-dense");
  c.num_experts = 4;  // a dense architecture with experts
  EXPECT_THAT(ValidateModelConfig(c, "s").message(), HasSubstr("num_experts"));

  c = MustPreset("tiny-moe");
  c.moe_intermediate_size = 0;
  EXPECT_THAT(ValidateModelConfig(c, "s").message(), HasSubstr("moe_intermediate_size"));
  c = MustPreset("tiny-moe");
  c.num_experts_per_tok = 0;
  EXPECT_THAT(ValidateModelConfig(c, "s").message(), HasSubstr("num_experts_per_tok"));
  c = MustPreset("tiny-moe");
  c.rope_theta = 0;
  EXPECT_THAT(ValidateModelConfig(c, "s").message(), HasSubstr("rope_theta"));
  c = MustPreset("tiny-moe");
  c.rms_norm_eps = -1;
  EXPECT_THAT(ValidateModelConfig(c, "s").message(), HasSubstr("rms_norm_eps"));
  c = MustPreset("tiny-moe");
  c.num_layers = 5000;
  EXPECT_THAT(ValidateModelConfig(c, "s").message(), HasSubstr("num_hidden_layers"));
}

// ---------------------------------------------------------------------------------------------
// Presets

// ---------------------------------------------------------------------------------------------
// Hybrid models: Qwen3-Next and Qwen3.5

// Qwen3-Next-80B-A3B as the Hub ships it (transformers 4.x spellings).
constexpr char kQwen3Next[] = R"({
  "architectures": ["Qwen3NextForCausalLM"],
  "attention_bias": false,
  "decoder_sparse_step": 1,
  "full_attention_interval": 4,
  "head_dim": 256,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 5120,
  "linear_conv_kernel_dim": 4,
  "linear_key_head_dim": 128,
  "linear_num_key_heads": 16,
  "linear_num_value_heads": 32,
  "linear_value_head_dim": 128,
  "max_position_embeddings": 262144,
  "mlp_only_layers": [],
  "model_type": "qwen3_next",
  "moe_intermediate_size": 512,
  "norm_topk_prob": true,
  "num_attention_heads": 16,
  "num_experts": 512,
  "num_experts_per_tok": 10,
  "num_hidden_layers": 48,
  "num_key_value_heads": 2,
  "partial_rotary_factor": 0.25,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 10000000,
  "shared_expert_intermediate_size": 512,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// A Qwen3.5 MoE multimodal save: the language model in text_config (transformers 5.x), RoPE in
// rope_parameters with multimodal sections, the layer pattern spelled out.
std::string Qwen35Wrapper(int layers = 8) {
  json layer_types = json::array();
  for (int i = 0; i < layers; ++i)
    layer_types.push_back((i + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  json text = {{"model_type", "qwen3_5_moe_text"},
               {"hidden_size", 4096},
               {"num_hidden_layers", layers},
               {"num_attention_heads", 32},
               {"num_key_value_heads", 2},
               {"head_dim", 256},
               {"hidden_act", "silu"},
               {"linear_num_key_heads", 16},
               {"linear_num_value_heads", 64},
               {"linear_key_head_dim", 128},
               {"linear_value_head_dim", 128},
               {"linear_conv_kernel_dim", 4},
               {"num_experts", 512},
               {"num_experts_per_tok", 10},
               {"moe_intermediate_size", 1024},
               {"shared_expert_intermediate_size", 1024},
               {"vocab_size", 248320},
               {"rms_norm_eps", 1e-6},
               {"max_position_embeddings", 262144},
               {"layer_types", layer_types},
               {"attn_output_gate", true},
               {"dtype", "bfloat16"},
               {"rope_parameters",
                {{"rope_type", "default"},
                 {"rope_theta", 10000000},
                 {"partial_rotary_factor", 0.25},
                 {"mrope_section", {11, 11, 10}},
                 {"mrope_interleaved", true}}}};
  json root = {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
               {"model_type", "qwen3_5_moe"},
               {"tie_word_embeddings", false},
               {"text_config", text},
               {"vision_config", {{"depth", 27}, {"hidden_size", 1152}}}};
  return root.dump();
}

// `text` with text_config.`key` set to `value`.
std::string WithText(const std::string& text, const std::string& key, const json& value) {
  json j = json::parse(text);
  j["text_config"][key] = value;
  return j.dump();
}

int CountFull(const ModelConfig& c) {
  int n = 0;
  for (int l = 0; l < c.num_layers; ++l) n += c.AttentionKind(l) == LayerAttention::kFull;
  return n;
}

TEST(ParseModelConfig, Qwen3NextHub) {
  const ModelConfig c = MustParse(kQwen3Next);
  EXPECT_EQ(c.arch, ModelArch::kQwen3Next);
  EXPECT_TRUE(c.is_hybrid());
  ASSERT_EQ(c.layer_attention.size(), 48u);
  EXPECT_EQ(c.AttentionKind(0), LayerAttention::kLinear);
  EXPECT_EQ(c.AttentionKind(2), LayerAttention::kLinear);
  EXPECT_EQ(c.AttentionKind(3), LayerAttention::kFull);
  EXPECT_EQ(c.AttentionKind(47), LayerAttention::kFull);
  EXPECT_EQ(CountFull(c), 12);
  // Per-kind slots (the GPU's KV cache and linear states are laid out by them).
  const std::vector<int> full = c.LayerSlots(LayerAttention::kFull);
  const std::vector<int> linear = c.LayerSlots(LayerAttention::kLinear);
  EXPECT_EQ(full[3], 0);
  EXPECT_EQ(full[47], 11);
  EXPECT_EQ(full[0], -1);
  EXPECT_EQ(linear[0], 0);
  EXPECT_EQ(linear[4], 3);
  EXPECT_EQ(linear[46], 35);
  EXPECT_EQ(linear[47], -1);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_conv_dim(), 2 * 16 * 128 + 32 * 128);
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_TRUE(c.zero_centered_norm);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_TRUE(c.IsMoeLayer(0));
  // Published as 80B total, 3B active.
  EXPECT_NEAR(static_cast<double>(c.TotalParams()), 80e9, 0.02 * 80e9);
  EXPECT_NEAR(static_cast<double>(c.ActiveParams()), 3.9e9, 0.1 * 3.9e9);
  EXPECT_EQ(SpecParams(c), c.TotalParams());
  // The preset has the same shapes.
  ExpectSameModel(c, MustPreset("qwen3-next-80b-a3b"));
  EXPECT_EQ(MustPreset("qwen3-next-80b-a3b").layer_attention, c.layer_attention);
}

TEST(ParseModelConfig, Qwen3NextLayerTypesOverrideInterval) {
  json types = json::array();
  for (int i = 0; i < 48; ++i) types.push_back(i < 2 ? "full_attention" : "linear_attention");
  const ModelConfig c = MustParse(With(kQwen3Next, "layer_types", types));
  EXPECT_EQ(c.AttentionKind(0), LayerAttention::kFull);
  EXPECT_EQ(c.AttentionKind(1), LayerAttention::kFull);
  EXPECT_EQ(c.AttentionKind(3), LayerAttention::kLinear);
  EXPECT_EQ(CountFull(c), 2);
  // Interval 2: layers 1, 3, 5, ... are full attention.
  const ModelConfig every2 = MustParse(With(kQwen3Next, "full_attention_interval", 2));
  EXPECT_EQ(every2.AttentionKind(0), LayerAttention::kLinear);
  EXPECT_EQ(every2.AttentionKind(1), LayerAttention::kFull);
  EXPECT_EQ(CountFull(every2), 24);
  // The RoPE fraction nested in rope_parameters (transformers 5.x).
  const ModelConfig nested = MustParse(
      With(Without(kQwen3Next, "partial_rotary_factor"), "rope_parameters",
           {{"rope_type", "default"}, {"rope_theta", 10000000}, {"partial_rotary_factor", 0.5}}));
  EXPECT_EQ(nested.rotary_dim(), 128);
  // Dense layers of a Qwen3-Next model use intermediate_size.
  const ModelConfig dense_first = MustParse(With(kQwen3Next, "mlp_only_layers", {0}));
  EXPECT_FALSE(dense_first.IsMoeLayer(0));
  EXPECT_EQ(SpecParams(dense_first), dense_first.TotalParams());
}

TEST(ParseModelConfig, Qwen35MoeWrapperReadsTextConfig) {
  const ModelConfig c = MustParse(Qwen35Wrapper());
  EXPECT_EQ(c.arch, ModelArch::kQwen35Moe);
  EXPECT_EQ(c.model_type, "qwen3_5_moe");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_layers, 8);
  EXPECT_EQ(CountFull(c), 2);
  EXPECT_EQ(c.AttentionKind(3), LayerAttention::kFull);
  EXPECT_EQ(c.linear_num_value_heads, 64);
  EXPECT_EQ(c.rotary_dim(), 64);  // mrope_section is accepted: text positions make it 1-D
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_TRUE(c.norm_topk_prob);  // Qwen3.5 always renormalises
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.zero_centered_norm);
  EXPECT_TRUE(c.attn_output_gate);
  for (int l = 0; l < c.num_layers; ++l) EXPECT_TRUE(c.IsMoeLayer(l)) << l;
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  // The wrapper's tie_word_embeddings decides.
  json tied = json::parse(Qwen35Wrapper());
  tied["tie_word_embeddings"] = true;
  EXPECT_TRUE(MustParse(tied.dump()).tie_word_embeddings);
  // The text-only save has the same config at the top level.
  json text_only = json::parse(Qwen35Wrapper())["text_config"];
  const ModelConfig t = MustParse(text_only.dump());
  EXPECT_EQ(t.arch, ModelArch::kQwen35Moe);
  EXPECT_EQ(t.model_type, "qwen3_5_moe_text");
  ExpectSameModel(c, t);
  // 60 layers are the published 397B-A17B.
  const ModelConfig big = MustParse(Qwen35Wrapper(60));
  EXPECT_EQ(CountFull(big), 15);
  EXPECT_NEAR(static_cast<double>(big.TotalParams()), 397e9, 0.02 * 397e9);
  EXPECT_NEAR(static_cast<double>(big.ActiveParams()), 17e9, 0.05 * 17e9);
  ExpectSameModel(big, MustPreset("qwen3.5-397b-a17b"));
  EXPECT_EQ(MustPreset("qwen3.5-397b-a17b").layer_attention, big.layer_attention);
}

TEST(ParseModelConfig, Qwen35Dense) {
  json text = json::parse(Qwen35Wrapper())["text_config"];
  for (const char* key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size"})
    text.erase(key);
  text["model_type"] = "qwen3_5_text";
  text["intermediate_size"] = 12288;
  const ModelConfig c = MustParse(text.dump());
  EXPECT_EQ(c.arch, ModelArch::kQwen35);
  EXPECT_FALSE(c.is_moe());
  EXPECT_TRUE(c.is_hybrid());
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(SpecParams(c), c.TotalParams());
  json wrapper = {{"model_type", "qwen3_5"}, {"text_config", text}};
  EXPECT_EQ(MustParse(wrapper.dump()).arch, ModelArch::kQwen35);
  text.erase("intermediate_size");
  EXPECT_THAT(ParseError(text.dump()).message(), HasSubstr("'intermediate_size'"));
}

TEST(ParseModelConfigErrors, HybridFieldsNamed) {
  // Missing or wrong fields name the nested field of a wrapper.
  json wrapper = json::parse(Qwen35Wrapper());
  wrapper["text_config"].erase("linear_num_key_heads");
  absl::Status s = ParseError(wrapper.dump(), "m/config.json");
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("m/config.json"), HasSubstr("'text_config.linear_num_key_heads'")));
  s = ParseError(WithText(Qwen35Wrapper(), "hidden_size", "big"));
  EXPECT_THAT(s.message(), HasSubstr("'text_config.hidden_size'"));
  s = ParseError(Without(Qwen35Wrapper(), "text_config"));
  EXPECT_THAT(s.message(), HasSubstr("'text_config'"));
  s = ParseError(WithText(Qwen35Wrapper(), "model_type", "qwen3_5_text"));
  EXPECT_THAT(s.message(), HasSubstr("'text_config.model_type'"));
  s = ParseError(WithText(Qwen35Wrapper(), "layer_types", {"full_attention"}));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("'text_config.layer_types'"), HasSubstr("1 entries")));
  json types = json::array();
  for (int i = 0; i < 8; ++i) types.push_back(i == 5 ? "sliding_attention" : "full_attention");
  s = ParseError(WithText(Qwen35Wrapper(), "layer_types", types));
  EXPECT_THAT(s.message(), HasSubstr("'text_config.layer_types[5]'"));
  s = ParseError(With(kQwen3Next, "linear_num_value_heads", 24));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("'linear_num_value_heads'"), HasSubstr("multiple")));
  s = ParseError(With(kQwen3Next, "partial_rotary_factor", 1.5));
  EXPECT_THAT(s.message(), HasSubstr("'partial_rotary_factor'"));
  s = ParseError(With(kQwen3Next, "attention_bias", true));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  // Partial RoPE and multimodal sections belong to hybrids.
  s = ParseError(With(kQwen3MoeHub4x, "partial_rotary_factor", 0.5));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("'partial_rotary_factor'"));
  s = ParseError(With(kQwen3MoeHub4x, "rope_parameters", {{"mrope_section", {16, 24, 24}}}));
  EXPECT_THAT(s.message(), HasSubstr("'rope_parameters.mrope_section'"));
}

TEST(Presets, TinyHybridHasBothLayerKindsAndSharedExperts) {
  const ModelConfig c = MustPreset("tiny-hybrid");
  EXPECT_TRUE(c.is_hybrid());
  EXPECT_THAT(c.layer_attention, ElementsAre(LayerAttention::kLinear, LayerAttention::kFull,
                                             LayerAttention::kLinear, LayerAttention::kFull));
  EXPECT_GT(c.shared_expert_intermediate_size, 0);
  EXPECT_GT(c.linear_num_value_heads, c.linear_num_key_heads);  // K<->V pairing matters
  for (int l = 0; l < c.num_layers; ++l) EXPECT_TRUE(c.IsMoeLayer(l));
  EXPECT_LT(c.rotary_dim(), c.head_dim);
  // Exact counts (docs/MODELS.md).
  EXPECT_EQ(c.TotalParams(), 1'288'016);
  EXPECT_EQ(c.ActiveParams(), 698'192);
  EXPECT_EQ(MustPreset("qwen3-next-80b-a3b").TotalParams(), 79'674'391'296);
  EXPECT_EQ(MustPreset("qwen3-next-80b-a3b").ActiveParams(), 3'874'929'408);
  EXPECT_EQ(MustPreset("qwen3.5-397b-a17b").TotalParams(), 396'346'350'336);
  EXPECT_EQ(MustPreset("qwen3.5-397b-a17b").ActiveParams(), 17'349'040'896);
  // A layer override keeps the pattern.
  const ModelConfig six = MustPreset("tiny-hybrid", 6);
  EXPECT_EQ(six.layer_attention.size(), 6u);
  EXPECT_EQ(six.AttentionKind(5), LayerAttention::kFull);
  EXPECT_EQ(six.AttentionKind(4), LayerAttention::kLinear);
  EXPECT_EQ(SpecParams(six), six.TotalParams());
  // The linear-attention tensors of layer 0 and the gated q_proj of layer 1.
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TensorSpec& spec : ModelTensorSpecs(c)) shapes[spec.name] = spec.shape;
  EXPECT_EQ(shapes.at("model.layers.0.linear_attn.in_proj_qkv.weight"),
            (std::vector<int64_t>{2 * 2 * 32 + 4 * 32, 128}));
  EXPECT_EQ(shapes.at("model.layers.0.linear_attn.conv1d.weight"),
            (std::vector<int64_t>{2 * 2 * 32 + 4 * 32, 1, 4}));
  EXPECT_EQ(shapes.at("model.layers.0.linear_attn.A_log"), (std::vector<int64_t>{4}));
  EXPECT_EQ(shapes.at("model.layers.0.linear_attn.norm.weight"), (std::vector<int64_t>{32}));
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.q_proj.weight"),
            (std::vector<int64_t>{2 * 4 * 32, 128}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.shared_expert_gate.weight"),
            (std::vector<int64_t>{1, 128}));
}

// tiny-hybrid at qwen3-next's attention head size: 8 q and 2 kv heads of 256 (the q_proj gated,
// twice q_dim), RoPE over the first 64 dims, the linear layers and experts tiny-hybrid's.
TEST(Presets, TinyHybridHd256HasQwen3NextsHeadSize) {
  const ModelConfig c = MustPreset("tiny-hybrid-hd256");
  const ModelConfig base = MustPreset("tiny-hybrid");
  EXPECT_EQ(c.arch, ModelArch::kQwen3Next);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.num_q_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_EQ(c.layer_attention, base.layer_attention);
  EXPECT_EQ(c.linear_key_head_dim, base.linear_key_head_dim);
  EXPECT_EQ(c.num_experts, base.num_experts);
  // Exact counts (docs/MODELS.md): tiny-hybrid's plus two full-attention layers' larger q, k, v,
  // o and norms.
  EXPECT_EQ(c.TotalParams(), 2'992'848);
  EXPECT_EQ(c.ActiveParams(), 2'403'024);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TensorSpec& spec : ModelTensorSpecs(c)) shapes[spec.name] = spec.shape;
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.q_proj.weight"),
            (std::vector<int64_t>{2 * 8 * 256, 128}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.k_proj.weight"),
            (std::vector<int64_t>{2 * 256, 128}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.o_proj.weight"),
            (std::vector<int64_t>{128, 8 * 256}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.q_norm.weight"), (std::vector<int64_t>{256}));
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_proj.weight"), 0u);
}

TEST(Presets, AllNamesLoad) {
  const std::vector<std::string> names = PresetNames();
  EXPECT_THAT(names,
              ElementsAre("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "qwen3-next-80b-a3b",
                          "qwen3.5-397b-a17b", "tiny-moe", "tiny-dense", "tiny-qwen2-moe",
                          "tiny-hybrid", "tiny-hybrid-hd256"));
  for (const std::string& name : names) {
    absl::StatusOr<ModelConfig> c = PresetConfig(name);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    EXPECT_TRUE(ValidateModelConfig(*c, name).ok()) << name;
    EXPECT_EQ(c->model_type, ModelArchName(c->arch)) << name;
    EXPECT_EQ(c->torch_dtype, "bfloat16") << name;
    EXPECT_FALSE(c->tie_word_embeddings) << name;
    // The tensor table and the parameter count agree.
    EXPECT_EQ(SpecParams(*c), c->TotalParams()) << name;
    EXPECT_LE(c->ActiveParams(), c->TotalParams()) << name;
  }
}

TEST(Presets, Shapes) {
  ModelConfig c = MustPreset("qwen3-235b-a22b");
  EXPECT_EQ(c.arch, ModelArch::kQwen3Moe);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_layers, 94);
  EXPECT_EQ(c.num_q_heads, 64);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.moe_intermediate_size, 1536);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_TRUE(c.qk_norm);

  c = MustPreset("tiny-moe");
  EXPECT_EQ(c.arch, ModelArch::kQwen3Moe);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.max_position_embeddings, 4096);

  c = MustPreset("tiny-dense");
  EXPECT_EQ(c.arch, ModelArch::kQwen3);
  EXPECT_FALSE(c.is_moe());
  EXPECT_EQ(c.intermediate_size, 384);
  EXPECT_TRUE(c.qk_norm);

  c = MustPreset("tiny-qwen2-moe");
  EXPECT_EQ(c.arch, ModelArch::kQwen2Moe);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.shared_expert_intermediate_size, 128);
  EXPECT_THAT(c.mlp_only_layers, ElementsAre(1));
  EXPECT_TRUE(c.IsMoeLayer(0));
  EXPECT_FALSE(c.IsMoeLayer(1));
  EXPECT_TRUE(c.IsMoeLayer(2));

  c = MustPreset("mixtral-8x7b");
  EXPECT_EQ(c.moe_intermediate_size, 14336);
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
}

TEST(Presets, LayerOverride) {
  EXPECT_EQ(MustPreset("qwen3-30b-a3b", 2).num_layers, 2);
  EXPECT_EQ(MustPreset("tiny-moe", 9).num_layers, 9);
  // Override below an mlp_only layer drops it.
  const ModelConfig one = MustPreset("tiny-qwen2-moe", 1);
  EXPECT_EQ(one.num_layers, 1);
  EXPECT_THAT(one.mlp_only_layers, IsEmpty());
  EXPECT_THAT(MustPreset("tiny-qwen2-moe", 2).mlp_only_layers, ElementsAre(1));
  // Params scale with layers.
  const ModelConfig full = MustPreset("qwen3-30b-a3b");
  const ModelConfig two = MustPreset("qwen3-30b-a3b", 2);
  const int64_t outside = 2 * int64_t{151936} * 2048 + 2048;  // embed + lm_head + final norm
  EXPECT_EQ((full.TotalParams() - outside) / 48, (two.TotalParams() - outside) / 2);
  EXPECT_FALSE(PresetConfig("tiny-moe", 100000).ok());
}

#ifdef INFERSWEEP_SOURCE_DIR
// 1234567 -> "1,234,567", as docs/MODELS.md writes parameter counts.
std::string WithCommas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// docs/MODELS.md's preset table has one row per preset, with its architecture and its exact
// parameter counts.
TEST(Presets, DocsTableListsEveryPresetWithItsCounts) {
  std::ifstream in(std::filesystem::path(INFERSWEEP_SOURCE_DIR) / "docs" / "MODELS.md");
  ASSERT_TRUE(in.good());
  std::map<std::string, std::string> rows;  // preset name -> its table row
  bool in_presets = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0) in_presets = line == "## Presets";
    if (!in_presets || line.rfind("| `", 0) != 0) continue;
    const size_t end = line.find('`', 3);
    ASSERT_NE(end, std::string::npos) << line;
    EXPECT_TRUE(rows.emplace(line.substr(3, end - 3), line).second) << line;
  }
  const std::vector<std::string> names = PresetNames();
  EXPECT_EQ(rows.size(), names.size());
  for (const std::string& name : names) {
    ASSERT_TRUE(rows.count(name)) << name << " has no row in docs/MODELS.md";
    const ModelConfig c = MustPreset(name);
    const std::string& row = rows[name];
    EXPECT_THAT(row, HasSubstr("| " + std::string(ModelArchName(c.arch)) + " ")) << name;
    EXPECT_THAT(row, HasSubstr(WithCommas(c.TotalParams()))) << name;
    EXPECT_THAT(row, HasSubstr(WithCommas(c.ActiveParams()))) << name;
  }
}
#endif

TEST(Presets, UnknownNameListsKnownOnes) {
  absl::StatusOr<ModelConfig> c = PresetConfig("qwen9-1t");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr("qwen9-1t"), HasSubstr("qwen3-30b-a3b"), HasSubstr("tiny-qwen2-moe")));
}

TEST(Presets, ParamCounts) {
  const ModelConfig a3b = MustPreset("qwen3-30b-a3b");
  EXPECT_NEAR(static_cast<double>(a3b.TotalParams()), 30.5e9, 0.01 * 30.5e9);
  EXPECT_GE(a3b.ActiveParams(), int64_t{2'900'000'000});
  EXPECT_LE(a3b.ActiveParams(), int64_t{3'400'000'000});
  // Exact values, hand-derivable from the shapes (see docs/MODELS.md).
  EXPECT_EQ(a3b.TotalParams(), 30'532'122'624);
  EXPECT_EQ(a3b.ActiveParams(), 3'353'032'704);

  const ModelConfig a22b = MustPreset("qwen3-235b-a22b");
  EXPECT_NEAR(static_cast<double>(a22b.TotalParams()), 235.1e9, 0.01 * 235.1e9);
  EXPECT_NEAR(static_cast<double>(a22b.ActiveParams()), 22.2e9, 0.01 * 22.2e9);

  const ModelConfig mixtral = MustPreset("mixtral-8x7b");
  EXPECT_NEAR(static_cast<double>(mixtral.TotalParams()), 46.7e9, 0.01 * 46.7e9);
  EXPECT_NEAR(static_cast<double>(mixtral.ActiveParams()), 12.9e9, 0.01 * 12.9e9);

  const ModelConfig dense = MustPreset("tiny-dense");
  EXPECT_EQ(dense.TotalParams(), dense.ActiveParams());
  // embed + lm_head + final norm + 4 x (2 norms + q,k,v,o + q/k norms + MLP)
  EXPECT_EQ(dense.TotalParams(),
            2 * 512 * 128 + 128 +
                4 * (2 * 128 + 128 * 128 * 2 + 128 * 64 * 2 + 2 * 32 + 3 * 128 * 384));
}

// ---------------------------------------------------------------------------------------------
// Checkpoints that transformers itself saved (tests/fixtures/hf, transformers 5.x): every config
// loads, and TotalParams equals the number of elements stored in the safetensors files (which
// include o_proj biases for llama attention_bias, shared experts, and no lm_head when tied).

#ifdef INFERSWEEP_SOURCE_DIR
// Sum of the element counts in one safetensors file's header.
int64_t SafetensorsElements(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  unsigned char len_bytes[8] = {};
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];
  if (len > (uint64_t{64} << 20)) {
    ADD_FAILURE() << file << ": implausible header length " << len;
    return 0;
  }
  std::string header(len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(len));
  EXPECT_TRUE(in.good()) << file;
  const json h = json::parse(header);
  int64_t total = 0;
  for (const auto& [name, info] : h.items()) {
    if (name == "__metadata__") continue;
    int64_t n = 1;
    for (const json& d : info.at("shape")) n *= d.get<int64_t>();
    total += n;
  }
  return total;
}

TEST(HfFixtures, ConfigsLoadAndParamCountsMatchCheckpoints) {
  const std::filesystem::path root =
      std::filesystem::path(INFERSWEEP_SOURCE_DIR) / "tests" / "fixtures" / "hf";
  if (!std::filesystem::is_directory(root)) GTEST_SKIP() << "no fixtures at " << root;
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(root)) {
    if (!std::filesystem::exists(entry.path() / "config.json")) continue;
    SCOPED_TRACE(entry.path().string());
    absl::StatusOr<ModelConfig> c = LoadModelConfig(entry.path().string());
    ASSERT_TRUE(c.ok()) << c.status();
    int64_t stored = 0;
    for (const auto& file : std::filesystem::directory_iterator(entry.path())) {
      if (file.path().extension() == ".safetensors") stored += SafetensorsElements(file.path());
    }
    EXPECT_EQ(c->TotalParams(), stored);
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(HfFixtures, SpecificFixtures) {
  const std::string root = std::string(INFERSWEEP_SOURCE_DIR) + "/tests/fixtures/hf/";
  if (!std::filesystem::is_directory(root)) GTEST_SKIP() << "no fixtures at " << root;
  absl::StatusOr<ModelConfig> llama = LoadModelConfig(root + "llama");
  EXPECT_TRUE(llama.ok()) << llama.status();
  if (llama.ok()) {
    EXPECT_TRUE(llama->attention_bias);
    EXPECT_TRUE(llama->tie_word_embeddings);
    EXPECT_EQ(llama->head_dim, 16);
  }
  absl::StatusOr<ModelConfig> moe = LoadModelConfig(root + "qwen3_moe");
  EXPECT_TRUE(moe.ok()) << moe.status();
  if (moe.ok()) {
    EXPECT_EQ(moe->num_experts, 4);  // spelled num_local_experts by transformers 5
    EXPECT_FALSE(moe->IsMoeLayer(0));
    EXPECT_TRUE(moe->IsMoeLayer(1));
    EXPECT_FALSE(moe->IsMoeLayer(2));
    EXPECT_TRUE(moe->IsMoeLayer(3));
  }
  absl::StatusOr<ModelConfig> q2 = LoadModelConfig(root + "qwen2_moe");
  EXPECT_TRUE(q2.ok()) << q2.status();
  if (q2.ok()) {
    EXPECT_TRUE(q2->attention_bias);
    EXPECT_EQ(q2->shared_expert_intermediate_size, 48);
    EXPECT_THAT(q2->mlp_only_layers, ElementsAre(1));
  }
  absl::StatusOr<ModelConfig> mixtral = LoadModelConfig(root + "mixtral");
  EXPECT_TRUE(mixtral.ok()) << mixtral.status();
  if (mixtral.ok()) {
    EXPECT_EQ(mixtral->head_dim, 16);  // "head_dim": null
    EXPECT_EQ(mixtral->moe_intermediate_size, 48);
    EXPECT_DOUBLE_EQ(mixtral->rope_theta, 1e6);
  }
}
#endif  // INFERSWEEP_SOURCE_DIR

// ---------------------------------------------------------------------------------------------
// LoadModelConfig

TEST(LoadModelConfig, MissingDirIsNotFoundNamingPath) {
  const std::string dir = testing::TempDir() + "/definitely-not-a-model-dir";
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr(dir + "/config.json"));
}

TEST(LoadModelConfig, ReadsConfigAndNamesPathInErrors) {
  const std::filesystem::path dir =
      std::filesystem::path(testing::TempDir()) / "model_config_test_load";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "config.json").string();
  {
    std::ofstream out(path);
    out << kMixtral;
  }
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir.string());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, ModelArch::kMixtral);
  // A trailing slash is fine.
  EXPECT_TRUE(LoadModelConfig(dir.string() + "/").ok());

  {
    std::ofstream out(path);
    out << With(kMixtral, "num_attention_heads", "abc");
  }
  c = LoadModelConfig(dir.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr(path), HasSubstr("'num_attention_heads'")));

  // config.json that is a directory.
  std::filesystem::remove(path);
  std::filesystem::create_directories(path);
  c = LoadModelConfig(dir.string());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace infersweep
