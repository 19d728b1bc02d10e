// What the coordinator knows of a connected agent's capacity, as the agent sessions, the
// scheduler and the user API all read it: the slots a Hello offers (SlotInfo), the inventory a
// Hello fixes for its stream's life (AgentInventory), and whether a trial's selector takes a slot
// (SelectorMatcher).
//
// Private to coordinator/.
#pragma once

#include <re2/re2.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "proto/infersweep.pb.h"
#include "storage/store.h"

namespace infersweep::coordinator {

// What one agent slot offers: a GPU, or the CPU slot of a CPU-only agent.
struct SlotInfo {
  int index = 0;
  bool gpu = false;
  std::string gpu_name;  // "cpu" for the CPU slot
  int sm = 0;
  int64_t memory_bytes = 0;
  std::vector<int> p2p_peers;  // the slots this GPU reaches by peer access
};

// A connected agent as its Hello describes it. Fixed once its stream is admitted, so a holder of
// it reads it without the sessions' lock.
struct AgentInventory {
  std::string agent_id;
  v1::Hello hello;  // without its token and its list of spooled results
  std::vector<SlotInfo> slots;
  int gpu_count = 0;
};

// The inventory a validated Hello describes: one slot a GPU, or the CPU slot of a CPU-only agent.
AgentInventory InventoryOf(const v1::Hello& hello);

// Free slots per connected agent (agent id -> slot indices), for one scheduling pass.
using FreeSlots = std::map<std::string, std::vector<int>>;

// Whether a trial's selector takes a slot: the device, the SM archs, the memory and the GPU-name
// pattern (RE2, compiled once per pattern). Thread-safe.
class SelectorMatcher {
 public:
  bool Matches(const Selector& selector, const SlotInfo& slot);

 private:
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<re2::RE2>> regex_cache_;  // nullptr: does not compile
};

// The selector in words, for a status line: "device cuda, sm [90], gpus 2".
std::string DescribeSelector(const Selector& selector);

}  // namespace infersweep::coordinator
