// HF checkpoint folders: config.json plus model.safetensors or shards listed in
// model.safetensors.index.json, memory-mapped, with every tensor checked before use.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/model_config.h"
#include "core/dtype.h"
#include "engine/quant/scheme.h"
#include "engine/safetensors.h"
#include "engine/tensor_spec.h"

namespace infersweep {

// A view of one weight inside a mapped file (or inside memory owned by whoever made it).
struct HostTensor {
  std::string name;      // canonical name (TensorSpec::name)
  std::string source;    // "<file>:<tensor name on disk>" for messages
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// The quantization <dir> declares (hf_quant_config.json, else config.json's
// quantization_config), read without opening any weight file.
absl::StatusOr<QuantScheme> ReadCheckpointQuantScheme(const std::string& dir);

// tensor name -> shard file name, from the text of model.safetensors.index.json (`path` names it
// in errors). Every shard must be a plain file name next to the index.
absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(const std::string& text,
                                                                         const std::string& path);

class Checkpoint {
 public:
  // Opens <dir>/config.json, its quantization declaration and the safetensors file(s); validates
  // every file header.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  const std::string& dir() const { return dir_; }
  const QuantScheme& quant_scheme() const { return quant_; }
  // A content fingerprint, 16 hex digits: FNV-1a 64 over config.json and every safetensors
  // file's name and header, in name order. It changes when the architecture, a tensor's name,
  // dtype, shape or layout changes, without reading the weights (a file with the same header
  // and other bytes keeps it: it is an identity of the layout, not a checksum of the data).
  std::string Fingerprint() const;

  // The format the declaration gives a quantizable linear (a dense spec), under any of its
  // on-disk module names; kNone when the checkpoint is dense or the module is excluded.
  QuantFormat LinearFormat(const TensorSpec& dense) const;

  // The format a linear or router (a dense spec) is loaded in: what its tensors are, which is
  // the declaration unless they contradict it. A module declared excluded (or never quantized
  // by default, e.g. lm_head) that ships the declared format's scales loads quantized; one
  // declared quantized that is stored dense loads dense. Each contradiction appends a warning
  // naming the tensor to `warnings`. A router or a tied lm_head always loads dense.
  QuantFormat StoredLinearFormat(const TensorSpec& dense, std::vector<std::string>* warnings) const;

  // Finds each spec's tensor under the architecture's on-disk names (per-expert Hub layout,
  // Mixtral w1/w2/w3, transformers 5 fused `experts.gate_up_proj`/`experts.down_proj`, tied
  // lm_head, Qwen3.5's `model.language_model.` prefix), and checks dtype (dense: F32, F16 or BF16;
  // quantized parts: their layout's) and shape. Qwen3-Next's grouped linear-attention
  // projections (in_proj_qkvz, in_proj_ba) are un-grouped into copies the checkpoint owns.
  // Returns views in spec order; an absent optional part is a view with no data.
  // Errors name the file and the tensor.
  absl::StatusOr<std::vector<HostTensor>> Resolve(const std::vector<TensorSpec>& specs) const;

 private:
  // On-disk names of a canonical linear or tensor, most canonical first (no fused names).
  std::vector<std::string> DirectNames(const std::string& canonical) const;

  // A flat linear-attention projection (in_proj_qkv, _z, _b, _a), or a part of a quantized one,
  // gathered row by row from the grouped tensor that holds it (a part of one value per tensor is
  // shared); nullopt when the spec is not one or no grouped tensor exists. Unimplemented for
  // fp8_block128, whose scale blocks straddle the groups. `tried` receives the names looked up.
  absl::StatusOr<std::optional<HostTensor>> Ungroup(const TensorSpec& spec,
                                                    std::vector<std::string>* tried) const;

  std::string dir_;
  ModelConfig config_;
  QuantScheme quant_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  // on-disk tensor name -> index into files_
  std::map<std::string, size_t, std::less<>> tensor_file_;
  // Un-grouped copies Resolve made; HostTensor views point into them.
  mutable std::mutex derived_mu_;
  mutable std::vector<std::unique_ptr<std::vector<uint8_t>>> derived_;
};

}  // namespace infersweep
