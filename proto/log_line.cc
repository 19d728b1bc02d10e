#include "proto/log_line.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace infersweep {

std::string LogTimestamp(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", t, absl::UTCTimeZone());
}

std::string LogLine(absl::string_view tag, absl::string_view text) {
  return absl::StrCat(LogTimestamp(absl::Now()), " [", tag, "] ", text);
}

void WriteLogLine(absl::string_view tag, absl::string_view text) {
  const std::string line = absl::StrCat(LogLine(tag, text), "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace infersweep
