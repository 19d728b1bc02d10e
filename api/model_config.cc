#include "api/model_config.h"

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
#include "absl/strings/str_join.h"
#include "api/status_macros.h"
#include "api/untrusted_json.h"
#include "nlohmann/json.hpp"

namespace infersweep {
namespace {

using json = nlohmann::json;

// Upper bounds that keep every size product (and the parameter totals) well inside int64 and every
// per-dimension product the header computes in `int` (q_dim, kv_dim) inside int32.
constexpr int kMaxHidden = 1 << 20;
constexpr int kMaxVocab = 1 << 24;
constexpr int kMaxLayers = 4096;
constexpr int kMaxExperts = 4096;
constexpr int kMaxHeads = 4096;
constexpr int kMaxHeadDim = 4096;
constexpr int kMaxProjDim = 1 << 20;          // num_heads * head_dim
constexpr int kMaxIntermediate = 1 << 22;
constexpr int kMaxPositions = 1 << 30;
constexpr double kMaxTotalParams = 1e15;      // ~1000x the largest models we know of
constexpr std::uintmax_t kMaxConfigBytes = 64u << 20;

constexpr int kDefaultMaxPositions = 4096;
constexpr double kDefaultRmsNormEps = 1e-6;
constexpr double kDefaultRopeTheta = 10000.0;

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

// The Qwen3.5 multimodal wrappers hold the language model's config in `text_config`.
bool IsWrapperType(std::string_view model_type) {
  return model_type == "qwen3_5_moe" || model_type == "qwen3_5";
}

constexpr int kMaxConvKernel = 64;
constexpr int kDefaultFullAttentionInterval = 4;
constexpr int kDefaultConvKernel = 4;

// This abseil build's absl::string_view is not std::string_view; StrCat/StrJoin need the former.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

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
    return absl::InvalidArgumentError(absl::StrFormat("%s: field '%s': expected %s, got %s",
                                                      source_, FieldName(key), expected, Show(got)));
  }
  absl::Status Missing(std::string_view key, std::string_view expected) const {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: missing required field '%s' (%s)", source_, FieldName(key), expected));
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
    absl::StatusOr<int> n = IntValue(key, *v, min_value);
    if (!n.ok()) return n.status();
    return std::optional<int>(*n);
  }
  absl::StatusOr<int> IntOr(std::string_view key, int default_value, int min_value = 1) const {
    absl::StatusOr<std::optional<int>> n = OptionalInt(key, min_value);
    if (!n.ok()) return n.status();
    return n->value_or(default_value);
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
  return absl::UnimplementedError(
      absl::StrFormat("%s: field '%s': %s", source, field, what));
}

absl::Status FieldError(std::string_view source, std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrFormat("%s: field '%s': %s", source, field, what));
}

absl::Status CheckRange(std::string_view source, std::string_view field, int64_t value, int64_t lo,
                        int64_t hi) {
  if (value < lo || value > hi) {
    return FieldError(source, field, absl::StrFormat("%d is out of range [%d, %d]", value, lo, hi));
  }
  return absl::OkStatus();
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
            "%s: field 'rope_theta' (%g) disagrees with 'rope_parameters.rope_theta' (%g)",
            source, *theta, *nested));
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
      return Unsupported(source, "use_sliding_window",
                         "sliding-window attention is not supported");
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
      ASSIGN_OR_RETURN(layer, r.IntValue(absl::StrCat("mlp_only_layers[", i, "]"),
                                         (*layers)[i], 0));
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

    const json* model_type = top.FindSet("model_type");
    if (model_type == nullptr) {
      std::string hint;
      if (const json* archs = top.FindSet("architectures")) {
        hint = absl::StrFormat(" (field 'architectures' is %s, but the architecture is chosen by "
                               "'model_type')",
                               Show(*archs));
      }
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: missing required field 'model_type'%s; supported model_type "
                          "values: %s",
                          source, hint, SupportedModelTypes()));
    }
    if (!model_type->is_string()) return top.TypeError("model_type", "a string", *model_type);
    c.model_type = model_type->get<std::string>();
    bool known = false;
    for (const ArchEntry& e : kArchs) {
      if (e.name == c.model_type) {
        c.arch = e.arch;
        known = true;
      }
    }
    if (!known) {
      return absl::UnimplementedError(absl::StrFormat(
          "%s: field 'model_type': unsupported model type %s; supported: %s", source,
          Show(*model_type), SupportedModelTypes()));
    }

    // A multimodal wrapper's language model is described by its `text_config`; the rest of the
    // file (vision tower, token ids) does not concern a text engine.
    const json* body = &root;
    std::string prefix;
    if (IsWrapperType(c.model_type)) {
      body = top.FindSet("text_config");
      if (body == nullptr) {
        return top.Missing("text_config", "an object holding the language model's config");
      }
      if (!body->is_object()) return top.TypeError("text_config", "an object", *body);
      prefix = "text_config.";
      FieldReader text(*body, source, prefix);
      std::optional<std::string> text_type;
      ASSIGN_OR_RETURN(text_type, text.OptionalString("model_type"));
      const std::string want = c.model_type + "_text";
      if (text_type.has_value() && *text_type != want) {
        return FieldError(source, "text_config.model_type",
                          absl::StrFormat("\"%s\" does not belong in a %s config (expected \"%s\")",
                                          *text_type, c.model_type, want));
      }
    }
    FieldReader r(*body, source, prefix);

    std::optional<std::string> act;
    ASSIGN_OR_RETURN(act, r.OptionalString("hidden_act"));
    if (act.has_value() && *act != "silu") {
      return Unsupported(
          source, r.FieldName("hidden_act"),
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
          absl::StrFormat("%s: field '%shead_dim' is absent and hidden_size %d is not divisible by "
                          "num_attention_heads %d",
                          source, prefix, c.hidden_size, c.num_q_heads));
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
    ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", false));
    if (body != &root) {  // a wrapper's own tie_word_embeddings, when it has one, decides
      ASSIGN_OR_RETURN(c.tie_word_embeddings,
                       top.BoolOr("tie_word_embeddings", c.tie_word_embeddings));
    }

    RETURN_IF_ERROR(ParseRope(r, c));

    std::optional<std::string> torch_dtype, dtype;
    ASSIGN_OR_RETURN(torch_dtype, r.OptionalString("torch_dtype"));
    ASSIGN_OR_RETURN(dtype, r.OptionalString("dtype"));
    if (torch_dtype.has_value() && dtype.has_value() && *torch_dtype != *dtype) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: field 'torch_dtype' (\"%s\") disagrees with 'dtype' (\"%s\")",
                          source, *torch_dtype, *dtype));
    }
    c.torch_dtype = dtype.value_or(torch_dtype.value_or("bfloat16"));

    if (!IsHybridArch(c.arch)) RETURN_IF_ERROR(ParseSlidingWindow(r, c));

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

    if (IsMoeArch(c.arch)) RETURN_IF_ERROR(ParseMoe(r, c));
    if (IsHybridArch(c.arch)) RETURN_IF_ERROR(ParseHybrid(r, c));

    RETURN_IF_ERROR(ValidateModelConfig(c, source));
    return c;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: unexpected JSON structure: %s", source, e.what()));
  }
}

absl::Status ValidateModelConfig(const ModelConfig& c, std::string_view source) {
  bool type_matches = c.model_type.empty();
  for (const ArchEntry& e : kArchs) type_matches |= e.arch == c.arch && e.name == c.model_type;
  if (!type_matches) {
    return FieldError(source, "model_type",
                      absl::StrFormat("\"%s\" does not match architecture %s", c.model_type,
                                      ModelArchName(c.arch)));
  }
  RETURN_IF_ERROR(CheckRange(source, "hidden_size", c.hidden_size, 1, kMaxHidden));
  RETURN_IF_ERROR(CheckRange(source, "num_hidden_layers", c.num_layers, 1, kMaxLayers));
  RETURN_IF_ERROR(CheckRange(source, "num_attention_heads", c.num_q_heads, 1, kMaxHeads));
  RETURN_IF_ERROR(CheckRange(source, "num_key_value_heads", c.num_kv_heads, 1, c.num_q_heads));
  if (c.num_q_heads % c.num_kv_heads != 0) {
    return FieldError(source, "num_key_value_heads",
                      absl::StrFormat("num_attention_heads %d is not divisible by "
                                      "num_key_value_heads %d",
                                      c.num_q_heads, c.num_kv_heads));
  }
  RETURN_IF_ERROR(CheckRange(source, "head_dim", c.head_dim, 2, kMaxHeadDim));
  if (c.head_dim % 2 != 0) {
    return FieldError(source, "head_dim",
                      absl::StrFormat("%d must be even (RoPE rotates pairs)", c.head_dim));
  }
  if (static_cast<int64_t>(c.num_q_heads) * c.head_dim > kMaxProjDim) {
    return FieldError(source, "head_dim",
                      absl::StrFormat("num_attention_heads * head_dim = %d is larger than %d",
                                      static_cast<int64_t>(c.num_q_heads) * c.head_dim,
                                      kMaxProjDim));
  }
  RETURN_IF_ERROR(
      CheckRange(source, "intermediate_size", c.intermediate_size, 0, kMaxIntermediate));
  RETURN_IF_ERROR(CheckRange(source, "vocab_size", c.vocab_size, 1, kMaxVocab));
  RETURN_IF_ERROR(CheckRange(source, "max_position_embeddings", c.max_position_embeddings, 1,
                             kMaxPositions));
  if (!(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0)) {
    return FieldError(source, "rms_norm_eps",
                      absl::StrFormat("%g must be a positive finite number", c.rms_norm_eps));
  }
  if (!(std::isfinite(c.rope_theta) && c.rope_theta > 0)) {
    return FieldError(source, "rope_theta",
                      absl::StrFormat("%g must be a positive finite number", c.rope_theta));
  }
  if (c.torch_dtype.empty()) return FieldError(source, "torch_dtype", "must not be empty");
  RETURN_IF_ERROR(
      CheckRange(source, "decoder_sparse_step", c.decoder_sparse_step, 1, kMaxLayers));

  if (c.num_experts < 0) {
    return FieldError(source, "num_experts", absl::StrFormat("%d is negative", c.num_experts));
  }
  if (IsMoeArch(c.arch) && c.num_experts == 0) {
    return FieldError(source, "num_experts",
                      absl::StrFormat("architecture %s needs at least one expert",
                                      ModelArchName(c.arch)));
  }
  if (!IsMoeArch(c.arch) && c.num_experts != 0) {
    return FieldError(source, "num_experts",
                      absl::StrFormat("architecture %s is dense but num_experts is %d",
                                      ModelArchName(c.arch), c.num_experts));
  }
  if (c.is_moe()) {
    RETURN_IF_ERROR(CheckRange(source, "num_experts", c.num_experts, 1, kMaxExperts));
    if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts) {
      return FieldError(source, "num_experts_per_tok",
                        absl::StrFormat("top-k %d must be in [1, num_experts = %d]",
                                        c.num_experts_per_tok, c.num_experts));
    }
    RETURN_IF_ERROR(CheckRange(source, "moe_intermediate_size", c.moe_intermediate_size, 1,
                               kMaxIntermediate));
    RETURN_IF_ERROR(CheckRange(source, "shared_expert_intermediate_size",
                               c.shared_expert_intermediate_size, 0, kMaxIntermediate));
    for (int layer : c.mlp_only_layers) {
      if (layer < 0 || layer >= c.num_layers) {
        return FieldError(source, "mlp_only_layers",
                          absl::StrFormat("layer %d is out of range [0, %d)", layer,
                                          c.num_layers));
      }
    }
  } else if (c.shared_expert_intermediate_size != 0) {
    return FieldError(source, "shared_expert_intermediate_size",
                      "a dense model cannot have a shared expert");
  }

  for (int l = 0; l < c.num_layers; ++l) {
    if (!c.IsMoeLayer(l) && c.intermediate_size <= 0) {
      return FieldError(source, "intermediate_size",
                        absl::StrFormat("must be positive: layer %d uses the dense MLP", l));
    }
  }

  if (IsHybridArch(c.arch)) {
    if (static_cast<int64_t>(c.layer_attention.size()) != c.num_layers) {
      return FieldError(
          source, "layer_types",
          absl::StrFormat("%d layer kinds for %d layers", c.layer_attention.size(), c.num_layers));
    }
    RETURN_IF_ERROR(
        CheckRange(source, "linear_num_key_heads", c.linear_num_key_heads, 1, kMaxHeads));
    RETURN_IF_ERROR(
        CheckRange(source, "linear_num_value_heads", c.linear_num_value_heads, 1, kMaxHeads));
    if (c.linear_num_value_heads % c.linear_num_key_heads != 0) {
      return FieldError(source, "linear_num_value_heads",
                        absl::StrFormat("%d is not a multiple of linear_num_key_heads %d",
                                        c.linear_num_value_heads, c.linear_num_key_heads));
    }
    RETURN_IF_ERROR(
        CheckRange(source, "linear_key_head_dim", c.linear_key_head_dim, 1, kMaxHeadDim));
    RETURN_IF_ERROR(
        CheckRange(source, "linear_value_head_dim", c.linear_value_head_dim, 1, kMaxHeadDim));
    RETURN_IF_ERROR(
        CheckRange(source, "linear_conv_kernel_dim", c.linear_conv_kernel_dim, 1, kMaxConvKernel));
    const int64_t conv_dim =
        2 * static_cast<int64_t>(c.linear_num_key_heads) * c.linear_key_head_dim +
        static_cast<int64_t>(c.linear_num_value_heads) * c.linear_value_head_dim;
    if (conv_dim > kMaxProjDim) {
      return FieldError(source, "linear_num_value_heads",
                        absl::StrFormat("the linear-attention width %d is larger than %d", conv_dim,
                                        kMaxProjDim));
    }
    if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1) || c.rotary_dim() < 2 ||
        c.rotary_dim() % 2 != 0) {
      return FieldError(source, "partial_rotary_factor",
                        absl::StrFormat("%g of head_dim %d rotates %d dims; it must be an even "
                                        "number of at least 2",
                                        c.partial_rotary_factor, c.head_dim, c.rotary_dim()));
    }
  } else {
    if (!c.layer_attention.empty()) {
      return FieldError(
          source, "layer_types",
          absl::StrFormat("architecture %s has no linear-attention layers", ModelArchName(c.arch)));
    }
    if (c.partial_rotary_factor != 1.0 || c.attn_output_gate || c.zero_centered_norm) {
      return FieldError(source, "model_type",
                        absl::StrFormat("partial RoPE, gated attention and zero-centred norms "
                                        "belong to the hybrid architectures, not %s",
                                        ModelArchName(c.arch)));
    }
  }

  const double total = CountParams<double>(c, false);
  if (total > kMaxTotalParams) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the configured model would have %.3g parameters, more than the supported %.3g",
        source, total, kMaxTotalParams));
  }
  return absl::OkStatus();
}

std::vector<std::string> PresetNames() {
  return {"qwen3-30b-a3b",      "qwen3-235b-a22b",   "mixtral-8x7b",
          "qwen3-next-80b-a3b", "qwen3.5-397b-a17b", "tiny-moe",
          "tiny-dense",         "tiny-qwen2-moe",    "tiny-hybrid"};
}

absl::StatusOr<ModelConfig> PresetConfig(std::string_view name, int num_layers_override) {
  ModelConfig c;
  c.torch_dtype = "bfloat16";
  c.tie_word_embeddings = false;
  auto set_arch = [&c](ModelArch arch) {
    c.arch = arch;
    c.model_type = std::string(ModelArchName(arch));
    c.qk_norm = arch == ModelArch::kQwen3 || arch == ModelArch::kQwen3Moe || IsHybridArch(arch);
    c.attention_bias = arch == ModelArch::kQwen2Moe;
    c.zero_centered_norm = IsHybridArch(arch);
    c.attn_output_gate = IsHybridArch(arch);
  };
  // Hybrid presets: the linear-attention dims and the full-attention interval.
  int full_attention_interval = 0;
  auto set_linear = [&c, &full_attention_interval](int key_heads, int value_heads, int key_dim,
                                                   int value_dim, int interval) {
    c.linear_num_key_heads = key_heads;
    c.linear_num_value_heads = value_heads;
    c.linear_key_head_dim = key_dim;
    c.linear_value_head_dim = value_dim;
    c.linear_conv_kernel_dim = 4;
    c.partial_rotary_factor = 0.25;
    full_attention_interval = interval;
  };
  auto set_attention = [&c](int hidden, int layers, int q_heads, int kv_heads, int head_dim) {
    c.hidden_size = hidden;
    c.num_layers = layers;
    c.num_q_heads = q_heads;
    c.num_kv_heads = kv_heads;
    c.head_dim = head_dim;
  };
  auto set_moe = [&c](int experts, int top_k, int moe_intermediate, bool norm_topk) {
    c.num_experts = experts;
    c.num_experts_per_tok = top_k;
    c.moe_intermediate_size = moe_intermediate;
    c.norm_topk_prob = norm_topk;
  };

  if (name == "qwen3-30b-a3b") {
    set_arch(ModelArch::kQwen3Moe);
    set_attention(2048, 48, 32, 4, 128);
    c.intermediate_size = 6144;
    set_moe(128, 8, 768, true);
    c.vocab_size = 151936;
    c.rope_theta = 1e6;
    c.rms_norm_eps = 1e-6f;
    c.max_position_embeddings = 40960;
  } else if (name == "qwen3-235b-a22b") {
    set_arch(ModelArch::kQwen3Moe);
    set_attention(4096, 94, 64, 4, 128);
    c.intermediate_size = 12288;
    set_moe(128, 8, 1536, true);
    c.vocab_size = 151936;
    c.rope_theta = 1e6;
    c.rms_norm_eps = 1e-6f;
    c.max_position_embeddings = 40960;
  } else if (name == "mixtral-8x7b") {
    set_arch(ModelArch::kMixtral);
    set_attention(4096, 32, 32, 8, 128);
    c.intermediate_size = 14336;
    set_moe(8, 2, 14336, true);
    c.vocab_size = 32000;
    c.rope_theta = 1e6;
    c.rms_norm_eps = 1e-5f;
    c.max_position_embeddings = 32768;
  } else if (name == "tiny-moe") {
    set_arch(ModelArch::kQwen3Moe);
    set_attention(128, 4, 4, 2, 32);
    c.intermediate_size = 256;
    set_moe(8, 2, 64, true);
    c.vocab_size = 512;
    c.rope_theta = 1e6;
    c.rms_norm_eps = 1e-6f;
    c.max_position_embeddings = 4096;
  } else if (name == "tiny-dense") {
    set_arch(ModelArch::kQwen3);
    set_attention(128, 4, 4, 2, 32);
    c.intermediate_size = 384;
    c.vocab_size = 512;
    c.rope_theta = 1e6;
    c.rms_norm_eps = 1e-6f;
    c.max_position_embeddings = 4096;
  } else if (name == "tiny-qwen2-moe") {
    set_arch(ModelArch::kQwen2Moe);
    set_attention(128, 4, 4, 2, 32);
    c.intermediate_size = 256;
    set_moe(8, 2, 64, false);
    c.shared_expert_intermediate_size = 128;
    c.decoder_sparse_step = 1;
    c.mlp_only_layers = {1};
    c.vocab_size = 512;
    c.rope_theta = 1e6;
    c.rms_norm_eps = 1e-6f;
    c.max_position_embeddings = 4096;
  } else if (name == "qwen3-next-80b-a3b") {
    set_arch(ModelArch::kQwen3Next);
    set_attention(2048, 48, 16, 2, 256);
    set_linear(16, 32, 128, 128, 4);
    c.intermediate_size = 5120;
    set_moe(512, 10, 512, true);
    c.shared_expert_intermediate_size = 512;
    c.vocab_size = 151936;
    c.rope_theta = 1e7;
    c.rms_norm_eps = 1e-6f;
    c.max_position_embeddings = 262144;
  } else if (name == "qwen3.5-397b-a17b") {
    set_arch(ModelArch::kQwen35Moe);
    set_attention(4096, 60, 32, 2, 256);
    set_linear(16, 64, 128, 128, 4);
    set_moe(512, 10, 1024, true);
    c.shared_expert_intermediate_size = 1024;
    c.vocab_size = 248320;
    c.rope_theta = 1e7;
    c.rms_norm_eps = 1e-6f;
    c.max_position_embeddings = 262144;
  } else if (name == "tiny-hybrid") {
    // Layers alternate linear and full attention; every layer is MoE with a shared expert.
    set_arch(ModelArch::kQwen3Next);
    set_attention(128, 4, 4, 2, 32);
    set_linear(2, 4, 32, 32, 2);
    set_moe(8, 2, 64, true);
    c.shared_expert_intermediate_size = 64;
    c.vocab_size = 512;
    c.rope_theta = 1e6;
    c.rms_norm_eps = 1e-6f;
    c.max_position_embeddings = 4096;
  } else {
    return absl::NotFoundError(absl::StrFormat("unknown model preset \"%s\"; known presets: %s",
                                               name, absl::StrJoin(PresetNames(), ", ")));
  }

  const std::string source = absl::StrFormat("preset '%s'", name);
  if (num_layers_override < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: layer override %d is negative", source, num_layers_override));
  }
  if (num_layers_override > 0) {
    c.num_layers = num_layers_override;
    std::erase_if(c.mlp_only_layers, [&c](int l) { return l >= c.num_layers; });
  }
  if (full_attention_interval > 0)
    c.layer_attention = LayersFromInterval(c.num_layers, full_attention_interval);
  RETURN_IF_ERROR(ValidateModelConfig(c, source));
  return c;
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
    return absl::NotFoundError(absl::StrFormat("%s: no such file (is %s a model directory?)",
                                               path, dir.empty() ? "." : dir));
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
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: too large for a config.json (limit %d bytes)", path,
                          kMaxConfigBytes));
    }
    if (n < sizeof buf) break;
  }
  const bool read_failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (read_failed) {
    return absl::DataLossError(
        absl::StrFormat("%s: read failed: %s", path, std::strerror(err)));
  }
  return ParseModelConfig(text, path);
}

}  // namespace infersweep
