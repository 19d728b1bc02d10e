// The CUDA build's capability probe (engine/capability_probe.h): each backend declares the
// kernels it launches (one representative entry point each) and whether it runs cuBLASLt or
// cuDNN; the probe asks the driver for each kernel's image on this GPU, cuBLASLt's heuristic for
// each of the model's GEMM shapes, and cuDNN for a plan of attention=cudnn's graph.
#include "engine/capability_probe.h"

#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/unreachable.h"
#include "engine/cuda/cudnn_attention.h"
#include "engine/cuda/cudnn_matmul.h"
#include "engine/options.h"
#include "engine/plan/probe_plan.h"
#include "kernels/cuda/gemm_cublaslt.h"
#include "kernels/cuda/probe_kernels.h"

namespace infersweep {
namespace {

// The entry point of a kernel the probe asks about.
cuda::ProbeKernel KernelOf(ProbeKernelId id) {
  switch (id) {
    case ProbeKernelId::kRmsNorm:
      return cuda::RmsNormProbeKernel();
    case ProbeKernelId::kFlashPrefill:
      return cuda::FlashPrefillProbeKernel();
    case ProbeKernelId::kFlashDecode:
      return cuda::FlashDecodeProbeKernel();
    case ProbeKernelId::kFusedGemv:
      return cuda::FusedGemvProbeKernel();
    case ProbeKernelId::kGemvTma:
      return cuda::GemvTmaProbeKernel();
    case ProbeKernelId::kExpertWgmma:
      return cuda::ExpertWgmmaProbeKernel();
    case ProbeKernelId::kPersistentDecode:
      return cuda::PersistentDecodeProbeKernel();
    case ProbeKernelId::kSm100aTest:
      return cuda::Sm100aTestProbeKernel();
  }
  Unreachable("KernelOf: a probe kernel without an entry point");
}

// The GEMM shapes (N, K) the model runs through cuBLASLt: attention projections, the dense MLP,
// the lm_head.
std::vector<std::pair<int, int>> GemmShapes(const ModelConfig& m) {
  std::vector<std::pair<int, int>> shapes = {{m.q_dim(), m.hidden_size},
                                             {m.kv_dim(), m.hidden_size},
                                             {m.hidden_size, m.q_dim()},
                                             {m.vocab_size, m.hidden_size}};
  if (m.intermediate_size > 0) {
    shapes.push_back({m.intermediate_size, m.hidden_size});
    shapes.push_back({m.hidden_size, m.intermediate_size});
  }
  return shapes;
}

class DeviceProbe final : public CapabilityProbe {
 public:
  explicit DeviceProbe(LocalDevices devices) : devices_(std::move(devices)) {}

  absl::Status Probe(const BackendConfig& config, const ModelConfig& model,
                     const std::string& weight_format) override {
    // The static preflight refuses device=cuda without a GPU; the CPU has nothing to ask.
    if (ConfigDevice(config) != Device::kCuda || devices_.gpu_count == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(CudaOptions options, ParseCudaOptions(config));
    const bool quantized = weight_format != "bf16" && weight_format != "f16" &&
                           weight_format != "f32" && !weight_format.empty();
    ASSIGN_OR_RETURN(std::vector<ProbeEntry> entries, ProbeEntries(options, model, quantized));
    for (const ProbeEntry& entry : entries) {
      if (entry.is_kernel) {
        RETURN_IF_ERROR(ProbeKernelImage(entry.by, KernelOf(entry.kernel)));
        continue;
      }
      switch (entry.library) {
        case ProbeLibraryId::kCudnnAttention: {
          // cuDNN loads, is new enough, and finalizes a decode plan for the model's heads (the KV
          // length is a device tensor; 4096 stands for any capacity).
          ASSIGN_OR_RETURN(
              std::unique_ptr<CudnnAttention> attention,
              CudnnAttention::Create({model.num_q_heads, model.num_kv_heads, model.head_dim, 4096},
                                     nullptr));
          break;
        }
        case ProbeLibraryId::kCudnnQuantGemm: {
          // cuDNN's plan for the q projection's shape in the weights' format (fp8 stands for its
          // three scale layouts).
          const QuantFormat format = weight_format == "nvfp4"   ? QuantFormat::kNvfp4
                                     : weight_format == "mxfp4" ? QuantFormat::kMxfp4
                                                                : QuantFormat::kFp8Channel;
          RETURN_IF_ERROR(ProbeCudnnQuantGemm(format, model.q_dim(), model.hidden_size));
          break;
        }
        case ProbeLibraryId::kCublasLtGemm:
          RETURN_IF_ERROR(ProbeCublasLt(entry.by, model));
          break;
      }
    }
    return absl::OkStatus();
  }

 private:
  // Whether this binary holds an image of `kernel` the GPU can run.
  absl::Status ProbeKernelImage(const std::string& by, const cuda::ProbeKernel& kernel) const {
    cudaFuncAttributes attributes{};
    const cudaError_t e = cudaFuncGetAttributes(&attributes, kernel.entry);
    if (e == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();  // not sticky: clear it
    const std::string driver = absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
    if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
      return absl::UnimplementedError(absl::StrCat(by, ": no kernel image for sm_", devices_.sm,
                                                   " of ", kernel.name, " in this binary (", driver,
                                                   ")"));
    return absl::InternalError(absl::StrCat("cudaFuncGetAttributes(", kernel.name, "): ", driver));
  }

  // cuBLASLt's heuristic for each of the model's GEMM shapes: decode (one row) and a prefill
  // chunk; the fp32 router GEMM of long prefill chunks.
  absl::Status ProbeCublasLt(const std::string& by, const ModelConfig& model) const {
    ASSIGN_OR_RETURN(std::unique_ptr<cuda::CublasLtGemm> gemm, cuda::CublasLtGemm::Create());
    for (int rows : {1, 512}) {
      for (const auto& [n, k] : GemmShapes(model))
        if (absl::Status s = gemm->Probe(rows, n, k, CUDA_R_16BF); !s.ok())
          return absl::Status(s.code(), absl::StrCat(by, ": ", s.message()));
      if (model.is_moe())
        if (absl::Status s = gemm->Probe(rows, model.num_experts, model.hidden_size, CUDA_R_32F);
            !s.ok())
          return absl::Status(s.code(), absl::StrCat("router: ", s.message()));
    }
    return absl::OkStatus();
  }

  const LocalDevices devices_;
};

}  // namespace

std::unique_ptr<CapabilityProbe> MakeDeviceProbe(const LocalDevices& devices) {
  return std::make_unique<DeviceProbe>(devices);
}

}  // namespace infersweep
