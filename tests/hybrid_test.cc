// Hybrid models (Qwen3-Next, Qwen3.5) on the CPU reference: the gated delta rule's chunked and
// recurrent forms agree, the two checkpoint layouts load to the same model, and properties of
// the math that hold whatever the weights (a zero-centred gain of -1 silences its input; a value
// head reads only its own key head).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/quant/dequantize.h"
#include "engine/cpu_model.h"
#include "engine/quant/quantize.h"
#include "engine/safetensors_writer.h"
#include "engine/weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/gated_delta.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using json = nlohmann::json;

constexpr uint16_t kBf16MinusOne = 0xBF80;

std::vector<int32_t> Prompt(int n, int vocab, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

// ---------------------------------------------------------------------------------------------
// Kernels

TEST(GatedDeltaKernels, ChunkedMatchesRecurrentAcrossChunkBoundaries) {
  const int n = 150, dk = 16, dv = 24;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::vector<float> q(n * dk), k(n * dk), v(n * dv), g(n), beta(n);
  for (float& x : q) x = uni(rng);
  for (float& x : k) x = uni(rng);
  for (float& x : v) x = uni(rng);
  cpu::L2NormalizeRows(q.data(), n, dk);
  cpu::L2NormalizeRows(k.data(), n, dk);
  for (int t = 0; t < n; ++t) {
    g[t] = -0.5f * (uni(rng) + 1.f) - 0.01f;  // decays in (0.37, 0.99)
    beta[t] = 0.5f * (uni(rng) + 1.f);
  }
  // A state carried in from earlier tokens.
  std::vector<float> start(dk * dv);
  for (float& x : start) x = 0.3f * uni(rng);

  std::vector<float> state_r = start, state_c = start, out_r(n * dv), out_c(n * dv);
  cpu::GatedDeltaRecurrent(q.data(), k.data(), v.data(), g.data(), beta.data(), n, dk, dv,
                           state_r.data(), out_r.data());
  cpu::GatedDeltaChunked(q.data(), k.data(), v.data(), g.data(), beta.data(), n, dk, dv, 64,
                         state_c.data(), out_c.data());
  EXPECT_LE(RelMaxError(out_c, out_r), 1e-5);
  EXPECT_LE(RelMaxError(state_c, state_r), 1e-5);
  // Other chunk sizes, one of them not dividing n, compute the same recurrence.
  for (int chunk : {1, 7, 150}) {
    std::vector<float> s = start, o(n * dv);
    cpu::GatedDeltaChunked(q.data(), k.data(), v.data(), g.data(), beta.data(), n, dk, dv, chunk,
                           s.data(), o.data());
    EXPECT_LE(RelMaxError(o, out_r), 1e-5) << "chunk " << chunk;
  }
}

TEST(GatedDeltaKernels, RecurrentStepByHand) {
  // dk = dv = 1: S = S e^g; d = beta (v - S k); S += k d; o = S q.
  float state = 2.f, out = 0.f;
  const float q = 0.5f, k = 1.f, v = 3.f, g = std::log(0.5f), beta = 0.25f;
  cpu::GatedDeltaRecurrent(&q, &k, &v, &g, &beta, 1, 1, 1, &state, &out);
  const float decayed = 1.f, d = 0.25f * (3.f - decayed);
  EXPECT_FLOAT_EQ(state, decayed + d);
  EXPECT_FLOAT_EQ(out, (decayed + d) * 0.5f);
}

TEST(GatedDeltaKernels, ConvIsCausalWithZeroLeftPadding) {
  // One channel, kernel [1, 2, 3]: out_t = silu(1 x_{t-2} + 2 x_{t-1} + 3 x_t).
  const float w[3] = {1.f, 2.f, 3.f};
  const MatrixRef weight{w, DType::kF32, 1, 3};
  std::vector<float> state(2, 0.f), out(3);
  const std::vector<float> in = {1.f, 10.f, 100.f};
  cpu::CausalConvSilu(in.data(), 3, 1, weight, state.data(), out.data());
  auto silu = [](float x) { return x / (1.f + std::exp(-x)); };
  EXPECT_FLOAT_EQ(out[0], silu(3.f));
  EXPECT_FLOAT_EQ(out[1], silu(2.f + 30.f));
  EXPECT_FLOAT_EQ(out[2], silu(1.f + 20.f + 300.f));
  EXPECT_EQ(state, (std::vector<float>{10.f, 100.f}));
  // The next step continues from the state.
  const float next = -1.f;
  cpu::CausalConvSilu(&next, 1, 1, weight, state.data(), out.data());
  EXPECT_FLOAT_EQ(out[0], silu(10.f + 200.f - 3.f));
}

TEST(GatedDeltaKernels, NormsByHand) {
  const std::vector<float> x = {1.f, -1.f, 1.f, -1.f};  // mean square 1
  const float w[4] = {0.f, 0.5f, -0.5f, -1.f};
  const MatrixRef gain{w, DType::kF32, 1, 4};
  std::vector<float> y(4);
  cpu::RmsNormZeroCentered(x.data(), 1, 4, gain, 0.f, y.data());
  EXPECT_THAT(y, testing::ElementsAre(1.f, -1.5f, 0.5f, -0.f));
  const std::vector<float> z = {0.f, 1.f, 2.f, 3.f};
  cpu::RmsNormGated(x.data(), z.data(), 1, 4, gain, 0.f, y.data());
  auto silu = [](float v) { return v / (1.f + std::exp(-v)); };
  EXPECT_FLOAT_EQ(y[0], 0.f);
  EXPECT_FLOAT_EQ(y[1], -0.5f * silu(1.f));
  EXPECT_FLOAT_EQ(y[2], -0.5f * silu(2.f));
  EXPECT_FLOAT_EQ(y[3], 1.f * silu(3.f));
}

// ---------------------------------------------------------------------------------------------
// The model

std::unique_ptr<HostModel> TinyHybrid(int layers = 0) {
  auto host = LoadHostModel("preset:tiny-hybrid", {layers, 1});
  EXPECT_TRUE(host.ok()) << host.status();
  return host.ok() ? std::move(*host) : nullptr;
}

// The bf16 buffer behind a synthetic model's tensor.
std::vector<uint16_t>& Buffer(HostModel& host, const std::string& name) {
  for (size_t i = 0; i < host.specs.size(); ++i)
    if (host.specs[i].name == name) return host.synthetic[i];
  ADD_FAILURE() << "no tensor " << name;
  static std::vector<uint16_t> none;
  return none;
}

std::vector<float> PrefillLogits(const HostModel& host, const std::vector<int32_t>& prompt) {
  auto model = MakeCpuModel(host);
  const int n = static_cast<int>(prompt.size());
  EXPECT_TRUE(model->StartBatch(1, n).ok());
  std::vector<float> logits;
  EXPECT_TRUE(model->Forward(prompt, n, LogitsMode::kAll, &logits).ok());
  return logits;
}

TEST(HybridModel, ChunkedPrefillMatchesTokenByTokenDecode) {
  auto host = TinyHybrid();
  ASSERT_NE(host, nullptr);
  const int vocab = host->config.vocab_size, n = 100;  // two chunks, the second partial
  const std::vector<int32_t> prompt = Prompt(n, vocab);
  const std::vector<float> prefill = PrefillLogits(*host, prompt);

  auto model = MakeCpuModel(*host);
  ASSERT_TRUE(model->StartBatch(1, n).ok());
  std::vector<float> steps, step;
  for (int t = 0; t < n; ++t) {
    ASSERT_TRUE(model->Forward({&prompt[t], 1}, 1, LogitsMode::kLast, &step).ok());
    steps.insert(steps.end(), step.begin(), step.end());
  }
  const double rel = RelMaxError(prefill, steps);
  std::printf("# prefill vs decode: max rel %.3g\n", rel);
  EXPECT_LE(rel, 1e-5);

  // A chunked prefill continuing from a carried state (70 tokens, then 30 at once).
  ASSERT_TRUE(model->StartBatch(1, n).ok());
  std::vector<float> first, rest;
  ASSERT_TRUE(model->Forward({prompt.data(), 70}, 70, LogitsMode::kAll, &first).ok());
  ASSERT_TRUE(model->Forward({prompt.data() + 70, 30}, 30, LogitsMode::kAll, &rest).ok());
  first.insert(first.end(), rest.begin(), rest.end());
  EXPECT_LE(RelMaxError(first, prefill), 1e-5);

  // Batch rows keep their own state.
  const std::vector<int32_t> other = Prompt(n, vocab, 11);
  std::vector<int32_t> both = prompt;
  both.insert(both.end(), other.begin(), other.end());
  ASSERT_TRUE(model->StartBatch(2, n).ok());
  std::vector<float> batched;
  ASSERT_TRUE(model->Forward(both, n, LogitsMode::kAll, &batched).ok());
  const std::vector<float> row0(batched.begin(), batched.begin() + n * vocab);
  const std::vector<float> row1(batched.begin() + n * vocab, batched.end());
  EXPECT_LE(RelMaxError(row0, prefill), 1e-6);
  EXPECT_LE(RelMaxError(row1, PrefillLogits(*host, other)), 1e-6);
}

// (1 + w) with w = -1 is zero: the final norm silences every logit. A plain gain of -1 would
// negate them instead.
TEST(HybridModel, ZeroCentredFinalNormOfMinusOneSilencesLogits) {
  auto host = TinyHybrid(2);
  ASSERT_NE(host, nullptr);
  const std::vector<int32_t> prompt = Prompt(5, host->config.vocab_size);
  const std::vector<float> before = PrefillLogits(*host, prompt);
  EXPECT_GT(*std::max_element(before.begin(), before.end()), 0.f);
  std::vector<uint16_t>& norm = Buffer(*host, "model.norm.weight");
  std::fill(norm.begin(), norm.end(), kBf16MinusOne);
  for (float v : PrefillLogits(*host, prompt)) ASSERT_EQ(v, 0.f);
}

// A linear-attention layer whose input norm gain is -1 sees zeros and adds nothing: the same
// logits as with its out_proj zeroed.
TEST(HybridModel, ZeroCentredInputNormOfMinusOneSilencesLinearLayer) {
  auto silenced = TinyHybrid(2);
  auto zeroed = TinyHybrid(2);
  ASSERT_NE(silenced, nullptr);
  ASSERT_EQ(silenced->config.AttentionKind(0), LayerAttention::kLinear);
  std::vector<uint16_t>& norm = Buffer(*silenced, "model.layers.0.input_layernorm.weight");
  std::fill(norm.begin(), norm.end(), kBf16MinusOne);
  std::vector<uint16_t>& out = Buffer(*zeroed, "model.layers.0.linear_attn.out_proj.weight");
  std::fill(out.begin(), out.end(), 0);
  const std::vector<int32_t> prompt = Prompt(9, silenced->config.vocab_size);
  EXPECT_EQ(PrefillLogits(*silenced, prompt), PrefillLogits(*zeroed, prompt));
}

// Value head j reads key head j / (Hv / Hk). With key head 1's k rows zeroed, value heads 2 and
// 3 (tiny-hybrid: Hk 2, Hv 4) never write their state and output zeros; zeroing out_proj's
// columns of heads 0 and 1 then silences the layer. Pairing j with key head j % Hk would leave
// value head 2 reading key head 0.
TEST(HybridModel, ValueHeadsReadTheirOwnKeyHead) {
  auto paired = TinyHybrid(2);
  auto zeroed = TinyHybrid(2);
  ASSERT_NE(paired, nullptr);
  const ModelConfig& c = paired->config;
  ASSERT_EQ(c.linear_num_key_heads, 2);
  ASSERT_EQ(c.linear_num_value_heads, 4);
  const int64_t hidden = c.hidden_size, dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t key_dim = c.linear_key_dim(), value_dim = c.linear_value_dim();
  std::vector<uint16_t>& qkv = Buffer(*paired, "model.layers.0.linear_attn.in_proj_qkv.weight");
  for (int64_t row = key_dim + dk; row < key_dim + 2 * dk; ++row)  // k of key head 1
    std::fill_n(qkv.begin() + row * hidden, hidden, 0);
  std::vector<uint16_t>& out = Buffer(*paired, "model.layers.0.linear_attn.out_proj.weight");
  for (int64_t row = 0; row < hidden; ++row)  // [hidden, value_dim]: heads 0 and 1
    std::fill_n(out.begin() + row * value_dim, 2 * dv, 0);
  std::vector<uint16_t>& all = Buffer(*zeroed, "model.layers.0.linear_attn.out_proj.weight");
  std::fill(all.begin(), all.end(), 0);
  const std::vector<int32_t> prompt = Prompt(9, c.vocab_size);
  EXPECT_EQ(PrefillLogits(*paired, prompt), PrefillLogits(*zeroed, prompt));
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: Qwen3.5's flat layout (multimodal wrapper, fused experts) and Qwen3-Next's grouped
// one (per-expert tensors) holding the same logical weights as the tiny-hybrid preset.

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<uint16_t> bf16;
};

// The preset's tensors by canonical name.
std::map<std::string, Tensor> PresetTensors(const HostModel& host) {
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < host.specs.size(); ++i) {
    const auto* data = static_cast<const uint16_t*>(host.tensors[i].data);
    out[host.specs[i].name] = {host.specs[i].name, host.specs[i].shape,
                               std::vector<uint16_t>(data, data + host.specs[i].numel())};
  }
  return out;
}

json TextConfig(const ModelConfig& c, const std::string& model_type) {
  json types = json::array();
  for (int l = 0; l < c.num_layers; ++l)
    types.push_back(c.AttentionKind(l) == LayerAttention::kFull ? "full_attention"
                                                                : "linear_attention");
  return {{"model_type", model_type},
          {"hidden_size", c.hidden_size},
          {"num_hidden_layers", c.num_layers},
          {"num_attention_heads", c.num_q_heads},
          {"num_key_value_heads", c.num_kv_heads},
          {"head_dim", c.head_dim},
          {"linear_num_key_heads", c.linear_num_key_heads},
          {"linear_num_value_heads", c.linear_num_value_heads},
          {"linear_key_head_dim", c.linear_key_head_dim},
          {"linear_value_head_dim", c.linear_value_head_dim},
          {"linear_conv_kernel_dim", c.linear_conv_kernel_dim},
          {"num_experts", c.num_experts},
          {"num_experts_per_tok", c.num_experts_per_tok},
          {"moe_intermediate_size", c.moe_intermediate_size},
          {"shared_expert_intermediate_size", c.shared_expert_intermediate_size},
          {"vocab_size", c.vocab_size},
          {"rms_norm_eps", c.rms_norm_eps},
          {"max_position_embeddings", c.max_position_embeddings},
          {"layer_types", types},
          {"rope_parameters",
           {{"rope_type", "default"},
            {"rope_theta", c.rope_theta},
            {"partial_rotary_factor", c.partial_rotary_factor},
            {"mrope_section", {2, 1, 1}},
            {"mrope_interleaved", true}}}};
}

void WriteFolder(const std::string& dir, const json& config, const std::vector<Tensor>& tensors) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.dump(1);
  std::vector<SafetensorsTensorToWrite> out;
  for (const Tensor& t : tensors)
    out.push_back({t.name,
                   DType::kBF16,
                   t.shape,
                   {reinterpret_cast<const uint8_t*>(t.bf16.data()), t.bf16.size() * 2}});
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", out).ok());
}

// Rows [begin, end) of a [rows, cols] tensor.
std::vector<uint16_t> Rows(const Tensor& t, int64_t begin, int64_t end) {
  const int64_t cols = t.shape.back();
  return {t.bf16.begin() + begin * cols, t.bf16.begin() + end * cols};
}

void Append(std::vector<uint16_t>& to, const std::vector<uint16_t>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

// Qwen3.5 multimodal: model.language_model.*, fused experts, plus vision and MTP tensors.
std::vector<Tensor> FlatLayout(const ModelConfig& c, const std::map<std::string, Tensor>& w) {
  std::vector<Tensor> out;
  const int64_t hidden = c.hidden_size, inter = c.moe_intermediate_size;
  for (const auto& [name, t] : w) {
    if (name.find(".mlp.experts.") != std::string::npos) continue;
    Tensor renamed = t;
    if (name.rfind("model.", 0) == 0) renamed.name = "model.language_model." + name.substr(6);
    out.push_back(std::move(renamed));
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".mlp.experts.");
    Tensor gate_up{absl::StrCat("model.language_model.layers.", l, ".mlp.experts.gate_up_proj"),
                   {c.num_experts, 2 * inter, hidden},
                   {}};
    Tensor down{absl::StrCat("model.language_model.layers.", l, ".mlp.experts.down_proj"),
                {c.num_experts, hidden, inter},
                {}};
    for (int e = 0; e < c.num_experts; ++e) {
      Append(gate_up.bf16, w.at(absl::StrCat(p, e, ".gate_proj.weight")).bf16);
      Append(gate_up.bf16, w.at(absl::StrCat(p, e, ".up_proj.weight")).bf16);
      Append(down.bf16, w.at(absl::StrCat(p, e, ".down_proj.weight")).bf16);
    }
    out.push_back(std::move(gate_up));
    out.push_back(std::move(down));
  }
  out.push_back({"model.visual.patch_embed.proj.weight", {4, 3}, std::vector<uint16_t>(12, 1)});
  out.push_back({"mtp.fc.weight", {2, 2}, std::vector<uint16_t>(4, 2)});
  return out;
}

// Qwen3-Next: model.layers.*, per-expert tensors, in_proj_qkvz and in_proj_ba grouped per key
// head: [q_g | k_g | v_g | z_g] and [b_g | a_g], v_g and z_g holding the group's value heads.
std::vector<Tensor> GroupedLayout(const ModelConfig& c, const std::map<std::string, Tensor>& w) {
  std::vector<Tensor> out;
  const int64_t hidden = c.hidden_size, dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t key_heads = c.linear_num_key_heads, key_dim = c.linear_key_dim();
  const int64_t per_key = c.linear_num_value_heads / key_heads;
  for (const auto& [name, t] : w) {
    const bool flat = name.find("in_proj_qkv.") != std::string::npos ||
                      name.find("in_proj_z.") != std::string::npos ||
                      name.find("in_proj_b.") != std::string::npos ||
                      name.find("in_proj_a.") != std::string::npos;
    if (!flat) out.push_back(t);
  }
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.AttentionKind(l) != LayerAttention::kLinear) continue;
    const std::string p = absl::StrCat("model.layers.", l, ".linear_attn.");
    const Tensor& qkv = w.at(p + "in_proj_qkv.weight");
    const Tensor& z = w.at(p + "in_proj_z.weight");
    const Tensor& b = w.at(p + "in_proj_b.weight");
    const Tensor& a = w.at(p + "in_proj_a.weight");
    Tensor qkvz{p + "in_proj_qkvz.weight", {2 * key_dim + 2 * c.linear_value_dim(), hidden}, {}};
    Tensor ba{p + "in_proj_ba.weight", {2 * c.linear_num_value_heads, hidden}, {}};
    for (int64_t g = 0; g < key_heads; ++g) {
      Append(qkvz.bf16, Rows(qkv, g * dk, (g + 1) * dk));
      Append(qkvz.bf16, Rows(qkv, key_dim + g * dk, key_dim + (g + 1) * dk));
      const int64_t v0 = g * per_key * dv, v1 = (g + 1) * per_key * dv;
      Append(qkvz.bf16, Rows(qkv, 2 * key_dim + v0, 2 * key_dim + v1));
      Append(qkvz.bf16, Rows(z, v0, v1));
      Append(ba.bf16, Rows(b, g * per_key, (g + 1) * per_key));
      Append(ba.bf16, Rows(a, g * per_key, (g + 1) * per_key));
    }
    out.push_back(std::move(qkvz));
    out.push_back(std::move(ba));
  }
  return out;
}

class HybridCheckpoint : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("hybrid-ckpt");
    ASSERT_FALSE(dir_.empty());
    preset_ = TinyHybrid();
    ASSERT_NE(preset_, nullptr);
    weights_ = PresetTensors(*preset_);
    const ModelConfig& c = preset_->config;
    flat_config_ = {{"model_type", "qwen3_5_moe"},
                    {"tie_word_embeddings", false},
                    {"text_config", TextConfig(c, "qwen3_5_moe_text")},
                    {"vision_config", {{"depth", 1}}}};
    grouped_config_ = TextConfig(c, "qwen3_next");
    grouped_config_.erase("layer_types");
    grouped_config_.erase("rope_parameters");
    grouped_config_["full_attention_interval"] = 2;
    grouped_config_["partial_rotary_factor"] = c.partial_rotary_factor;
    grouped_config_["rope_theta"] = c.rope_theta;
    grouped_config_["norm_topk_prob"] = true;
    grouped_config_["decoder_sparse_step"] = 1;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string dir_;
  std::unique_ptr<HostModel> preset_;
  std::map<std::string, Tensor> weights_;
  json flat_config_, grouped_config_;
};

TEST_F(HybridCheckpoint, BothLayoutsLoadToThePresetsLogits) {
  const ModelConfig& c = preset_->config;
  WriteFolder(dir_ + "/flat", flat_config_, FlatLayout(c, weights_));
  WriteFolder(dir_ + "/grouped", grouped_config_, GroupedLayout(c, weights_));
  auto flat = LoadHostModel(dir_ + "/flat");
  ASSERT_TRUE(flat.ok()) << flat.status();
  auto grouped = LoadHostModel(dir_ + "/grouped");
  ASSERT_TRUE(grouped.ok()) << grouped.status();
  EXPECT_EQ((*flat)->config.arch, ModelArch::kQwen35Moe);
  EXPECT_EQ((*grouped)->config.arch, ModelArch::kQwen3Next);

  const std::vector<int32_t> prompt = Prompt(80, c.vocab_size);
  const std::vector<float> expected = PrefillLogits(*preset_, prompt);
  EXPECT_EQ(PrefillLogits(**flat, prompt), expected);
  EXPECT_EQ(PrefillLogits(**grouped, prompt), expected);
}

TEST_F(HybridCheckpoint, WrongShapeOrMissingTensorIsNamed) {
  const ModelConfig& c = preset_->config;
  std::vector<Tensor> grouped = GroupedLayout(c, weights_);
  for (Tensor& t : grouped)
    if (t.name == "model.layers.0.linear_attn.in_proj_ba.weight") {
      t.shape[0] -= 2;
      t.bf16.resize(t.bf16.size() - 2 * c.hidden_size);
    }
  WriteFolder(dir_ + "/ba", grouped_config_, grouped);
  auto bad = LoadHostModel(dir_ + "/ba");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(),
              AllOf(HasSubstr("model.layers.0.linear_attn.in_proj_ba.weight"),
                    HasSubstr("[6, 128]"), HasSubstr("expected [8, 128]")));

  std::vector<Tensor> flat = FlatLayout(c, weights_);
  for (Tensor& t : flat)
    if (t.name == "model.language_model.layers.2.linear_attn.conv1d.weight")
      t.shape = {t.shape[0], t.shape[2], 1};
  WriteFolder(dir_ + "/conv", flat_config_, flat);
  bad = LoadHostModel(dir_ + "/conv");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(),
              AllOf(HasSubstr("model.language_model.layers.2.linear_attn.conv1d.weight"),
                    HasSubstr("expected [256, 1, 4]")));

  flat = FlatLayout(c, weights_);
  std::erase_if(flat, [](const Tensor& t) {
    return t.name == "model.language_model.layers.0.linear_attn.A_log";
  });
  WriteFolder(dir_ + "/missing", flat_config_, flat);
  bad = LoadHostModel(dir_ + "/missing");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(bad.status().message(), HasSubstr("'model.layers.0.linear_attn.A_log'"));
}

// A Qwen3-Next checkpoint whose grouped in_proj_qkvz is quantized (the other linears declared
// excluded by pattern): the loader gathers the quantized rows of in_proj_qkv and in_proj_z, so
// they dequantize to the grouped tensor's rows in the flat order, and the model runs.
void WriteQuantizedGrouped(const std::string& dir, const json& config, const ModelConfig& c,
                           const std::map<std::string, Tensor>& weights, QuantFormat format,
                           std::map<std::string, QuantizedMatrix>* grouped_quantized) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.dump(1);
  const char* algo = format == QuantFormat::kNvfp4 ? "NVFP4" : "FP8_PER_CHANNEL_PER_TOKEN";
  const json hf = {{"quantization",
                    {{"quant_algo", algo},
                     {"exclude_modules", {"lm_head", "*self_attn*", "*mlp*", "*out_proj*"}}}}};
  std::ofstream(dir + "/hf_quant_config.json") << hf.dump(1);
  const std::vector<Tensor> tensors = GroupedLayout(c, weights);
  std::vector<SafetensorsTensorToWrite> out;
  for (const Tensor& t : tensors) {
    const std::string kQkvz = "in_proj_qkvz.weight";
    if (!t.name.ends_with(kQkvz)) {
      out.push_back({t.name,
                     DType::kBF16,
                     t.shape,
                     {reinterpret_cast<const uint8_t*>(t.bf16.data()), t.bf16.size() * 2}});
      continue;
    }
    auto q = QuantizeMatrix(format, MatrixRef{t.bf16.data(), DType::kBF16, t.shape[0], t.shape[1]});
    ASSERT_TRUE(q.ok()) << q.status();
    QuantizedMatrix& stored = (*grouped_quantized)[t.name] = *std::move(q);
    const std::string module = t.name.substr(0, t.name.size() - 7);
    for (size_t i = 0; i < stored.parts.size(); ++i)
      out.push_back({module + stored.layout[i].suffix, stored.layout[i].dtypes.front(),
                     stored.layout[i].shape, stored.parts[i]});
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", out).ok());
}

TEST_F(HybridCheckpoint, QuantizedGroupedProjectionsAreUngroupedRowByRow) {
  const ModelConfig& c = preset_->config;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, hidden = c.hidden_size;
  const int64_t per_key = c.linear_num_value_heads / c.linear_num_key_heads;
  for (QuantFormat format : {QuantFormat::kNvfp4, QuantFormat::kFp8Channel}) {
    const std::string dir = dir_ + "/" + QuantFormatName(format);
    std::map<std::string, QuantizedMatrix> grouped;
    WriteQuantizedGrouped(dir, grouped_config_, c, weights_, format, &grouped);
    auto host = LoadHostModel(dir);
    ASSERT_TRUE(host.ok()) << QuantFormatName(format) << ": " << host.status();
    const std::string p = "model.layers.0.linear_attn.";
    auto qkv = FindWeight(**host, p + "in_proj_qkv.weight");
    auto z = FindWeight(**host, p + "in_proj_z.weight");
    ASSERT_TRUE(qkv.ok() && z.ok());
    ASSERT_TRUE(qkv->quantized() && z->quantized());
    EXPECT_FALSE(FindWeight(**host, p + "in_proj_b.weight")->quantized());
    EXPECT_FALSE(FindWeight(**host, p + "out_proj.weight")->quantized());
    // The grouped rows, dealt back to q, k, v and z per key head.
    const std::vector<float> disk = DequantizeMatrix(grouped.at(p + "in_proj_qkvz.weight").View());
    const std::vector<float> flat_qkv = DequantizeMatrix(*qkv), flat_z = DequantizeMatrix(*z);
    const int64_t key_dim = c.linear_key_dim();
    int64_t row = 0;
    auto expect_rows = [&](const std::vector<float>& flat, int64_t first, int64_t count) {
      for (int64_t i = 0; i < count; ++i, ++row)
        for (int64_t k = 0; k < hidden; ++k)
          ASSERT_EQ(flat[(first + i) * hidden + k], disk[row * hidden + k])
              << QuantFormatName(format) << " flat row " << first + i << " disk row " << row;
    };
    for (int64_t g = 0; g < c.linear_num_key_heads; ++g) {
      expect_rows(flat_qkv, g * dk, dk);
      expect_rows(flat_qkv, key_dim + g * dk, dk);
      expect_rows(flat_qkv, 2 * key_dim + g * per_key * dv, per_key * dv);
      expect_rows(flat_z, g * per_key * dv, per_key * dv);
    }
    const std::vector<float> logits = PrefillLogits(**host, Prompt(16, c.vocab_size));
    EXPECT_TRUE(
        std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
  }

  // fp8_block128's scale blocks straddle the groups: the error names the tensor.
  const std::string dir = dir_ + "/block";
  std::map<std::string, QuantizedMatrix> grouped;
  WriteQuantizedGrouped(dir, grouped_config_, c, weights_, QuantFormat::kFp8Block128, &grouped);
  json config = grouped_config_;
  config["quantization_config"] = {
      {"quant_method", "fp8"},
      {"weight_block_size", {128, 128}},
      {"modules_to_not_convert", {"lm_head", "*self_attn*", "*mlp*", "*out_proj*"}}};
  std::ofstream(dir + "/config.json") << config.dump(1);
  std::filesystem::remove(dir + "/hf_quant_config.json");
  auto block = LoadHostModel(dir);
  ASSERT_FALSE(block.ok());
  EXPECT_EQ(block.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(block.status().message(),
              AllOf(HasSubstr("model.layers.0.linear_attn.in_proj_qkvz.weight"),
                    HasSubstr("fp8_block128"), HasSubstr("cannot be un-grouped")));
}

// A ModelOpt NVFP4 checkpoint of the hybrid, written from the quantized preset with ModelOpt's
// exclusions by pattern, except that it does not list mlp.gate (as Qwen3.5-397B's does not)
// although the router is dense. `edit` changes the tensors before they are written.
std::string WriteModelOptHybrid(
    const std::string& dir, const json& config, const HostModel& q,
    const std::function<void(std::vector<SafetensorsTensorToWrite>&)>& edit) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.dump(1);
  const json hf = {{"quantization",
                    {{"quant_algo", "NVFP4"},
                     {"group_size", 16},
                     {"exclude_modules",
                      {"*linear_attn.conv1d*", "*linear_attn.in_proj_a*", "*linear_attn.in_proj_b*",
                       "*lm_head*", "*mlp.shared_expert_gate.*", "mtp.*"}}}}};
  std::ofstream(dir + "/hf_quant_config.json") << hf.dump(1);
  std::vector<SafetensorsTensorToWrite> out;
  for (size_t i = 0; i < q.specs.size(); ++i) {
    const TensorSpec& spec = q.specs[i];
    const size_t bytes = static_cast<size_t>(spec.numel()) * DTypeSize(q.tensors[i].dtype);
    out.push_back({spec.name,
                   q.tensors[i].dtype,
                   spec.shape,
                   {static_cast<const uint8_t*>(q.tensors[i].data), bytes}});
  }
  edit(out);
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", out).ok());
  return dir;
}

TEST_F(HybridCheckpoint, ModelOptNvfp4LoadsWithItsExclusionsByPattern) {
  auto q = LoadHostModel("preset:tiny-hybrid@nvfp4", {0, 1});
  ASSERT_TRUE(q.ok()) << q.status();
  const std::string dir =
      WriteModelOptHybrid(dir_ + "/modelopt", grouped_config_, **q, [](auto&) {});
  auto host = LoadHostModel(dir);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ((*host)->quant_format, QuantFormat::kNvfp4);
  EXPECT_TRUE(FindWeight(**host, "model.layers.0.linear_attn.out_proj.weight")->quantized());
  EXPECT_FALSE(FindWeight(**host, "model.layers.0.linear_attn.in_proj_a.weight")->quantized());
  const std::vector<int32_t> prompt = Prompt(24, preset_->config.vocab_size);
  EXPECT_EQ(PrefillLogits(**host, prompt), PrefillLogits(**q, prompt));
  // Every router is declared quantized and stored dense: named, loaded dense.
  ASSERT_EQ((*host)->warnings.size(), static_cast<size_t>(preset_->config.num_layers));
  EXPECT_THAT((*host)->warnings[0], AllOf(HasSubstr("'model.layers.0.mlp.gate.weight'"),
                                          HasSubstr("is stored dense; loaded dense")));
}

// The tensors win over the declaration: lm_head declared excluded but shipped as nvfp4 loads
// quantized; out_proj declared quantized but stored dense loads dense. Each is named.
TEST_F(HybridCheckpoint, TensorsThatContradictTheDeclarationLoadAsStoredWithAWarning) {
  auto q = LoadHostModel("preset:tiny-hybrid@nvfp4", {0, 1});
  ASSERT_TRUE(q.ok()) << q.status();
  const Tensor& head = weights_.at("lm_head.weight");
  auto head_q = QuantizeMatrix(
      QuantFormat::kNvfp4, MatrixRef{head.bf16.data(), DType::kBF16, head.shape[0], head.shape[1]});
  ASSERT_TRUE(head_q.ok());
  const Tensor& out_proj = weights_.at("model.layers.2.linear_attn.out_proj.weight");
  const std::string dir = WriteModelOptHybrid(
      dir_ + "/contradicting", grouped_config_, **q,
      [&](std::vector<SafetensorsTensorToWrite>& out) {
        std::erase_if(out, [](const SafetensorsTensorToWrite& t) {
          return t.name == "lm_head.weight" ||
                 t.name.starts_with("model.layers.2.linear_attn.out_proj.");
        });
        for (size_t i = 0; i < head_q->parts.size(); ++i)
          out.push_back({"lm_head" + head_q->layout[i].suffix, head_q->layout[i].dtypes.front(),
                         head_q->layout[i].shape, head_q->parts[i]});
        out.push_back(
            {out_proj.name,
             DType::kBF16,
             out_proj.shape,
             {reinterpret_cast<const uint8_t*>(out_proj.bf16.data()), out_proj.bf16.size() * 2}});
      });
  auto host = LoadHostModel(dir);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_TRUE(FindWeight(**host, "lm_head.weight")->quantized());
  EXPECT_FALSE(FindWeight(**host, "model.layers.2.linear_attn.out_proj.weight")->quantized());
  EXPECT_TRUE(FindWeight(**host, "model.layers.0.linear_attn.out_proj.weight")->quantized());
  const std::vector<std::string>& w = (*host)->warnings;
  EXPECT_THAT(w, testing::Contains(AllOf(HasSubstr("'lm_head.weight'"), HasSubstr("excludes it"),
                                         HasSubstr("ships 'lm_head.weight_scale'"),
                                         HasSubstr("loaded as nvfp4"))));
  EXPECT_THAT(w, testing::Contains(AllOf(HasSubstr("'model.layers.2.linear_attn.out_proj.weight'"),
                                         HasSubstr("is stored dense; loaded dense"))));
  const std::vector<float> logits = PrefillLogits(**host, Prompt(16, preset_->config.vocab_size));
  EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
}

}  // namespace
}  // namespace infersweep
