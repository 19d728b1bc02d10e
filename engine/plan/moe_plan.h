// The MoE block's plan: for one step (its rows, tokens a sequence, the fused-GEMV path or not),
// how the router, the routed experts and the shared expert run under the options on the loaded
// experts. One pure function decides; the runner's launch switch (engine/cuda/moe_runner.cc),
// the launch log's fallbacks, the model refusal and the capability probe read its answer. Host
// code: built and tested without CUDA.
#pragma once

#include <string>
#include <vector>

#include "engine/options.h"
#include "kernels/cuda/limits.h"

namespace infersweep {

struct MoeShape {
  int experts = 0;
  int top_k = 0;
  int hidden = 0;
  int inter = 0;  // moe_intermediate_size
};

// What one layer's loaded experts are, as the runner finds them.
struct MoeLayerFacts {
  // The quantized view holds device-side quantized expert tables (qgemm=w4a16|w8a16 on a
  // quantized checkpoint, device routing).
  bool quantized_tables = false;
  cuda::QuantMatrixShape gate, up, down;  // their shapes and format
  bool experts_quantized_alike = false;   // every expert matrix quantized, the same shapes
  bool experts_bf16 = false;              // plain bf16 experts (cuBLAS's grouped GEMMs take them)
  bool router_f32_copy = false;           // cuBLASLt's fp32 copy of the router exists
  bool shared_expert = false;
  int shared_down_cols = 0;
  // The shared expert has an entry in the tables the per-pair expert kernels read (index
  // `experts`: SharedExpertFitsExpertTables), and the down kernel takes top_k + 1 slots a row.
  bool shared_in_tables = false;
};

struct MoeStep {
  int rows = 0;
  int n = 0;          // tokens a sequence: 1 for decode, the chunk length for prefill
  bool gemv = false;  // the fused-GEMV path (gemm=fused|tma on decode rows)
  // Fill MoePlan::fallbacks: the launch log is recording. Steps that are not recorded format no
  // text (the plan runs every layer of every step).
  bool explain = false;
};

enum class MoeRouter {
  kFusedGemv,     // the RMSNorm, the router and its top-k in one fused-GEMV launch
  kCublasLtF32,   // cuBLASLt's fp32 GEMM on the router's fp32 copy
  kRouterKernel,  // our fp32 router kernel
  kReference,     // the reference GEMM (gemm=reference)
};

enum class MoeExperts {
  kLoop,              // the routing read on the host; gather, MLP, scatter per expert
  kCublasGrouped,     // the routing read on the host; cuBLAS grouped GEMMs over the experts
  kPerPairGemv,       // device routing; per-pair bf16 GEMVs (decode)
  kPerPairQuantGemv,  // device routing; per-pair quantized GEMVs (decode)
  kGrouped,           // device routing; the expert-grouped tensor-core kernels (`grouped`)
};

enum class MoeShared {
  kNone,
  // The shared expert as one more pair a row in the per-pair expert kernels (its gate's logit a
  // segment of the router's fused GEMV, its sigmoid the pair's weight, written by the top-k):
  // no launches of its own.
  kFoldedPair,
  kFusedGemv,  // gate, up and its gate in one fused GEMV, down in another, then the gated add
  kUnfused,
};

struct MoePlan {
  MoeRouter router = MoeRouter::kReference;
  MoeExperts experts = MoeExperts::kLoop;
  cuda::MoeGroupedKernel grouped = cuda::MoeGroupedKernel::kMma4;  // with MoeExperts::kGrouped
  // kGrouped on a prefill chunk of quantized experts the grouped quantized kernels do not take:
  // the layer's experts dequantized to bf16 copies first.
  bool bf16_copies = false;
  bool bf16_input = false;  // the norm also writes its output in bf16 (grouped paths read it)
  MoeShared shared = MoeShared::kNone;
  // Where the step runs on something other than what the moe and gemm values name, in words
  // (core/launch_log.h's fallbacks); empty unless MoeStep::explain.
  std::vector<std::string> fallbacks;
};

// A cuBLAS grouped-GEMM runner exists: moe=grouped, and moe=fused on cuBLASLt configs (long bf16
// prefill chunks).
bool UsesCublasGrouped(const CudaOptions& options);
// The chunk size above which bf16 prefill chunks leave the mma.sync kernels (pairs an expert on
// average): cuBLAS's grouped GEMMs under moe=fused, wgmma under moe=wgmma.
inline constexpr int kMoeMmaMaxPairsPerExpert = 16;
// Router GEMMs of this many rows and more run on cuBLASLt's fp32 GEMM.
inline constexpr int kRouterCublasMinRows = 16;

MoePlan PlanMoe(const CudaOptions& options, const MoeShape& shape, const MoeLayerFacts& layer,
                const MoeStep& step);

// Every reason the model's MoE shapes refuse the options' moe value (empty: none).
std::vector<std::string> MoeRefusals(const CudaOptions& options, const MoeShape& shape);

}  // namespace infersweep
