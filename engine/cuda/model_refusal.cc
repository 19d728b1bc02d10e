// CudaModelRefusal: the model-side requirements of the CUDA backends, in one place.
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/persistent_decode.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/ops.h"

namespace infersweep {

std::string CudaModelRefusal(const ModelConfig& c, QuantFormat weights,
                             const CudaOptions& options) {
  // tp > 1: `c` is a rank's shard (MakeCudaModel shards before it asks).
  if (options.parallel.tp > 1 && options.parallel.expert_parallel)
    return absl::StrCat("tp=", options.parallel.tp,
                        ", ep=on: the CUDA ranks shard every expert on its intermediate "
                        "dimension; whole experts per rank leave the others' experts empty, "
                        "which the MoE runners do not skip");
  if (options.parallel.tp > 1 && weights != QuantFormat::kNone)
    return absl::StrCat("tp=", options.parallel.tp,
                        ": quantized weights are not sharded for the CUDA engine (a rank's "
                        "column slices decode to fp32; the CPU reference runs them)");
  if (options.parallel.RunsCollective() && IsPersistent(options.graphs))
    return absl::StrCat("allreduce=", AxisValueName(options.parallel.allreduce),
                        ": graphs=persistent runs every layer in one kernel, with no seam "
                        "between its blocks for an all-reduce");
  if (options.parallel.allreduce == AllReduce::kCustom && c.hidden_size % 4 != 0)
    return absl::StrCat("allreduce=custom moves 16-byte packs: hidden_size ", c.hidden_size,
                        " must be a multiple of 4");
  if (options.linear_attn != LinearAttn::kReference) {
    if (!c.has_linear_attention())
      return absl::StrCat("linear_attn=", AxisValueName(options.linear_attn),
                          ": the model has no linear-attention layers (linear_attn=reference "
                          "stands for every value)");
    if (options.linear_attn == LinearAttn::kFused &&
        !cuda::GatedDeltaFusedSupports(c.linear_key_head_dim))
      return absl::StrCat(
          "linear_attn=fused holds a state column in 8 lanes' registers: key "
          "head dim ",
          c.linear_key_head_dim, " must be a multiple of 8 and <= 256");
  }
  if (c.has_linear_attention() && c.linear_conv_kernel_dim > 8)
    return absl::StrCat("device=cuda: the causal conv takes <= 8 taps, not ",
                        c.linear_conv_kernel_dim);
  if (options.attention == Attention::kFlash &&
      !cuda::FlashSupports(c.num_q_heads, c.num_kv_heads, c.head_dim))
    return "attention=flash supports head_dim <= 128 (a multiple of 8) and <= 16 q heads per kv "
           "head";
  if (options.kv_cache == KvCache::kFp8 && !cuda::FlashDecodeMmaSupports(c.head_dim))
    return absl::StrCat("kv_cache=fp8 is read by the tensor-core flash kernels only: head_dim ",
                        c.head_dim, " must be 32, 64 or 128");
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
