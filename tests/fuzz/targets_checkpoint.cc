// Targets: what a checkpoint folder holds. A safetensors header that parses must be safe to
// use (every tensor inside the data section, no overlaps, byte lengths matching); config.json
// and the quantization declarations parse or name the file; an accepted quantization scheme
// can be matched against module names.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/model_config.h"
#include "engine/checkpoint.h"
#include "engine/quant/scheme.h"
#include "engine/safetensors.h"
#include "engine/safetensors_writer.h"
#include "tests/fuzz/targets.h"

namespace infersweep::fuzz {
namespace {

namespace fs = std::filesystem;

constexpr char kSafetensorsFile[] = "fuzz.safetensors";

std::string FixtureText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Every file called `name` under tests/fixtures, in path order.
std::vector<std::string> Fixtures(const std::string& name) {
  std::vector<fs::path> paths;
  const fs::path root = fs::path(INFERSWEEP_SOURCE_DIR) / "tests" / "fixtures";
  for (const auto& entry : fs::recursive_directory_iterator(root))
    if (entry.is_regular_file() && entry.path().filename() == name) paths.push_back(entry.path());
  std::sort(paths.begin(), paths.end());
  std::vector<std::string> out;
  for (const fs::path& p : paths) out.push_back(FixtureText(p));
  return out;
}

// ------------------------------------------------------------------------ safetensors headers

uint64_t HeaderLength(std::string_view image) {
  uint64_t n = 0;
  for (size_t i = 0; i < 8 && i < image.size(); ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(image[i])) << (8 * i);
  return n;
}

void SetHeaderLength(std::string& image, uint64_t n) {
  if (image.size() < 8) image.resize(8);
  for (int i = 0; i < 8; ++i) image[i] = static_cast<char>(n >> (8 * i));
}

// The end of the header JSON, clipped to the image.
size_t HeaderEnd(std::string_view image) {
  if (image.size() < 8) return image.size();
  return 8 + static_cast<size_t>(std::min<uint64_t>(HeaderLength(image), image.size() - 8));
}

std::string Encode(const std::vector<SafetensorsTensorToWrite>& tensors,
                   const std::map<std::string, std::string>& metadata = {}) {
  absl::StatusOr<std::vector<uint8_t>> header = EncodeSafetensorsHeader(tensors, metadata);
  std::string image = header.ok() ? std::string(header->begin(), header->end()) : std::string();
  for (const SafetensorsTensorToWrite& t : tensors) image.append(t.bytes.begin(), t.bytes.end());
  return image;
}

std::string RawImage(const std::string& json, size_t data_bytes) {
  std::string image(8, '\0');
  SetHeaderLength(image, json.size());
  return image + json + std::string(data_bytes, '\x5a');
}

std::vector<std::string> SafetensorsSeeds() {
  const std::vector<uint8_t> a(2 * 3 * 4, 1), b(4 * 2, 2), c(5, 3), d(2 * 8, 4), none;
  return {
      Encode({{"model.embed_tokens.weight", DType::kF32, {2, 3}, a},
              {"model.layers.0.mlp.gate.weight", DType::kBF16, {2, 2}, b},
              {"mask", DType::kBool, {5}, c},
              {"ids", DType::kI64, {2}, d}},
             {{"format", "pt"}}),
      Encode({{"x", DType::kU8, {5}, c}}),
      Encode({{"empty", DType::kF16, {0, 4}, none}, {"y", DType::kI8, {5}, c}}),
      RawImage(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
               R"("__metadata__":{"k":"v"}}    )",
               12),
  };
}

// Edits that keep or break the framing on purpose: edge-case length prefixes, tensors moved
// onto each other, a data section that grows or shrinks.
void MutateSafetensors(std::string& image, Rng& rng) {
  const size_t header_end = HeaderEnd(image);
  switch (rng.Below(3)) {
    case 0: {
      const uint64_t n = HeaderLength(image);
      const uint64_t choices[] = {rng.Next(),
                                  n + 1,
                                  n - 1,
                                  n + rng.Below(64),
                                  image.size() >= 8 ? image.size() - 8 : 0,
                                  image.size() - rng.Below(16),
                                  100ull << 20,
                                  (100ull << 20) + 1,
                                  ~0ull};
      SetHeaderLength(image, choices[rng.Below(std::size(choices))]);
      break;
    }
    case 1: {  // one tensor's range moved, length kept, so that ranges can collide
      if (header_end <= 8) return;
      const std::string text = image.substr(8, header_end - 8);
      static const std::string kKey = "\"data_offsets\":[";
      std::vector<size_t> found;
      for (size_t p = text.find(kKey); p != std::string::npos; p = text.find(kKey, p + 1))
        found.push_back(p + kKey.size());
      if (found.empty()) return;
      const size_t start = found[rng.Below(found.size())];
      const size_t close = text.find(']', start);
      unsigned long long begin = 0, end = 0;
      if (close == std::string::npos ||
          std::sscanf(text.c_str() + start, "%llu,%llu", &begin, &end) != 2 || end < begin)
        return;
      const unsigned long long to = rng.Below(end + 8);
      const std::string moved = absl::StrCat(to, ",", to + (end - begin));
      image.replace(8 + start, close - start, moved);
      SetHeaderLength(image, HeaderLength(image) + moved.size() - (close - start));
      break;
    }
    default:
      if (rng.Chance(50)) {
        image.resize(image.size() + 1 + rng.Below(16), '\x77');
      } else if (image.size() > header_end) {
        image.resize(image.size() - 1 - rng.Below(std::min<size_t>(image.size() - header_end, 8)));
      }
      break;
  }
}

// Everything a caller relies on; "" or the first violation.
std::string CheckInvariants(const SafetensorsHeader& h, const uint8_t* bytes, size_t size) {
  if (size < 8) return "accepted a file shorter than 8 bytes";
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  if (h.data_offset != 8 + n) return "data_offset != 8 + header length";
  if (h.data_offset > size) return "data section starts past the end of the file";
  const uint64_t data_size = size - h.data_offset;
  std::set<std::string> names;
  const SafetensorsEntry* prev_nonempty = nullptr;
  uint64_t prev_begin = 0;
  unsigned checksum = 0;
  for (const SafetensorsEntry& t : h.tensors) {
    if (!names.insert(t.name).second) return "duplicate tensor " + t.name;
    if (t.data_begin < prev_begin) return "tensors not sorted by data_begin";
    prev_begin = t.data_begin;
    if (t.data_begin > t.data_end) return "begin > end for " + t.name;
    if (t.data_end > data_size) return "tensor past the data section: " + t.name;
    unsigned __int128 numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return "negative dimension in " + t.name;
      numel *= static_cast<uint64_t>(d);
      if (numel > (static_cast<unsigned __int128>(1) << 64)) return "numel overflow in " + t.name;
    }
    if (numel * DTypeSize(t.dtype) != t.data_end - t.data_begin)
      return "byte length != numel * dtype size for " + t.name;
    if (t.data_begin == t.data_end) continue;
    if (prev_nonempty != nullptr && t.data_begin < prev_nonempty->data_end)
      return "overlap between " + prev_nonempty->name + " and " + t.name;
    prev_nonempty = &t;
    // The first and last byte, as a consumer reads them (ASan reports a read out of bounds).
    const uint8_t* data = bytes + h.data_offset;
    checksum += data[t.data_begin] + data[t.data_end - 1];
  }
  volatile unsigned sink = checksum;
  (void)sink;
  return "";
}

Outcome SafetensorsHeaders(std::string_view input) {
  // An exact-size copy, so that any read past the end leaves the allocation.
  const size_t size = input.size();
  std::unique_ptr<uint8_t[]> buf(size == 0 ? nullptr : new uint8_t[size]);
  if (size != 0) std::memcpy(buf.get(), input.data(), size);
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(buf.get(), size, kSafetensorsFile);
  if (!h.ok()) return Rejected(h.status(), kSafetensorsFile);
  if (std::string broken = CheckInvariants(*h, buf.get(), size); !broken.empty())
    return Broken(broken);
  return Accepted();
}

// ------------------------------------------------------------------------ JSON files

Outcome HfConfigs(std::string_view input) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(input, "config.json");
  if (!config.ok()) return Rejected(config.status(), "config.json");
  if (absl::Status s = ValidateModelConfig(*config, "config.json"); !s.ok())
    return Broken(absl::StrCat("accepted, but ValidateModelConfig says: ", s.message()));
  // The parameter counts every model listing prints.
  volatile int64_t total = config->TotalParams(), active = config->ActiveParams();
  (void)total;
  (void)active;
  return Accepted();
}

// Module names a checkpoint's quantization scheme is matched against (canonical and on-disk).
const std::vector<std::vector<std::string>>& ModuleNames() {
  static const std::vector<std::vector<std::string>> names = {
      {"lm_head"},
      {"model.layers.0.self_attn.q_proj"},
      {"model.layers.0.mlp.gate"},
      {"model.layers.1.mlp.experts.3.down_proj", "model.layers.1.block_sparse_moe.experts.3.w2"},
      {"model.layers.2.mlp.shared_expert_gate"},
  };
  return names;
}

Outcome CheckScheme(const absl::StatusOr<QuantScheme>& scheme, std::string_view file) {
  if (!scheme.ok()) return Rejected(scheme.status(), file);
  for (const std::vector<std::string>& names : ModuleNames()) (void)scheme->Quantizes(names);
  if (scheme->Describe().empty()) return Broken("empty Describe()");
  return Accepted();
}

Outcome QuantConfigs(std::string_view input) {
  return CheckScheme(ParseQuantScheme(input, std::nullopt), "config.json");
}

Outcome HfQuantConfigs(std::string_view input) {
  return CheckScheme(ParseQuantScheme("{}", input), "hf_quant_config.json");
}

std::vector<std::string> QuantConfigSeeds() {
  std::vector<std::string> seeds;
  for (const std::string& text : Fixtures("config.json"))
    if (text.find("quantization_config") != std::string::npos) seeds.push_back(text);
  // compressed-tensors with regular-expression targets and ignores.
  seeds.push_back(R"({"model_type": "qwen3_moe", "quantization_config": {
  "quant_method": "compressed-tensors", "format": "float-quantized",
  "config_groups": {"group_0": {"targets": ["re:.*mlp\\.experts\\.[0-9]+\\.(gate|up|down)_proj$", "Linear"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}},
  "ignore": ["lm_head", "re:.*mlp\\.gate$"]}})");
  return seeds;
}

Outcome ShardIndexes(std::string_view input) {
  absl::StatusOr<std::map<std::string, std::string>> map =
      ParseSafetensorsIndex(std::string(input), "model.safetensors.index.json");
  if (!map.ok()) return Rejected(map.status(), "model.safetensors.index.json");
  for (const auto& [tensor, file] : *map)
    if (file.empty() || file.find('/') != std::string::npos || file.find("..") != std::string::npos)
      return Broken(absl::StrCat("accepted shard file '", file, "' for ", tensor));
  return Accepted();
}

const std::vector<std::string> kJsonTokens = {
    "{",           "}",           "[",        "]",        ",",      ":",   "\"",
    "null",        "true",        "false",    "-1",       "1e400",  "0.5", "18446744073709551616",
    "\"\\u0000\"", "\"\\ud800\"", "[[[[[[[[", "]]]]]]]]", "{\"a\":"};

std::vector<std::string> WithJsonTokens(std::vector<std::string> extra) {
  extra.insert(extra.end(), kJsonTokens.begin(), kJsonTokens.end());
  return extra;
}

}  // namespace

std::vector<FuzzTarget> CheckpointTargets() {
  constexpr size_t kMax = 4 << 20;
  FuzzTarget safetensors{
      "safetensors_header", SafetensorsHeaders, SafetensorsSeeds,
      WithJsonTokens({"\"dtype\"", "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", "\"F32\"",
                      "\"BF16\"", "\"F8_E4M3\"", "\"BOOL\"", "[0,0]", "[0,18446744073709551615]",
                      "\"x\":"}),
      kMax};
  safetensors.framing.unwrap = [](std::string_view image) {
    return std::string(image.substr(std::min<size_t>(8, image.size()),
                                    HeaderEnd(image) - std::min<size_t>(8, image.size())));
  };
  safetensors.framing.rewrap = [](std::string_view original, std::string_view json) {
    std::string image(8, '\0');
    SetHeaderLength(image, json.size());
    image.append(json);
    image.append(original.substr(HeaderEnd(original)));
    return image;
  };
  safetensors.framing.mutate = MutateSafetensors;
  return {
      std::move(safetensors),
      {"hf_config", HfConfigs, [] { return Fixtures("config.json"); },
       WithJsonTokens({"\"model_type\"", "\"qwen3_moe\"", "\"num_hidden_layers\"",
                       "\"hidden_size\"", "\"num_experts\"", "\"rope_theta\"", "\"torch_dtype\"",
                       "\"text_config\"", "\"rope_parameters\"", "\"layer_types\"",
                       "\"mlp_only_layers\""}),
       kMax},
      {"quant_config", QuantConfigs, QuantConfigSeeds,
       WithJsonTokens({"\"quantization_config\"", "\"quant_method\"", "\"compressed-tensors\"",
                       "\"modelopt\"", "\"fp8\"", "\"mxfp4\"", "\"config_groups\"", "\"weights\"",
                       "\"targets\"", "\"ignore\"", "\"re:(\"", "\"re:.*\"", "\"num_bits\"",
                       "\"block_structure\"", "\"weight_block_size\""}),
       kMax},
      {"hf_quant_config", HfQuantConfigs, [] { return Fixtures("hf_quant_config.json"); },
       WithJsonTokens({"\"quantization\"", "\"quant_algo\"", "\"NVFP4\"", "\"FP8\"",
                       "\"group_size\"", "\"exclude_modules\"", "\"re:\""}),
       kMax},
      {"shard_index", ShardIndexes, [] { return Fixtures("model.safetensors.index.json"); },
       WithJsonTokens({"\"weight_map\"", "\"metadata\"", "\"..\"", "\"/etc/passwd\"",
                       "\"model-00001-of-00002.safetensors\""}),
       kMax},
  };
}

}  // namespace infersweep::fuzz
