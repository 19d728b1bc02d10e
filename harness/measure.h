// Latency and throughput of one batch size, measured after warm-up, median over repeats.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model.h"
#include "harness/gpu_sampler.h"
#include "api/trial.h"

namespace infersweep {

struct MeasureOptions {
  std::optional<double> bandwidth_gb_s;  // for % of roofline; nullopt when unknown
  std::optional<double> bf16_tflops;     // for % of the prefill (compute) roofline
  double bytes_per_weight = 2;           // bf16
  double quantized_bytes_per_weight = 0; // quantized linears, scales included; 0: not quantized
  double bytes_per_kv_element = 4;       // fp32 KV on the CPU
  std::function<void(const std::string&)> progress;
  GpuEnergyMeter* energy = nullptr;  // the GPU's energy counter; null on the CPU / without NVML
};

// Runs warmup + repeats of [prefill prompt_len tokens, then output_len - 1 decode steps] for
// `batch` sequences. Every sequence gets a distinct deterministic prompt. Timing: the model's
// device timer (CUDA events around each step) when it has one, else the wall clock around each
// Forward, which returns host logits (so GPU work is complete when it returns). What the engine
// ran (BatchFigures::prefill_kernels, decode_kernels) is recorded in untimed steps only: the last
// warm-up repeat's prefill and last decode step, or with no warm-up one more prefill and decode
// step after the timed repeats.
absl::StatusOr<BatchFigures> MeasureBatch(Model& model, const Workload& workload, int batch,
                                          const MeasureOptions& options);

// Nearest-rank percentile of unsorted values (p in [0, 100]).
double Percentile(std::vector<double> values, double p);

}  // namespace infersweep
