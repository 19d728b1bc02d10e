// What the capability probe asks the GPU and its libraries about a config, derived from each op
// family's plan: the kernels whose images the binary must hold for this GPU, and the library
// plans (cuBLASLt's heuristics, cuDNN's graphs) the config will make. Every axis value has its
// entry here, through exhaustive switches: a value without one is an error, never skipped. The
// CUDA build maps each entry to a kernel's entry point and asks (engine/cuda/capability_probe.cc).
// Host code: built and tested without CUDA.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/model_config.h"
#include "engine/options.h"

namespace infersweep {

enum class ProbeKernelId {
  kRmsNorm,           // every device=cuda config
  kFlashPrefill,      // attention=flash
  kFlashDecode,       // attention=flash
  kFusedGemv,         // gemm=fused and tma
  kGemvTma,           // gemm=tma
  kExpertWgmma,       // moe=wgmma on MoE models
  kPersistentDecode,  // graphs=persistent
  kSm100aTest,        // test_kernel=sm100a (TEST ONLY)
};

enum class ProbeLibraryId {
  kCublasLtGemm,    // gemm=cublaslt|fused|tma: the model's bf16 GEMM shapes and the fp32 router
  kCudnnAttention,  // attention=cudnn: a decode plan of its graph for the model's heads
  kCudnnQuantGemm,  // qgemm=cudnn on quantized weights: its matmul graph for the weights' format
};

struct ProbeEntry {
  std::string by;  // the axis value that needs it, "attention=flash"
  bool is_kernel = true;
  ProbeKernelId kernel = ProbeKernelId::kRmsNorm;
  ProbeLibraryId library = ProbeLibraryId::kCublasLtGemm;
};

// The entries of one axis value under `options` on `model` (an empty list: the value launches
// only what other entries cover). InvalidArgument for an axis this file does not know.
absl::StatusOr<std::vector<ProbeEntry>> ProbeEntriesOf(const std::string& axis,
                                                       const CudaOptions& options,
                                                       const ModelConfig& model,
                                                       bool quantized_weights);
// Every entry of a config: device=cuda's, then each axis's.
absl::StatusOr<std::vector<ProbeEntry>> ProbeEntries(const CudaOptions& options,
                                                     const ModelConfig& model,
                                                     bool quantized_weights);

}  // namespace infersweep
