#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <new>
#include <set>
#include <system_error>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/status_macros.h"
#include "api/untrusted_json.h"
#include "nlohmann/json.hpp"

namespace infersweep {
namespace {

using json = nlohmann::json;

// The reference implementation caps headers at 100 MB; a larger prefix is garbage, not a model.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Parser messages quote the offending token, which can be the rest of a huge header.
constexpr size_t kMaxQuotedChars = 200;

// This abseil build's absl::string_view is not std::string_view; StrCat needs the former.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

std::string Shorten(absl::string_view s) {
  if (s.size() <= kMaxQuotedChars) return std::string(s);
  return absl::StrCat(s.substr(0, kMaxQuotedChars), "...");
}

std::string FormatShape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status TensorError(absl::string_view file, absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": tensor '", Shorten(tensor), "': ", what));
}

// Validates one header entry against the data section size. Everything except the overlap check
// (which needs all entries) happens here.
absl::StatusOr<SafetensorsEntry> ParseEntry(absl::string_view file, const std::string& name,
                                            const json& v, uint64_t data_size) {
  if (!v.is_object()) {
    return TensorError(file, name, absl::StrCat("entry must be an object, found ", v.type_name()));
  }
  SafetensorsEntry entry;
  entry.name = name;

  // dtype
  const auto dtype_it = v.find("dtype");
  if (dtype_it == v.end()) return TensorError(file, name, "missing \"dtype\"");
  if (!dtype_it->is_string()) {
    return TensorError(file, name,
                       absl::StrCat("\"dtype\" must be a string, found ", dtype_it->type_name()));
  }
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  const std::optional<DType> dtype = DTypeFromSafetensorsName(dtype_name);
  if (!dtype) {
    return TensorError(file, name, absl::StrCat("unknown dtype '", Shorten(dtype_name), "'"));
  }
  entry.dtype = *dtype;

  // shape, with a checked element count
  const auto shape_it = v.find("shape");
  if (shape_it == v.end()) return TensorError(file, name, "missing \"shape\"");
  if (!shape_it->is_array()) {
    return TensorError(file, name,
                       absl::StrCat("\"shape\" must be an array, found ", shape_it->type_name()));
  }
  int64_t numel = 1;
  for (size_t i = 0; i < shape_it->size(); ++i) {
    const json& d = (*shape_it)[i];
    int64_t dim = 0;
    if (d.is_number_unsigned()) {
      const uint64_t u = d.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return TensorError(file, name, absl::StrCat("shape[", i, "] = ", u, " is too large"));
      }
      dim = static_cast<int64_t>(u);
    } else if (d.is_number_integer()) {  // signed and not unsigned: negative
      return TensorError(file, name,
                         absl::StrCat("shape[", i, "] = ", d.get<int64_t>(), " is negative"));
    } else {
      return TensorError(file, name,
                         absl::StrCat("shape[", i, "] must be an integer, found ", d.type_name()));
    }
    if (__builtin_mul_overflow(numel, dim, &numel)) {
      return TensorError(file, name, "shape element count overflows 64 bits");
    }
    entry.shape.push_back(dim);
  }

  // data_offsets
  const auto off_it = v.find("data_offsets");
  if (off_it == v.end()) return TensorError(file, name, "missing \"data_offsets\"");
  if (!off_it->is_array() || off_it->size() != 2 || !(*off_it)[0].is_number_unsigned() ||
      !(*off_it)[1].is_number_unsigned()) {
    return TensorError(file, name, "\"data_offsets\" must be [begin, end] of unsigned integers");
  }
  const uint64_t begin = (*off_it)[0].get<uint64_t>();
  const uint64_t end = (*off_it)[1].get<uint64_t>();
  const std::string offsets = absl::StrCat("data_offsets [", begin, ", ", end, "]");
  if (begin > end) return TensorError(file, name, absl::StrCat(offsets, " begin > end"));
  if (end > data_size) {
    // Usually a truncated download, so DataLoss rather than InvalidArgument.
    return absl::DataLossError(absl::StrCat(file, ": tensor '", Shorten(name), "': ", offsets,
                                            " end past data section of ", data_size, " bytes"));
  }
  uint64_t want_bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel),
                             static_cast<uint64_t>(DTypeSize(entry.dtype)), &want_bytes)) {
    return TensorError(file, name, "shape byte size overflows 64 bits");
  }
  if (end - begin != want_bytes) {
    return TensorError(
        file, name,
        absl::StrCat(offsets, " span ", end - begin, " bytes but ", Sv(DTypeName(entry.dtype)), " ",
                     FormatShape(entry.shape), " needs ", want_bytes));
  }
  entry.data_begin = begin;
  entry.data_end = end;
  return entry;
}

absl::StatusOr<SafetensorsHeader> ParseHeaderJson(const uint8_t* json_begin, uint64_t json_size,
                                                  uint64_t data_size, absl::string_view file) {
  // nlohmann keeps only the last of duplicate keys; record top-level keys as they stream past
  // so that a tensor listed twice is an error instead of silently losing one copy.
  std::set<std::string, std::less<>> keys;
  std::string duplicate;
  json::parser_callback_t track_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!keys.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };

  const std::string_view text(reinterpret_cast<const char*>(json_begin), json_size);
  RETURN_IF_ERROR(CheckJsonDepth(text, absl::StrCat(file, ": header")));
  json root;
  try {
    root = json::parse(text, track_keys);
  } catch (const json::exception& e) {  // out_of_range too: a number that overflows a double
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": header is not valid JSON: ", Shorten(e.what())));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": header must be a JSON object, found ", root.type_name()));
  }
  if (!duplicate.empty()) {
    return TensorError(file, duplicate, "listed more than once in the header");
  }

  SafetensorsHeader header;
  header.data_offset = 8 + json_size;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": \"__metadata__\" must be an object, found ", value.type_name()));
      }
      for (const auto& [mkey, mvalue] : value.items()) {
        if (!mvalue.is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(file, ": \"__metadata__\" value for '", Shorten(mkey),
                           "' must be a string, found ", mvalue.type_name()));
        }
        header.metadata[mkey] = mvalue.get<std::string>();
      }
      continue;
    }
    ASSIGN_OR_RETURN(SafetensorsEntry entry, ParseEntry(file, key, value, data_size));
    header.tensors.push_back(std::move(entry));
  }

  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return std::tie(a.data_begin, a.data_end, a.name) <
                     std::tie(b.data_begin, b.data_end, b.name);
            });
  // Empty tensors occupy no bytes, so they cannot overlap anything; only nonempty ranges count.
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry& t : header.tensors) {
    if (t.data_begin == t.data_end) continue;
    if (prev != nullptr && t.data_begin < prev->data_end) {
      return TensorError(
          file, t.name,
          absl::StrCat("data_offsets [", t.data_begin, ", ", t.data_end, "] overlap tensor '",
                       Shorten(prev->name), "' [", prev->data_begin, ", ", prev->data_end, "]"));
    }
    prev = &t;
  }
  return header;
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const uint8_t* bytes, size_t size,
                                                         std::string_view file_name) {
  const absl::string_view file = Sv(file_name);
  if (bytes == nullptr && size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": null buffer"));
  }
  if (size < 8) {
    return absl::DataLossError(
        absl::StrCat(file, ": file is ", size, " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes, " bytes"));
  }
  if (header_len > size - 8) {
    return absl::DataLossError(absl::StrCat(file, ": header length ", header_len,
                                            " runs past the end of the file (", size,
                                            " bytes); truncated?"));
  }
  const uint64_t data_size = size - 8 - header_len;
  // Nothing below should throw (json errors are caught inside), but a header full of huge
  // arrays can still run out of memory; report that rather than abort.
  try {
    return ParseHeaderJson(bytes + 8, header_len, data_size, file);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": bad header: ", Shorten(e.what())));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(file, ": out of memory parsing header"));
  }
}

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  auto errno_status = [&path](int err, absl::string_view what) {
    return absl::Status(absl::ErrnoToStatusCode(err),
                        absl::StrCat(path, ": ", what, ": ", std::generic_category().message(err)));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, "cannot open");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return errno_status(err, "cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  if (st.st_size == 0) {
    // mmap of length 0 fails with EINVAL; say what is actually wrong.
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": empty file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping holds its own reference to the file
  if (p == MAP_FAILED) return errno_status(err, "cannot mmap");
  return std::unique_ptr<MappedFile>(new MappedFile(path, static_cast<const uint8_t*>(p), size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> mapped, MappedFile::Open(path));
  ASSIGN_OR_RETURN(SafetensorsHeader header,
                   ParseSafetensorsHeader(mapped->data(), mapped->size(), path));

  auto out = std::make_unique<SafetensorsFile>();
  out->file_ = std::move(mapped);
  out->header_ = std::move(header);
  for (size_t i = 0; i < out->header_.tensors.size(); ++i) {
    out->index_.emplace(out->header_.tensors[i].name, i);
  }
  return out;
}

const SafetensorsEntry* SafetensorsFile::Find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

}  // namespace infersweep
