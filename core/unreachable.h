// Unreachable: a case that a plan rules out happened anyway. A broken invariant after start-up
// crashes loudly, naming it, rather than running something else.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace infersweep {

[[noreturn]] inline void Unreachable(const char* what) {
  std::fprintf(stderr, "infersweep: unreachable: %s\n", what);
  std::abort();
}

}  // namespace infersweep
