#include "engine/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <set>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/status_macros.h"
#include "api/untrusted_json.h"
#include "engine/quant/layout.h"
#include "nlohmann/json.hpp"

namespace infersweep {
namespace {

using json = nlohmann::json;

constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";

std::string JoinPath(const std::string& dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

std::string Basename(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// This abseil build's absl::string_view is not std::string_view; StrCat needs the former.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool PathExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string FormatShape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status Annotate(const absl::Status& s, absl::string_view prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    return absl::Status(
        absl::ErrnoToStatusCode(err),
        absl::StrCat(path, ": cannot open: ", std::generic_category().message(err)));
  }
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return text;
}

// A shard must live next to the index: no paths, no parent references, no embedded NULs.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name.find('/') == std::string::npos &&
         name.find("..") == std::string::npos && name.find('\0') == std::string::npos;
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(const std::string& text,
                                                                         const std::string& path) {
  ASSIGN_OR_RETURN(json parsed, ParseUntrustedJson(text, path));
  const json& root = parsed;
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": must be a JSON object, found ", root.type_name()));
  }
  const auto wm = root.find("weight_map");
  if (wm == root.end() || !wm->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": missing \"weight_map\" object"));
  }
  if (wm->empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": empty weight_map"));
  std::map<std::string, std::string> out;
  for (const auto& [tensor, shard] : wm->items()) {
    if (!shard.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": weight_map entry for '", tensor,
                                                     "' must be a string, found ",
                                                     shard.type_name()));
    }
    const std::string& file = shard.get_ref<const std::string&>();
    if (!IsPlainFileName(file)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": weight_map entry for '", tensor,
                                                     "' names shard '", file,
                                                     "', which is not a plain file name"));
    }
    out.emplace(tensor, file);
  }
  return out;
}

namespace {

// "model.layers.<L>.mlp.<rest>" split into "model.layers.<L>." and "<rest>".
struct MlpName {
  std::string layer_prefix;
  std::string rest;
};

std::optional<MlpName> SplitMlpName(std::string_view name) {
  constexpr std::string_view kLayers = "model.layers.";
  if (!name.starts_with(kLayers)) return std::nullopt;
  size_t i = kLayers.size();
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i;
  if (i == kLayers.size() || !name.substr(i).starts_with(".mlp.")) return std::nullopt;
  return MlpName{std::string(name.substr(0, i + 1)), std::string(name.substr(i + 5))};
}

enum class Proj { kGate, kUp, kDown };

// "experts.<E>.<proj>_proj.weight" split into expert index and projection.
struct ExpertName {
  int expert = 0;
  Proj proj = Proj::kGate;
};

std::optional<ExpertName> ParseExpertName(std::string_view rest) {
  constexpr std::string_view kExperts = "experts.";
  if (!rest.starts_with(kExperts)) return std::nullopt;
  size_t i = kExperts.size();
  int64_t e = 0;
  while (i < rest.size() && rest[i] >= '0' && rest[i] <= '9') {
    e = e * 10 + (rest[i] - '0');
    if (e > (1 << 30)) return std::nullopt;
    ++i;
  }
  if (i == kExperts.size()) return std::nullopt;
  const std::string_view tail = rest.substr(i);
  ExpertName out;
  out.expert = static_cast<int>(e);
  if (tail == ".gate_proj.weight") {
    out.proj = Proj::kGate;
  } else if (tail == ".up_proj.weight") {
    out.proj = Proj::kUp;
  } else if (tail == ".down_proj.weight") {
    out.proj = Proj::kDown;
  } else {
    return std::nullopt;
  }
  return out;
}

// Mixtral's per-expert names: w1 = gate, w3 = up, w2 = down.
const char* MixtralWeight(Proj p) {
  switch (p) {
    case Proj::kGate:
      return "w1";
    case Proj::kUp:
      return "w3";
    case Proj::kDown:
      return "w2";
  }
  return "";
}

bool SupportedDType(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

// Dtypes that only quantized codes or scales use.
bool IsQuantizedDType(DType t) {
  return t == DType::kF8E4M3 || t == DType::kF8E8M0 || t == DType::kU8;
}

std::string DTypeList(const std::vector<DType>& dtypes) {
  return absl::StrJoin(dtypes, " or ",
                       [](std::string* out, DType t) { absl::StrAppend(out, Sv(DTypeName(t))); });
}

// Equal after dropping size-1 dimensions: a scale [N] may be stored [N, 1], a scalar [] as [1].
bool SameIgnoringUnitDims(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> sa, sb;
  for (int64_t d : a)
    if (d != 1) sa.push_back(d);
  for (int64_t d : b)
    if (d != 1) sb.push_back(d);
  return sa == sb;
}

// "<module>.weight" -> "<module>".
std::string ModuleOf(const std::string& weight_name) {
  return weight_name.substr(0, weight_name.size() - std::string_view(".weight").size());
}

// "" when the disk name is the canonical one, else " (for 'canonical')" so messages show both.
std::string ForCanonical(const std::string& disk, const std::string& canonical) {
  if (disk == canonical) return "";
  return absl::StrCat(" (for '", canonical, "')");
}

}  // namespace

std::string Checkpoint::Fingerprint() const {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a 64: offset basis, then the prime per byte
  auto mix = [&hash](std::string_view bytes) {
    for (unsigned char c : bytes) {
      hash ^= c;
      hash *= 0x100000001b3ull;
    }
    hash ^= 0xff;  // a separator, so that ("ab", "c") and ("a", "bc") differ
    hash *= 0x100000001b3ull;
  };
  absl::StatusOr<std::string> config_text = ReadTextFile(JoinPath(dir_, "config.json"));
  mix(config_text.ok() ? *config_text : std::string());
  std::vector<const SafetensorsFile*> files;
  for (const auto& f : files_) files.push_back(f.get());
  std::sort(files.begin(), files.end(), [](const SafetensorsFile* a, const SafetensorsFile* b) {
    return Basename(a->path()) < Basename(b->path());
  });
  for (const SafetensorsFile* f : files) {
    mix(Basename(f->path()));
    mix(f->HeaderBytes());
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));

  ASSIGN_OR_RETURN(QuantScheme scheme, ReadCheckpointQuantScheme(dir));

  auto ckpt = std::make_unique<Checkpoint>();
  ckpt->dir_ = dir;
  ckpt->config_ = std::move(config);
  ckpt->quant_ = std::move(scheme);

  // Maps every tensor of files_[i], rejecting a name that a second file also holds.
  auto index_file = [&ckpt](size_t i) -> absl::Status {
    const SafetensorsFile& f = *ckpt->files_[i];
    for (const SafetensorsEntry& t : f.header().tensors) {
      const auto [it, inserted] = ckpt->tensor_file_.emplace(t.name, i);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", t.name, "' is in two shards: ", Basename(ckpt->files_[it->second]->path()),
            " and ", Basename(f.path())));
      }
    }
    return absl::OkStatus();
  };

  const std::string index_path = JoinPath(dir, kIndexName);
  if (PathExists(index_path)) {
    ASSIGN_OR_RETURN(std::string text, ReadTextFile(index_path));
    absl::StatusOr<std::map<std::string, std::string>> weight_map =
        ParseSafetensorsIndex(text, index_path);
    if (!weight_map.ok()) return weight_map.status();

    // Open each distinct shard once, in name order so errors are deterministic.
    std::map<std::string, size_t> shard_slot;
    for (const auto& [tensor, shard] : *weight_map) shard_slot.emplace(shard, 0);
    for (auto& [shard, slot] : shard_slot) {
      absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
          SafetensorsFile::Open(JoinPath(dir, shard));
      if (!f.ok()) {
        return Annotate(f.status(), absl::StrCat(kIndexName, " lists shard '", shard, "': "));
      }
      slot = ckpt->files_.size();
      ckpt->files_.push_back(*std::move(f));
      if (absl::Status s = index_file(slot); !s.ok()) return Annotate(s, absl::StrCat(dir, ": "));
    }
    // Every tensor the index promises must really be in the shard it names.
    for (const auto& [tensor, shard] : *weight_map) {
      const auto it = ckpt->tensor_file_.find(tensor);
      if (it == ckpt->tensor_file_.end() || it->second != shard_slot.at(shard)) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, " maps tensor '", tensor,
                                                       "' to shard '", shard,
                                                       "', but that shard has no such tensor"));
      }
    }
    return ckpt;
  }

  const std::string single_path = JoinPath(dir, kSingleName);
  if (!PathExists(single_path)) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no ", kSingleName, " or ", kIndexName, " in this folder"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(single_path));
  ckpt->files_.push_back(std::move(f));
  RETURN_IF_ERROR(index_file(0));
  return ckpt;
}

absl::StatusOr<QuantScheme> ReadCheckpointQuantScheme(const std::string& dir) {
  ASSIGN_OR_RETURN(std::string config, ReadTextFile(JoinPath(dir, "config.json")));
  const std::string hf_path = JoinPath(dir, "hf_quant_config.json");
  std::optional<std::string> hf_quant_config;
  if (PathExists(hf_path)) {
    ASSIGN_OR_RETURN(std::string text, ReadTextFile(hf_path));
    hf_quant_config = std::move(text);
  }
  absl::StatusOr<QuantScheme> scheme = ParseQuantScheme(config, hf_quant_config);
  if (!scheme.ok()) return Annotate(scheme.status(), absl::StrCat(dir, ": "));
  return scheme;
}

std::vector<std::string> Checkpoint::DirectNames(const std::string& canonical) const {
  std::vector<std::string> names = {canonical};
  if (config_.arch == ModelArch::kMixtral) {
    if (const std::optional<MlpName> mlp = SplitMlpName(canonical)) {
      if (mlp->rest == "gate.weight") {
        names.push_back(absl::StrCat(mlp->layer_prefix, "block_sparse_moe.gate.weight"));
      } else if (const std::optional<ExpertName> e = ParseExpertName(mlp->rest)) {
        const std::string w = absl::StrCat(e->expert, ".", MixtralWeight(e->proj));
        names.push_back(absl::StrCat(mlp->layer_prefix, "block_sparse_moe.experts.", w, ".weight"));
        names.push_back(absl::StrCat(mlp->layer_prefix, "mlp.experts.", w, ".weight"));
      }
    }
  }
  if (canonical == "lm_head.weight" && config_.tie_word_embeddings)
    names.push_back("model.embed_tokens.weight");
  // Qwen3.5's multimodal saves put the language model under model.language_model.
  if (config_.is_hybrid()) {
    const size_t direct = names.size();
    for (size_t i = 0; i < direct; ++i)
      if (absl::StartsWith(names[i], "model."))
        names.push_back(absl::StrCat("model.language_model.", names[i].substr(6)));
  }
  return names;
}

QuantFormat Checkpoint::LinearFormat(const TensorSpec& dense) const {
  if (!quant_.quantized() || !IsQuantizable(dense)) return QuantFormat::kNone;
  std::vector<std::string> modules;
  for (const std::string& name : DirectNames(dense.name)) modules.push_back(ModuleOf(name));
  return quant_.Quantizes(modules) ? quant_.format : QuantFormat::kNone;
}

QuantFormat Checkpoint::StoredLinearFormat(const TensorSpec& dense,
                                           std::vector<std::string>* warnings) const {
  const bool linear = dense.kind == WeightKind::kLinear || dense.kind == WeightKind::kRouter;
  if (!quant_.quantized() || !linear || dense.shape.size() != 2) return QuantFormat::kNone;
  std::vector<std::string> modules;
  for (const std::string& name : DirectNames(dense.name)) modules.push_back(ModuleOf(name));
  const bool by_pattern = quant_.Quantizes(modules);
  const QuantFormat declared =
      IsQuantizable(dense) && by_pattern ? quant_.format : QuantFormat::kNone;
  // Qwen3-Next keeps the flat projections inside a grouped one.
  constexpr std::string_view kLinear = ".linear_attn.";
  if (const size_t at = dense.name.find(kLinear); config_.is_hybrid() && at != std::string::npos) {
    const std::string which = dense.name.substr(at + kLinear.size());
    const std::string prefix = dense.name.substr(0, at + kLinear.size());
    const char* grouped =
        which == "in_proj_qkv.weight" || which == "in_proj_z.weight" ? "in_proj_qkvz"
        : which == "in_proj_a.weight" || which == "in_proj_b.weight" ? "in_proj_ba"
                                                                     : nullptr;
    if (grouped != nullptr)
      for (const std::string& name : DirectNames(prefix + grouped + ".weight"))
        modules.push_back(ModuleOf(name));
  }
  // Stored dense: a ".weight" of a dense dtype. Stored quantized: the format's first scale.
  std::string dense_name, scale_name;
  for (const std::string& module : modules) {
    const auto it = tensor_file_.find(module + ".weight");
    if (dense_name.empty() && it != tensor_file_.end() &&
        SupportedDType(files_[it->second]->Find(module + ".weight")->dtype))
      dense_name = module + ".weight";
  }
  auto layout = QuantLayout(quant_.format, dense.shape[0], dense.shape[1]);
  if (layout.ok())
    for (const QuantPartLayout& part : *layout) {
      if (part.part == QuantPart::kData || part.optional) continue;
      for (const std::string& module : modules)
        if (scale_name.empty() && tensor_file_.contains(module + part.suffix))
          scale_name = module + part.suffix;
      break;
    }
  const bool tied_head = dense.name == "lm_head.weight" && config_.tie_word_embeddings;
  if (by_pattern && scale_name.empty() && !dense_name.empty() &&
      (declared != QuantFormat::kNone || dense.kind == WeightKind::kRouter)) {
    warnings->push_back(absl::StrCat("'", dense.name, "': ", quant_.Describe(),
                                     " does not exclude it, but '", dense_name,
                                     "' is stored dense; loaded dense"));
    return QuantFormat::kNone;
  }
  if (declared == QuantFormat::kNone && !scale_name.empty() && dense.kind == WeightKind::kLinear &&
      !tied_head) {
    warnings->push_back(absl::StrCat("'", dense.name, "': ", quant_.Describe(),
                                     by_pattern ? " leaves it dense by default" : " excludes it",
                                     ", but the checkpoint ships '", scale_name, "'; loaded as ",
                                     QuantFormatName(quant_.format)));
    return quant_.format;
  }
  return declared;
}

absl::StatusOr<std::optional<HostTensor>> Checkpoint::Ungroup(
    const TensorSpec& spec, std::vector<std::string>* tried) const {
  constexpr std::string_view kLinear = ".linear_attn.";
  // A part of a quantized projection goes by its linear's name, with the part's suffix.
  const bool is_part = spec.quant != QuantFormat::kNone;
  const std::string& linear = is_part ? spec.linear : spec.name;
  const size_t at = linear.find(kLinear);
  if (!config_.is_hybrid() || at == std::string::npos) return std::optional<HostTensor>();
  const std::string module = linear.substr(0, at + kLinear.size());
  const std::string which = linear.substr(at + kLinear.size());
  const std::string suffix = is_part ? spec.name.substr(ModuleOf(linear).size()) : ".weight";
  const bool qkvz = which == "in_proj_qkv.weight" || which == "in_proj_z.weight";
  const bool ba = which == "in_proj_b.weight" || which == "in_proj_a.weight";
  if (!qkvz && !ba) return std::optional<HostTensor>();

  // Per key head g the grouped rows are [q_g(dk) | k_g(dk) | v_g(r dv) | z_g(r dv)] and
  // [b_g(r) | a_g(r)], r = value heads per key head.
  const int64_t dk = config_.linear_key_head_dim, dv = config_.linear_value_head_dim;
  const int64_t key_heads = config_.linear_num_key_heads;
  const int64_t r = config_.linear_num_value_heads / key_heads;
  const int64_t key_dim = key_heads * dk, group = qkvz ? 2 * dk + 2 * r * dv : 2 * r;
  auto disk_row = [&](int64_t i) -> int64_t {
    if (which == "in_proj_qkv.weight") {
      if (i < key_dim) return (i / dk) * group + i % dk;                       // q
      if (i < 2 * key_dim) return ((i - key_dim) / dk) * group + dk + i % dk;  // k
      const int64_t j = i - 2 * key_dim;                                       // v
      return (j / (r * dv)) * group + 2 * dk + j % (r * dv);
    }
    if (which == "in_proj_z.weight") return (i / (r * dv)) * group + 2 * dk + r * dv + i % (r * dv);
    if (which == "in_proj_b.weight") return (i / r) * group + i % r;
    return (i / r) * group + r + i % r;  // in_proj_a
  };

  const std::string source_name = (qkvz ? "in_proj_qkvz" : "in_proj_ba") + suffix;
  // Row-wise parts (codes, per-row or per-group scales) are gathered like dense rows; a part of
  // one value per tensor (scale_2, fp8_tensor's scale, input_scale) is shared by both halves.
  const bool scalar = spec.shape.empty();
  std::vector<int64_t> want = spec.shape;
  if (!scalar) want[0] = key_heads * group;
  for (const std::string& name : DirectNames(module + source_name)) {
    tried->push_back(name);
    const auto it = tensor_file_.find(name);
    if (it == tensor_file_.end()) continue;
    const SafetensorsFile& file = *files_[it->second];
    const SafetensorsEntry* entry = file.Find(name);
    const std::string what =
        absl::StrCat(Basename(file.path()), ": tensor '", name, "' (for '", spec.name, "')");
    if (spec.quant == QuantFormat::kFp8Block128)
      return absl::UnimplementedError(absl::StrCat(
          what,
          ": fp8_block128 scales span 128 rows of the grouped [q|k|v|z] layout, which "
          "cannot be un-grouped into in_proj_qkv and in_proj_z; formats with per-row scales "
          "(nvfp4, mxfp4, fp8_channel, fp8_tensor) can"));
    const bool dtype_ok = spec.dtypes.empty() ? SupportedDType(entry->dtype)
                                              : std::find(spec.dtypes.begin(), spec.dtypes.end(),
                                                          entry->dtype) != spec.dtypes.end();
    if (!dtype_ok)
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dtype ", Sv(DTypeName(entry->dtype)), ", expected ",
                       spec.dtypes.empty() ? "F32, F16 or BF16" : DTypeList(spec.dtypes)));
    const bool shape_ok = is_part && spec.part != QuantPart::kData
                              ? SameIgnoringUnitDims(entry->shape, want)
                              : entry->shape == want;
    if (!shape_ok)
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has shape ", FormatShape(entry->shape), ", expected ", FormatShape(want),
          scalar ? ""
          : qkvz ? " [key_heads * (2 * key_head_dim + 2 * value_heads_per_key_head * "
                   "value_head_dim), ...]"
                 : " [2 * value_heads, ...]"));
    const uint8_t* base = file.Data(*entry);
    const std::string source = absl::StrCat(Basename(file.path()), ":", name);
    if (scalar)
      return std::optional<HostTensor>(
          HostTensor{spec.name, source, entry->dtype, spec.shape, base});
    const int64_t rows = spec.shape[0];
    int64_t row_elements = 1;
    for (size_t d = 1; d < spec.shape.size(); ++d) row_elements *= spec.shape[d];
    const size_t row_bytes = static_cast<size_t>(row_elements) * DTypeSize(entry->dtype);
    auto copy = std::make_unique<std::vector<uint8_t>>(static_cast<size_t>(rows) * row_bytes);
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(copy->data() + i * row_bytes, base + disk_row(i) * row_bytes, row_bytes);
    HostTensor t{spec.name, source + " (un-grouped)", entry->dtype, spec.shape, copy->data()};
    std::lock_guard<std::mutex> lock(derived_mu_);
    derived_.push_back(std::move(copy));
    return std::optional<HostTensor>(std::move(t));
  }
  return std::optional<HostTensor>();
}

absl::StatusOr<std::vector<HostTensor>> Checkpoint::Resolve(
    const std::vector<TensorSpec>& specs) const {
  struct Hit {
    const SafetensorsFile* file = nullptr;
    const SafetensorsEntry* entry = nullptr;
  };
  auto find = [this](const std::string& disk_name) -> Hit {
    const auto it = tensor_file_.find(disk_name);
    if (it == tensor_file_.end()) return {};
    const SafetensorsFile* f = files_[it->second].get();
    return {f, f->Find(disk_name)};
  };
  auto describe = [](const Hit& hit, const std::string& canonical) {
    return absl::StrCat(Basename(hit.file->path()), ": tensor '", hit.entry->name, "'",
                        ForCanonical(hit.entry->name, canonical));
  };
  auto check_dtype = [&](const Hit& hit, const TensorSpec& spec) -> absl::Status {
    const DType got = hit.entry->dtype;
    if (spec.dtypes.empty()
            ? SupportedDType(got)
            : std::find(spec.dtypes.begin(), spec.dtypes.end(), got) != spec.dtypes.end())
      return absl::OkStatus();
    const std::string what = describe(hit, spec.name);
    if (!spec.dtypes.empty())
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dtype ", Sv(DTypeName(got)), ", expected ", DTypeList(spec.dtypes),
                       " ", spec.rule, " (", QuantFormatName(spec.quant), ")"));
    if (IsQuantizedDType(got))
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": dtype ", Sv(DTypeName(got)),
          " holds quantized codes, but this tensor is not "
          "quantized here: ",
          quant_.Describe(),
          "; only attention, MLP, expert and linear-attention projections are, unless excluded"));
    return absl::UnimplementedError(absl::StrCat(what, ": dtype ", Sv(DTypeName(got)),
                                                 " not supported yet (F32, F16 or BF16 only)"));
  };
  auto check_shape = [&](const Hit& hit, const TensorSpec& spec) -> absl::Status {
    const bool is_scale = spec.quant != QuantFormat::kNone && spec.part != QuantPart::kData;
    if (is_scale ? SameIgnoringUnitDims(hit.entry->shape, spec.shape)
                 : hit.entry->shape == spec.shape)
      return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        describe(hit, spec.name), " has shape ", FormatShape(hit.entry->shape), ", expected ",
        FormatShape(spec.shape), spec.rule.empty() ? "" : " ", spec.rule));
  };

  std::vector<HostTensor> out;
  out.reserve(specs.size());
  for (const TensorSpec& spec : specs) {
    const bool is_part = spec.quant != QuantFormat::kNone;
    // Names whose tensor is exactly the spec's tensor, most canonical first. A part of a
    // quantized linear goes by each name of its linear, with the part's suffix.
    std::vector<std::string> direct;
    if (is_part) {
      const std::string suffix = spec.name.substr(ModuleOf(spec.linear).size());
      for (const std::string& name : DirectNames(spec.linear))
        direct.push_back(ModuleOf(name) + suffix);
    } else {
      direct = DirectNames(spec.name);
    }
    // transformers 5 stores all experts of a layer in one tensor; the spec is a slice of it.
    const std::optional<MlpName> mlp = SplitMlpName(spec.name);
    // Plain values rather than an optional: GCC 12 misreads the optional as maybe-uninitialized.
    bool is_expert = false;
    ExpertName expert;
    if (mlp) {
      if (const std::optional<ExpertName> e = ParseExpertName(mlp->rest)) {
        is_expert = true;
        expert = *e;
      }
    }
    std::vector<std::string> fused;
    if (is_expert && !is_part && config_.is_moe() && spec.shape.size() == 2) {
      const char* which = expert.proj == Proj::kDown ? "down_proj" : "gate_up_proj";
      std::vector<std::string> parents = {absl::StrCat(mlp->layer_prefix, "mlp.experts.")};
      if (config_.arch == ModelArch::kMixtral)
        parents.push_back(absl::StrCat(mlp->layer_prefix, "block_sparse_moe.experts."));
      if (config_.is_hybrid())
        parents.push_back(
            absl::StrCat("model.language_model.", mlp->layer_prefix.substr(6), "mlp.experts."));
      for (const std::string& p : parents) {
        fused.push_back(absl::StrCat(p, which));
        fused.push_back(absl::StrCat(p, which, ".weight"));
      }
    }

    bool resolved = false;
    for (const std::string& name : direct) {
      const Hit hit = find(name);
      if (hit.entry == nullptr) continue;
      RETURN_IF_ERROR(check_dtype(hit, spec));
      RETURN_IF_ERROR(check_shape(hit, spec));
      out.push_back({spec.name, absl::StrCat(Basename(hit.file->path()), ":", name),
                     hit.entry->dtype, spec.shape, hit.file->Data(*hit.entry)});
      resolved = true;
      break;
    }
    for (size_t k = 0; !resolved && k < fused.size(); ++k) {
      const std::string& name = fused[k];
      const Hit hit = find(name);
      if (hit.entry == nullptr) continue;
      RETURN_IF_ERROR(check_dtype(hit, spec));
      // gate_up_proj: [E, 2*I, H], gate rows first; down_proj: [E, H, I].
      const int64_t rows = spec.shape[0];
      const int64_t cols = spec.shape[1];
      const std::vector<int64_t> want =
          expert.proj == Proj::kDown ? std::vector<int64_t>{config_.num_experts, rows, cols}
                                     : std::vector<int64_t>{config_.num_experts, 2 * rows, cols};
      if (hit.entry->shape != want || expert.expert >= config_.num_experts) {
        return absl::InvalidArgumentError(absl::StrCat(
            Basename(hit.file->path()), ": fused tensor '", name, "' (for '", spec.name,
            "') has shape ", FormatShape(hit.entry->shape), ", expected ", FormatShape(want),
            expert.proj == Proj::kDown ? " [experts, hidden, intermediate]"
                                       : " [experts, 2 * intermediate, hidden]"));
      }
      // Offsets stay inside the tensor: expert < shape[0] and the shape matched exactly.
      int64_t offset = expert.expert * want[1] * want[2];
      if (expert.proj == Proj::kUp) offset += rows * cols;
      const uint8_t* base = hit.file->Data(*hit.entry);
      out.push_back({spec.name, absl::StrCat(Basename(hit.file->path()), ":", name),
                     hit.entry->dtype, spec.shape, base + offset * DTypeSize(hit.entry->dtype)});
      resolved = true;
    }
    if (resolved) continue;
    std::vector<std::string> grouped;
    ASSIGN_OR_RETURN(std::optional<HostTensor> ungrouped, Ungroup(spec, &grouped));
    if (ungrouped.has_value()) {
      out.push_back(*std::move(ungrouped));
      continue;
    }
    if (is_part && spec.optional) {
      out.push_back({spec.name, "", DType::kF32, spec.shape, nullptr});
      continue;
    }
    std::vector<std::string> tried = direct;
    tried.insert(tried.end(), fused.begin(), fused.end());
    tried.insert(tried.end(), grouped.begin(), grouped.end());
    std::string why;
    if (is_part) {
      why = absl::StrCat("; ", quant_.Describe(), " quantizes '", ModuleOf(spec.linear),
                         "', whose ", QuantFormatName(spec.quant), " layout stores '",
                         spec.name.substr(ModuleOf(spec.linear).size()), "' ", spec.rule);
      for (const std::string& name : DirectNames(spec.linear)) {
        const Hit dense = find(name);
        if (dense.entry == nullptr || !SupportedDType(dense.entry->dtype)) continue;
        absl::StrAppend(&why, "; '", name, "' is stored dense (", Sv(DTypeName(dense.entry->dtype)),
                        "): is the module missing from the exclusion list?");
        break;
      }
    }
    return absl::NotFoundError(absl::StrCat("tensor '", spec.name, "' not found in ", dir_,
                                            " (tried: ", absl::StrJoin(tried, ", "), ")", why));
  }
  return out;
}

}  // namespace infersweep
