// CudaModelRefusal: the model-side requirements of the CUDA backends, in one place.
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/persistent_decode.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"

namespace infersweep {

QuantFormat PersistentStreamFormat(QuantFormat weights, QGemm qgemm) {
  return qgemm == QGemm::kDequantBf16 ? QuantFormat::kNone : weights;
}

cuda::PersistentDecodeShape PersistentDecodeShapeFor(const ModelConfig& c, QuantFormat format) {
  cuda::PersistentDecodeShape shape;
  shape.format = format;
  shape.num_layers = c.num_layers;
  shape.hidden = c.hidden_size;
  shape.q_heads = c.num_q_heads;
  shape.kv_heads = c.num_kv_heads;
  shape.head_dim = c.head_dim;
  shape.num_experts = c.is_moe() ? c.num_experts : 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const bool moe = c.IsMoeLayer(l);
    shape.max_top_k = std::max(shape.max_top_k, moe ? c.num_experts_per_tok : 1);
    shape.max_inter = std::max(shape.max_inter, moe ? c.moe_intermediate_size : c.intermediate_size);
  }
  return shape;
}

std::string PersistentDecodeRefusal(const ModelConfig& c, QuantFormat format) {
  const std::string prefix = "graphs=persistent: ";
  // The kernel's bulk copies take 16-byte rows: 8 bf16 weights, 16 fp8 codes, 32 fp4 codes.
  const int row_align = format == QuantFormat::kNone    ? 8
                        : format == QuantFormat::kNvfp4 ? 32
                                                        : 16;
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string where = absl::StrCat(prefix, "layer ", l, ": ");
    if (c.attention_bias) return where + "attention biases";
    const bool moe = c.IsMoeLayer(l);
    if (moe && c.shared_expert_intermediate_size > 0) return where + "a shared expert";
    const int inter = moe ? c.moe_intermediate_size : c.intermediate_size;
    if (format == QuantFormat::kNone)
      if (const std::string why = cuda::PersistentDownTilesUnsupported(c.hidden_size, inter);
          !why.empty())
        return where + why;
    if (inter % row_align)
      return absl::StrCat(where, "MLP width ", inter, " is not a multiple of ", row_align,
                          " (16-byte rows)");
  }
  if (const std::string why = cuda::PersistentDecodeUnsupported(PersistentDecodeShapeFor(c, format));
      !why.empty())
    return prefix + why;
  return "";
}

std::string CudaModelRefusal(const ModelConfig& c, QuantFormat weights, const CudaOptions& options) {
  if (options.attention == Attention::kFlash &&
      !cuda::FlashSupports(c.num_q_heads, c.num_kv_heads, c.head_dim))
    return "attention=flash supports head_dim <= 128 (a multiple of 8) and <= 16 q heads per kv "
           "head";
  if (RoutesOnDevice(options.moe) && c.is_moe() &&
      (c.num_experts_per_tok > 32 || c.num_experts > 1024 || c.hidden_size % 8 != 0 ||
       c.moe_intermediate_size % 8 != 0 || int64_t{4} * c.hidden_size > cuda::kMoeMaxSharedBytes))
    return absl::StrCat("moe=", AxisValueName(options.moe),
                        " supports <= 1024 experts, top-k <= 32, hidden and moe_intermediate "
                        "sizes that are multiples of 8 (16-byte weight loads), and hidden x 4 "
                        "bytes <= 200 KB (staged x)");
  if (IsPersistent(options.graphs))
    return PersistentDecodeRefusal(c, PersistentStreamFormat(weights, options.qgemm));
  return "";
}

}  // namespace infersweep
