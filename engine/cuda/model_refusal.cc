// CudaModelRefusal: the model-side requirements of the CUDA backends, in one place.
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/persistent_decode.h"
#include "kernels/cuda/ops.h"

namespace infersweep {

std::string CudaModelRefusal(const ModelConfig& c, QuantFormat weights,
                             const CudaOptions& options) {
  if (options.parallel.tp > 1)
    return absl::StrCat("tp=", options.parallel.tp,
                        ": the CUDA engine runs one GPU (tp=1); its tensor-parallel ranks are "
                        "not built yet (the CPU reference runs tp > 1)");
  // Hybrids (qwen3_next, qwen3_5) run on the CPU reference only.
  for (int l = 0; l < c.num_layers; ++l)
    if (c.AttentionKind(l) == LayerAttention::kLinear)
      return absl::StrCat("device=cuda: layer ", l,
                          " is Gated DeltaNet linear attention, which the CUDA engine does not "
                          "run (the CPU reference does)");
  if (c.attn_output_gate || c.zero_centered_norm || c.rotary_dim() != c.head_dim)
    return "device=cuda: gated attention, zero-centred norms and partial rotary (qwen3_next, "
           "qwen3_5) are the CPU reference's only";
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
