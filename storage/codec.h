// How a result's JSON is kept in SQLite: deflated against a fixed dictionary of the result
// schema's field names, behind a one-byte codec tag (docs/STORAGE.md "Compressed results").
// A stored result shrinks about 6x; reading one costs a few microseconds.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infersweep {

// Tag 0x01 + a zlib stream made with kResultDictionaryV1 as the preset dictionary.
std::string CompressResultJson(std::string_view json);
// The JSON text back; DataLoss for an unknown tag or a damaged stream (what is wrong is said).
absl::StatusOr<std::string> DecompressResultJson(std::string_view blob);

// A stored result's JSON keeps each batch's kernel log by reference, "kernels_ref":ID (the logs
// are interned in the kernel_logs table); this puts "kernels":LOG back for each, with `log`
// giving a log's JSON text by id (DataLoss naming `where` and the id when it has none). The
// token can only be a key: inside a JSON string its quotes would be escaped.
absl::StatusOr<std::string> ExpandKernelLogRefs(
    std::string text, const std::function<absl::StatusOr<std::string>(int64_t)>& log);

// The same JSON with every "kernels_ref":ID member removed, for readers that do not want the
// kernel logs (they are most of a GPU result's bytes).
std::string StripKernelLogRefs(std::string text);

// JSON text read back from the database (a result, a trial's workload or selector), parsed as
// untrusted JSON: DataLoss "stored <what>: ..." when it does not parse.
absl::StatusOr<nlohmann::json> ParseStoredJson(const std::string& text, absl::string_view what);

}  // namespace infersweep
