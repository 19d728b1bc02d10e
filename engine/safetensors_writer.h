// Writes safetensors files: tests build fixtures with it, and synthetic checkpoints are saved
// through it. The output is what engine/safetensors.h parses (and what the HF reader accepts).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace infersweep {

struct SafetensorsTensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  // Raw little-endian element bytes, numel * DTypeSize(dtype) of them. Not owned: the caller
  // keeps the memory alive until the write returns (so large weights are never copied).
  std::span<const uint8_t> bytes;
};

// The first part of a safetensors file: the u64 little-endian header length followed by the JSON
// header, padded with spaces to a multiple of 8 bytes. Tensor data follows in `tensors` order,
// packed without gaps. Rejects empty or duplicate names, the reserved name "__metadata__",
// negative dimensions and byte counts that do not match dtype and shape.
absl::StatusOr<std::vector<uint8_t>> EncodeSafetensorsHeader(
    const std::vector<SafetensorsTensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// Writes header and data to `path` (through a temporary file renamed into place, so a failed
// write never leaves a half-written file under the final name).
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace infersweep
