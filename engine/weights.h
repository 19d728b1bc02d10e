// Host-resident model weights: typed views bound to the forward pass's structure, plus whatever
// owns their bytes (a mapped checkpoint or generated synthetic buffers).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/model_description.h"
#include "core/identity.h"
#include "engine/checkpoint.h"
#include "api/model_config.h"
#include "core/tensor_ref.h"
#include "engine/tensor_spec.h"

namespace infersweep {

// Linear weights may be quantized (MatrixRef::quant set; engine/quant/); the rest are dense.
struct ExpertWeights {
  MatrixRef gate;  // [inter, hidden]
  MatrixRef up;    // [inter, hidden]
  MatrixRef down;  // [hidden, inter]
};

// A Gated DeltaNet layer, in the flat layout (value head j pairs with key head j / (Hv / Hk)).
struct LinearAttentionWeights {
  MatrixRef in_proj_qkv;     // [2 * key_dim + value_dim, hidden]: q | k | v
  MatrixRef in_proj_z;       // [value_dim, hidden]
  MatrixRef in_proj_b;       // [value_heads, hidden]
  MatrixRef in_proj_a;       // [value_heads, hidden]
  MatrixRef conv;            // [2 * key_dim + value_dim, kernel] (stored [.., 1, kernel])
  MatrixRef dt_bias, a_log;  // [value_heads]
  MatrixRef norm;            // [value_head_dim], a plain gain
  MatrixRef out_proj;        // [hidden, value_dim]
};

struct LayerWeights {
  MatrixRef input_norm;           // [hidden]
  MatrixRef q, k, v;              // [q_dim (2 * q_dim gated) | kv_dim, hidden]
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
  LinearAttentionWeights linear_attn;  // linear-attention layers, else empty (and q..o empty)
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
  // The format of the quantized linears (declared by the checkpoint or made by --quantize);
  // kNone when every weight is dense.
  QuantFormat quant_format = QuantFormat::kNone;
  // Where a checkpoint's tensors contradict its quantization declaration (they win), one line
  // naming each such tensor.
  std::vector<std::string> warnings;
  std::unique_ptr<Checkpoint> checkpoint;          // owns mapped files
  std::vector<std::vector<uint16_t>> synthetic;    // owns generated bf16 buffers
  std::vector<std::vector<uint8_t>> quantized;     // owns the parts --quantize made
  bool is_synthetic = false;
  bool host_materialized = true;  // false: synthetic weights not generated on the host (yet)
  double load_seconds = 0;           // host side: mapping, parsing, generating
  double device_upload_seconds = 0;  // first upload (or on-device generation) of the weights
  // Weights resident on a device, shared by every model built on this host model (CUDA).
  std::shared_ptr<void> device_weights;
};

// Every linear of a layer that may be quantized, in a fixed order: q, k, v, o, the dense MLP,
// each expert's gate/up/down, the shared expert, Gated DeltaNet's in_proj_qkv, in_proj_z and
// out_proj (empty ones included).
std::vector<MatrixRef*> LayerLinears(LayerWeights& layer);

// The experts of a layer that this model holds, [begin, end): all of them, except on a rank at
// ep=on, whose shard (engine/tp_model.h) keeps its run of whole experts and leaves the others'
// ExpertWeights empty. A dense layer's (no experts) is [0, 0). The device-routed MoE kernels take
// it as the range of experts they run; a pair routed outside it contributes nothing on this rank.
// FailedPrecondition where an expert inside the run is empty (or only part of one is held), or
// where a MoE layer holds none.
struct HeldExperts {
  int begin = 0;
  int end = 0;
  int count() const { return end - begin; }
  bool holds(int expert) const { return expert >= begin && expert < end; }
};
absl::StatusOr<HeldExperts> HeldExpertRange(const std::vector<ExpertWeights>& experts);

// The shared expert can ride in the device expert tables as one more expert, index num_experts,
// its pair a row run by the routed experts' kernels: the layer holds every expert (not a rank's
// run at ep=on) and a shared expert whose gate, up and down match the experts' in dtype,
// quantization format, scale dtype and shape (qwen3-next and qwen3.5: 512 and 1024 wide like
// their experts; qwen2_moe's wider one does not).
bool SharedExpertFitsExpertTables(const LayerWeights& layer, const HeldExperts& held);

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
  // Quantize the dense linears (IsQuantizable) on load; the same as a "@<format>" suffix.
  QuantFormat quantize = QuantFormat::kNone;
  // Presets only: another head_dim, for tests of kernels on attention shapes the presets lack.
  // Last, so that the brace initialisations of the fields above keep their meaning.
  int head_dim_override = 0;
};

// The weight format preflight judges by, known without loading weights: a "@<format>" suffix, a
// checkpoint's quantization declaration, "bf16" for presets; "" when it takes loading to know.
std::string DeclaredWeightFormat(const std::string& model);

// The identity of a model description's weights (core/identity.h), known without loading them:
// a preset's layers, seed and format; a checkpoint's absolute folder, layers, format (the
// quantization it declares or is given, else the stored dtype) and fingerprint, from its
// config.json and safetensors headers. Errors as LoadHostModel's for a model it cannot open.
absl::StatusOr<ModelIdentity> DescribeModel(const std::string& model,
                                            const LoadOptions& options = {});

// `model` is a model description (above).
absl::StatusOr<std::unique_ptr<HostModel>> LoadHostModel(const std::string& model,
                                                         const LoadOptions& options = {});

// The bound view of a canonical weight name ("model.layers.0.self_attn.q_proj.weight"): the
// dense matrix, or the quantized linear with its scales. NotFound for a name the model lacks.
absl::StatusOr<MatrixRef> FindWeight(const HostModel& model, const std::string& canonical);
// The same weight's field in `weights`, a copy of model.weights (or model.weights itself).
absl::StatusOr<MatrixRef*> WeightSlot(ModelWeights& weights, const HostModel& model,
                                      const std::string& canonical);

// Replaces every dense quantizable linear of a materialized host model by its quantized parts.
absl::Status QuantizeHostModel(HostModel& model, QuantFormat format);

}  // namespace infersweep
