#include "api/untrusted_regex.h"

#include <re2/re2.h>

#include "absl/strings/str_cat.h"

namespace infersweep {

int RegexGroupDepth(std::string_view pattern) {
  int depth = 0, deepest = 0;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      ++i;  // the escaped character is a literal
    } else if (in_class) {
      if (c == ']') in_class = false;
    } else if (c == '[') {
      in_class = true;
      // A ']' first in the class (after an optional '^') is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') ++i;
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') ++i;
    } else if (c == '(') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ')') {
      if (depth > 0) --depth;
    }
  }
  return deepest;
}

absl::StatusOr<std::unique_ptr<re2::RE2>> CompileUntrustedRegex(std::string_view pattern,
                                                                const RegexLimits& limits) {
  if (pattern.size() > limits.max_length)
    return absl::InvalidArgumentError(absl::StrCat(
        "the pattern is ", pattern.size(), " characters; the limit is ", limits.max_length));
  if (const int depth = RegexGroupDepth(pattern); depth > limits.max_nesting)
    return absl::InvalidArgumentError(absl::StrCat("the pattern nests groups ", depth,
                                                   " deep; the limit is ", limits.max_nesting));
  re2::RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(limits.max_program_bytes);
  auto re = std::make_unique<re2::RE2>(re2::StringPiece(pattern.data(), pattern.size()), options);
  if (!re->ok()) {
    if (re->error_code() == re2::RE2::ErrorPatternTooLarge)
      return absl::InvalidArgumentError(absl::StrCat("the pattern is too costly to compile (over ",
                                                     limits.max_program_bytes,
                                                     " bytes of program; RE2: ", re->error(), ")"));
    return absl::InvalidArgumentError(
        absl::StrCat("not a valid regular expression (RE2 syntax): ", re->error()));
  }
  return re;
}

bool RegexSearch(const re2::RE2& re, std::string_view text) {
  return re2::RE2::PartialMatch(re2::StringPiece(text.data(), text.size()), re);
}

bool RegexMatchesPrefix(const re2::RE2& re, std::string_view text) {
  return re.Match(re2::StringPiece(text.data(), text.size()), 0, text.size(),
                  re2::RE2::ANCHOR_START, nullptr, 0);
}

}  // namespace infersweep
