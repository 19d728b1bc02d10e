// graphs=persistent (kernels/cuda/sm90a/decode_persistent.h): what a model must be for its
// batch-1 decode step to run as the one cooperative kernel, and the kernel's per-layer tables
// built on the device from the model's weights.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "api/model_config.h"
#include "core/quant/format.h"
#include "engine/cuda/device_util.h"
#include "engine/cuda/runner_context.h"
#include "engine/options.h"
#include "kernels/cuda/sm90a/decode_persistent.h"

namespace infersweep {

// The format the persistent kernel streams for a model of `weights` format under `qgemm`:
// kNone (bf16) for dense models and dequant_bf16's copies, else the codes' format (w8a16, w4a16).
QuantFormat PersistentStreamFormat(QuantFormat weights, QGemm qgemm);

// The kernel's shape for `config` streaming `format`: sizes, experts, the widest MLP and top-k.
cuda::PersistentDecodeShape PersistentDecodeShapeFor(const ModelConfig& config, QuantFormat format);

// Why the persistent kernel cannot run `config`'s decode step streaming `format` (layers with
// attention biases or a shared expert, MLP widths, shapes the kernel does not take on this
// device), prefixed "graphs=persistent: "; empty when it can. What depends on the weights
// themselves (dtypes, alignment, memory for the tiled copies) is judged as the tables are built.
std::string PersistentDecodeRefusal(const ModelConfig& config, QuantFormat format);

// The persistent kernel of one model: its arguments that do not change per step and the device
// buffer behind them (layer tables, expert pointer tables, its own scratch), and the copies it
// streams (transposed routers, tiled down projections, padded nvfp4 group scales).
class PersistentDecoder {
 public:
  explicit PersistentDecoder(const RunnerContext& context);
  PersistentDecoder(const PersistentDecoder&) = delete;
  PersistentDecoder& operator=(const PersistentDecoder&) = delete;

  // Builds the tables from the step's weights (`quantized_view`: a quantized model's view).
  absl::Status Prepare(bool quantized_view);
  // Whether Prepare ran: batch-1 decode steps then take the kernel.
  bool ready() const { return args_.layers != nullptr; }
  // The barrier counters, zeroed by the step's input kernel ahead of each launch.
  unsigned* barrier() const { return args_.barrier; }
  int counters() const { return cuda::PersistentDecodeCounters(args_.shape); }

  // One batch-1 decode step over every layer: x (the embedded token) in, x before the final
  // norm out; K and V appended to the bf16 cache. The counters must be zero (StepInputs).
  void Launch(float* x, char* k_cache, char* v_cache, int capacity, const float2* rope,
              const int* position, float* qkv, float* attn, float* logits);

  // TEST ONLY (INFERSWEEP_PERSISTENT_TIMELINE): whether the kernel stamps a timeline, and its
  // table written after a step (engine/cuda/persistent_debug.h).
  bool timeline() const { return args_.timeline != nullptr; }
  void ReportTimeline() const;

 private:
  const ModelConfig& config_;
  const ModelWeights& w_;
  const CudaOptions& options_;
  const FaultInjection& fault_;
  cudaStream_t stream_;
  cuda::PersistentDecodeArgs args_;  // layers null: not prepared
  DeviceBuffer<char> buffer_;        // what args_ points into
  DeviceAllocations copies_;
  std::string timeline_path_;  // TEST ONLY
};

}  // namespace infersweep
