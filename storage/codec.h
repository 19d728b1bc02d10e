// How a result's JSON is kept in SQLite: deflated against a fixed dictionary of the result
// schema's field names, behind a one-byte codec tag (docs/STORAGE.md "Compressed results").
// A stored result shrinks about 6x; reading one costs a few microseconds.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace infersweep {

// Tag 0x01 + a zlib stream made with kResultDictionaryV1 as the preset dictionary.
std::string CompressResultJson(std::string_view json);
// The JSON text back; DataLoss for an unknown tag or a damaged stream (what is wrong is said).
absl::StatusOr<std::string> DecompressResultJson(std::string_view blob);

}  // namespace infersweep
