#include "api/untrusted_json.h"
#include "api/status_macros.h"

#include "absl/strings/str_cat.h"

namespace infersweep {
namespace {

// This Abseil's absl::string_view is not std::string_view; StrCat takes the former.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace

absl::Status CheckJsonDepth(std::string_view text, std::string_view what, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > max_depth)
          return absl::InvalidArgumentError(absl::StrCat(Sv(what), ": JSON nested deeper than ",
                                                         max_depth, " levels (at byte ", i,
                                                         "); the limit is ", max_depth));
        break;
      case ']':
      case '}':
        // Unbalanced closers are the parser's to report; depth only needs an upper bound.
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::json> ParseUntrustedJson(std::string_view text, std::string_view what,
                                                  int max_depth) {
  RETURN_IF_ERROR(CheckJsonDepth(text, what, max_depth));
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // Drop nlohmann's "[json.exception.parse_error.101] " tag; keep where and why.
    std::string_view detail = e.what();
    if (!detail.empty() && detail.front() == '[') {
      if (const size_t close = detail.find("] "); close != std::string_view::npos)
        detail.remove_prefix(close + 2);
    }
    return absl::InvalidArgumentError(absl::StrCat(Sv(what), ": not valid JSON: ", Sv(detail)));
  }
}

}  // namespace infersweep
