// JSON that comes from outside the process (agents' results, checkpoint files, stored rows, the
// coordinator's assignments): parsed with a bound on nesting depth. nlohmann's parser and
// destructor do not recurse, but dump(), copies and comparisons do, so a document of a few
// megabytes of "[[[[..." would overflow the stack of whatever touches it next. The bound is
// checked by a pre-scan that costs one pass over the bytes and skips string contents.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace infersweep {

// The deepest nesting of arrays and objects accepted. The documents infersweep reads are at most
// 6 levels deep (a result's batches[].kernels.decode.launches[]; a compressed-tensors
// quantization_config); docs/SECURITY.md "Limits".
inline constexpr int kMaxJsonDepth = 64;

// OK when no array or object in `text` is nested deeper than `max_depth`; else InvalidArgument
// "<what>: JSON nested deeper than 64 levels (at byte 1234); the limit is 64". Only the
// brackets outside strings count; the text need not be valid JSON.
absl::Status CheckJsonDepth(std::string_view text, std::string_view what,
                            int max_depth = kMaxJsonDepth);

// CheckJsonDepth, then nlohmann::json::parse without exceptions: InvalidArgument
// "<what>: not valid JSON: <where and why>" when it is not JSON.
absl::StatusOr<nlohmann::json> ParseUntrustedJson(std::string_view text, std::string_view what,
                                                  int max_depth = kMaxJsonDepth);

}  // namespace infersweep
