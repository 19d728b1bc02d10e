#include "engine/backends.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/cpu_model.h"
#include "engine/quant/layout.h"
#ifdef INFERSWEEP_HAVE_CUDA
#include "engine/cuda/cuda_model.h"
#endif

namespace infersweep {

#ifndef INFERSWEEP_HAVE_CUDA
LocalDevices ProbeLocalDevices() { return {}; }
#endif

std::string WeightFormat(const HostModel& model) {
  if (model.quant_format != QuantFormat::kNone)
    return QuantFormatFamily(model.quant_format);
  for (const HostTensor& t : model.tensors) {
    switch (t.dtype) {
      case DType::kBF16:
        return "bf16";
      case DType::kF16:
        return "f16";
      case DType::kF32:
        return "f32";
      default:
        break;
    }
  }
  return "bf16";
}

PreflightTarget MakePreflightTarget(const LocalDevices& devices, const HostModel* model) {
  PreflightTarget target;
  target.has_cuda_build = devices.has_cuda_build;
  target.gpu_count = devices.gpu_count;
  target.sm = devices.sm;
  if (model != nullptr) target.weight_format = WeightFormat(*model);
  return target;
}

PreflightTarget MakePreflightTarget(const LocalDevices& devices, const std::string& model) {
  PreflightTarget target = MakePreflightTarget(devices, nullptr);
  target.weight_format = DeclaredWeightFormat(model);
  return target;
}

BackendConfig ReferenceConfigFor(const BackendConfig& normalized) {
  return DefaultAxes(ConfigDevice(normalized));
}

absl::StatusOr<std::unique_ptr<Model>> CreateModel(HostModel& host,
                                                   const BackendConfig& config,
                                                   const FaultInjection& fault) {
  const std::string device = ConfigDevice(config);
  if (device == "cpu") {
    if (auto s = MaterializeHostWeights(host); !s.ok()) return s;
    if (fault.kind == FaultInjection::Kind::kBadQuantScale) {  // can these weights take it?
      ModelWeights probe = host.weights;
      std::vector<uint8_t> scratch;
      if (auto s = CorruptQuantScale(probe, host, fault.value, fault.target, &scratch); !s.ok())
        return absl::InvalidArgumentError(
            absl::StrCat(s.message(),
                         " (bad-quant-scale needs quantized weights: a quantized checkpoint or "
                         "--quantize",
                         fault.target.empty() ? "" : ", and a target they have", ")"));
    }
    CpuModelOptions options;
    options.fault = fault;
    options.matmul =
        config.at("matmul") == "blocked" ? cpu::MatmulVariant::kBlocked : cpu::MatmulVariant::kNaive;
    const std::string& threads = config.at("threads");
    if (threads != "all" && !absl::SimpleAtoi(threads, &options.threads))
      return absl::InvalidArgumentError(absl::StrCat("threads=", threads, " is not a number"));
    return MakeCpuModel(host, options);
  }
#ifdef INFERSWEEP_HAVE_CUDA
  if (device == "cuda") {
    CudaModelOptions options;
    const std::string& gemm = config.at("gemm");
    options.gemm_cublaslt = gemm == "cublaslt" || gemm == "fused" || gemm == "tma";
    options.gemm_fused = gemm == "fused";
    options.gemm_tma = gemm == "tma";
    options.attention_flash = config.at("attention") == "flash";
    options.kv_cache_bf16 = config.at("kv_cache") == "bf16";
    options.moe_fused = config.at("moe") == "fused" || config.at("moe") == "wgmma";
    options.moe_wgmma = config.at("moe") == "wgmma";
    options.moe_grouped = config.at("moe") == "grouped";
    options.graphs = config.at("graphs") == "on" || config.at("graphs") == "persistent";
    options.persistent_decode = config.at("graphs") == "persistent";
    options.qgemm = config.at("qgemm");
    options.fault = fault;
    return MakeCudaModel(host, options);
  }
#endif
  return absl::UnimplementedError(
      absl::StrCat("device=", device, ": this build has no implementation for it"));
}

}  // namespace infersweep
