// The CUDA build's capability probe (engine/capability_probe.h): each backend declares the
// kernels it launches (one representative entry point each) and whether it runs cuBLASLt or
// cuDNN; the probe asks the driver for each kernel's image on this GPU, cuBLASLt's heuristic for
// each of the model's GEMM shapes, and cuDNN for a plan of attention=cudnn's graph.
#include "engine/capability_probe.h"

#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cudnn_attention.h"
#include "engine/cuda/cudnn_matmul.h"
#include "engine/options.h"
#include "kernels/cuda/gemm_cublaslt.h"
#include "kernels/cuda/probe_kernels.h"

namespace infersweep {
namespace {

// A kernel a config launches, and the axis value that launches it.
struct ProbedKernel {
  std::string by;  // "attention=flash"
  cuda::ProbeKernel kernel;
};

// The kernels `o` launches on `model`, one representative entry point per backend.
std::vector<ProbedKernel> KernelsOf(const CudaOptions& o, const ModelConfig& model) {
  std::vector<ProbedKernel> k = {{"device=cuda", cuda::RmsNormProbeKernel()}};
  auto named = [](const char* axis, auto value) {
    return absl::StrCat(axis, "=", AxisValueName(value));
  };
  if (o.attention == Attention::kFlash) {
    k.push_back({named("attention", o.attention), cuda::FlashPrefillProbeKernel()});
    k.push_back({named("attention", o.attention), cuda::FlashDecodeProbeKernel()});
  }
  if (UsesFusedGemv(o.gemm)) k.push_back({named("gemm", o.gemm), cuda::FusedGemvProbeKernel()});
  if (UsesTma(o.gemm)) k.push_back({named("gemm", o.gemm), cuda::GemvTmaProbeKernel()});
  if (o.moe == Moe::kWgmma && model.is_moe())
    k.push_back({named("moe", o.moe), cuda::ExpertWgmmaProbeKernel()});
  if (IsPersistent(o.graphs))
    k.push_back({named("graphs", o.graphs), cuda::PersistentDecodeProbeKernel()});
  if (o.test_kernel == TestKernel::kSm100a)
    k.push_back({named("test_kernel", o.test_kernel), cuda::Sm100aTestProbeKernel()});
  return k;
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
    if (ConfigDevice(config) != "cuda" || devices_.gpu_count == 0) return absl::OkStatus();
    absl::StatusOr<CudaOptions> options = ParseCudaOptions(config);
    if (!options.ok()) return options.status();
    for (const ProbedKernel& k : KernelsOf(*options, model)) {
      cudaFuncAttributes attributes{};
      const cudaError_t e = cudaFuncGetAttributes(&attributes, k.kernel.entry);
      if (e == cudaSuccess) continue;
      cudaGetLastError();  // not sticky: clear it
      const std::string driver = absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
      if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
        return absl::UnimplementedError(absl::StrCat(k.by, ": no kernel image for sm_", devices_.sm,
                                                     " of ", k.kernel.name, " in this binary (",
                                                     driver, ")"));
      return absl::InternalError(
          absl::StrCat("cudaFuncGetAttributes(", k.kernel.name, "): ", driver));
    }
    // attention=cudnn: cuDNN loads, is new enough, and finalizes a decode plan for the model's
    // heads (the KV length is a device tensor; 4096 stands for any capacity).
    if (options->attention == Attention::kCudnn && model.num_q_heads > 0) {
      absl::StatusOr<std::unique_ptr<CudnnAttention>> attention = CudnnAttention::Create(
          {model.num_q_heads, model.num_kv_heads, model.head_dim, 4096}, nullptr);
      if (!attention.ok()) return attention.status();
    }
    // qgemm=cudnn on quantized weights: cuDNN's plan for the q projection's shape in the
    // weights' format (fp8 stands for its three scale layouts).
    if (options->qgemm == QGemm::kCudnn && weight_format != "bf16" && model.num_q_heads > 0) {
      const QuantFormat format = weight_format == "nvfp4"   ? QuantFormat::kNvfp4
                                 : weight_format == "mxfp4" ? QuantFormat::kMxfp4
                                                            : QuantFormat::kFp8Channel;
      if (absl::Status s = ProbeCudnnQuantGemm(format, model.q_dim(), model.hidden_size); !s.ok())
        return s;
    }
    if (UsesCublasLt(options->gemm)) {
      absl::StatusOr<std::unique_ptr<cuda::CublasLtGemm>> gemm = cuda::CublasLtGemm::Create();
      if (!gemm.ok()) return gemm.status();
      // Decode (one row) and a prefill chunk; the fp32 router GEMM of long prefill chunks.
      for (int rows : {1, 512}) {
        for (const auto& [n, k] : GemmShapes(model))
          if (absl::Status s = (*gemm)->Probe(rows, n, k, CUDA_R_16BF); !s.ok())
            return absl::Status(
                s.code(), absl::StrCat("gemm=", AxisValueName(options->gemm), ": ", s.message()));
        if (model.is_moe())
          if (absl::Status s =
                  (*gemm)->Probe(rows, model.num_experts, model.hidden_size, CUDA_R_32F);
              !s.ok())
            return absl::Status(s.code(), absl::StrCat("router: ", s.message()));
      }
    }
    return absl::OkStatus();
  }

 private:
  const LocalDevices devices_;
};

}  // namespace

std::unique_ptr<CapabilityProbe> MakeDeviceProbe(const LocalDevices& devices) {
  return std::make_unique<DeviceProbe>(devices);
}

}  // namespace infersweep
