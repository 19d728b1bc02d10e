// Host-resident model weights: typed views bound to the forward pass's structure, plus whatever
// owns their bytes (a mapped checkpoint or generated synthetic buffers).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/checkpoint.h"
#include "engine/model_config.h"
#include "engine/tensor_ref.h"
#include "engine/tensor_spec.h"

namespace infersweep {

struct ExpertWeights {
  MatrixRef gate;  // [inter, hidden]
  MatrixRef up;    // [inter, hidden]
  MatrixRef down;  // [hidden, inter]
};

struct LayerWeights {
  MatrixRef input_norm;           // [hidden]
  MatrixRef q, k, v;              // [q_dim | kv_dim, hidden]
  MatrixRef q_bias, k_bias, v_bias;  // [q_dim | kv_dim] or empty
  MatrixRef q_norm, k_norm;       // [head_dim] or empty
  MatrixRef o;                    // [hidden, q_dim]
  MatrixRef o_bias;               // [hidden] or empty (llama/qwen3 with attention_bias)
  MatrixRef post_attention_norm;  // [hidden]
  ExpertWeights mlp;              // dense MLP (non-MoE layers)
  MatrixRef router;               // [experts, hidden] (MoE layers)
  std::vector<ExpertWeights> experts;
  ExpertWeights shared_expert;    // qwen2_moe, else empty
  MatrixRef shared_expert_gate;   // [1, hidden] or empty
};

struct ModelWeights {
  MatrixRef embed;       // [vocab, hidden]
  MatrixRef final_norm;  // [hidden]
  MatrixRef lm_head;     // [vocab, hidden]
  std::vector<LayerWeights> layers;
};

// A loaded model on the host: config, tensor table, bound views and the storage behind them.
struct HostModel {
  ModelConfig config;
  std::string source;  // "preset:NAME" or the checkpoint folder
  uint64_t seed = 0;   // synthetic seed (0 for checkpoints)
  std::vector<TensorSpec> specs;
  std::vector<HostTensor> tensors;  // parallel to specs
  ModelWeights weights;
  std::unique_ptr<Checkpoint> checkpoint;          // owns mapped files
  std::vector<std::vector<uint16_t>> synthetic;    // owns generated bf16 buffers
  bool is_synthetic = false;
  bool host_materialized = true;  // false: synthetic weights not generated on the host (yet)
  double load_seconds = 0;           // host side: mapping, parsing, generating
  double device_upload_seconds = 0;  // first upload (or on-device generation) of the weights
  // Weights resident on a device, shared by every model built on this host model (CUDA).
  std::shared_ptr<void> device_weights;
};

// Generates a synthetic model's host copy if it was loaded without one (GPU-only runs skip it).
absl::Status MaterializeHostWeights(HostModel& model);

// Binds tensors (parallel to specs) into the forward pass's structure.
absl::StatusOr<ModelWeights> BindWeights(const ModelConfig& config,
                                         const std::vector<TensorSpec>& specs,
                                         const std::vector<HostTensor>& tensors);

struct LoadOptions {
  int num_layers_override = 0;  // presets only
  uint64_t seed = 1;            // presets only
  bool materialize_host = true; // presets: generate the host copy now (else on first CPU use)
};

// `model` is a checkpoint folder or "preset:NAME".
absl::StatusOr<std::unique_ptr<HostModel>> LoadHostModel(const std::string& model,
                                                         const LoadOptions& options = {});

}  // namespace infersweep
