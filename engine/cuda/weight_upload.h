// The model's weights on the device: uploaded (or generated) once per HostModel and shared by
// every CudaModel built on it, and each model's own view of quantized weights (the qgemm axis's
// form of them, with the expert tables the device-routed MoE runners index).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/device_util.h"
#include "engine/fault_injection.h"
#include "engine/options.h"
#include "engine/weights.h"
#include "kernels/cuda/gemm_scaled.h"
#include "kernels/cuda/quant.h"

namespace infersweep {

// The model's weights on the device, shared by every CudaModel of one HostModel.
struct DeviceWeights {
  DeviceAllocations buffers;        // the weights and the tables below
  std::vector<HostTensor> tensors;  // device pointers, parallel to the specs
  ModelWeights weights;
  // Per MoE layer: device tables of expert weight pointers for the device-indexed kernels, one
  // entry an expert and one more (index num_experts) for the shared expert where
  // SharedExpertFitsExpertTables (shared_in_table[l]), null otherwise.
  std::vector<const uint16_t**> gate_table, up_table, down_table;
  std::vector<bool> shared_in_table;
  double load_seconds = 0;
};

// `host`'s weights on the device, uploaded (or generated in place) at the first call and kept in
// host.device_weights for the next.
absl::StatusOr<std::shared_ptr<DeviceWeights>> UploadWeights(HostModel& host);

// A tensor-parallel rank's shard (ShardHostModel's weights, on the host) on the device: every
// matrix copied as it is (a quantized one as its codes, scale tensor and global and input scales,
// as UploadWeights places a checkpoint's), a layer's q, k and v back to back when all three are
// bf16 (one GEMM, as UploadWeights places them), zero-centred norms (known by their pointers into
// `host`'s tensors) as UploadWeights makes them, and the expert pointer tables.
absl::StatusOr<std::shared_ptr<DeviceWeights>> UploadShardWeights(const HostModel& host,
                                                                  const ModelWeights& shard);

// A model's own view of quantized weights (dequant_bf16: bf16 copies; reference, w4a16, w8a16,
// fp8_cublaslt, native_fp4: the codes as uploaded), with the TEST ONLY bad-quant-scale fault
// applied to it alone, so the shared weights (and the reference built on them) stay intact.
struct QuantView {
  ModelWeights weights;
  DeviceAllocations buffers;  // the view's copies and scales, and the tables below
  // fp8_cublaslt, native_fp4, cudnn: the library GEMM, scales in its layouts
  std::unique_ptr<cuda::QuantLinearGemm> scaled;
  // moe=fused, per layer (empty for dense layers), built from `weights` so that the fault shows
  // there too: device pointer tables of dequant_bf16's bf16 copies of the experts, or the
  // quantized experts' tables (gate, up, down) for w4a16 / w8a16; each with the shared expert's
  // entry as DeviceWeights' tables have it (shared_in_table).
  std::vector<const uint16_t**> gate_table, up_table, down_table;
  std::vector<std::array<cuda::QuantExpertTable, 3>> quant_tables;
  std::vector<bool> shared_in_table;
};

// The view of a quantized model's weights for `options.qgemm` (and the TEST ONLY
// bad-quant-scale `fault`): scaled-GEMM layouts, bf16 copies, or the codes as uploaded; with
// the expert tables when a device-routed MoE runner reads them. `host` is the model `dw` holds:
// a tensor-parallel rank's shard (RankShard::host, its config the rank's shapes), which takes no
// bad-quant-scale fault (the fault names a tensor of the whole model).
absl::StatusOr<std::unique_ptr<QuantView>> BuildQuantView(HostModel& host, const DeviceWeights& dw,
                                                          const CudaOptions& options,
                                                          const FaultInjection& fault);

}  // namespace infersweep
