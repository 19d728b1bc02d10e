#include "engine/safetensors_writer.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <set>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace infersweep {
namespace {

using json = nlohmann::json;

// This abseil build's absl::string_view is not std::string_view; StrCat needs the former.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status ErrnoError(int err, absl::string_view what, const std::string& path) {
  return absl::Status(absl::ErrnoToStatusCode(err),
                      absl::StrCat(path, ": ", what, ": ", std::generic_category().message(err)));
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> EncodeSafetensorsHeader(
    const std::vector<SafetensorsTensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const SafetensorsTensorToWrite& t : tensors) {
    if (t.name.empty()) return absl::InvalidArgumentError("tensor with an empty name");
    if (t.name == "__metadata__") {
      return absl::InvalidArgumentError("'__metadata__' is reserved, not a tensor name");
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' given twice"));
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", t.name, "': negative dimension ", d));
      }
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': shape overflows"));
      }
    }
    uint64_t want = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(t.dtype)), &want) ||
        want != t.bytes.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': ", t.bytes.size(),
                                                     " bytes given, ", Sv(DTypeName(t.dtype)),
                                                     " shape needs ", want));
    }
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + want}}};
    offset += want;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::string text;
  try {
    // Strict: names must be valid UTF-8, as every safetensors reader requires.
    text = header.dump(-1, ' ', false, json::error_handler_t::strict);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("cannot encode header: ", e.what()));
  }
  // Pad so the data section starts 8-byte aligned (readers may then view tensors in place).
  text.append((8 - text.size() % 8) % 8, ' ');

  std::vector<uint8_t> out(8 + text.size());
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::copy(text.begin(), text.end(), out.begin() + 8);
  return out;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::vector<uint8_t>> header = EncodeSafetensorsHeader(tensors, metadata);
  if (!header.ok()) {
    return absl::Status(header.status().code(),
                        absl::StrCat(path, ": ", header.status().message()));
  }
  const std::string tmp = absl::StrCat(path, ".partial.", ::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return ErrnoError(errno, "cannot create", tmp);

  auto write = [f](const void* data, size_t size) {
    return size == 0 || std::fwrite(data, 1, size, f) == size;
  };
  bool ok = write(header->data(), header->size());
  for (size_t i = 0; ok && i < tensors.size(); ++i) {
    ok = write(tensors[i].bytes.data(), tensors[i].bytes.size());
  }
  const int write_errno = errno;
  // fclose flushes, so its failure is a write failure too.
  if (std::fclose(f) != 0 && ok) {
    const absl::Status s = ErrnoError(errno, "cannot write", tmp);
    std::remove(tmp.c_str());
    return s;
  }
  if (!ok) {
    std::remove(tmp.c_str());
    return ErrnoError(write_errno, "cannot write", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status s = ErrnoError(errno, "cannot rename into place", tmp);
    std::remove(tmp.c_str());
    return s;
  }
  return absl::OkStatus();
}

}  // namespace infersweep
