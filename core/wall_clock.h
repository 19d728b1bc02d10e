// The wall clock as Unix milliseconds: what results, leases and spooled records are stamped with.
#pragma once

#include <chrono>
#include <cstdint>

namespace infersweep {

inline int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace infersweep
