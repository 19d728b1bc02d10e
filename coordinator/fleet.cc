#include "coordinator/fleet.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/untrusted_regex.h"

namespace infersweep::coordinator {

AgentInventory InventoryOf(const v1::Hello& hello) {
  AgentInventory inventory;
  inventory.agent_id = hello.agent_id();
  inventory.hello = hello;
  inventory.hello.clear_auth_token();
  inventory.hello.clear_spooled();
  if (hello.gpus_size() == 0) {
    inventory.slots.push_back(SlotInfo{0, false, "cpu", 0, 0});
  } else {
    for (const v1::Gpu& g : hello.gpus())
      inventory.slots.push_back(SlotInfo{g.index(),
                                         true,
                                         g.name(),
                                         g.sm(),
                                         g.memory_bytes(),
                                         {g.p2p_peers().begin(), g.p2p_peers().end()}});
    inventory.gpu_count = hello.gpus_size();
  }
  return inventory;
}

bool SelectorMatcher::Matches(const Selector& sel, const SlotInfo& slot) {
  // CPU trials run on the host's CPU, so any slot can take one; CUDA trials need a GPU slot.
  if (sel.device != Device::kCpu && !slot.gpu) return false;
  if (!sel.sm_archs.empty() &&
      std::find(sel.sm_archs.begin(), sel.sm_archs.end(), slot.sm) == sel.sm_archs.end())
    return false;
  if (sel.min_memory_bytes > 0 && slot.memory_bytes < sel.min_memory_bytes) return false;
  if (!sel.gpu_name_regex.empty()) {
    const re2::RE2* re = nullptr;
    {
      // Entries are never removed, so a compiled pattern outlives the lock (RE2 matches from
      // any thread).
      std::lock_guard<std::mutex> lock(mu_);
      auto it = regex_cache_.find(sel.gpu_name_regex);
      if (it == regex_cache_.end()) {
        // Validated at submit; a stored pattern that no longer compiles matches nothing.
        absl::StatusOr<std::unique_ptr<re2::RE2>> compiled =
            CompileUntrustedRegex(sel.gpu_name_regex);
        it =
            regex_cache_.emplace(sel.gpu_name_regex, compiled.ok() ? *std::move(compiled) : nullptr)
                .first;
      }
      re = it->second.get();
    }
    if (re == nullptr || !RegexSearch(*re, slot.gpu_name)) return false;
  }
  return true;
}

std::string DescribeSelector(const Selector& s) {
  std::vector<std::string> parts = {absl::StrCat("device ", DeviceName(s.device))};
  if (!s.sm_archs.empty())
    parts.push_back(absl::StrCat("sm [", absl::StrJoin(s.sm_archs, ", "), "]"));
  if (!s.gpu_name_regex.empty()) parts.push_back(absl::StrCat("gpu_name '", s.gpu_name_regex, "'"));
  if (s.min_memory_bytes > 0)
    parts.push_back(absl::StrCat("min_memory_gb ", static_cast<double>(s.min_memory_bytes) / 1e9));
  if (s.gpus_needed > 1) parts.push_back(absl::StrCat("gpus ", s.gpus_needed));
  if (s.needs_p2p) parts.push_back("p2p");
  return absl::StrJoin(parts, ", ");
}

}  // namespace infersweep::coordinator
