// What an agent offers: its host, its GPUs (or one CPU slot), and the backends its build runs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace infersweep {

struct LocalDevices;  // engine/backends.h

struct GpuInfo {
  int index = 0;
  std::string name;
  int sm = 0;  // 90 for sm_90
  int64_t memory_bytes = 0;
  std::string driver_version;  // the NVIDIA driver's ("580.65.06"), from NVML
  std::string cuda_version;    // the CUDA version the driver supports ("13.0")
  std::string pci_bus_id;      // "0000:3b:00.0"; empty for fake GPUs
  bool test_fake = false;      // labelled with --test-fake-gpu: a CPU pretending, for tests only
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

// A slot per CUDA device of `devices`, in CUDA's numbering (the one CUDA_VISIBLE_DEVICES gives
// the agent's workers), each with its own name, SM, memory and PCI bus id, so a host of mixed
// GPUs offers each as what it is; `driver_version` (NVML's) and the CUDA version on each.
// TEST ONLY: `slots` past the device count (INFERSWEEP_RANK_DEVICES placing several ranks on one
// GPU) are copies of GPU 0.
std::vector<GpuInfo> GpusOf(const LocalDevices& devices, const std::string& driver_version,
                            int slots);

// The GPUs of this machine: GpusOf the engine's device probe (engine/backends.h) and NVML's
// driver version; none in a build without CUDA.
std::vector<GpuInfo> DetectGpus();

std::string HostName();

// How GPU a reaches GPU b.
struct PeerLink {
  bool p2p = false;     // peer access
  bool nvlink = false;  // over NVLink
};
// Sets each GPU's p2p_peers and nvlink_peers from `link`, over every ordered pair of slots that
// are different GPUs (slots sharing a PCI bus id, TEST ONLY copies, are no peers of each other).
void SetTopology(std::vector<GpuInfo>& gpus,
                 const std::function<PeerLink(const GpuInfo& a, const GpuInfo& b)>& link);

// SetTopology from NVML (libnvidia-ml through dlopen), each slot found by its PCI bus id, so
// CUDA's numbering need not be NVML's; leaves the peers empty where NVML is absent, does not
// answer, or a slot has no bus id.
void DetectTopology(std::vector<GpuInfo>& gpus);

// Fake GPUs' peers from their link kinds (TEST ONLY).
void FakeTopology(std::vector<GpuInfo>& gpus);

// The whole inventory. When `fake_gpus` is not empty (TEST ONLY), they replace the detected GPUs.
absl::StatusOr<Inventory> DetectInventory(const std::vector<std::string>& fake_gpus);

}  // namespace infersweep
