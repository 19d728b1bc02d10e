// Regular expressions from untrusted text (sweep specs' selector.gpu_name, checkpoints'
// quantization exclusion patterns), compiled with RE2: linear-time matching, no recursion on
// the pattern, and a bounded compile memory. The pattern is checked before RE2 sees it, so an
// oversized or deeply nested pattern is refused with the bound it broke.
#pragma once

#include <re2/re2.h>

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"

namespace infersweep {

struct RegexLimits {
  size_t max_length = 256;              // characters of pattern
  int max_nesting = 16;                 // depth of ( ... ) groups
  int64_t max_program_bytes = 1 << 20;  // RE2's compile memory (max_mem)
};

// The compiled pattern (RE2 syntax), or InvalidArgument saying what is wrong: too long, nested
// too deep, not a valid RE2 pattern, or too costly to compile. The message names no source;
// callers prefix their file, line and field.
absl::StatusOr<std::unique_ptr<re2::RE2>> CompileUntrustedRegex(std::string_view pattern,
                                                                const RegexLimits& limits = {});

// The deepest ( ... ) nesting of `pattern`: escaped parentheses and those inside [...] classes
// do not count.
int RegexGroupDepth(std::string_view pattern);

// True when `re` matches somewhere in `text` (std::regex_search semantics).
bool RegexSearch(const re2::RE2& re, std::string_view text);
// True when `re` matches a prefix of `text` (a match that starts at its first character).
bool RegexMatchesPrefix(const re2::RE2& re, std::string_view text);

}  // namespace infersweep
