// Device pieces shared by the Gated DeltaNet kernels (gated_delta.cu, gated_delta_chunked.cu).
#pragma once

#include "kernels/cuda/gated_delta.h"

namespace infersweep::cuda {

// Sequence seq's state slot (GatedDeltaShape::ragged), and whether it starts from zero states.
struct SequenceState {
  int slot;
  bool fresh;
};
__device__ __forceinline__ SequenceState StateOf(const int2* ragged, int seq, int n) {
  if (ragged == nullptr) return {seq, false};
  const int2 first = ragged[static_cast<int64_t>(seq) * n];
  return {first.x, first.y == 0};
}

}  // namespace infersweep::cuda
