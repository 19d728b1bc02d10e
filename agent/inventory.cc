#include "agent/inventory.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "api/backend_config.h"
#include "api/status_macros.h"
#include "engine/backends.h"
#include "engine/rank_context.h"
#include "harness/executor.h"
#include "harness/gpu_sampler.h"
#include "harness/nvml_library.h"

namespace infersweep {

namespace {

// The SM of one of the accepted spellings: "sm_90", "sm_90a", "sm_100f", "90"; nullopt for
// anything else.
std::optional<int> SmOfExactForm(absl::string_view v) {
  // An architecture-specific suffix letter names the same SM; only the sm_ form carries one.
  if (absl::ConsumePrefix(&v, "sm_") && !v.empty() && (v.back() == 'a' || v.back() == 'f'))
    v.remove_suffix(1);
  const bool digits = !v.empty() && v.size() <= 4 && v.front() != '0' &&
                      std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
  int sm = 0;
  if (!digits || !absl::SimpleAtoi(v, &sm) || sm < 10 || sm > 1000) return std::nullopt;
  return sm;
}

}  // namespace

absl::StatusOr<int> ParseSmArch(std::string_view text_in, bool allow_cpu) {
  const absl::string_view text(text_in.data(), text_in.size());
  if (allow_cpu && text == "cpu") return 0;  // CPU-only hosts store their results under SM 0
  if (std::optional<int> sm = SmOfExactForm(text)) return *sm;
  // A near miss (case, whitespace, a missing '_' or suffix on the bare number) is refused too,
  // so that every spelling of an arch that is accepted means one thing; the hint names the
  // accepted spelling.
  std::string near = absl::AsciiStrToLower(text);
  std::erase_if(near, [](char c) { return absl::ascii_isspace(static_cast<unsigned char>(c)); });
  std::string hint;
  if (near == "cpu") {
    if (allow_cpu) hint = "cpu";
  } else {
    absl::string_view v = near;
    if (!absl::ConsumePrefix(&v, "sm_")) absl::ConsumePrefix(&v, "sm");
    const std::string canonical = absl::StrCat("sm_", v);
    if (SmOfExactForm(canonical)) hint = canonical;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", text, "' is not an SM architecture",
                   hint.empty() ? "" : absl::StrCat(": did you mean ", hint, "?"),
                   " (expected sm_NN, sm_NNa or NN with NN in 10..1000, e.g. sm_90, sm_90a, 90",
                   allow_cpu ? "; or cpu" : "", ")"));
}

absl::StatusOr<GpuInfo> ParseFakeGpu(std::string_view text_in) {
  absl::string_view text(text_in.data(), text_in.size());
  // An optional last field names the link kind.
  std::string link;
  for (const char* kind : {"nvlink", "p2p", "pcie"})
    if (absl::EndsWith(text, absl::StrCat(":", kind))) {
      link = kind;
      text.remove_suffix(link.size() + 1);
      break;
    }
  const auto last = text.rfind(':');
  const auto mid = last == absl::string_view::npos || last == 0 ? absl::string_view::npos
                                                                : text.rfind(':', last - 1);
  if (mid == absl::string_view::npos || mid == 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "--test-fake-gpu '", text, "': expected NAME:SM:MEMORY_GIB, e.g. \"NVIDIA H200:90:141\""));
  GpuInfo gpu;
  gpu.name = std::string(absl::StripAsciiWhitespace(text.substr(0, mid)));
  const absl::string_view sm_text = text.substr(mid + 1, last - mid - 1);
  auto sm = ParseSmArch(std::string_view(sm_text.data(), sm_text.size()), /*allow_cpu=*/false);
  if (!sm.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("--test-fake-gpu '", text, "': ", sm.status().message()));
  gpu.sm = *sm;
  double gib = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(text.substr(last + 1)), &gib) || gib <= 0 ||
      gib > 1e6)
    return absl::InvalidArgumentError(
        absl::StrCat("--test-fake-gpu '", text, "': memory must be a positive number of GiB"));
  gpu.memory_bytes = static_cast<int64_t>(gib * 1024.0 * 1024.0 * 1024.0);
  if (gpu.name.empty())
    return absl::InvalidArgumentError(absl::StrCat("--test-fake-gpu '", text, "': empty name"));
  gpu.test_fake = true;
  gpu.test_fake_link = link;
  gpu.driver_version = "test-fake";
  gpu.cuda_version = "test-fake";
  return gpu;
}

std::vector<GpuInfo> GpusOf(const LocalDevices& devices, const std::string& driver_version,
                            int slots) {
  std::vector<GpuInfo> gpus;
  if (devices.gpus.empty()) return gpus;
  for (int i = 0; i < std::max(slots, static_cast<int>(devices.gpus.size())); ++i) {
    const LocalGpu& d = devices.gpus[i < static_cast<int>(devices.gpus.size()) ? i : 0];
    GpuInfo g;
    g.index = i;
    g.name = d.name.empty() ? "GPU" : d.name;
    g.sm = d.sm;
    g.memory_bytes = d.memory_bytes;
    g.pci_bus_id = d.pci_bus_id;
    g.driver_version = driver_version;
    g.cuda_version = devices.cuda_driver_version;
    gpus.push_back(std::move(g));
  }
  return gpus;
}

std::vector<GpuInfo> DetectGpus() {
  const LocalDevices devices = ProbeLocalDevices();
  // TEST ONLY: where INFERSWEEP_RANK_DEVICES places more ranks than this host has GPUs ("0,0"),
  // the agent offers that many GPU slots, so that a tp trial is leased here and its ranks share
  // the GPUs the map names (engine/rank_context.h).
  return GpusOf(devices, NvidiaDriverVersion(),
                std::max(devices.gpu_count, TestRankDeviceCount(devices.gpu_count)));
}

void SetTopology(std::vector<GpuInfo>& gpus,
                 const std::function<PeerLink(const GpuInfo& a, const GpuInfo& b)>& link) {
  for (GpuInfo& a : gpus) {
    a.p2p_peers.clear();
    a.nvlink_peers.clear();
    for (const GpuInfo& b : gpus) {
      if (a.index == b.index || (!a.pci_bus_id.empty() && a.pci_bus_id == b.pci_bus_id)) continue;
      const PeerLink l = link(a, b);
      if (l.p2p) a.p2p_peers.push_back(b.index);
      if (l.nvlink) a.nvlink_peers.push_back(b.index);
    }
  }
}

void FakeTopology(std::vector<GpuInfo>& gpus) {
  SetTopology(gpus, [](const GpuInfo& a, const GpuInfo& b) {
    auto peer = [](const GpuInfo& g) {
      return g.test_fake_link == "nvlink" || g.test_fake_link == "p2p";
    };
    return PeerLink{peer(a) && peer(b),
                    a.test_fake_link == "nvlink" && b.test_fake_link == "nvlink"};
  });
}

void DetectTopology(std::vector<GpuInfo>& gpus) {
  if (gpus.size() < 2) return;
  for (const GpuInfo& g : gpus)
    if (g.pci_bus_id.empty()) return;
  std::unique_ptr<NvmlLibrary> nvml = NvmlLibrary::Open();
  if (!nvml || nvml->get_p2p_status == nullptr) return;
  std::map<std::string, nvml::Device> handles;
  for (const GpuInfo& g : gpus) {
    nvml::Device device = nullptr;
    if (nvml->get_handle_by_pci(g.pci_bus_id.c_str(), &device) != nvml::kSuccess) return;
    handles[g.pci_bus_id] = device;
  }
  SetTopology(gpus, [&](const GpuInfo& a, const GpuInfo& b) {
    auto reaches = [&](int caps) {
      int status = -1;
      return nvml->get_p2p_status(handles[a.pci_bus_id], handles[b.pci_bus_id], caps, &status) ==
                 nvml::kSuccess &&
             status == nvml::kP2PStatusOk;
    };
    return PeerLink{reaches(nvml::kP2PCapsRead), reaches(nvml::kP2PCapsNvlink)};
  });
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

absl::StatusOr<Inventory> DetectInventory(const std::vector<std::string>& fake_gpus) {
  Inventory inv;
  inv.host = HostName();
  inv.engine_version = EngineVersion();
  inv.cuda_build = ProbeLocalDevices().has_cuda_build;
  if (fake_gpus.empty()) {
    inv.gpus = DetectGpus();
    DetectTopology(inv.gpus);
  } else {
    for (const std::string& text : fake_gpus) {
      ASSIGN_OR_RETURN(auto gpu, ParseFakeGpu(text));
      gpu.index = static_cast<int>(inv.gpus.size());
      inv.gpus.push_back(std::move(gpu));
    }
    FakeTopology(inv.gpus);
  }
  for (const BackendDescriptor& d : BackendRegistry()) {
    if (d.needs_cuda_build && !inv.cuda_build) continue;
    if (d.test_only) continue;
    inv.backends.push_back(absl::StrCat(d.axis, "=", d.value));
  }
  return inv;
}

}  // namespace infersweep
