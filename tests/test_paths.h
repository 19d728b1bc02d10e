// Paths the tests need: the source tree (fixtures) and the built `infersweep` binary (workers,
// CLI). Compiled in by tests/CMakeLists.txt; the environment overrides them where tests run from
// another tree (the GPU machine, scripts/gpu.sh).
#pragma once

#include <cstdlib>
#include <string>

namespace infersweep {

inline std::string SourceDir() {
  const char* env = std::getenv("INFERSWEEP_SOURCE_DIR");
  return env ? env : INFERSWEEP_SOURCE_DIR;
}

inline std::string WorkerBinary() {
  const char* env = std::getenv("INFERSWEEP_BINARY");
  return env ? env : INFERSWEEP_BINARY;
}

}  // namespace infersweep
