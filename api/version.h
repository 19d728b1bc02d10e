// The engine's version, as every result and agent carries it.
#pragma once

#include <string>

namespace infersweep {

// "infersweep <git describe>" of the tree this binary was built from (cmake/write_version.cmake).
std::string EngineVersion();

}  // namespace infersweep
