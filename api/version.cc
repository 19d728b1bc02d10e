// The version string every result and agent carries: the project's version and `git describe`
// of the tree it was built from (written at build time by cmake/write_version.cmake).
#include "api/version.h"

#include "infersweep_version.h"

namespace infersweep {

std::string EngineVersion() { return "infersweep " INFERSWEEP_GIT_DESCRIBE; }

}  // namespace infersweep
