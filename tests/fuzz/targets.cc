#include "tests/fuzz/targets.h"

namespace infersweep::fuzz {

const std::vector<FuzzTarget>& Targets() {
  static const std::vector<FuzzTarget> targets = [] {
    std::vector<FuzzTarget> all;
    for (auto* group : {&StringTargets, &CheckpointTargets, &ServiceTargets})
      for (FuzzTarget& t : group()) all.push_back(std::move(t));
    return all;
  }();
  return targets;
}

}  // namespace infersweep::fuzz
