// HF config.json: reading the file, parsing its JSON and mapping its fields, in every spelling
// transformers 4.x and 5.x write, onto a ModelConfig (docs/MODELS.md). Every error names the file
// and the field.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "api/model_config.h"
#include "api/model_config_internal.h"
#include "api/status_macros.h"
#include "api/untrusted_json.h"
#include "nlohmann/json.hpp"

namespace infersweep {
namespace {

using json = nlohmann::json;
using model_config_internal::ArchFromModelType;
using model_config_internal::FieldError;
using model_config_internal::IsHybridArch;
using model_config_internal::IsMoeArch;
using model_config_internal::LayersFromInterval;
using model_config_internal::SupportedModelTypes;
using model_config_internal::Sv;

constexpr std::uintmax_t kMaxConfigBytes = 64u << 20;

// What an absent field means.
constexpr int kDefaultMaxPositions = 4096;
constexpr double kDefaultRmsNormEps = 1e-6;
constexpr double kDefaultRopeTheta = 10000.0;
constexpr int kDefaultFullAttentionInterval = 4;
constexpr int kDefaultConvKernel = 4;

// The Qwen3.5 multimodal wrappers hold the language model's config in `text_config`.
bool IsWrapperType(std::string_view model_type) {
  return model_type == "qwen3_5_moe" || model_type == "qwen3_5";
}

// A JSON value for an error message: strings quoted, long values cut.
std::string Show(const json& v) {
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
  constexpr size_t kMax = 80;
  if (s.size() > kMax) s = absl::StrCat(s.substr(0, kMax), "...");
  return s;
}

// Records the first parse error so the message can carry its byte position without any
// exception being thrown.
class ErrorCapturingSax : public nlohmann::json_sax<json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t byte, const std::string& token,
                   const nlohmann::detail::exception& ex) override {
    failed = true;
    position = byte;
    last_token = token;
    message = ex.what();
    return false;
  }

  bool failed = false;
  std::size_t position = 0;
  std::string last_token;
  std::string message;
};

absl::Status MalformedJson(std::string_view text, std::string_view source) {
  ErrorCapturingSax sax;
  // With a SAX handler that returns false from parse_error, nothing is thrown.
  json::sax_parse(text, &sax, json::input_format_t::json, /*strict=*/true);
  if (!sax.failed) {
    return absl::InvalidArgumentError(absl::StrCat(Sv(source), ": malformed JSON"));
  }
  // Drop nlohmann's "[json.exception.parse_error.101] " tag; keep the human part, with any
  // offending raw bytes it quotes made printable.
  std::string_view raw = sax.message;
  if (!raw.empty() && raw.front() == '[') {
    const size_t close = raw.find("] ");
    if (close != std::string_view::npos) raw.remove_prefix(close + 2);
  }
  std::string detail;
  for (const char ch : raw) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (u >= 0x20 && u < 0x7f) {
      detail.push_back(ch);
    } else {
      absl::StrAppendFormat(&detail, "\\x%02x", u);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(Sv(source), ": malformed JSON at byte ", sax.position, ": ", detail));
}

// Reads typed fields out of one JSON object, producing messages that name the source and field.
// Optional fields treat an explicit `null` like an absent key (HF writes nulls for "unset").
class FieldReader {
 public:
  FieldReader(const json& object, std::string_view source, std::string prefix = "")
      : obj_(object), source_(source), prefix_(std::move(prefix)) {}

  std::string FieldName(std::string_view key) const { return absl::StrCat(prefix_, Sv(key)); }

  const json* Find(std::string_view key) const {
    auto it = obj_.find(std::string(key));
    return it == obj_.end() ? nullptr : &*it;
  }
  // Present and not null.
  const json* FindSet(std::string_view key) const {
    const json* v = Find(key);
    return (v == nullptr || v->is_null()) ? nullptr : v;
  }

  absl::Status TypeError(std::string_view key, std::string_view expected, const json& got) const {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: field '%s': expected %s, got %s", source_, FieldName(key), expected, Show(got)));
  }
  absl::Status Missing(std::string_view key, std::string_view expected) const {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: missing required field '%s' (%s)", source_, FieldName(key), expected));
  }

  // An integer >= min_value that fits in int. Integral floats (2048.0) are accepted.
  absl::StatusOr<int> IntValue(std::string_view key, const json& v, int min_value) const {
    const std::string_view expected =
        min_value > 0 ? "a positive integer" : "a non-negative integer";
    int64_t n = 0;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
        return TypeError(key, absl::StrCat(Sv(expected), " that fits in 32 bits"), v);
      }
      n = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      n = v.get<int64_t>();
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (!std::isfinite(d) || std::floor(d) != d || std::fabs(d) > 2147483647.0) {
        return TypeError(key, expected, v);
      }
      n = static_cast<int64_t>(d);
    } else {
      return TypeError(key, expected, v);
    }
    if (n < min_value) return TypeError(key, expected, v);
    if (n > std::numeric_limits<int>::max()) {
      return TypeError(key, absl::StrCat(Sv(expected), " that fits in 32 bits"), v);
    }
    return static_cast<int>(n);
  }

  absl::StatusOr<int> RequiredInt(std::string_view key, int min_value = 1) const {
    const json* v = Find(key);
    if (v == nullptr) {
      return Missing(key, min_value > 0 ? "a positive integer" : "a non-negative integer");
    }
    return IntValue(key, *v, min_value);
  }
  absl::StatusOr<std::optional<int>> OptionalInt(std::string_view key, int min_value = 1) const {
    const json* v = FindSet(key);
    if (v == nullptr) return std::optional<int>();
    ASSIGN_OR_RETURN(const int n, IntValue(key, *v, min_value));
    return std::optional<int>(n);
  }
  absl::StatusOr<int> IntOr(std::string_view key, int default_value, int min_value = 1) const {
    ASSIGN_OR_RETURN(const std::optional<int> n, OptionalInt(key, min_value));
    return n.value_or(default_value);
  }

  // A finite number > 0.
  absl::StatusOr<std::optional<double>> OptionalPositiveNumber(std::string_view key) const {
    const json* v = FindSet(key);
    if (v == nullptr) return std::optional<double>();
    if (!v->is_number()) return TypeError(key, "a positive number", *v);
    const double d = v->get<double>();
    if (!std::isfinite(d) || d <= 0) return TypeError(key, "a positive number", *v);
    return std::optional<double>(d);
  }

  absl::StatusOr<bool> BoolOr(std::string_view key, bool default_value) const {
    const json* v = FindSet(key);
    if (v == nullptr) return default_value;
    if (!v->is_boolean()) return TypeError(key, "true or false", *v);
    return v->get<bool>();
  }

  absl::StatusOr<std::optional<std::string>> OptionalString(std::string_view key) const {
    const json* v = FindSet(key);
    if (v == nullptr) return std::optional<std::string>();
    if (!v->is_string()) return TypeError(key, "a string", *v);
    return std::optional<std::string>(v->get<std::string>());
  }

  std::string_view source() const { return source_; }

 private:
  const json& obj_;
  std::string_view source_;
  std::string prefix_;
};

absl::Status Unsupported(std::string_view source, std::string_view field, std::string_view what) {
  return absl::UnimplementedError(absl::StrFormat("%s: field '%s': %s", source, field, what));
}

// rope_theta from `rope_theta` (4.x) or `rope_parameters.rope_theta` (5.x); rejects any RoPE
// variant other than the default one.
absl::Status ParseRope(const FieldReader& r, ModelConfig& c) {
  std::string_view source = r.source();
  std::optional<double> theta, partial;
  ASSIGN_OR_RETURN(theta, r.OptionalPositiveNumber("rope_theta"));
  ASSIGN_OR_RETURN(partial, r.OptionalPositiveNumber("partial_rotary_factor"));

  if (const json* scaling = r.FindSet("rope_scaling")) {
    if (!scaling->is_object()) return r.TypeError("rope_scaling", "an object or null", *scaling);
    std::string type = "(unspecified)";
    for (const char* key : {"rope_type", "type"}) {
      auto it = scaling->find(key);
      if (it != scaling->end() && it->is_string()) {
        type = it->get<std::string>();
        break;
      }
    }
    if (type != "default") {
      return Unsupported(source, r.FieldName("rope_scaling"),
                         absl::StrFormat("RoPE scaling type \"%s\" is not supported (only "
                                         "default RoPE is implemented)",
                                         type));
    }
  }

  if (const json* params = r.FindSet("rope_parameters")) {
    if (!params->is_object()) {
      return r.TypeError("rope_parameters", "an object or null", *params);
    }
    FieldReader pr(*params, source, r.FieldName("rope_parameters."));
    // transformers 5 nests one parameter set per layer type for hybrid-attention models.
    for (auto it = params->begin(); it != params->end(); ++it) {
      if (it.value().is_object()) {
        return Unsupported(source, pr.FieldName(it.key()),
                           "per-layer-type RoPE parameters are not supported");
      }
    }
    std::optional<std::string> type;
    ASSIGN_OR_RETURN(type, pr.OptionalString("rope_type"));
    if (type.has_value() && *type != "default") {
      return Unsupported(source, pr.FieldName("rope_type"),
                         absl::StrFormat("RoPE type \"%s\" is not supported (only default RoPE "
                                         "is implemented)",
                                         *type));
    }
    std::optional<double> nested;
    ASSIGN_OR_RETURN(nested, pr.OptionalPositiveNumber("rope_theta"));
    if (nested.has_value()) {
      if (theta.has_value() && *theta != *nested) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: field 'rope_theta' (%g) disagrees with 'rope_parameters.rope_theta' (%g)", source,
            *theta, *nested));
      }
      theta = nested;
    }
    std::optional<double> nested_partial;
    ASSIGN_OR_RETURN(nested_partial, pr.OptionalPositiveNumber("partial_rotary_factor"));
    if (nested_partial.has_value()) {
      if (partial.has_value() && *partial != *nested_partial) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: field '%s' (%g) disagrees with '%s' (%g)", source,
                            r.FieldName("partial_rotary_factor"), *partial,
                            pr.FieldName("partial_rotary_factor"), *nested_partial));
      }
      partial = nested_partial;
    }
    // Multimodal RoPE splits the rotary frequencies into (temporal, height, width) sections; for
    // text every position row is the same, so it is 1-D RoPE. Hybrids only.
    if (const json* sections = pr.FindSet("mrope_section")) {
      if (!IsHybridArch(c.arch)) {
        return Unsupported(source, pr.FieldName("mrope_section"),
                           "multimodal RoPE is supported for qwen3_5 models only");
      }
      if (!sections->is_array()) {
        return pr.TypeError("mrope_section", "a list of integers", *sections);
      }
      for (size_t i = 0; i < sections->size(); ++i) {
        RETURN_IF_ERROR(
            pr.IntValue(absl::StrCat("mrope_section[", i, "]"), (*sections)[i], 0).status());
      }
    }
    bool interleaved = false;
    ASSIGN_OR_RETURN(interleaved, pr.BoolOr("mrope_interleaved", false));
    (void)interleaved;  // any section layout reduces to 1-D RoPE for text
  }
  c.rope_theta = theta.value_or(kDefaultRopeTheta);
  c.partial_rotary_factor = partial.value_or(1.0);
  if (c.partial_rotary_factor > 1.0) {
    return FieldError(source, r.FieldName("partial_rotary_factor"),
                      absl::StrFormat("%g must be in (0, 1]", c.partial_rotary_factor));
  }
  if (c.partial_rotary_factor != 1.0 && !IsHybridArch(c.arch)) {
    return Unsupported(source, r.FieldName("partial_rotary_factor"),
                       absl::StrFormat("partial RoPE (%g) is supported for hybrid models only",
                                       c.partial_rotary_factor));
  }
  return absl::OkStatus();
}

absl::Status ParseSlidingWindow(const FieldReader& r, ModelConfig& c) {
  std::string_view source = r.source();
  if (c.arch == ModelArch::kQwen2Moe || c.arch == ModelArch::kQwen3 ||
      c.arch == ModelArch::kQwen3Moe) {
    bool use_sliding = false;
    ASSIGN_OR_RETURN(use_sliding, r.BoolOr("use_sliding_window", false));
    if (use_sliding) {
      return Unsupported(source, "use_sliding_window", "sliding-window attention is not supported");
    }
  } else {
    std::optional<int> window;
    ASSIGN_OR_RETURN(window, r.OptionalInt("sliding_window", 1));
    if (window.has_value() && *window < c.max_position_embeddings) {
      return Unsupported(
          source, "sliding_window",
          absl::StrFormat("sliding-window attention (window %d < max_position_embeddings %d) "
                          "is not supported",
                          *window, c.max_position_embeddings));
    }
  }
  // Newer transformers also spell the attention pattern out per layer.
  if (const json* types = r.FindSet("layer_types")) {
    if (!types->is_array()) return r.TypeError("layer_types", "a list of strings", *types);
    for (size_t i = 0; i < types->size(); ++i) {
      const json& t = (*types)[i];
      const std::string field = absl::StrCat("layer_types[", i, "]");
      if (!t.is_string()) return r.TypeError(field, "a string", t);
      if (t.get<std::string>() != "full_attention") {
        return Unsupported(source, field,
                           absl::StrFormat("attention type %s is not supported (only "
                                           "\"full_attention\")",
                                           Show(t)));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ParseMoe(const FieldReader& r, ModelConfig& c) {
  std::string_view source = r.source();
  std::optional<int> num_experts, num_local;
  ASSIGN_OR_RETURN(num_experts, r.OptionalInt("num_experts", 0));
  ASSIGN_OR_RETURN(num_local, r.OptionalInt("num_local_experts", 0));
  if (num_experts.has_value() && num_local.has_value() && *num_experts != *num_local) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: field 'num_experts' (%d) disagrees with 'num_local_experts' (%d)",
                        source, *num_experts, *num_local));
  }
  c.num_experts = num_experts.value_or(num_local.value_or(0));
  if (c.num_experts == 0) {
    const std::string_view field =
        c.arch == ModelArch::kMixtral ? "num_local_experts" : "num_experts";
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: field '%s': model_type \"%s\" is a mixture-of-experts architecture and needs a "
        "positive expert count (`num_experts` or `num_local_experts`)",
        source, field, c.model_type));
  }
  ASSIGN_OR_RETURN(c.num_experts_per_tok, r.RequiredInt("num_experts_per_tok"));

  if (c.arch == ModelArch::kMixtral) {
    // Mixtral experts are full-width SwiGLU MLPs, every layer is sparse and the top-k weights
    // are always renormalised.
    c.moe_intermediate_size = c.intermediate_size;
    c.norm_topk_prob = true;
    c.decoder_sparse_step = 1;
    c.mlp_only_layers.clear();
    return absl::OkStatus();
  }

  ASSIGN_OR_RETURN(c.moe_intermediate_size, r.RequiredInt("moe_intermediate_size"));
  ASSIGN_OR_RETURN(c.norm_topk_prob, r.BoolOr("norm_topk_prob", false));
  ASSIGN_OR_RETURN(c.decoder_sparse_step, r.IntOr("decoder_sparse_step", 1, 1));
  if (const json* layers = r.FindSet("mlp_only_layers")) {
    if (!layers->is_array()) {
      return r.TypeError("mlp_only_layers", "a list of layer indices", *layers);
    }
    for (size_t i = 0; i < layers->size(); ++i) {
      int layer = 0;
      ASSIGN_OR_RETURN(layer,
                       r.IntValue(absl::StrCat("mlp_only_layers[", i, "]"), (*layers)[i], 0));
      c.mlp_only_layers.push_back(layer);
    }
    std::sort(c.mlp_only_layers.begin(), c.mlp_only_layers.end());
    c.mlp_only_layers.erase(std::unique(c.mlp_only_layers.begin(), c.mlp_only_layers.end()),
                            c.mlp_only_layers.end());
  }
  if (c.arch == ModelArch::kQwen2Moe || c.arch == ModelArch::kQwen3Next ||
      c.arch == ModelArch::kQwen35Moe) {
    ASSIGN_OR_RETURN(c.shared_expert_intermediate_size,
                     r.IntOr("shared_expert_intermediate_size", 0, 0));
  }
  return absl::OkStatus();
}

// The linear-attention dims, the layer pattern and the fixed traits of the hybrid architectures.
absl::Status ParseHybrid(const FieldReader& r, ModelConfig& c) {
  std::string_view source = r.source();
  ASSIGN_OR_RETURN(c.linear_num_key_heads, r.RequiredInt("linear_num_key_heads"));
  ASSIGN_OR_RETURN(c.linear_num_value_heads, r.RequiredInt("linear_num_value_heads"));
  ASSIGN_OR_RETURN(c.linear_key_head_dim, r.RequiredInt("linear_key_head_dim"));
  ASSIGN_OR_RETURN(c.linear_value_head_dim, r.RequiredInt("linear_value_head_dim"));
  ASSIGN_OR_RETURN(c.linear_conv_kernel_dim, r.IntOr("linear_conv_kernel_dim", kDefaultConvKernel));

  if (const json* types = r.FindSet("layer_types")) {
    if (!types->is_array()) return r.TypeError("layer_types", "a list of strings", *types);
    if (static_cast<int64_t>(types->size()) != c.num_layers) {
      return FieldError(source, r.FieldName("layer_types"),
                        absl::StrFormat("has %d entries, but num_hidden_layers is %d",
                                        types->size(), c.num_layers));
    }
    for (size_t i = 0; i < types->size(); ++i) {
      const json& t = (*types)[i];
      const std::string field = absl::StrCat("layer_types[", i, "]");
      if (t == "full_attention") {
        c.layer_attention.push_back(LayerAttention::kFull);
      } else if (t == "linear_attention") {
        c.layer_attention.push_back(LayerAttention::kLinear);
      } else {
        return r.TypeError(field, "\"full_attention\" or \"linear_attention\"", t);
      }
    }
  } else {
    int interval = 0;
    ASSIGN_OR_RETURN(interval, r.IntOr("full_attention_interval", kDefaultFullAttentionInterval));
    c.layer_attention = LayersFromInterval(c.num_layers, interval);
  }

  ASSIGN_OR_RETURN(c.attn_output_gate, r.BoolOr("attn_output_gate", true));
  bool bias = false;
  ASSIGN_OR_RETURN(bias, r.BoolOr("attention_bias", false));
  if (bias) {
    return Unsupported(source, r.FieldName("attention_bias"),
                       "attention biases are not supported for hybrid models");
  }
  bool use_sliding = false;
  ASSIGN_OR_RETURN(use_sliding, r.BoolOr("use_sliding_window", false));
  if (use_sliding) {
    return Unsupported(source, r.FieldName("use_sliding_window"),
                       "sliding-window attention is not supported");
  }
  c.attention_bias = false;
  c.qk_norm = true;
  c.zero_centered_norm = true;
  if (c.arch == ModelArch::kQwen35Moe) {
    // Every Qwen3.5 layer is sparse and renormalises its top-k weights.
    c.norm_topk_prob = true;
    c.decoder_sparse_step = 1;
    c.mlp_only_layers.clear();
  }
  return absl::OkStatus();
}

// model_type, and the architecture it names.
absl::Status ParseModelType(const FieldReader& top, ModelConfig& c) {
  const json* model_type = top.FindSet("model_type");
  if (model_type == nullptr) {
    std::string hint;
    if (const json* archs = top.FindSet("architectures")) {
      hint = absl::StrFormat(
          " (field 'architectures' is %s, but the architecture is chosen by "
          "'model_type')",
          Show(*archs));
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: missing required field 'model_type'%s; supported model_type "
                        "values: %s",
                        top.source(), hint, SupportedModelTypes()));
  }
  if (!model_type->is_string()) return top.TypeError("model_type", "a string", *model_type);
  c.model_type = model_type->get<std::string>();
  const std::optional<ModelArch> arch = ArchFromModelType(c.model_type);
  if (!arch.has_value()) {
    return absl::UnimplementedError(
        absl::StrFormat("%s: field 'model_type': unsupported model type %s; supported: %s",
                        top.source(), Show(*model_type), SupportedModelTypes()));
  }
  c.arch = *arch;
  return absl::OkStatus();
}

// The object that describes the language model: the file's top level, or a multimodal
// wrapper's `text_config`.
absl::StatusOr<const json*> TextModel(const json& root, const FieldReader& top,
                                      const ModelConfig& c) {
  if (!IsWrapperType(c.model_type)) return &root;
  const json* body = top.FindSet("text_config");
  if (body == nullptr) {
    return top.Missing("text_config", "an object holding the language model's config");
  }
  if (!body->is_object()) return top.TypeError("text_config", "an object", *body);
  FieldReader text(*body, top.source(), "text_config.");
  std::optional<std::string> text_type;
  ASSIGN_OR_RETURN(text_type, text.OptionalString("model_type"));
  const std::string want = c.model_type + "_text";
  if (text_type.has_value() && *text_type != want) {
    return FieldError(top.source(), "text_config.model_type",
                      absl::StrFormat("\"%s\" does not belong in a %s config (expected \"%s\")",
                                      *text_type, c.model_type, want));
  }
  return body;
}

// The activation and the sizes every architecture has: layers, heads, widths, vocabulary,
// positions and the norm's epsilon.
absl::Status ParseDims(const FieldReader& r, ModelConfig& c) {
  std::string_view source = r.source();
  std::optional<std::string> act;
  ASSIGN_OR_RETURN(act, r.OptionalString("hidden_act"));
  if (act.has_value() && *act != "silu") {
    return Unsupported(source, r.FieldName("hidden_act"),
                       absl::StrFormat("activation \"%s\" is not supported (only \"silu\")", *act));
  }

  ASSIGN_OR_RETURN(c.hidden_size, r.RequiredInt("hidden_size"));
  ASSIGN_OR_RETURN(c.num_layers, r.RequiredInt("num_hidden_layers"));
  ASSIGN_OR_RETURN(c.num_q_heads, r.RequiredInt("num_attention_heads"));
  ASSIGN_OR_RETURN(c.num_kv_heads, r.IntOr("num_key_value_heads", c.num_q_heads));
  std::optional<int> head_dim;
  ASSIGN_OR_RETURN(head_dim, r.OptionalInt("head_dim"));
  if (head_dim.has_value()) {
    c.head_dim = *head_dim;
  } else if (c.hidden_size % c.num_q_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: field '%s' is absent and hidden_size %d is not divisible by "
                        "num_attention_heads %d",
                        source, r.FieldName("head_dim"), c.hidden_size, c.num_q_heads));
  } else {
    c.head_dim = c.hidden_size / c.num_q_heads;
  }
  // Dense architectures (and Mixtral, whose experts use it) need the MLP width; the Qwen MoE
  // ones only when some layer is dense, which validation checks.
  if (IsMoeArch(c.arch) && c.arch != ModelArch::kMixtral) {
    ASSIGN_OR_RETURN(c.intermediate_size, r.IntOr("intermediate_size", 0, 0));
  } else {
    ASSIGN_OR_RETURN(c.intermediate_size, r.RequiredInt("intermediate_size"));
  }
  ASSIGN_OR_RETURN(c.vocab_size, r.RequiredInt("vocab_size"));
  ASSIGN_OR_RETURN(c.max_position_embeddings,
                   r.IntOr("max_position_embeddings", kDefaultMaxPositions));
  std::optional<double> eps;
  ASSIGN_OR_RETURN(eps, r.OptionalPositiveNumber("rms_norm_eps"));
  c.rms_norm_eps = static_cast<float>(eps.value_or(kDefaultRmsNormEps));
  if (!(c.rms_norm_eps > 0) || !std::isfinite(c.rms_norm_eps)) {
    return r.TypeError("rms_norm_eps", "a positive number representable as a float",
                       *r.FindSet("rms_norm_eps"));
  }
  return absl::OkStatus();
}

// The weights' dtype: `torch_dtype` (4.x) or `dtype` (5.x), bfloat16 when neither is given.
absl::Status ParseDtype(const FieldReader& r, ModelConfig& c) {
  std::string_view source = r.source();
  std::optional<std::string> torch_dtype, dtype;
  ASSIGN_OR_RETURN(torch_dtype, r.OptionalString("torch_dtype"));
  ASSIGN_OR_RETURN(dtype, r.OptionalString("dtype"));
  if (torch_dtype.has_value() && dtype.has_value() && *torch_dtype != *dtype) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: field 'torch_dtype' (\"%s\") disagrees with 'dtype' (\"%s\")", source,
                        *torch_dtype, *dtype));
  }
  c.torch_dtype = dtype.value_or(torch_dtype.value_or("bfloat16"));
  return absl::OkStatus();
}

// Which projections carry biases, and whether q and k are normed per head (the hybrids' are set
// by ParseHybrid).
absl::Status ParseBiasesAndNorms(const FieldReader& r, ModelConfig& c) {
  std::string_view source = r.source();
  switch (c.arch) {
    case ModelArch::kQwen2Moe: {
      // q/k/v carry a bias (o_proj never does): hard-coded in transformers 4.x, the `qkv_bias`
      // field (default true) in 5.x.
      ASSIGN_OR_RETURN(c.attention_bias, r.BoolOr("qkv_bias", true));
      break;
    }
    case ModelArch::kMixtral:
      c.attention_bias = false;
      break;
    case ModelArch::kLlama:
    case ModelArch::kQwen3:
    case ModelArch::kQwen3Moe: {
      ASSIGN_OR_RETURN(c.attention_bias, r.BoolOr("attention_bias", false));
      break;
    }
    case ModelArch::kQwen3Next:
    case ModelArch::kQwen35Moe:
    case ModelArch::kQwen35:
      break;  // ParseHybrid
  }
  c.qk_norm = c.arch == ModelArch::kQwen3 || c.arch == ModelArch::kQwen3Moe;

  // Llama can put biases on the MLP projections; the engine has no MLP biases.
  bool mlp_bias = false;
  ASSIGN_OR_RETURN(mlp_bias, r.BoolOr("mlp_bias", false));
  if (mlp_bias) {
    return Unsupported(source, "mlp_bias", "biases on the MLP projections are not supported");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source) {
  // Messages quote values through Show(), whose dump() recurses per level.
  RETURN_IF_ERROR(CheckJsonDepth(json_text, source));
  const json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return MalformedJson(json_text, source);
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: expected a JSON object at the top level, got %s", source, Show(root)));
  }

  // nlohmann's accessors can throw type_error on mismatches we did not foresee; keep them inside.
  try {
    FieldReader top(root, source);
    ModelConfig c;
    RETURN_IF_ERROR(ParseModelType(top, c));
    ASSIGN_OR_RETURN(const json* body, TextModel(root, top, c));
    FieldReader r(*body, source, body == &root ? "" : "text_config.");
    RETURN_IF_ERROR(ParseDims(r, c));
    ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", false));
    if (body != &root) {  // a wrapper's own tie_word_embeddings, when it has one, decides
      ASSIGN_OR_RETURN(c.tie_word_embeddings,
                       top.BoolOr("tie_word_embeddings", c.tie_word_embeddings));
    }
    RETURN_IF_ERROR(ParseRope(r, c));
    RETURN_IF_ERROR(ParseDtype(r, c));
    if (!IsHybridArch(c.arch)) RETURN_IF_ERROR(ParseSlidingWindow(r, c));
    RETURN_IF_ERROR(ParseBiasesAndNorms(r, c));
    if (IsMoeArch(c.arch)) RETURN_IF_ERROR(ParseMoe(r, c));
    if (IsHybridArch(c.arch)) RETURN_IF_ERROR(ParseHybrid(r, c));
    RETURN_IF_ERROR(ValidateModelConfig(c, source));
    return c;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: unexpected JSON structure: %s", source, e.what()));
  }
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  std::string path;
  if (dir.empty()) {
    path = "config.json";
  } else if (dir.back() == '/') {
    path = dir + "config.json";
  } else {
    path = dir + "/config.json";
  }

  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (st.type() == std::filesystem::file_type::not_found) {
    return absl::NotFoundError(absl::StrFormat("%s: no such file (is %s a model directory?)", path,
                                               dir.empty() ? "." : dir));
  }
  // Other status failures (permissions, ...) are reported by fopen below with their errno.
  if (std::filesystem::is_directory(st)) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: is a directory, not a file", path));
  }
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > kMaxConfigBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d bytes is too large for a config.json (limit %d)", path, size, kMaxConfigBytes));
  }

  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    const std::string msg = absl::StrFormat("%s: cannot open: %s", path, std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(msg);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
    return absl::UnavailableError(msg);
  }
  std::string text;
  char buf[1 << 16];
  while (true) {
    const size_t n = std::fread(buf, 1, sizeof buf, f);
    text.append(buf, n);
    if (text.size() > kMaxConfigBytes) {
      std::fclose(f);
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: too large for a config.json (limit %d bytes)", path, kMaxConfigBytes));
    }
    if (n < sizeof buf) break;
  }
  const bool read_failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (read_failed) {
    return absl::DataLossError(absl::StrFormat("%s: read failed: %s", path, std::strerror(err)));
  }
  return ParseModelConfig(text, path);
}

}  // namespace infersweep
