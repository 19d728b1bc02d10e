// What an agent offers: its host, its GPUs (or one CPU slot), and the backends its build runs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace infersweep {

struct GpuInfo {
  int index = 0;
  std::string name;
  int sm = 0;  // 90 for sm_90
  int64_t memory_bytes = 0;
  std::string driver_version;
  std::string cuda_version;
  bool test_fake = false;  // labelled with --test-fake-gpu: a CPU pretending, for tests only
};

struct Inventory {
  std::string host;
  std::vector<GpuInfo> gpus;  // empty: a CPU-only agent with one CPU slot
  bool cuda_build = false;
  std::string engine_version;
  std::vector<std::string> backends;  // "axis=value" this build can run
};

// "sm_90", "90", "sm_90a", "SM90" -> 90; "cpu" -> 0 (the SM CPU results are stored under). The
// whole word must be an arch: "90x", "+90" or "sm_90zzz" is an error naming the text.
absl::StatusOr<int> ParseSmArch(std::string_view text);

// TEST ONLY. "NAME:SM:MEMORY_GIB", e.g. "NVIDIA H200:90:141" or "NVIDIA RTX PRO 6000:sm_120:96";
// the name may contain colons, the last two fields are the arch and the memory in GiB.
absl::StatusOr<GpuInfo> ParseFakeGpu(std::string_view text);

// The GPUs of this machine, from the engine's device probe (engine/backends.h): none in a build
// without CUDA. NVML (driver version, per-GPU names) is not wired in yet.
std::vector<GpuInfo> DetectGpus();

std::string HostName();

// The whole inventory. When `fake_gpus` is not empty (TEST ONLY), they replace the detected GPUs.
absl::StatusOr<Inventory> DetectInventory(const std::vector<std::string>& fake_gpus);

}  // namespace infersweep
