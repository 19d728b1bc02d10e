// The engine on one NVIDIA GPU: weights resident on the device (synthetic ones generated there),
// an fp32 KV cache, and per-axis choices of GEMM, MoE runner and CUDA graphs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/fault_injection.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace infersweep {

struct CudaModelOptions {
  bool gemm_cublaslt = false;  // else the reference GEMM
  bool gemm_fused = false;     // decode rows: our GEMV with norm/bias/residual fused (needs cublaslt)
  bool gemm_tma = false;       // as gemm_fused, q/k/v and o streamed by the TMA engine (sm_90a)
  bool attention_flash = false;  // else the naive (materialised scores) kernel
  bool kv_cache_bf16 = false;    // kv_cache=bf16: K and V rounded to bf16 (attention=flash only)
  bool moe_fused = false;      // else the per-expert loop with a host sync
  bool moe_wgmma = false;      // with moe_fused: the grouped expert GEMMs on sm_90a wgmma
  bool moe_grouped = false;    // cuBLAS grouped GEMMs over the experts (host sync; needs cublaslt)
  bool graphs = false;         // capture the decode step (needs moe_fused)
  // graphs=persistent: batch-1 decode steps as one cooperative kernel over every layer
  // (kernels/cuda/sm90a/decode_persistent.h), captured like graphs=on; bf16 weights only.
  bool persistent_decode = false;
  // How quantized linears run (the qgemm axis; dense models ignore it): "reference" (dequantized
  // exactly to fp32 at build, reference GEMM), "dequant_bf16" (dequantized to bf16, then the gemm
  // axis's GEMM), "w4a16" (FP4 codes read by the fused dequant GEMV), "fp8_cublaslt" and
  // "native_fp4" (codes as loaded, activations quantized per call, cuBLASLt scaled GEMMs:
  // kernels/cuda/gemm_scaled.h).
  std::string qgemm = "reference";
  FaultInjection fault;        // TEST ONLY
};

// Uploads (or generates) `host`'s weights once per HostModel; every model built on the same host
// model shares them. `host` must outlive the model.
absl::StatusOr<std::unique_ptr<Model>> MakeCudaModel(HostModel& host, const CudaModelOptions& options);

// Tests: the raw bytes of tensor `index` (spec order) as resident on the device.
absl::StatusOr<std::vector<uint8_t>> CopyDeviceTensorToHost(HostModel& host, size_t index);

}  // namespace infersweep
