#include "engine/plan/probe_plan.h"

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "engine/plan/linear_attention_plan.h"

namespace infersweep {
namespace {

template <typename E>
std::string By(const char* axis, E value) {
  return absl::StrCat(axis, "=", AxisValueName(value));
}

ProbeEntry Kernel(std::string by, ProbeKernelId id) { return {std::move(by), true, id, {}}; }
ProbeEntry Library(std::string by, ProbeLibraryId id) {
  return {std::move(by), false, ProbeKernelId::kRmsNorm, id};
}

}  // namespace

absl::StatusOr<std::vector<ProbeEntry>> ProbeEntriesOf(const std::string& axis,
                                                       const CudaOptions& o,
                                                       const ModelConfig& model,
                                                       bool quantized_weights) {
  std::vector<ProbeEntry> e;
  if (axis == "device") {
    e.push_back(Kernel("device=cuda", ProbeKernelId::kRmsNorm));
  } else if (axis == "attention") {
    // The plan's kernel family, whatever refusal the model's heads may give (the model refusal
    // states that).
    switch (o.attention) {
      case Attention::kNaive:
        break;
      case Attention::kFlash:
        e.push_back(Kernel(By("attention", o.attention), ProbeKernelId::kFlashPrefill));
        e.push_back(Kernel(By("attention", o.attention), ProbeKernelId::kFlashDecode));
        break;
      case Attention::kCudnn:
        if (model.num_q_heads > 0)
          e.push_back(Library(By("attention", o.attention), ProbeLibraryId::kCudnnAttention));
        break;
    }
  } else if (axis == "kv_cache") {
    switch (o.kv_cache) {  // read by the attention kernels above
      case KvCache::kFp32:
      case KvCache::kBf16:
      case KvCache::kFp8:
        break;
    }
  } else if (axis == "gemm") {
    switch (o.gemm) {
      case Gemm::kReference:
        break;
      case Gemm::kCublasLt:
        e.push_back(Library(By("gemm", o.gemm), ProbeLibraryId::kCublasLtGemm));
        break;
      case Gemm::kFused:
        e.push_back(Kernel(By("gemm", o.gemm), ProbeKernelId::kFusedGemv));
        e.push_back(Library(By("gemm", o.gemm), ProbeLibraryId::kCublasLtGemm));
        break;
      case Gemm::kTma:
        e.push_back(Kernel(By("gemm", o.gemm), ProbeKernelId::kFusedGemv));
        e.push_back(Kernel(By("gemm", o.gemm), ProbeKernelId::kGemvTma));
        e.push_back(Library(By("gemm", o.gemm), ProbeLibraryId::kCublasLtGemm));
        break;
    }
  } else if (axis == "moe") {
    switch (o.moe) {
      case Moe::kLoop:
      case Moe::kGrouped:  // cuBLAS's grouped GEMMs: asked on first use
      case Moe::kFused:
        break;
      case Moe::kWgmma:
        if (model.is_moe()) e.push_back(Kernel(By("moe", o.moe), ProbeKernelId::kExpertWgmma));
        break;
    }
  } else if (axis == "graphs") {
    switch (o.graphs) {
      case Graphs::kOff:
      case Graphs::kOn:
        break;
      case Graphs::kPersistent:
        e.push_back(Kernel(By("graphs", o.graphs), ProbeKernelId::kPersistentDecode));
        break;
    }
  } else if (axis == "qgemm") {
    switch (o.qgemm) {
      case QGemm::kReference:
      case QGemm::kDequantBf16:
      case QGemm::kW4A16:
      case QGemm::kW8A16:
      case QGemm::kW8A8:  // its E4M3 kernels live in the image every config loads (sm_89+)
      case QGemm::kFp8CublasLt:  // cuBLASLt's scaled heuristics: refused in its words at build
      case QGemm::kNativeFp4:
        break;
      case QGemm::kCudnn:
        if (quantized_weights && model.num_q_heads > 0)
          e.push_back(Library(By("qgemm", o.qgemm), ProbeLibraryId::kCudnnQuantGemm));
        break;
    }
  } else if (axis == "linear_attn") {
    // The delta-rule kernels, the chunked form's and the decode kernel live beside kRmsNorm in
    // the sm_90 image every config loads.
    switch (PlanLinearAttention(o).delta_rule) {
      case DeltaRulePath::kReference:
      case DeltaRulePath::kFused:
      case DeltaRulePath::kChunked:
        break;
    }
  } else if (axis == "test_kernel") {
    switch (o.test_kernel) {
      case TestKernel::kNone:
        break;
      case TestKernel::kSm100a:
        e.push_back(Kernel(By("test_kernel", o.test_kernel), ProbeKernelId::kSm100aTest));
        break;
    }
  } else if (axis == "tp" || axis == "ep") {
    // Rank processes each run the config's other kernels on their shard.
  } else if (axis == "allreduce") {
    switch (o.parallel.allreduce) {
      case AllReduce::kReference:
      case AllReduce::kAuto:
      case AllReduce::kNccl:
      case AllReduce::kCustom:
      case AllReduce::kFused:
        break;
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("the capability probe has no entry for axis '", axis, "'"));
  }
  return e;
}

absl::StatusOr<std::vector<ProbeEntry>> ProbeEntries(const CudaOptions& o, const ModelConfig& model,
                                                     bool quantized_weights) {
  std::vector<ProbeEntry> all;
  for (const char* axis : {"device", "attention", "kv_cache", "gemm", "moe", "graphs", "qgemm",
                           "linear_attn", "test_kernel", "tp", "ep", "allreduce"}) {
    ASSIGN_OR_RETURN(std::vector<ProbeEntry> e, ProbeEntriesOf(axis, o, model, quantized_weights));
    all.insert(all.end(), e.begin(), e.end());
  }
  return all;
}

}  // namespace infersweep
