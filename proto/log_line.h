// The one form of every log line the coordinator and the agent write (docs/OBSERVABILITY.md
// "Logs"): "2026-12-02T03:04:05.678Z [coordinator] sweep 3 submitted", an RFC 3339 UTC timestamp
// with milliseconds, the process's tag in brackets, then the text.
#pragma once

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace infersweep {

// `t` as RFC 3339 in UTC with milliseconds: "2026-12-02T03:04:05.678Z".
std::string LogTimestamp(absl::Time t);
// "<LogTimestamp(now)> [<tag>] <text>", without a newline.
std::string LogLine(absl::string_view tag, absl::string_view text);
// Writes LogLine(tag, text) and a newline to stderr in one write.
void WriteLogLine(absl::string_view tag, absl::string_view text);

}  // namespace infersweep
