#include "engine/plan/moe_plan.h"

#include "absl/strings/str_cat.h"
#include "core/quant/format.h"

namespace infersweep {

bool UsesCublasGrouped(const CudaOptions& o) {
  switch (o.moe) {
    case Moe::kGrouped:
      return true;
    case Moe::kFused:
      return UsesCublasLt(o.gemm);
    case Moe::kLoop:
    case Moe::kWgmma:
      return false;
  }
  return false;
}

MoePlan PlanMoe(const CudaOptions& o, const MoeShape& s, const MoeLayerFacts& layer,
                const MoeStep& step) {
  MoePlan plan;
  const int rows = step.rows, pairs = rows * s.top_k;
  const bool device_routing = RoutesOnDevice(o.moe);
  const char* moe_name = AxisValueName(o.moe);
  const std::string chunk =
      step.explain ? absl::StrCat(step.n > 1 ? "prefill chunk of " : "decode of ", rows, " rows (",
                                  pairs, " pairs over ", s.experts, " experts)")
                   : std::string();
  // The fallbacks in the order the steps run into them: the experts' and the shared expert's
  // (decided first), the router's, then the grouped launcher's.
  std::vector<std::string> router_fallbacks, launcher_fallbacks;
  auto fallback = [&](auto&&... parts) {
    if (step.explain) plan.fallbacks.push_back(absl::StrCat(parts...));
  };
  auto router_fallback = [&](auto&&... parts) {
    if (step.explain) router_fallbacks.push_back(absl::StrCat(parts...));
  };
  auto launcher_fallback = [&](auto&&... parts) {
    if (step.explain) launcher_fallbacks.push_back(absl::StrCat(parts...));
  };

  // The router runs in fp32 on every config: rounding its input to bf16 would flip near-tied
  // routing decisions, a discrete error no bf16 GEMM elsewhere makes.
  const bool cublaslt = UsesCublasLt(o.gemm), fused_gemm = UsesFusedGemv(o.gemm);
  if (step.gemv) {
    plan.router = MoeRouter::kFusedGemv;
  } else if (cublaslt && rows >= kRouterCublasMinRows && layer.router_f32_copy) {
    plan.router = MoeRouter::kCublasLtF32;
    if (fused_gemm)
      router_fallback("gemm=", AxisValueName(o.gemm), ": router of ", rows,
                      " rows (>= ", kRouterCublasMinRows,
                      "): cuBLASLt's fp32 GEMM, not the fused GEMV");
  } else if (cublaslt) {
    plan.router = MoeRouter::kRouterKernel;
    if (!fused_gemm)
      router_fallback("gemm=", AxisValueName(o.gemm), ": router of ", rows, " rows",
                      rows < kRouterCublasMinRows
                          ? absl::StrCat(" (< ", kRouterCublasMinRows, ")")
                          : std::string(" (no fp32 copy of a quantized router)"),
                      ": our fp32 router kernel, not cuBLASLt");
  } else {
    plan.router = MoeRouter::kReference;
  }

  // The routed experts.
  const bool quant = device_routing && layer.quantized_tables;
  const bool many_pairs = pairs > kMoeMmaMaxPairsPerExpert * s.experts;
  const bool grouped_shape =
      rows >= cuda::kMoeGroupedMinRows && cuda::MoeGroupedSupports(s.experts, s.hidden, s.inter);
  // Long bf16 prefill chunks go to cuBLAS's grouped GEMMs, with a host sync (prefill is never
  // captured): the mma.sync kernels re-read an expert's weights for every 64 of its pairs.
  // moe=wgmma has no cuBLAS runner: its kernels read each expert once per 128 pairs.
  const bool long_prefill =
      step.n > 1 && UsesCublasGrouped(o) && !quant && layer.experts_bf16 && many_pairs;
  const bool quant_grouped_shape = quant && grouped_shape && layer.experts_quantized_alike;
  // qgemm=w8a8: E4M3 inputs onto the FP8 codes (block-128 too, which the decoding kernels lack).
  const bool fp8_mma = quant_grouped_shape && QuantizesActivationsFp8(o.qgemm) &&
                       cuda::MoeGroupedFp8Supports(layer.gate, layer.up, layer.down);
  const bool quant_grouped =
      quant_grouped_shape &&
      (fp8_mma || cuda::MoeGroupedQuantSupports(layer.gate, layer.up, layer.down));
  const bool copies = quant_grouped_shape && step.n > 1 && !quant_grouped;
  const bool bf16_grouped = device_routing && !quant && !long_prefill && grouped_shape;
  if (bf16_grouped || quant_grouped || copies) {
    plan.experts = MoeExperts::kGrouped;
    plan.bf16_copies = copies;
    // moe=wgmma: chunks of more than kMoeMmaMaxPairsPerExpert pairs an expert (prefill); decode
    // batches keep the mma.sync kernels, where wgmma's smallest N (32) is mostly padding.
    const bool want_wgmma = o.moe == Moe::kWgmma && many_pairs;
    if (fp8_mma) {
      // qgemm=w8a8: E4M3 inputs onto the codes, whatever the moe value's kernels would decode;
      // moe=wgmma's on wgmma k32 where the K are whole 128-byte chunks.
      const bool wide = pairs > cuda::kMoeWidePairsPerExpert * s.experts;
      if (want_wgmma &&
          cuda::MoeWgmmaFp8Supports(layer.gate, layer.up, layer.down, s.hidden, s.inter)) {
        plan.grouped = cuda::MoeGroupedKernel::kFp8Wgmma;
      } else {
        plan.grouped = wide ? cuda::MoeGroupedKernel::kFp8Mma8 : cuda::MoeGroupedKernel::kFp8Mma4;
        if (want_wgmma)
          launcher_fallback("moe=wgmma: qgemm=w8a8: the E4M3 x E4M3 mma.sync grouped kernels");
      }
    } else if (quant_grouped) {
      const bool wgmma = want_wgmma && cuda::MoeWgmmaQuantSupports(layer.gate, layer.up, layer.down,
                                                                   s.hidden, s.inter);
      if (want_wgmma && !wgmma)
        launcher_fallback("moe=wgmma: ", QuantFormatName(layer.gate.format), " experts, hidden ",
                          s.hidden, ", inter ", s.inter,
                          ": the quantized mma.sync grouped kernels");
      plan.grouped = cuda::MoeGroupedKernelFor(/*quantized=*/true, wgmma, pairs, s.experts);
    } else {
      const bool wgmma = want_wgmma && cuda::MoeWgmmaSupports(s.hidden, s.inter);
      if (want_wgmma && !wgmma)
        launcher_fallback(
            "moe=wgmma: hidden ", s.hidden, ", inter ", s.inter,
            " (the wgmma tiles take hidden % 128 == 0, inter % 64 == 0): the mma.sync "
            "grouped kernels");
      plan.grouped = cuda::MoeGroupedKernelFor(/*quantized=*/false, wgmma, pairs, s.experts);
    }
    if (copies)
      fallback("qgemm=", AxisValueName(o.qgemm), ": ", chunk,
               ": the layer's experts dequantized to bf16, then the bf16 grouped mma.sync "
               "kernels");
    if (o.moe == Moe::kWgmma && !many_pairs && !copies)
      fallback("moe=wgmma: ", chunk,
               ", 16 or fewer pairs an expert: the mma.sync grouped kernels, not wgmma");
  } else if (step.n == 1 && device_routing) {
    plan.experts = quant ? MoeExperts::kPerPairQuantGemv : MoeExperts::kPerPairGemv;
    if (o.moe == Moe::kWgmma)
      fallback("moe=wgmma: ", chunk, ": the per-pair expert GEMVs (moe=fused's), not wgmma");
  } else if (o.moe == Moe::kGrouped || long_prefill) {
    plan.experts = MoeExperts::kCublasGrouped;
    if (long_prefill && device_routing)
      fallback("moe=", moe_name, ": ", chunk,
               ", more than 16 pairs an expert: the experts on cuBLAS grouped GEMMs, with a host "
               "sync");
  } else {
    plan.experts = MoeExperts::kLoop;
    if (device_routing)
      fallback("moe=", moe_name, ": ", chunk,
               ": the per-expert loop with a host sync (moe=loop's path): ",
               rows < cuda::kMoeGroupedMinRows
                   ? "fewer rows than the grouped expert kernels take"
                   : "the grouped expert kernels do not take these experts (MoeGroupedSupports, "
                     "or quantized experts not all alike)");
  }
  switch (plan.experts) {
    case MoeExperts::kGrouped:
    case MoeExperts::kCublasGrouped:
      plan.bf16_input = true;
      break;
    case MoeExperts::kLoop:
    case MoeExperts::kPerPairGemv:
    case MoeExperts::kPerPairQuantGemv:
      plan.bf16_input = false;
      break;
  }

  // The shared expert: one more pair a row in the per-pair expert kernels where it fits their
  // tables (decode rows, the fused router), else gate, up and its sigmoid gate in one fused GEMV
  // where the rows fit.
  const bool per_pair =
      plan.experts == MoeExperts::kPerPairGemv || plan.experts == MoeExperts::kPerPairQuantGemv;
  if (!layer.shared_expert) {
    plan.shared = MoeShared::kNone;
  } else if (layer.shared_in_tables && per_pair && plan.router == MoeRouter::kFusedGemv &&
             s.top_k < 32) {
    plan.shared = MoeShared::kFoldedPair;
  } else if (step.gemv && cuda::GemvSupports(rows, layer.shared_down_cols)) {
    plan.shared = MoeShared::kFusedGemv;
  } else {
    plan.shared = MoeShared::kUnfused;
    if (step.gemv)
      fallback("gemm=", AxisValueName(o.gemm),
               ": the shared expert and its gate unfused (cuBLASLt for bf16 weights), not the "
               "fused GEMV");
  }
  plan.fallbacks.insert(plan.fallbacks.end(), router_fallbacks.begin(), router_fallbacks.end());
  plan.fallbacks.insert(plan.fallbacks.end(), launcher_fallbacks.begin(), launcher_fallbacks.end());
  return plan;
}

std::vector<std::string> MoeRefusals(const CudaOptions& o, const MoeShape& s) {
  std::vector<std::string> why;
  switch (o.moe) {
    case Moe::kLoop:
    case Moe::kGrouped:
      break;
    case Moe::kFused:
    case Moe::kWgmma:
      if (s.experts > 0 && !cuda::MoeDeviceRoutingSupports(s.experts, s.top_k, s.hidden, s.inter))
        why.push_back(absl::StrCat(
            "moe=", AxisValueName(o.moe), " supports <= ", cuda::kMoeMaxExperts,
            " experts, top-k <= ", cuda::kMoeMaxTopK,
            ", hidden and moe_intermediate sizes that are multiples of 8 (16-byte weight loads), "
            "and hidden x 4 bytes <= ",
            cuda::kMoeMaxSharedBytes / 1024, " KB (staged x)"));
      break;
  }
  return why;
}

}  // namespace infersweep
