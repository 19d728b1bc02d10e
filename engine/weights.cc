#include "engine/weights.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "engine/quant/layout.h"
#include "engine/quant/quantize.h"
#include "engine/synthetic.h"
#include "kernels/cpu/parallel.h"

namespace infersweep {
namespace {

MatrixRef ToRef(const TensorSpec& spec, const HostTensor& t) {
  // Vectors are one row; a conv [channels, 1, kernel] is [channels, kernel].
  MatrixRef ref{t.data, t.dtype, 1, spec.shape.back()};
  if (spec.shape.size() >= 2) ref.rows = spec.numel() / spec.shape.back();
  return ref;
}

// Binds one stored tensor into its slot: a dense tensor is the whole view; a part of a quantized
// linear fills in the codes (with the logical shape [N, K]) or one of the scale pointers.
void BindTensor(const TensorSpec& spec, const HostTensor& t, MatrixRef& slot) {
  if (spec.quant == QuantFormat::kNone) {
    slot = ToRef(spec, t);
    return;
  }
  slot.quant.format = spec.quant;
  switch (spec.part) {
    case QuantPart::kData:
      slot.data = t.data;
      slot.dtype = t.dtype;
      slot.rows = spec.shape[0];
      slot.cols = spec.fan_in;
      break;
    case QuantPart::kScale:
      slot.quant.scale = t.data;
      slot.quant.scale_dtype = t.dtype;
      break;
    case QuantPart::kGlobalScale:
      slot.quant.global_scale = t.data;
      break;
    case QuantPart::kInputScale:
      slot.quant.input_scale = t.data;
      break;
  }
}

// Which field of the structure a canonical name binds to; the name (of the logical weight, for
// the parts of a quantized linear) is the single key.
MatrixRef* Slot(ModelWeights& w, const TensorSpec& spec) {
  const std::string& name = spec.linear.empty() ? spec.name : spec.linear;
  if (spec.layer < 0) {
    if (name == "model.embed_tokens.weight") return &w.embed;
    if (name == "model.norm.weight") return &w.final_norm;
    if (name == "lm_head.weight") return &w.lm_head;
    return nullptr;
  }
  LayerWeights& l = w.layers[spec.layer];
  const auto ends = [&](const char* suffix) { return absl::EndsWith(name, suffix); };
  if (spec.expert >= 0) {
    ExpertWeights& e = l.experts[spec.expert];
    if (ends(".gate_proj.weight")) return &e.gate;
    if (ends(".up_proj.weight")) return &e.up;
    if (ends(".down_proj.weight")) return &e.down;
    return nullptr;
  }
  if (absl::StrContains(name, ".linear_attn.")) {
    LinearAttentionWeights& la = l.linear_attn;
    if (ends(".in_proj_qkv.weight")) return &la.in_proj_qkv;
    if (ends(".in_proj_z.weight")) return &la.in_proj_z;
    if (ends(".in_proj_b.weight")) return &la.in_proj_b;
    if (ends(".in_proj_a.weight")) return &la.in_proj_a;
    if (ends(".conv1d.weight")) return &la.conv;
    if (ends(".dt_bias")) return &la.dt_bias;
    if (ends(".A_log")) return &la.a_log;
    if (ends(".norm.weight")) return &la.norm;
    if (ends(".out_proj.weight")) return &la.out_proj;
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
  ASSIGN_OR_RETURN(auto config, PresetConfig(preset, options.num_layers_override));
  if (options.head_dim_override != 0) {
    config.head_dim = options.head_dim_override;
    const std::string source =
        absl::StrCat("preset '", preset, "' with head_dim ", options.head_dim_override);
    RETURN_IF_ERROR(ValidateModelConfig(config, source));
  }
  auto model = std::make_unique<HostModel>();
  model->config = config;
  model->source = "preset:" + preset;
  model->seed = options.seed;
  model->is_synthetic = true;
  model->host_materialized = false;
  model->specs = ModelTensorSpecs(config);
  model->tensors.resize(model->specs.size());
  for (size_t i = 0; i < model->specs.size(); ++i) {
    const TensorSpec& spec = model->specs[i];
    model->tensors[i] = {spec.name, "synthetic:" + spec.name, DType::kBF16, spec.shape, nullptr};
  }
  if (options.materialize_host) RETURN_IF_ERROR(MaterializeHostWeights(*model));
  return model;
}

}  // namespace

absl::StatusOr<HeldExperts> HeldExpertRange(const std::vector<ExpertWeights>& experts) {
  if (experts.empty()) return HeldExperts{};
  auto held = [](const ExpertWeights& e) { return !e.gate.empty(); };
  const int n = static_cast<int>(experts.size());
  HeldExperts r;
  while (r.begin < n && !held(experts[r.begin])) ++r.begin;
  r.end = r.begin;
  while (r.end < n && held(experts[r.end])) ++r.end;
  if (r.begin == n)
    return absl::FailedPreconditionError(
        absl::StrCat("a MoE layer holds none of its ", n, " experts"));
  for (int e = 0; e < n; ++e) {
    const ExpertWeights& x = experts[e];
    const bool whole = !x.gate.empty() && !x.up.empty() && !x.down.empty();
    const bool none = x.gate.empty() && x.up.empty() && x.down.empty();
    if (r.holds(e) && !whole)
      return absl::FailedPreconditionError(
          absl::StrCat("expert ", e, " is held in part (gate, up and down go together)"));
    if (!r.holds(e) && !none)
      return absl::FailedPreconditionError(absl::StrCat("the experts held are not one run: expert ",
                                                        e, " is held outside [", r.begin, ", ",
                                                        r.end, ")"));
  }
  return r;
}

bool SharedExpertFitsExpertTables(const LayerWeights& layer, const HeldExperts& held) {
  const int experts = static_cast<int>(layer.experts.size());
  if (layer.shared_expert.gate.empty() || experts == 0 || held.begin != 0 || held.end != experts)
    return false;
  auto alike = [](const MatrixRef& a, const MatrixRef& b) {
    return a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols &&
           a.quant.format == b.quant.format && a.quant.scale_dtype == b.quant.scale_dtype;
  };
  const ExpertWeights& e = layer.experts[0];
  const ExpertWeights& s = layer.shared_expert;
  return alike(s.gate, e.gate) && alike(s.up, e.up) && alike(s.down, e.down);
}

std::vector<MatrixRef*> LayerLinears(LayerWeights& l) {
  std::vector<MatrixRef*> linears = {&l.q, &l.k, &l.v, &l.o, &l.mlp.gate, &l.mlp.up, &l.mlp.down};
  for (ExpertWeights& e : l.experts) linears.insert(linears.end(), {&e.gate, &e.up, &e.down});
  linears.insert(linears.end(),
                 {&l.shared_expert.gate, &l.shared_expert.up, &l.shared_expert.down});
  LinearAttentionWeights& la = l.linear_attn;
  linears.insert(linears.end(), {&la.in_proj_qkv, &la.in_proj_z, &la.out_proj});
  return linears;
}

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
  ASSIGN_OR_RETURN(auto bound, BindWeights(model.config, model.specs, model.tensors));
  model.weights = std::move(bound);
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
    BindTensor(specs[i], tensors[i], *slot);
  }
  // A quantized linear needs its codes and scales (and nvfp4 its scale_2) to be usable.
  for (const TensorSpec& spec : specs) {
    if (spec.quant == QuantFormat::kNone || spec.part != QuantPart::kData) continue;
    const MatrixRef& q = *Slot(w, spec);
    if (q.data == nullptr || q.quant.scale == nullptr ||
        (q.quant.format == QuantFormat::kNvfp4 && q.quant.global_scale == nullptr))
      return absl::InternalError(
          absl::StrCat("BindWeights: quantized ", spec.linear, " lacks its codes or scales"));
  }
  return w;
}

std::string DeclaredWeightFormat(const std::string& model) {
  auto d = ParseModelDescription(model);
  if (!d.ok()) return "";
  if (d->quantize != QuantFormat::kNone) return QuantFormatFamily(d->quantize);
  if (absl::StartsWith(d->model, "preset:")) return "bf16";
  auto scheme = ReadCheckpointQuantScheme(d->model);
  if (!scheme.ok() || !scheme->quantized()) return "";  // the dense dtype shows on load
  return QuantFormatFamily(scheme->format);
}

absl::StatusOr<MatrixRef*> WeightSlot(ModelWeights& weights, const HostModel& model,
                                      const std::string& canonical) {
  for (const TensorSpec& spec : model.specs) {
    const bool dense = spec.quant == QuantFormat::kNone && spec.name == canonical;
    const bool codes = spec.part == QuantPart::kData && spec.linear == canonical;
    if (!dense && !codes) continue;
    if (MatrixRef* slot = Slot(weights, spec)) return slot;
  }
  return absl::NotFoundError(absl::StrCat(model.source, " has no weight '", canonical, "'"));
}

absl::StatusOr<MatrixRef> FindWeight(const HostModel& model, const std::string& canonical) {
  // WeightSlot only navigates; the weights are not modified.
  ASSIGN_OR_RETURN(auto slot,
                   WeightSlot(const_cast<ModelWeights&>(model.weights), model, canonical));
  return *slot;
}

absl::Status QuantizeHostModel(HostModel& model, QuantFormat format) {
  if (model.quant_format != QuantFormat::kNone)
    return absl::InvalidArgumentError(
        absl::StrCat(model.source, " is already quantized (", QuantFormatName(model.quant_format),
                     "); quantizing takes dense bf16, f16 or f32 weights"));
  // A synthetic model not yet on the host is streamed: each quantizable tensor is generated in
  // bf16 into a per-thread buffer, quantized and dropped, so the dense copy (61 GB for
  // qwen3-30b-a3b) never exists; the tensors that stay dense are generated as usual. The bytes
  // are the same as quantizing the materialised model (the generator is a pure function).
  const bool stream = model.is_synthetic && !model.host_materialized;
  const int64_t count = static_cast<int64_t>(model.specs.size());
  if (stream) {
    model.synthetic.assign(model.specs.size(), {});
    for (int64_t i = 0; i < count; ++i) {
      if (IsQuantizable(model.specs[i])) continue;
      model.synthetic[i].resize(model.specs[i].numel());
      model.tensors[i].data = model.synthetic[i].data();
    }
  } else if (auto s = MaterializeHostWeights(model); !s.ok()) {
    return s;
  }
  // Tensors quantize independently; threads take them largest first from a shared cursor, so
  // one big tensor never ends up last on one thread. The model changes only once all of them
  // succeeded.
  std::vector<int64_t> order(count);
  for (int64_t i = 0; i < count; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return model.specs[a].numel() > model.specs[b].numel();
  });
  std::vector<std::optional<absl::StatusOr<QuantizedMatrix>>> quantized(count);
  std::atomic<int64_t> next{0};
  cpu::ParallelFor(cpu::NumThreads(), 1, [&](int64_t, int64_t) {
    std::vector<uint16_t> scratch;  // this thread's bf16 copy of the tensor being quantized
    std::vector<float> dense;       // and the quantizer's fp32 copy of it
    for (int64_t at = next++; at < count; at = next++) {
      const int64_t i = order[at];
      const TensorSpec& spec = model.specs[i];
      if (!IsQuantizable(spec)) {
        if (stream)
          GenerateSyntheticBf16(model.seed, spec, model.config.tie_word_embeddings, 0, spec.numel(),
                                model.synthetic[i].data());
        continue;
      }
      HostTensor tensor = model.tensors[i];
      if (stream) {
        scratch.resize(spec.numel());
        GenerateSyntheticBf16(model.seed, spec, model.config.tie_word_embeddings, 0, spec.numel(),
                              scratch.data());
        tensor.data = scratch.data();
      }
      quantized[i] = QuantizeMatrix(format, ToRef(spec, tensor), &dense);
    }
  });
  if (stream) model.host_materialized = true;
  std::vector<TensorSpec> specs;
  std::vector<HostTensor> tensors;
  std::vector<std::vector<uint8_t>> storage;
  for (int64_t i = 0; i < count; ++i) {
    const TensorSpec& spec = model.specs[i];
    if (!quantized[i]) {
      specs.push_back(spec);
      tensors.push_back(model.tensors[i]);
      continue;
    }
    absl::StatusOr<QuantizedMatrix>& q = *quantized[i];
    if (!q.ok())
      return absl::Status(q.status().code(), absl::StrCat(spec.name, ": ", q.status().message()));
    auto parts = QuantizedTensorSpecs({spec}, [format](const TensorSpec&) { return format; });
    if (!parts.ok()) return parts.status();
    size_t written = 0;  // the quantizer writes every part but the optional ones, in order
    for (const TensorSpec& part : *parts) {
      if (part.optional) continue;
      storage.push_back(std::move(q->parts[written++]));
      tensors.push_back({part.name, "quantized:" + spec.name, part.dtypes.front(), part.shape,
                         storage.back().data()});
      specs.push_back(part);
    }
  }
  ASSIGN_OR_RETURN(auto bound, BindWeights(model.config, specs, tensors));
  for (int64_t i = 0; i < count; ++i)  // the bf16 copies of quantized linears are not read again
    if (quantized[i] && i < static_cast<int64_t>(model.synthetic.size()))
      std::vector<uint16_t>().swap(model.synthetic[i]);
  model.quantized = std::move(storage);
  model.specs = std::move(specs);
  model.tensors = std::move(tensors);
  model.weights = std::move(bound);
  model.quant_format = format;
  // The stored tensors are host buffers of codes and scales now, no longer a function of the
  // seed: devices must copy them rather than generate weights in place.
  model.is_synthetic = false;
  return absl::OkStatus();
}

absl::StatusOr<ModelIdentity> DescribeModel(const std::string& model_arg,
                                            const LoadOptions& options) {
  ASSIGN_OR_RETURN(auto description, ParseModelDescription(model_arg));
  const QuantFormat quantize =
      options.quantize != QuantFormat::kNone ? options.quantize : description.quantize;
  const std::string& path = description.model;
  ModelIdentity id;
  if (absl::StartsWith(path, "preset:"))
    return DescribePreset(path.substr(7), options.num_layers_override, options.seed, quantize);
  ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::Open(path));
  const Checkpoint& ckpt = *checkpoint;
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::weakly_canonical(path, ec);
  id.source = "checkpoint";
  id.name = ec ? path : absolute.string();
  id.layers = ckpt.config().num_layers;
  id.fingerprint = ckpt.Fingerprint();
  if (quantize != QuantFormat::kNone) {
    id.weights = QuantFormatName(quantize);
    return id;
  }
  // The declared format of the linears, else the stored dtype of the first tensor in the table
  // (WeightFormat's reading, after loading).
  for (const TensorSpec& spec : ModelTensorSpecs(ckpt.config())) {
    if (const QuantFormat f = ckpt.LinearFormat(spec); f != QuantFormat::kNone) {
      id.weights = QuantFormatName(f);
      return id;
    }
  }
  ASSIGN_OR_RETURN(auto first, ckpt.Resolve({ModelTensorSpecs(ckpt.config()).front()}));
  switch (first[0].dtype) {
    case DType::kF16:
      id.weights = "f16";
      break;
    case DType::kF32:
      id.weights = "f32";
      break;
    default:
      id.weights = "bf16";
  }
  return id;
}

absl::StatusOr<std::unique_ptr<HostModel>> LoadHostModel(const std::string& model_arg,
                                                         const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(auto description, ParseModelDescription(model_arg));
  if (options.quantize != QuantFormat::kNone) {
    if (description.quantize != QuantFormat::kNone && description.quantize != options.quantize)
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", model_arg, "' names format ", QuantFormatName(description.quantize),
          " but the load asks for ", QuantFormatName(options.quantize)));
    description.quantize = options.quantize;
  }
  const std::string& path = description.model;
  std::unique_ptr<HostModel> model;
  if (absl::StartsWith(path, "preset:")) {
    LoadOptions synthetic = options;
    // Quantized presets are generated tensor by tensor as they are quantized (QuantizeHostModel).
    if (description.quantize != QuantFormat::kNone) synthetic.materialize_host = false;
    ASSIGN_OR_RETURN(auto made, MakeSynthetic(path.substr(7), synthetic));
    model = std::move(made);
  } else {
    ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::Open(path));
    const Checkpoint& ckpt = *checkpoint;
    model = std::make_unique<HostModel>();
    model->config = ckpt.config();
    model->source = path;
    std::vector<std::string>& warnings = model->warnings;
    auto specs = QuantizedTensorSpecs(
        ModelTensorSpecs(model->config),
        [&ckpt, &warnings](const TensorSpec& s) { return ckpt.StoredLinearFormat(s, &warnings); });
    if (!specs.ok())
      return absl::Status(specs.status().code(),
                          absl::StrCat(path, ": ", specs.status().message()));
    ASSIGN_OR_RETURN(auto tensors, ckpt.Resolve(*specs));
    // Optional parts the checkpoint does not hold (activation scales) leave the table, so every
    // spec has bytes behind it.
    for (size_t i = 0; i < specs->size(); ++i) {
      if (tensors[i].data == nullptr) continue;
      if ((*specs)[i].quant != QuantFormat::kNone) model->quant_format = (*specs)[i].quant;
      model->specs.push_back((*specs)[i]);
      model->tensors.push_back(tensors[i]);
    }
    model->checkpoint = std::move(checkpoint);
  }
  ASSIGN_OR_RETURN(auto bound, BindWeights(model->config, model->specs, model->tensors));
  model->weights = std::move(bound);
  if (description.quantize != QuantFormat::kNone) {
    RETURN_IF_ERROR(QuantizeHostModel(*model, description.quantize));
    model->source = ModelDescriptionString(description);
  }
  model->load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return model;
}

}  // namespace infersweep
