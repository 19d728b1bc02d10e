#include "engine/weights.h"

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/synthetic.h"
#include "kernels/cpu/parallel.h"

namespace infersweep {
namespace {

MatrixRef ToRef(const TensorSpec& spec, const HostTensor& t) {
  MatrixRef ref{t.data, t.dtype, 1, spec.shape.back()};
  if (spec.shape.size() == 2) ref.rows = spec.shape[0];
  return ref;
}

// Which field of the structure a canonical name binds to; the name is the single key.
MatrixRef* Slot(ModelWeights& w, const TensorSpec& spec) {
  if (spec.layer < 0) {
    if (spec.name == "model.embed_tokens.weight") return &w.embed;
    if (spec.name == "model.norm.weight") return &w.final_norm;
    if (spec.name == "lm_head.weight") return &w.lm_head;
    return nullptr;
  }
  LayerWeights& l = w.layers[spec.layer];
  const std::string& name = spec.name;
  const auto ends = [&](const char* suffix) { return absl::EndsWith(name, suffix); };
  if (spec.expert >= 0) {
    ExpertWeights& e = l.experts[spec.expert];
    if (ends(".gate_proj.weight")) return &e.gate;
    if (ends(".up_proj.weight")) return &e.up;
    if (ends(".down_proj.weight")) return &e.down;
    return nullptr;
  }
  if (ends("input_layernorm.weight")) return &l.input_norm;
  if (ends("post_attention_layernorm.weight")) return &l.post_attention_norm;
  if (ends("self_attn.q_proj.weight")) return &l.q;
  if (ends("self_attn.k_proj.weight")) return &l.k;
  if (ends("self_attn.v_proj.weight")) return &l.v;
  if (ends("self_attn.o_proj.weight")) return &l.o;
  if (ends("self_attn.q_proj.bias")) return &l.q_bias;
  if (ends("self_attn.k_proj.bias")) return &l.k_bias;
  if (ends("self_attn.v_proj.bias")) return &l.v_bias;
  if (ends("self_attn.o_proj.bias")) return &l.o_bias;
  if (ends("self_attn.q_norm.weight")) return &l.q_norm;
  if (ends("self_attn.k_norm.weight")) return &l.k_norm;
  if (ends("mlp.gate.weight")) return &l.router;
  if (ends("mlp.shared_expert_gate.weight")) return &l.shared_expert_gate;
  if (ends("mlp.shared_expert.gate_proj.weight")) return &l.shared_expert.gate;
  if (ends("mlp.shared_expert.up_proj.weight")) return &l.shared_expert.up;
  if (ends("mlp.shared_expert.down_proj.weight")) return &l.shared_expert.down;
  if (ends("mlp.gate_proj.weight")) return &l.mlp.gate;
  if (ends("mlp.up_proj.weight")) return &l.mlp.up;
  if (ends("mlp.down_proj.weight")) return &l.mlp.down;
  return nullptr;
}

absl::StatusOr<std::unique_ptr<HostModel>> MakeSynthetic(const std::string& preset,
                                                         const LoadOptions& options) {
  auto config = PresetConfig(preset, options.num_layers_override);
  if (!config.ok()) return config.status();
  auto model = std::make_unique<HostModel>();
  model->config = *config;
  model->source = "preset:" + preset;
  model->seed = options.seed;
  model->is_synthetic = true;
  model->host_materialized = false;
  model->specs = ModelTensorSpecs(*config);
  model->tensors.resize(model->specs.size());
  for (size_t i = 0; i < model->specs.size(); ++i) {
    const TensorSpec& spec = model->specs[i];
    model->tensors[i] = {spec.name, "synthetic:" + spec.name, DType::kBF16, spec.shape, nullptr};
  }
  if (options.materialize_host)
    if (auto s = MaterializeHostWeights(*model); !s.ok()) return s;
  return model;
}

}  // namespace

absl::Status MaterializeHostWeights(HostModel& model) {
  if (model.host_materialized) return absl::OkStatus();
  model.synthetic.resize(model.specs.size());
  for (size_t i = 0; i < model.specs.size(); ++i) {
    model.synthetic[i].resize(model.specs[i].numel());
    model.tensors[i].data = model.synthetic[i].data();
  }
  // Embarrassingly parallel over tensors (the largest dominate; fine at our sizes).
  cpu::ParallelFor(static_cast<int64_t>(model.specs.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      GenerateSyntheticBf16(model.seed, model.specs[i], model.config.tie_word_embeddings, 0,
                            model.specs[i].numel(), model.synthetic[i].data());
  });
  auto bound = BindWeights(model.config, model.specs, model.tensors);
  if (!bound.ok()) return bound.status();
  model.weights = std::move(*bound);
  model.host_materialized = true;
  return absl::OkStatus();
}

absl::StatusOr<ModelWeights> BindWeights(const ModelConfig& config,
                                         const std::vector<TensorSpec>& specs,
                                         const std::vector<HostTensor>& tensors) {
  if (specs.size() != tensors.size())
    return absl::InternalError("BindWeights: specs and tensors differ in length");
  ModelWeights w;
  w.layers.resize(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l)
    if (config.IsMoeLayer(l)) w.layers[l].experts.resize(config.num_experts);
  for (size_t i = 0; i < specs.size(); ++i) {
    MatrixRef* slot = Slot(w, specs[i]);
    if (slot == nullptr)
      return absl::InternalError(absl::StrCat("BindWeights: no slot for ", specs[i].name));
    *slot = ToRef(specs[i], tensors[i]);
  }
  return w;
}

absl::StatusOr<std::unique_ptr<HostModel>> LoadHostModel(const std::string& model_arg,
                                                         const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<HostModel> model;
  if (absl::StartsWith(model_arg, "preset:")) {
    auto made = MakeSynthetic(model_arg.substr(7), options);
    if (!made.ok()) return made.status();
    model = std::move(*made);
  } else {
    auto checkpoint = Checkpoint::Open(model_arg);
    if (!checkpoint.ok()) return checkpoint.status();
    model = std::make_unique<HostModel>();
    model->config = (*checkpoint)->config();
    model->source = model_arg;
    model->specs = ModelTensorSpecs(model->config);
    auto tensors = (*checkpoint)->Resolve(model->specs);
    if (!tensors.ok()) return tensors.status();
    model->tensors = std::move(*tensors);
    model->checkpoint = std::move(*checkpoint);
  }
  auto bound = BindWeights(model->config, model->specs, model->tensors);
  if (!bound.ok()) return bound.status();
  model->weights = std::move(*bound);
  model->load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return model;
}

}  // namespace infersweep
