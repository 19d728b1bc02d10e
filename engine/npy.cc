#include "engine/npy.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace infersweep {

absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const float* data) {
  std::string dims;
  int64_t count = 1;
  for (int64_t d : shape) {
    absl::StrAppend(&dims, d, ",");
    count *= d;
  }
  if (shape.size() > 1) dims.pop_back();  // (3,) for 1-D, (3,4) otherwise
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  // Magic (6) + version (2) + length (2) + header + '\n' is padded to a multiple of 64.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  const uint16_t len = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.write(reinterpret_cast<const char*>(&len), 2);
  out.write(header.data(), header.size());
  out.write(reinterpret_cast<const char*>(data), count * sizeof(float));
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

absl::StatusOr<NpyArray> ReadNpyFloat32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a .npy file"));
  uint16_t len;
  memcpy(&len, bytes.data() + 8, 2);
  if (bytes[6] != 1 || 10u + len > bytes.size())
    return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported version or bad header"));
  const std::string header = bytes.substr(10, len);
  if (header.find("'descr': '<f4'") == std::string::npos ||
      header.find("'fortran_order': False") == std::string::npos)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected little-endian float32 in C order, header ", header));
  const size_t open = header.find("'shape': ("), close = header.find(')', open);
  if (open == std::string::npos || close == std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat(path, ": header has no shape"));
  NpyArray array;
  int64_t count = 1;
  for (absl::string_view dim :
       absl::StrSplit(header.substr(open + 10, close - open - 10), ',', absl::SkipWhitespace())) {
    int64_t d;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(dim), &d) || d < 0)
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad shape in header ", header));
    array.shape.push_back(d);
    count *= d;
  }
  const size_t offset = 10 + len;
  if (bytes.size() - offset != static_cast<size_t>(count) * sizeof(float))
    return absl::InvalidArgumentError(absl::StrCat(path, ": data is ", bytes.size() - offset,
                                                   " bytes, shape needs ", count * 4));
  array.data.resize(count);
  memcpy(array.data.data(), bytes.data() + offset, count * sizeof(float));
  return array;
}

}  // namespace infersweep
