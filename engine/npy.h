// NumPy .npy files (format 1.0, little-endian float32, C order): what `infersweep logits` writes
// and what the transformers fixtures are stored as.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace infersweep {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const float* data);
// Reads a '<f4' C-order array; errors name the file and what was wrong.
absl::StatusOr<NpyArray> ReadNpyFloat32(const std::string& path);

}  // namespace infersweep
