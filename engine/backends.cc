#include "engine/backends.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "engine/cpu_model.h"
#include "engine/options.h"
#include "engine/quant/layout.h"
#include "engine/rank_context.h"
#include "engine/tp_model.h"
#ifdef INFERSWEEP_HAVE_CUDA
#include "engine/cuda/cuda_model.h"
#endif

namespace infersweep {

#ifndef INFERSWEEP_HAVE_CUDA
LocalDevices ProbeLocalDevices() { return {}; }
absl::Status UseRankDevice(int, int) { return absl::OkStatus(); }
#endif

std::string WeightFormat(const HostModel& model) {
  if (model.quant_format != QuantFormat::kNone) return QuantFormatFamily(model.quant_format);
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
  // TEST ONLY: ranks INFERSWEEP_RANK_DEVICES places on this host's GPUs ("0,0") count as GPUs.
  target.gpu_count = std::max(target.gpu_count, TestRankDeviceCount(devices.gpu_count));
  target.sm = devices.sm;
  if (model != nullptr) {
    target.weight_format = WeightFormat(*model);
    target.model = model->config;
  }
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

absl::StatusOr<std::unique_ptr<Model>> CreateModel(HostModel& host, const BackendConfig& config,
                                                   const FaultInjection& fault) {
  // Conflicts between axis values are the registry's alone; a model built without a preflight
  // (the CLI's logits and generate) still refuses them, with the registry's reason.
  if (const std::string why = RegistryConflict(config, WeightFormat(host)); !why.empty())
    return absl::UnimplementedError(why);
  if ((fault.kind == FaultInjection::Kind::kBadState ||
       fault.kind == FaultInjection::Kind::kStateSlotSwap) &&
      !host.config.has_linear_attention())
    return absl::InvalidArgumentError(absl::StrCat(
        fault.kind == FaultInjection::Kind::kBadState ? "bad-state" : "state-slot-swap",
        " needs a model with linear-attention layers (qwen3_next, qwen3_5): this model has no "
        "recurrent state to corrupt"));
  // A config that skipped NormalizeBackendConfig may name a device the registry does not know.
  const absl::StatusOr<Device> parsed_device = ParseConfigDevice(config);
  if (!parsed_device.ok())
    return absl::UnimplementedError(
        absl::StrCat("device=", config.at("device"), ": this build has no implementation for it"));
  const Device device = *parsed_device;
  if (fault.kind == FaultInjection::Kind::kKvSlotSwap && device != Device::kCpu)
    return absl::InvalidArgumentError(absl::StrCat(
        "kv-slot-swap is committed by the CPU reference only; device=", DeviceName(device),
        " would run the trial without the fault"));
  if (device == Device::kCpu) {
    RETURN_IF_ERROR(MaterializeHostWeights(host));
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
    ASSIGN_OR_RETURN(auto parsed, ParseCpuOptions(config));
    CpuModelOptions options;
    options.fault = fault;
    options.matmul = parsed.matmul == Matmul::kBlocked ? cpu::MatmulVariant::kBlocked
                                                       : cpu::MatmulVariant::kNaive;
    options.threads = parsed.threads;
    if (parsed.parallel.tp > 1) {
      TensorParallelOptions parallel;
      parallel.tp = parsed.parallel.tp;
      parallel.expert_parallel = parsed.parallel.expert_parallel;
      parallel.matmul = options.matmul;
      parallel.fault = fault;
      return MakeTensorParallelCpuModel(host, parallel);
    }
    return MakeCpuModel(host, options);
  }
#ifdef INFERSWEEP_HAVE_CUDA
  if (device == Device::kCuda) {
    ASSIGN_OR_RETURN(auto options, ParseCudaOptions(config));
    // A checkpoint may ship lm_head quantized against its declaration; the CUDA engine streams
    // lm_head as bf16 only.
    if (host.weights.lm_head.quantized())
      return absl::UnimplementedError(
          "device=cuda: lm_head is stored quantized, which only the CPU reference runs");
    // tp > 1: this rank process's shard, joined to the other ranks (engine/rank_context.h).
    if (options.parallel.tp > 1) {
      ASSIGN_OR_RETURN(auto rank, JoinCudaRank(options.parallel));
      return MakeCudaModel(host, options, fault, rank);
    }
    return MakeCudaModel(host, options, fault);
  }
#endif
  return absl::UnimplementedError(
      absl::StrCat("device=", DeviceName(device), ": this build has no implementation for it"));
}

absl::StatusOr<std::unique_ptr<Model>> CreateYardstick(HostModel& host,
                                                       const BackendConfig& reference,
                                                       Yardstick yardstick) {
  if (yardstick == Yardstick::kNone)
    return absl::InvalidArgumentError("CreateYardstick: Yardstick::kNone is the reference itself");
#ifdef INFERSWEEP_HAVE_CUDA
  if (ConfigDevice(reference) == Device::kCuda) {
    ASSIGN_OR_RETURN(auto options, ParseCudaOptions(reference));
    options.yardstick = yardstick;
    return MakeCudaModel(host, options, {});
  }
#endif
  return absl::UnimplementedError(absl::StrCat("device=", DeviceName(ConfigDevice(reference)),
                                               ": no ", YardstickName(yardstick),
                                               " yardstick (its configs are all fp32-class)"));
}

Yardstick YardstickFor(const BackendConfig& normalized) {
  if (ConfigDevice(normalized) != Device::kCuda) return Yardstick::kBf16;
  const absl::StatusOr<CudaOptions> options = ParseCudaOptions(normalized);
  if (!options.ok()) return Yardstick::kBf16;
  switch (options->qgemm) {
    case QGemm::kW8A8:
    case QGemm::kFp8CublasLt:
    case QGemm::kCudnn:
      return Yardstick::kE4m3;
    case QGemm::kReference:
    case QGemm::kDequantBf16:
    case QGemm::kW4A16:
    case QGemm::kW8A16:
    case QGemm::kNativeFp4:
      return Yardstick::kBf16;
  }
  return Yardstick::kBf16;
}

}  // namespace infersweep
