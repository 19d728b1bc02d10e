// The engine on one NVIDIA GPU: weights resident on the device (synthetic ones generated there),
// a KV cache, and per-axis choices (engine/options.h) of GEMM, attention, MoE runner, CUDA
// graphs and quantized GEMM.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/fault_injection.h"
#include "engine/model.h"
#include "engine/options.h"
#include "engine/weights.h"

namespace infersweep {

// Why `config` with `weights`-format weights cannot run under `options` on this GPU: what the
// kernels need of the model's shapes and layer kinds (flash's head_dim, the device-routed MoE
// runners' sizes, graphs=persistent's layers and shapes); empty when they can. MakeCudaModel
// answers Unimplemented (UNSUPPORTED to the harness) with it. Conflicts between axis values are
// the registry's (RegistryConflict), not repeated here.
std::string CudaModelRefusal(const ModelConfig& config, QuantFormat weights,
                             const CudaOptions& options);

// Uploads (or generates) `host`'s weights once per HostModel; every model built on the same host
// model shares them. `host` must outlive the model. `options` must hold no registry conflict
// (CreateModel refuses those first); the model's own refusals come back as Unimplemented.
// `fault` is TEST ONLY.
absl::StatusOr<std::unique_ptr<Model>> MakeCudaModel(HostModel& host, const CudaOptions& options,
                                                     const FaultInjection& fault = {});

// Tests: the raw bytes of tensor `index` (spec order) as resident on the device.
absl::StatusOr<std::vector<uint8_t>> CopyDeviceTensorToHost(HostModel& host, size_t index);

}  // namespace infersweep
