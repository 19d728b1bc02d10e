// Safetensors files: a bounds-checked header parser and a read-only memory map.
//
// Layout: u64 little-endian header length N, then N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data section; offsets are relative to the start of the data section.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace infersweep {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // relative to the data section
  uint64_t data_end = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct SafetensorsHeader {
  uint64_t data_offset = 0;  // absolute file offset of the data section (8 + header length)
  std::vector<SafetensorsEntry> tensors;  // sorted by data_begin
  std::map<std::string, std::string> metadata;
};

// Parses and validates the header of a safetensors file whose first `size` bytes are `bytes`
// (the whole file). Every check failure names `file` and, where known, the tensor:
// header length beyond the file, malformed JSON, unknown dtype, negative/overflowing shape,
// byte size != numel * dtype size, offsets past the end, overlapping tensors.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const uint8_t* bytes, size_t size,
                                                         std::string_view file);

// A read-only private memory map of a whole file.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// One mapped, validated safetensors file.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  const SafetensorsHeader& header() const { return header_; }
  const std::string& path() const { return file_->path(); }
  // nullptr when the file has no tensor of that name.
  const SafetensorsEntry* Find(std::string_view name) const;
  // The file's header as stored: the 8-byte length and the JSON text (the checkpoint's
  // fingerprint hashes it: names, dtypes, shapes and offsets, without reading any tensor).
  std::string_view HeaderBytes() const {
    return {reinterpret_cast<const char*>(file_->data()), header_.data_offset};
  }
  // Start of the tensor's bytes inside the map (validated at Open).
  const uint8_t* Data(const SafetensorsEntry& entry) const {
    return file_->data() + header_.data_offset + entry.data_begin;
  }

 private:
  std::unique_ptr<MappedFile> file_;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;
};

}  // namespace infersweep
