// Quantized HF checkpoints: every format written in its on-disk layout and declared the way its
// producers declare it loads to the same weights (and logits) as quantizing the dense model on
// load; malformed companions (missing, wrong shape, wrong dtype) are clear errors naming the
// file and tensor.
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "engine/backends.h"
#include "engine/cpu_model.h"
#include "core/quant/dequantize.h"
#include "engine/quant/layout.h"
#include "engine/quant/quantize.h"
#include "engine/safetensors_writer.h"
#include "engine/synthetic.h"
#include "engine/weights.h"

namespace infersweep {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// qwen3_moe with a dense layer 0 and an MoE layer 1; every input width a multiple of 32.
constexpr char kConfig[] = R"({
  "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
  "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
  "num_experts_per_tok": 2, "decoder_sparse_step": 2, "norm_topk_prob": true,
  "vocab_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000,
  "tie_word_embeddings": false, "max_position_embeddings": 64 QUANT})";

constexpr char kMixtralConfig[] = R"({
  "model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 1,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
  "intermediate_size": 32, "num_local_experts": 2, "num_experts_per_tok": 1,
  "vocab_size": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000,
  "tie_word_embeddings": false, "max_position_embeddings": 64 QUANT})";

struct DiskTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// How each format's producers declare it (config.json fragment or hf_quant_config.json).
struct Declaration {
  QuantFormat format;
  std::string config_fragment;  // appended inside config.json
  std::string hf_quant_config;  // "" when absent
};

std::vector<Declaration> Declarations() {
  return {
      {QuantFormat::kNvfp4, "",
       R"({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4",
           "group_size": 16, "exclude_modules": ["lm_head", "*.mlp.gate"]}})"},
      {QuantFormat::kMxfp4,
       R"(, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]})",
       ""},
      {QuantFormat::kFp8Block128,
       R"(, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
           "weight_block_size": [128, 128]})",
       ""},
      {QuantFormat::kFp8Tensor,
       R"(, "quantization_config": {"quant_method": "compressed-tensors", "config_groups":
           {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
           "strategy": "tensor"}}}, "ignore": ["lm_head"]})",
       ""},
      {QuantFormat::kFp8Channel, R"(, "quantization_config": {"quant_method": "fbgemm_fp8"})", ""},
  };
}

class QuantCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "quant_checkpoint_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  static ModelConfig Config(const char* text) {
    auto c = ParseModelConfig(absl::StrReplaceAll(text, {{"QUANT", ""}}), "config.json");
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  }

  // The dense model's tensors (synthetic bf16), canonical names.
  static std::vector<DiskTensor> DenseTensors(const ModelConfig& c) {
    std::vector<DiskTensor> out;
    for (const TensorSpec& spec : ModelTensorSpecs(c)) {
      std::vector<uint16_t> v(spec.numel());
      GenerateSyntheticBf16(3, spec, false, 0, spec.numel(), v.data());
      DiskTensor t{spec.name, DType::kBF16, spec.shape, std::vector<uint8_t>(v.size() * 2)};
      std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
      out.push_back(std::move(t));
    }
    return out;
  }

  // The dense tensors with every quantizable linear that `quantize(name)` says replaced by its
  // parts in `format`'s on-disk layout.
  static std::vector<DiskTensor> Quantized(
      const ModelConfig& c, QuantFormat format,
      const std::function<bool(const std::string&)>& quantize = [](const std::string&) {
        return true;
      }) {
    const std::vector<TensorSpec> specs = ModelTensorSpecs(c);
    std::vector<DiskTensor> dense = DenseTensors(c), out;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!IsQuantizable(specs[i]) || !quantize(specs[i].name)) {
        out.push_back(dense[i]);
        continue;
      }
      const MatrixRef ref{dense[i].bytes.data(), DType::kBF16, specs[i].shape[0],
                          specs[i].shape[1]};
      auto q = QuantizeMatrix(format, ref);
      EXPECT_TRUE(q.ok()) << q.status();
      const std::string module = specs[i].name.substr(0, specs[i].name.size() - 7);
      for (size_t p = 0; p < q->parts.size(); ++p)
        out.push_back({module + q->layout[p].suffix, q->layout[p].dtypes.front(),
                       q->layout[p].shape, q->parts[p]});
    }
    return out;
  }

  std::string Write(const std::string& name, const std::string& config,
                    const std::vector<DiskTensor>& tensors, const std::string& hf = "") {
    const std::string dir = root_ + "/" + name;
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/config.json") << config;
    if (!hf.empty()) std::ofstream(dir + "/hf_quant_config.json") << hf;
    std::vector<SafetensorsTensorToWrite> w;
    for (const DiskTensor& t : tensors) w.push_back({t.name, t.dtype, t.shape, t.bytes});
    const absl::Status s = WriteSafetensors(dir + "/model.safetensors", w);
    EXPECT_TRUE(s.ok()) << s;
    return dir;
  }

  std::string WriteDeclared(const Declaration& d, const std::vector<DiskTensor>& tensors,
                            const char* config = kConfig) {
    return Write(QuantFormatName(d.format),
                 absl::StrReplaceAll(config, {{"QUANT", d.config_fragment}}), tensors,
                 d.hf_quant_config);
  }

  static std::vector<float> Logits(const HostModel& host) {
    auto model = MakeCpuModel(host);
    const std::vector<int32_t> tokens = {1, 7, 3, 60, 12, 5};
    std::vector<float> logits;
    EXPECT_TRUE(model->StartBatch(1, 6).ok());
    EXPECT_TRUE(model->Forward(tokens, 6, LogitsMode::kAll, &logits).ok());
    return logits;
  }

  std::string root_;
};

TEST_F(QuantCheckpointTest, EveryFormatLoadsToTheWeightsQuantizingOnLoadMakes) {
  const ModelConfig c = Config(kConfig);
  const std::string dense_dir =
      Write("dense", absl::StrReplaceAll(kConfig, {{"QUANT", ""}}), DenseTensors(c));
  for (const Declaration& d : Declarations()) {
    SCOPED_TRACE(QuantFormatName(d.format));
    const std::string dir = WriteDeclared(d, Quantized(c, d.format));
    auto loaded = LoadHostModel(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    auto on_load = LoadHostModel(dense_dir + "@" + QuantFormatName(d.format));
    ASSERT_TRUE(on_load.ok()) << on_load.status();
    EXPECT_EQ((*loaded)->quant_format, d.format);
    EXPECT_EQ(WeightFormat(**loaded), QuantFormatFamily(d.format));
    EXPECT_EQ((*on_load)->source, dense_dir + "@" + QuantFormatName(d.format));

    // Same quantized linears, bit for bit, from the file and from --quantize.
    for (const char* name :
         {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.experts.2.down_proj.weight",
          "model.layers.0.mlp.up_proj.weight"}) {
      auto x = FindWeight(**loaded, name), y = FindWeight(**on_load, name);
      ASSERT_TRUE(x.ok() && y.ok()) << name;
      ASSERT_TRUE(x->quantized()) << name;
      EXPECT_EQ(x->rows, y->rows);
      EXPECT_EQ(x->cols, y->cols);
      EXPECT_EQ(DequantizeMatrix(*x), DequantizeMatrix(*y)) << name;
    }
    const LayerWeights& a = (*loaded)->weights.layers[1];
    EXPECT_FALSE(a.router.quantized());
    EXPECT_FALSE((*loaded)->weights.lm_head.quantized());
    EXPECT_EQ(Logits(**loaded), Logits(**on_load));
  }
}

TEST_F(QuantCheckpointTest, ExcludedModulesStayDenseAndMixtralNamesResolve) {
  const ModelConfig c = Config(kConfig);
  const Declaration attention_dense = {
      QuantFormat::kNvfp4, "",
      R"({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head",
          "model.layers.*.self_attn*", "model.layers.0.mlp"]}})"};
  const auto quantize = [](const std::string& name) {
    return name.find("self_attn") == std::string::npos &&
           name.find("layers.0.mlp") == std::string::npos;
  };
  auto host =
      LoadHostModel(WriteDeclared(attention_dense, Quantized(c, QuantFormat::kNvfp4, quantize)));
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_FALSE((*host)->weights.layers[1].q.quantized());
  EXPECT_FALSE((*host)->weights.layers[0].mlp.gate.quantized());
  EXPECT_TRUE((*host)->weights.layers[1].experts[0].gate.quantized());

  // Mixtral's Hub names: block_sparse_moe.experts.E.w1 + the part suffixes.
  const ModelConfig m = Config(kMixtralConfig);
  std::vector<DiskTensor> tensors = Quantized(m, QuantFormat::kMxfp4);
  for (DiskTensor& t : tensors) {
    t.name = absl::StrReplaceAll(t.name, {{".mlp.experts.", ".block_sparse_moe.experts."},
                                          {".mlp.gate.", ".block_sparse_moe.gate."},
                                          {".gate_proj.", ".w1."},
                                          {".up_proj.", ".w3."},
                                          {".down_proj.", ".w2."}});
  }
  const Declaration mx = {QuantFormat::kMxfp4,
                          R"(, "quantization_config": {"quant_method": "mxfp4",
                              "modules_to_not_convert": ["block_sparse_moe.gate", "lm_head"]})",
                          ""};
  auto mixtral = LoadHostModel(WriteDeclared(mx, tensors, kMixtralConfig));
  ASSERT_TRUE(mixtral.ok()) << mixtral.status();
  EXPECT_TRUE((*mixtral)->weights.layers[0].experts[1].up.quantized());
}

// A valid nvfp4 checkpoint with one edit; the load must fail naming the tensor and the rule.
class MalformedCompanionTest : public QuantCheckpointTest {
 protected:
  absl::Status LoadEdited(QuantFormat format,
                          const std::function<void(std::vector<DiskTensor>&)>& edit) {
    std::vector<DiskTensor> tensors = Quantized(Config(kConfig), format);
    edit(tensors);
    for (const Declaration& d : Declarations())
      if (d.format == format) return LoadHostModel(WriteDeclared(d, tensors)).status();
    return absl::InternalError("no declaration");
  }
  static DiskTensor& Find(std::vector<DiskTensor>& tensors, const std::string& name) {
    for (DiskTensor& t : tensors)
      if (t.name == name) return t;
    ADD_FAILURE() << "no tensor " << name;
    return tensors[0];
  }
};

TEST_F(MalformedCompanionTest, MissingScale) {
  const absl::Status s = LoadEdited(QuantFormat::kNvfp4, [](std::vector<DiskTensor>& t) {
    std::erase_if(t, [](const DiskTensor& d) {
      return d.name == "model.layers.1.mlp.experts.3.up_proj.weight_scale";
    });
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("'model.layers.1.mlp.experts.3.up_proj.weight_scale' not found"));
  EXPECT_THAT(s.message(), HasSubstr("nvfp4 layout stores '.weight_scale' for group 16 over K=64"));
}

TEST_F(MalformedCompanionTest, WrongScaleShape) {
  const absl::Status s = LoadEdited(QuantFormat::kNvfp4, [](std::vector<DiskTensor>& t) {
    DiskTensor& scale = Find(t, "model.layers.1.mlp.experts.3.up_proj.weight_scale");
    scale.shape = {32, 3};
    scale.bytes.resize(32 * 3);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors: tensor "
                                     "'model.layers.1.mlp.experts.3.up_proj.weight_scale' has "
                                     "shape [32, 3], expected [32, 4] for group 16 over K=64"));
}

TEST_F(MalformedCompanionTest, WrongScaleDtype) {
  const absl::Status s = LoadEdited(QuantFormat::kNvfp4, [](std::vector<DiskTensor>& t) {
    DiskTensor& scale = Find(t, "model.layers.0.self_attn.k_proj.weight_scale");
    scale.dtype = DType::kBF16;
    scale.bytes.resize(scale.bytes.size() * 2);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("'model.layers.0.self_attn.k_proj.weight_scale': dtype BF16, "
                                     "expected F8_E4M3 for group 16 over K=64 (nvfp4)"));
}

TEST_F(MalformedCompanionTest, MissingScale2AndWrongCodesShape) {
  absl::Status s = LoadEdited(QuantFormat::kNvfp4, [](std::vector<DiskTensor>& t) {
    std::erase_if(t, [](const DiskTensor& d) {
      return d.name == "model.layers.0.mlp.down_proj.weight_scale_2";
    });
  });
  EXPECT_THAT(s.message(), HasSubstr("'model.layers.0.mlp.down_proj.weight_scale_2' not found"));
  s = LoadEdited(QuantFormat::kMxfp4, [](std::vector<DiskTensor>& t) {
    Find(t, "model.layers.0.mlp.down_proj.weight_blocks").shape = {64, 6, 8};
  });
  EXPECT_THAT(s.message(), HasSubstr("'model.layers.0.mlp.down_proj.weight_blocks' has shape "
                                     "[64, 6, 8], expected [64, 3, 16]"));
}

TEST_F(MalformedCompanionTest, DenseWeightWhereTheDeclarationQuantizesLoadsDenseWithAWarning) {
  const ModelConfig c = Config(kConfig);
  // The MXFP4 declaration excludes only lm_head, but q_proj is stored dense.
  absl::Status s = LoadEdited(QuantFormat::kMxfp4, [&c](std::vector<DiskTensor>& t) {
    std::erase_if(t, [](const DiskTensor& d) {
      return d.name.starts_with("model.layers.0.self_attn.q_proj.");
    });
    for (const DiskTensor& d : DenseTensors(c))
      if (d.name == "model.layers.0.self_attn.q_proj.weight") t.push_back(d);
  });
  // The tensors win: q_proj loads dense, with a warning naming it.
  EXPECT_TRUE(s.ok()) << s;
  std::vector<DiskTensor> tensors = Quantized(c, QuantFormat::kMxfp4);
  std::erase_if(tensors, [](const DiskTensor& d) {
    return d.name.starts_with("model.layers.0.self_attn.q_proj.");
  });
  for (const DiskTensor& d : DenseTensors(c))
    if (d.name == "model.layers.0.self_attn.q_proj.weight") tensors.push_back(d);
  for (const Declaration& d : Declarations()) {
    if (d.format != QuantFormat::kMxfp4) continue;
    auto host = LoadHostModel(WriteDeclared(d, tensors));
    ASSERT_TRUE(host.ok()) << host.status();
    EXPECT_FALSE(FindWeight(**host, "model.layers.0.self_attn.q_proj.weight")->quantized());
    EXPECT_TRUE(FindWeight(**host, "model.layers.0.self_attn.k_proj.weight")->quantized());
    // (The declaration does not exclude the routers either: they are named too.)
    EXPECT_THAT((*host)->warnings,
                testing::Contains(AllOf(HasSubstr("'model.layers.0.self_attn.q_proj.weight'"),
                                        HasSubstr("is stored dense; loaded dense"))));
    EXPECT_THAT((*host)->warnings, testing::Not(testing::Contains(HasSubstr("self_attn.k_proj"))));
  }
  // FP8: the codes tensor has the dense name, so the dtype check says it.
  s = LoadEdited(QuantFormat::kFp8Block128, [&c](std::vector<DiskTensor>& t) {
    for (DiskTensor& d : t)
      if (d.name == "model.layers.0.self_attn.q_proj.weight") d = DenseTensors(c)[2];
  });
  EXPECT_THAT(s.message(), HasSubstr("'model.layers.0.self_attn.q_proj.weight': dtype BF16, "
                                     "expected F8_E4M3 for E4M3 codes [N, K] (fp8_block128)"));
}

TEST_F(MalformedCompanionTest, QuantizedTensorInADenseCheckpoint) {
  std::vector<DiskTensor> tensors = Quantized(Config(kConfig), QuantFormat::kFp8Channel);
  const absl::Status s =
      LoadHostModel(Write("undeclared", absl::StrReplaceAll(kConfig, {{"QUANT", ""}}), tensors))
          .status();
  EXPECT_THAT(s.message(), HasSubstr("dtype F8_E4M3 holds quantized codes, but this tensor is "
                                     "not quantized here: no quantization declared"));
}

TEST_F(MalformedCompanionTest, AcceptedAlternativeScaleLayouts) {
  // fp8_channel scales as [N, 1] (fbgemm, compressed-tensors), input scales optional but checked.
  EXPECT_TRUE(LoadEdited(QuantFormat::kFp8Channel, [](std::vector<DiskTensor>& t) {
                for (DiskTensor& d : t)
                  if (d.name.ends_with(".weight_scale")) d.shape = {d.shape[0], 1};
              }).ok());
  // mxfp4 scales typed F8_E8M0 (newer safetensors) instead of U8.
  EXPECT_TRUE(LoadEdited(QuantFormat::kMxfp4, [](std::vector<DiskTensor>& t) {
                for (DiskTensor& d : t)
                  if (d.name.ends_with(".weight_scales")) d.dtype = DType::kF8E8M0;
              }).ok());
  const float one = 1.0f;
  const absl::Status s = LoadEdited(QuantFormat::kNvfp4, [&](std::vector<DiskTensor>& t) {
    std::vector<uint8_t> bytes(8);
    std::memcpy(bytes.data(), &one, 4);
    std::memcpy(bytes.data() + 4, &one, 4);
    t.push_back({"model.layers.0.self_attn.v_proj.input_scale", DType::kF32, {2}, bytes});
  });
  EXPECT_THAT(s.message(), HasSubstr("'model.layers.0.self_attn.v_proj.input_scale' has shape [2], "
                                     "expected [] for one fp32 activation scale"));
}

}  // namespace
}  // namespace infersweep
