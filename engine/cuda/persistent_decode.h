// graphs=persistent (kernels/cuda/sm90a/decode_persistent.h): what a model must be for its
// batch-1 decode step to run as the one cooperative kernel, and the kernel's per-layer tables
// built on the device from the model's weights.
#pragma once

#include <string>

#include "core/quant/format.h"
#include "engine/model_config.h"
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

}  // namespace infersweep
