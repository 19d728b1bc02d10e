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
  // The indices of the GPUs this one reaches by peer access (P2P), and of those linked to it by
  // NVLink; empty where unknown.
  std::vector<int> p2p_peers;
  std::vector<int> nvlink_peers;
  // TEST ONLY: a fake GPU's link kind, "nvlink", "p2p" (peer access over PCIe) or "pcie" (no
  // peer access); empty: unknown.
  std::string test_fake_link;
};

struct Inventory {
  std::string host;
  std::vector<GpuInfo> gpus;  // empty: a CPU-only agent with one CPU slot
  bool cuda_build = false;
  std::string engine_version;
  std::vector<std::string> backends;  // "axis=value" this build can run
};

// "sm_90", "sm_90a", "sm_100f", "90" -> the SM; with allow_cpu, "cpu" -> 0 (the SM CPU results
// are stored under). Nothing else: "90x", "+90", " 90", "SM_90" or "sm90" is an error naming
// the text, with the accepted spelling as a hint where there is one ("did you mean sm_90?").
absl::StatusOr<int> ParseSmArch(std::string_view text, bool allow_cpu = true);

// TEST ONLY. "NAME:SM:MEMORY_GIB[:LINK]", e.g. "NVIDIA H200:90:141" or "NVIDIA RTX PRO
// 6000:sm_120:96:pcie"; the name may contain colons. LINK, when given, is nvlink, p2p or pcie:
// fake GPUs with nvlink reach each other by NVLink, those with nvlink or p2p by peer access.
absl::StatusOr<GpuInfo> ParseFakeGpu(std::string_view text);

// The GPUs of this machine, from the engine's device probe (engine/backends.h): none in a build
// without CUDA. NVML (driver version, per-GPU names) is not wired in yet.
std::vector<GpuInfo> DetectGpus();

std::string HostName();

// Fills each GPU's p2p_peers and nvlink_peers from NVML (libnvidia-ml through dlopen), pairs
// in NVML's device order, which is the PCI bus order the slots follow when CUDA_DEVICE_ORDER is
// PCI_BUS_ID; leaves them empty where NVML is absent or does not answer.
void DetectTopology(std::vector<GpuInfo>& gpus);

// Fake GPUs' peers from their link kinds (TEST ONLY).
void FakeTopology(std::vector<GpuInfo>& gpus);

// The whole inventory. When `fake_gpus` is not empty (TEST ONLY), they replace the detected GPUs.
absl::StatusOr<Inventory> DetectInventory(const std::vector<std::string>& fake_gpus);

}  // namespace infersweep
