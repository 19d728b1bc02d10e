// Checkpoint folders: single file, shards, transformers 5 fused experts, Mixtral names, tied
// lm_head, and the errors a broken folder must produce.
#include "engine/checkpoint.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/safetensors_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

constexpr char kQwen3MoeConfig[] = R"({
  "model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 1,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
  "intermediate_size": 16, "moe_intermediate_size": 4, "num_experts": 2,
  "num_experts_per_tok": 1, "vocab_size": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000,
  "tie_word_embeddings": false, "max_position_embeddings": 64})";

constexpr char kMixtralConfig[] = R"({
  "model_type": "mixtral", "hidden_size": 8, "num_hidden_layers": 2,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
  "intermediate_size": 6, "num_local_experts": 3, "num_experts_per_tok": 2,
  "vocab_size": 16, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
  "tie_word_embeddings": false, "max_position_embeddings": 64})";

// One tensor as it will be written: name on disk, dtype, shape and owned bytes.
struct DiskTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Distinct, reproducible contents per tensor name, so a mix-up shows as a byte mismatch.
std::vector<uint8_t> Contents(const std::string& name, size_t n) {
  uint32_t h = 2166136261u;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    h = h * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(h >> 24);
  }
  return v;
}

DiskTensor Make(const std::string& name, const std::vector<int64_t>& shape,
                DType dtype = DType::kBF16) {
  return {name, dtype, shape,
          Contents(name, static_cast<size_t>(Numel(shape)) * DTypeSize(dtype))};
}

ModelConfig ParseConfig(const std::string& json) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(json, "config.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

// Every spec tensor under its canonical name.
std::vector<DiskTensor> CanonicalTensors(const ModelConfig& config) {
  std::vector<DiskTensor> out;
  for (const TensorSpec& s : ModelTensorSpecs(config)) out.push_back(Make(s.name, s.shape));
  return out;
}

std::map<std::string, DiskTensor> ByName(const std::vector<DiskTensor>& tensors) {
  std::map<std::string, DiskTensor> m;
  for (const DiskTensor& t : tensors) m[t.name] = t;
  return m;
}

std::vector<DiskTensor> Without(std::vector<DiskTensor> tensors, const std::string& name) {
  std::erase_if(tensors, [&](const DiskTensor& t) { return t.name == name; });
  return tensors;
}

// Per-expert tensors of layer `layer` folded into transformers 5 fused tensors named
// <parent>gate_up_proj<suffix> ([E, 2I, H], gate rows first) and <parent>down_proj<suffix>.
std::vector<DiskTensor> FuseExperts(const std::vector<DiskTensor>& tensors, const ModelConfig& c,
                                    const std::string& parent, const std::string& suffix) {
  const std::map<std::string, DiskTensor> by_name = ByName(tensors);
  std::vector<DiskTensor> out;
  for (const DiskTensor& t : tensors) {
    if (t.name.find(".mlp.experts.") == std::string::npos) out.push_back(t);
  }
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    DiskTensor gate_up{absl::StrCat(p, parent, "gate_up_proj", suffix), DType::kBF16,
                       {E, 2 * I, H}, {}};
    DiskTensor down{absl::StrCat(p, parent, "down_proj", suffix), DType::kBF16, {E, H, I}, {}};
    for (int e = 0; e < E; ++e) {
      const std::string ep = absl::StrCat(p, "mlp.experts.", e, ".");
      for (const char* proj : {"gate_proj", "up_proj"}) {
        const std::vector<uint8_t>& b = by_name.at(absl::StrCat(ep, proj, ".weight")).bytes;
        gate_up.bytes.insert(gate_up.bytes.end(), b.begin(), b.end());
      }
      const std::vector<uint8_t>& b = by_name.at(absl::StrCat(ep, "down_proj.weight")).bytes;
      down.bytes.insert(down.bytes.end(), b.begin(), b.end());
    }
    out.push_back(std::move(gate_up));
    out.push_back(std::move(down));
  }
  return out;
}

// Renames tensors whose name contains `from` (first occurrence) to use `to` instead.
std::vector<DiskTensor> Rename(std::vector<DiskTensor> tensors, const std::string& from,
                               const std::string& to) {
  for (DiskTensor& t : tensors) {
    const size_t pos = t.name.find(from);
    if (pos != std::string::npos) t.name.replace(pos, from.size(), to);
  }
  return tensors;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "checkpoint_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  void WriteText(const std::string& name, const std::string& text) {
    std::ofstream out(Path(name), std::ios::binary);
    out << text;
    ASSERT_TRUE(out.good());
  }

  void WriteFile(const std::string& name, const std::vector<DiskTensor>& tensors) {
    std::vector<SafetensorsTensorToWrite> w;
    for (const DiskTensor& t : tensors) w.push_back({t.name, t.dtype, t.shape, t.bytes});
    const absl::Status s = WriteSafetensors(Path(name), w, {{"format", "pt"}});
    ASSERT_TRUE(s.ok()) << s;
  }

  // Writes tensors round-robin into `shards` files plus a matching index.json.
  void WriteSharded(const std::vector<DiskTensor>& tensors, int shards) {
    std::vector<std::vector<DiskTensor>> parts(shards);
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t i = 0; i < tensors.size(); ++i) {
      parts[i % shards].push_back(tensors[i]);
      weight_map[tensors[i].name] = ShardName(static_cast<int>(i % shards), shards);
    }
    for (int s = 0; s < shards; ++s) WriteFile(ShardName(s, shards), parts[s]);
    WriteText("model.safetensors.index.json",
              nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2));
  }

  static std::string ShardName(int s, int n) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", s + 1, n);
    return buf;
  }

  absl::StatusOr<std::vector<HostTensor>> OpenAndResolve() {
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
    if (!ckpt.ok()) return ckpt.status();
    ckpt_ = *std::move(ckpt);
    return ckpt_->Resolve(ModelTensorSpecs(ckpt_->config()));
  }

  // Every resolved view must equal the canonical tensor's bytes.
  void ExpectMatches(const std::vector<HostTensor>& got, const std::vector<DiskTensor>& want) {
    const std::map<std::string, DiskTensor> by_name = ByName(want);
    const std::vector<TensorSpec> specs = ModelTensorSpecs(ckpt_->config());
    ASSERT_EQ(got.size(), specs.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const HostTensor& t = got[i];
      EXPECT_EQ(t.name, specs[i].name);
      EXPECT_EQ(t.shape, specs[i].shape) << t.name;
      const DiskTensor& w = by_name.at(t.name);
      EXPECT_EQ(t.dtype, w.dtype) << t.name;
      ASSERT_NE(t.data, nullptr) << t.name;
      EXPECT_EQ(std::memcmp(t.data, w.bytes.data(), w.bytes.size()), 0)
          << t.name << " from " << t.source;
    }
  }

  std::string dir_;
  std::unique_ptr<Checkpoint> ckpt_;
};

TEST_F(CheckpointTest, SingleFile) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  const std::vector<DiskTensor> tensors = CanonicalTensors(c);
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model.safetensors", tensors);

  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(ckpt_->config().arch, ModelArch::kQwen3Moe);
  EXPECT_EQ(ckpt_->dir(), dir_);
  ExpectMatches(*got, tensors);
  for (const HostTensor& t : *got) EXPECT_EQ(t.source, "model.safetensors:" + t.name);
}

TEST_F(CheckpointTest, AcceptsF32AndF16) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  std::vector<DiskTensor> tensors;
  bool f32 = true;
  for (const TensorSpec& s : ModelTensorSpecs(c)) {
    tensors.push_back(Make(s.name, s.shape, f32 ? DType::kF32 : DType::kF16));
    f32 = !f32;
  }
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model.safetensors", tensors);
  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatches(*got, tensors);
}

TEST_F(CheckpointTest, ShardedWithIndex) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  const std::vector<DiskTensor> tensors = CanonicalTensors(c);
  WriteText("config.json", kQwen3MoeConfig);
  WriteSharded(tensors, 3);

  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatches(*got, tensors);
  std::map<std::string, std::string> shard_of;
  for (size_t i = 0; i < tensors.size(); ++i) {
    shard_of[tensors[i].name] = ShardName(static_cast<int>(i % 3), 3);
  }
  for (const HostTensor& t : *got) EXPECT_EQ(t.source, shard_of[t.name] + ":" + t.name);
}

// transformers 5 layout, with and without the `.weight` suffix: the views equal per-expert bytes.
class CheckpointFusedExpertsTest : public CheckpointTest,
                         public ::testing::WithParamInterface<std::string> {};

TEST_P(CheckpointFusedExpertsTest, SameBytesAsPerExpert) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  const std::vector<DiskTensor> per_expert = CanonicalTensors(c);
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model.safetensors", FuseExperts(per_expert, c, "mlp.experts.", GetParam()));

  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatches(*got, per_expert);
  // Views, not copies: expert 1's up rows sit (2 + 1) * I * H elements into gate_up_proj.
  const HostTensor* gate0 = nullptr;
  const HostTensor* up1 = nullptr;
  for (const HostTensor& t : *got) {
    if (t.name == "model.layers.0.mlp.experts.0.gate_proj.weight") gate0 = &t;
    if (t.name == "model.layers.0.mlp.experts.1.up_proj.weight") up1 = &t;
  }
  ASSERT_TRUE(gate0 != nullptr && up1 != nullptr);
  EXPECT_EQ(up1->source, "model.safetensors:model.layers.0.mlp.experts.gate_up_proj" + GetParam());
  EXPECT_EQ(static_cast<const uint8_t*>(up1->data) - static_cast<const uint8_t*>(gate0->data),
            3 * c.moe_intermediate_size * c.hidden_size * 2);
}

INSTANTIATE_TEST_SUITE_P(Suffix, CheckpointFusedExpertsTest, ::testing::Values("", ".weight"),
                         [](const auto& info) { return info.param.empty() ? "Bare" : "Weight"; });

TEST_F(CheckpointTest, FusedExpertsWrongShape) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  std::vector<DiskTensor> tensors = FuseExperts(CanonicalTensors(c), c, "mlp.experts.", "");
  for (DiskTensor& t : tensors) {
    if (t.name == "model.layers.0.mlp.experts.gate_up_proj") {
      t.shape = {2, 8, 4, 2};  // same byte count, wrong rank
    }
  }
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model.safetensors", tensors);
  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(got.status().message(), HasSubstr("model.safetensors"));
  EXPECT_THAT(got.status().message(), HasSubstr("'model.layers.0.mlp.experts.gate_up_proj'"));
  EXPECT_THAT(got.status().message(), HasSubstr("[2, 8, 4, 2]"));
  EXPECT_THAT(got.status().message(), HasSubstr("expected [2, 8, 8]"));
}

// Mixtral on-disk spellings; the first variant is the Hub layout.
struct MixtralLayout {
  std::string label;
  std::function<std::vector<DiskTensor>(const std::vector<DiskTensor>&, const ModelConfig&)> make;
};

void PrintTo(const MixtralLayout& l, std::ostream* os) { *os << l.label; }

class CheckpointMixtralTest : public CheckpointTest, public ::testing::WithParamInterface<MixtralLayout> {};

std::vector<DiskTensor> MixtralW123(std::vector<DiskTensor> t) {
  t = Rename(std::move(t), "gate_proj.weight", "w1.weight");
  t = Rename(std::move(t), "up_proj.weight", "w3.weight");
  return Rename(std::move(t), "down_proj.weight", "w2.weight");
}

TEST_P(CheckpointMixtralTest, ResolvesToCanonicalBytes) {
  const ModelConfig c = ParseConfig(kMixtralConfig);
  ASSERT_EQ(c.arch, ModelArch::kMixtral);
  const std::vector<DiskTensor> canonical = CanonicalTensors(c);
  WriteText("config.json", kMixtralConfig);
  const std::vector<DiskTensor> disk = GetParam().make(canonical, c);
  WriteSharded(disk, 2);
  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatches(*got, canonical);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CheckpointMixtralTest,
    ::testing::Values(
        MixtralLayout{"BlockSparseMoeW123",
                      [](const std::vector<DiskTensor>& t, const ModelConfig&) {
                        // experts' mlp. prefix -> block_sparse_moe. (also renames the router)
                        return Rename(MixtralW123(t), ".mlp.", ".block_sparse_moe.");
                      }},
        MixtralLayout{"MlpW123",
                      [](const std::vector<DiskTensor>& t, const ModelConfig&) {
                        return MixtralW123(t);
                      }},
        MixtralLayout{"BlockSparseMoeFused",
                      [](const std::vector<DiskTensor>& t, const ModelConfig& c) {
                        return Rename(FuseExperts(t, c, "block_sparse_moe.experts.", ""),
                                      ".mlp.gate.", ".block_sparse_moe.gate.");
                      }},
        MixtralLayout{"MlpFusedWeight",
                      [](const std::vector<DiskTensor>& t, const ModelConfig& c) {
                        return FuseExperts(t, c, "mlp.experts.", ".weight");
                      }}),
    [](const ::testing::TestParamInfo<MixtralLayout>& info) { return info.param.label; });

TEST_F(CheckpointTest, MixtralNamesAreOnlyForMixtral) {
  // A qwen3_moe checkpoint spelled with w1/w2/w3 is not accepted: those names mean Mixtral.
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model.safetensors", MixtralW123(CanonicalTensors(c)));
  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, TiedLmHeadUsesEmbedding) {
  std::string config = kQwen3MoeConfig;
  const std::string untied = "\"tie_word_embeddings\": false";
  config.replace(config.find(untied), untied.size(), "\"tie_word_embeddings\": true");
  const ModelConfig c = ParseConfig(config);
  ASSERT_TRUE(c.tie_word_embeddings);
  WriteText("config.json", config);
  const std::vector<DiskTensor> tensors = CanonicalTensors(c);
  WriteFile("model.safetensors", Without(tensors, "lm_head.weight"));

  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->front().name, "model.embed_tokens.weight");
  ASSERT_EQ(got->back().name, "lm_head.weight");
  EXPECT_EQ(got->back().data, got->front().data);
  EXPECT_EQ(got->back().source, "model.safetensors:model.embed_tokens.weight");
}

TEST_F(CheckpointTest, UntiedLmHeadMissingIsAnError) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model.safetensors", Without(CanonicalTensors(c), "lm_head.weight"));
  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(), HasSubstr("'lm_head.weight'"));
}

TEST_F(CheckpointTest, MissingTensorNamesTensorTriedNamesAndFolder) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model.safetensors",
            Without(CanonicalTensors(c), "model.layers.0.mlp.experts.1.down_proj.weight"));
  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  const std::string msg(got.status().message());
  EXPECT_THAT(msg, HasSubstr("'model.layers.0.mlp.experts.1.down_proj.weight'"));
  EXPECT_THAT(msg, HasSubstr("model.layers.0.mlp.experts.down_proj"));  // fused name tried
  EXPECT_THAT(msg, HasSubstr(dir_));
}

TEST_F(CheckpointTest, WrongShapeNamesTensorExpectedAndFound) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  std::vector<DiskTensor> tensors = CanonicalTensors(c);
  for (DiskTensor& t : tensors) {
    if (t.name == "model.layers.0.self_attn.k_proj.weight") t.shape = {8, 4};  // transposed
  }
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model.safetensors", tensors);
  absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
  ASSERT_FALSE(got.ok());
  const std::string msg(got.status().message());
  EXPECT_THAT(msg, HasSubstr("model.safetensors"));
  EXPECT_THAT(msg, HasSubstr("'model.layers.0.self_attn.k_proj.weight'"));
  EXPECT_THAT(msg, HasSubstr("has shape [8, 4], expected [4, 8]"));
}

// A dtype no spec takes; F8/U8 codes in a checkpoint that declares no quantization say so
// (tests/quant_checkpoint_test.cc covers declared ones).
TEST_F(CheckpointTest, UnsupportedDtype) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  const std::pair<DType, std::string> cases[] = {
      {DType::kI32, "dtype I32 not supported yet"},
      {DType::kF8E4M3, "dtype F8_E4M3 holds quantized codes, but this tensor is not quantized "
                       "here: no quantization declared"}};
  for (const auto& [dtype, expected] : cases) {
    std::vector<DiskTensor> tensors = CanonicalTensors(c);
    for (DiskTensor& t : tensors) {
      if (t.name == "model.layers.0.self_attn.q_proj.weight") t = Make(t.name, t.shape, dtype);
    }
    WriteText("config.json", kQwen3MoeConfig);
    WriteFile("model.safetensors", tensors);
    absl::StatusOr<std::vector<HostTensor>> got = OpenAndResolve();
    ASSERT_FALSE(got.ok());
    const std::string msg(got.status().message());
    EXPECT_THAT(msg, HasSubstr("model.safetensors"));
    EXPECT_THAT(msg, HasSubstr("'model.layers.0.self_attn.q_proj.weight'"));
    EXPECT_THAT(msg, HasSubstr(expected));
  }
}

TEST_F(CheckpointTest, ShardFileMissing) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  WriteText("config.json", kQwen3MoeConfig);
  WriteSharded(CanonicalTensors(c), 2);
  std::filesystem::remove(Path(ShardName(1, 2)));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(), HasSubstr(ShardName(1, 2)));
}

TEST_F(CheckpointTest, IndexJsonMalformed) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  WriteText("config.json", kQwen3MoeConfig);
  WriteFile("model-00001-of-00001.safetensors", CanonicalTensors(c));
  for (const std::string& bad : {
           std::string("{\"weight_map\": {\"a\": "),                       // truncated JSON
           std::string("[1, 2]"),                                          // not an object
           std::string("{\"metadata\": {}}"),                              // no weight_map
           std::string("{\"weight_map\": []}"),                            // wrong type
           std::string("{\"weight_map\": {}}"),                            // empty
           std::string("{\"weight_map\": {\"lm_head.weight\": 3}}"),       // shard not a string
       }) {
    WriteText("model.safetensors.index.json", bad);
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
    ASSERT_FALSE(ckpt.ok()) << bad;
    EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(ckpt.status().message(), HasSubstr("model.safetensors.index.json")) << bad;
  }
}

TEST_F(CheckpointTest, IndexShardMustBePlainFileName) {
  WriteText("config.json", kQwen3MoeConfig);
  for (const std::string shard : {"../model.safetensors", "sub/model.safetensors", "..", ""}) {
    WriteText("model.safetensors.index.json",
              nlohmann::json{{"weight_map", {{"lm_head.weight", shard}}}}.dump());
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
    ASSERT_FALSE(ckpt.ok()) << shard;
    EXPECT_THAT(ckpt.status().message(), HasSubstr("not a plain file name")) << shard;
  }
}

TEST_F(CheckpointTest, IndexedTensorAbsentFromItsShard) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  const std::vector<DiskTensor> tensors = CanonicalTensors(c);
  WriteText("config.json", kQwen3MoeConfig);
  WriteSharded(tensors, 2);
  // Claim that shard 1 holds a tensor that is really in shard 2.
  const std::string moved = tensors[1].name;  // round-robin put it in shard 2
  nlohmann::json index = nlohmann::json::parse(
      std::ifstream(Path("model.safetensors.index.json")));
  index["weight_map"][moved] = ShardName(0, 2);
  WriteText("model.safetensors.index.json", index.dump());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(ckpt.status().message(), HasSubstr("'" + moved + "'"));
  EXPECT_THAT(ckpt.status().message(), HasSubstr(ShardName(0, 2)));
}

TEST_F(CheckpointTest, IndexedTensorMissingEverywhere) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  WriteText("config.json", kQwen3MoeConfig);
  WriteSharded(CanonicalTensors(c), 2);
  nlohmann::json index = nlohmann::json::parse(
      std::ifstream(Path("model.safetensors.index.json")));
  index["weight_map"]["model.ghost.weight"] = ShardName(1, 2);
  WriteText("model.safetensors.index.json", index.dump());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(ckpt.status().message(), HasSubstr("'model.ghost.weight'"));
  EXPECT_THAT(ckpt.status().message(), HasSubstr(ShardName(1, 2)));
}

TEST_F(CheckpointTest, SameTensorInTwoShards) {
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  std::vector<DiskTensor> tensors = CanonicalTensors(c);
  WriteText("config.json", kQwen3MoeConfig);
  WriteSharded(tensors, 2);
  // Rewrite shard 2 with an extra copy of a tensor that shard 1 already holds.
  std::vector<DiskTensor> second;
  for (size_t i = 1; i < tensors.size(); i += 2) second.push_back(tensors[i]);
  second.push_back(tensors[0]);
  WriteFile(ShardName(1, 2), second);
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(ckpt.status().message(), HasSubstr("'" + tensors[0].name + "'"));
  EXPECT_THAT(ckpt.status().message(), HasSubstr(ShardName(0, 2)));
  EXPECT_THAT(ckpt.status().message(), HasSubstr(ShardName(1, 2)));
}

TEST_F(CheckpointTest, NoSafetensorsInFolder) {
  WriteText("config.json", kQwen3MoeConfig);
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(ckpt.status().message(), HasSubstr(dir_));
  EXPECT_THAT(ckpt.status().message(), HasSubstr("model.safetensors"));
}

TEST_F(CheckpointTest, CorruptSafetensorsFails) {
  WriteText("config.json", kQwen3MoeConfig);
  WriteText("model.safetensors", std::string("\x10\0\0\0\0\0\0\0{\"a\": nonsense}", 24));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(ckpt.status().message(), HasSubstr("model.safetensors"));
}

TEST_F(CheckpointTest, UnknownArchitecture) {
  std::string config = kQwen3MoeConfig;
  config.replace(config.find("qwen3_moe"), 9, "gpt_unknown");
  WriteText("config.json", config);
  const ModelConfig c = ParseConfig(kQwen3MoeConfig);
  WriteFile("model.safetensors", CanonicalTensors(c));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(ckpt.status().message(), HasSubstr("gpt_unknown"));
}

TEST_F(CheckpointTest, MissingConfig) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(ckpt.status().message(), HasSubstr("config.json"));
}

}  // namespace
}  // namespace infersweep
