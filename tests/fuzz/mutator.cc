#include "tests/fuzz/mutator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace infersweep::fuzz {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool IsPunctuation(char c) {
  switch (c) {
    case ' ':
    case '\t':
    case '\r':
    case '\n':
    case ',':
    case ':':
    case '{':
    case '}':
    case '[':
    case ']':
    case '"':
    case '\'':
    case '#':
      return true;
    default:
      return false;
  }
}

std::vector<Span> Lines(std::string_view text) {
  std::vector<Span> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    out.push_back({begin, end});
    begin = end + 1;
  }
  return out;
}

size_t Indent(std::string_view text, const Span& line) {
  size_t i = line.begin;
  while (i < line.end && text[i] == ' ') ++i;
  return i - line.begin;
}

const std::pair<const char*, const char*> kBrackets[] = {
    {"(", ")"}, {"[", "]"}, {"{", "}"}, {"{\"a\":", "}"}, {"[", ",0]"}, {"(?:", ")"}};
// The structural stage wraps in the first three; the random stage in any.
constexpr int kStructuralBrackets = 3;

const int kDepths[] = {2, 8, 63, 64, 65, 100, 499, 500, 501, 1000, 5000, 20000, 100000};
const int kRepeats[] = {2, 3, 10, 100, 1000, 10000, 100000};
const size_t kLongTokens[] = {256, 4096, 65536, 1 << 20};

const std::vector<std::string>& CommonTokens() {
  static const std::vector<std::string> tokens = {
      "{",       "}",     "[",     "]",           ",",
      ":",       "\"",    "'",     "null",        "true",
      "false",   "\"\"",  "[]",    "{}",          "\\u0000",
      "\\ud800", "\\",    "\xff",  "\xc3\x28",    "\xef\xbb\xbf",
      "#",       "&a ",   "*a",    "!!binary ",   "!!str ",
      "<<: ",    "---\n", "...\n", "%YAML 1.2\n", "? ",
      "|",       ">",     "- ",    "~",           "=",
      "@",       "%",     "(",     ")",           "(?:",
      "*",       "+",     "?",     "{1000000}",   "{99999,}",
      "\\1",     "[^",    "$",     "re:",         ".*",
      "a=b",     "a=",    "=b",    ":",           "::",
      "-",       "--",    "0x",    "\t",          "\n",
      "\r\n",    " ",
  };
  return tokens;
}

const std::vector<std::string>& Numbers() {
  static const std::vector<std::string> numbers = [] {
    std::vector<std::string> n = {"0",
                                  "-0",
                                  "1",
                                  "-1",
                                  "7",
                                  "8",
                                  "64",
                                  "65",
                                  "127",
                                  "128",
                                  "255",
                                  "256",
                                  "1023",
                                  "1024",
                                  "65535",
                                  "65536",
                                  "2147483647",
                                  "2147483648",
                                  "-2147483648",
                                  "-2147483649",
                                  "4294967295",
                                  "4294967296",
                                  "9007199254740993",
                                  "9223372036854775807",
                                  "9223372036854775808",
                                  "-9223372036854775808",
                                  "-9223372036854775809",
                                  "18446744073709551615",
                                  "18446744073709551616",
                                  "1e308",
                                  "1e309",
                                  "-1e309",
                                  "1e400",
                                  "1e-400",
                                  "4.9e-324",
                                  "0.1",
                                  "1.5",
                                  "-0.0",
                                  "NaN",
                                  "nan",
                                  "inf",
                                  "-inf",
                                  "Infinity",
                                  ".inf",
                                  ".nan",
                                  "0x10",
                                  "010",
                                  "0b1",
                                  "1_000",
                                  "1e",
                                  "1.",
                                  ".5",
                                  "+5",
                                  "5-",
                                  "99999999999999999999999999999999"};
    n.push_back(std::string(400, '9'));
    n.push_back("0." + std::string(400, '0') + "1");
    return n;
  }();
  return numbers;
}

const std::vector<std::string>& ControlBytes() {
  static const std::vector<std::string> bytes = {std::string(1, '\0'),
                                                 "\x01",
                                                 "\x07",
                                                 "\x08",
                                                 "\x0b",
                                                 "\x0c",
                                                 "\x1b",
                                                 "\x7f",
                                                 "\r",
                                                 "\t",
                                                 "\xc0\x80",
                                                 "\xc2\x85",
                                                 "\xe2\x80\xa8",
                                                 "\xef\xbf\xbf",
                                                 "\xf4\x90\x80\x80",
                                                 "\x80",
                                                 "\xfe"};
  return bytes;
}

// `text` with `span` wrapped in `depth` levels of open/close, depth cut to fit `room` bytes.
void Wrap(std::string& text, Span span, std::string_view open, std::string_view close, size_t depth,
          size_t room) {
  depth = std::min(depth, room / (open.size() + close.size()));
  std::string out;
  out.reserve(text.size() + depth * (open.size() + close.size()));
  out.append(text, 0, span.begin);
  for (size_t i = 0; i < depth; ++i) out.append(open);
  out.append(text, span.begin, span.end - span.begin);
  for (size_t i = 0; i < depth; ++i) out.append(close);
  out.append(text, span.end, std::string::npos);
  text = std::move(out);
}

// The line nested under `levels` block mappings, one space of indentation a level ("a:\n a:\n
// ..."), levels cut to fit `room` bytes.
void YamlNest(std::string& text, Span line, size_t levels, size_t room) {
  const size_t indent = Indent(text, line);
  const std::string content = text.substr(line.begin + indent, line.end - line.begin - indent);
  // Level k costs k + indent + 3 bytes; the content moves right by `levels`.
  while (levels > 0 && levels * (levels + 2 * indent + 7) / 2 + levels > room) levels /= 2;
  std::string nested;
  for (size_t k = 0; k < levels; ++k)
    absl::StrAppend(&nested, std::string(indent + k, ' '), "a:\n");
  absl::StrAppend(&nested, std::string(indent + levels, ' '), content);
  text.replace(line.begin, line.end - line.begin, nested);
}

// The line behind `levels` compact sequence entries ("- - - - value").
void DashNest(std::string& text, Span line, size_t levels, size_t room) {
  levels = std::min(levels, room / 2);
  std::string dashes;
  for (size_t k = 0; k < levels; ++k) dashes += "- ";
  text.insert(line.begin + Indent(text, line), dashes);
}

Span RandomRange(const std::string& text, Rng& rng, size_t max_len) {
  const size_t begin = rng.Below(text.size() + 1);
  const size_t len = std::min(text.size() - begin, 1 + rng.Below(max_len));
  return {begin, begin + len};
}

}  // namespace

std::vector<Span> Tokens(std::string_view text) {
  std::vector<Span> out;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '"' || c == '\'') {
      // A quote that does not close within the line (or kMaxQuoted bytes) is punctuation, so
      // that a long line of stray quotes costs linear time.
      constexpr size_t kMaxQuoted = 4096;
      const size_t limit = std::min(text.size(), i + kMaxQuoted);
      size_t j = i + 1;
      while (j < limit && text[j] != c && text[j] != '\n') j += text[j] == '\\' ? 2 : 1;
      if (j < limit && text[j] == c) {
        out.push_back({i, j + 1});
        // The words inside count too: a regex inside quotes is a token of its own.
        for (Span s : Tokens(text.substr(i + 1, j - i - 1)))
          out.push_back({s.begin + i + 1, s.end + i + 1});
        i = j + 1;
        continue;
      }
      ++i;
      continue;
    }
    if (IsPunctuation(c)) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && !IsPunctuation(text[j])) ++j;
    out.push_back({i, j});
    i = j;
  }
  return out;
}

Mutator::Mutator(MutatorOptions options) : options_(std::move(options)) {
  for (size_t s = 0; s < options_.seeds.size(); ++s) {
    texts_.push_back(Unwrap(options_.seeds[s]));
    const std::string& text = texts_.back();
    for (const Span& token : Tokens(text))
      for (int b = 0; b < kStructuralBrackets; ++b) plan_.push_back({s, Step::kWrap, token, b});
    for (const Span& line : Lines(text)) {
      if (line.begin == line.end) continue;
      plan_.push_back({s, Step::kYamlNest, line, 0});
      plan_.push_back({s, Step::kDashNest, line, 0});
      plan_.push_back({s, Step::kNulAtLine, line, 0});
    }
    for (int b = 1; b < kStructuralBrackets; ++b) plan_.push_back({s, Step::kWrapWhole, {}, b});
    plan_.push_back({s, Step::kRepeatWhole, {}, 0});
    plan_.push_back({s, Step::kLongToken, {}, 0});
  }
}

std::string Mutator::Unwrap(std::string_view input) const {
  return options_.framing.unwrap ? options_.framing.unwrap(input) : std::string(input);
}

std::string Mutator::Rewrap(std::string_view original, std::string_view text) const {
  return options_.framing.rewrap ? options_.framing.rewrap(original, text) : std::string(text);
}

FuzzInput Mutator::Make(uint64_t run_seed, int64_t index) const {
  if (index < structural_count()) return MakeStructural(plan_[static_cast<size_t>(index)]);
  Rng rng(SplitMix(run_seed ^ SplitMix(static_cast<uint64_t>(index))));
  return MakeRandom(rng);
}

FuzzInput Mutator::MakeStructural(const Planned& p) const {
  std::string text = texts_[p.seed];
  const size_t room = Room(text.size());
  std::string how = absl::StrCat("seed ", p.seed, ", ");
  switch (p.step) {
    case Step::kWrap: {
      const auto [open, close] = kBrackets[p.variant];
      absl::StrAppend(&how, "token '",
                      text.substr(p.span.begin, std::min<size_t>(p.span.end - p.span.begin, 40)),
                      "' at byte ", p.span.begin, " wrapped in ", kDeepNesting, " '", open, "'");
      Wrap(text, p.span, open, close, kDeepNesting, room);
      break;
    }
    case Step::kWrapWhole: {
      const auto [open, close] = kBrackets[p.variant];
      const size_t depth = std::min<size_t>(room / 2, 1 << 20);
      absl::StrAppend(&how, "wrapped whole in ", depth, " '", open, "'");
      Wrap(text, {0, text.size()}, open, close, depth, room);
      break;
    }
    case Step::kYamlNest:
      absl::StrAppend(&how, "line at byte ", p.span.begin, " nested under ", kDeepYamlLevels,
                      " YAML levels");
      YamlNest(text, p.span, kDeepYamlLevels, room);
      break;
    case Step::kDashNest:
      absl::StrAppend(&how, "line at byte ", p.span.begin, " behind ", kDeepNesting / 10, " '- '");
      DashNest(text, p.span, kDeepNesting / 10, room);
      break;
    case Step::kNulAtLine:
      absl::StrAppend(&how, "NUL at line at byte ", p.span.begin);
      text.insert(p.span.begin + Indent(text, p.span), 1, '\0');
      break;
    case Step::kRepeatWhole: {
      absl::StrAppend(&how, "repeated to ", options_.max_input_bytes, " bytes");
      const std::string one = text + "\n";
      while (text.size() + one.size() <= options_.max_input_bytes) text += one;
      break;
    }
    case Step::kLongToken: {
      const std::vector<Span> tokens = Tokens(text);
      const size_t at = tokens.empty() ? 0 : tokens[tokens.size() / 2].begin;
      const size_t n = std::min<size_t>(room, 1 << 20);
      absl::StrAppend(&how, "token of ", n, " 'A's at byte ", at);
      text.insert(at, n, 'A');
      break;
    }
  }
  return {Rewrap(options_.seeds[p.seed], text), how};
}

FuzzInput Mutator::MakeRandom(Rng& rng) const {
  const size_t seed = rng.Below(options_.seeds.size());
  std::string text = texts_[seed];
  std::string how = absl::StrCat("seed ", seed, ":");
  std::vector<std::string> framed_ops;
  const int n = 1 + static_cast<int>(rng.Below(4));
  for (int m = 0; m < n; ++m) {
    if (options_.framing.mutate && rng.Below(3) == 0) {
      framed_ops.push_back("framing");
      continue;
    }
    absl::StrAppend(&how, " ", MutateOnce(text, rng));
    if (text.size() > options_.max_input_bytes) text.resize(options_.max_input_bytes);
  }
  std::string input = Rewrap(options_.seeds[seed], text);
  for (const std::string& op : framed_ops) {
    options_.framing.mutate(input, rng);
    absl::StrAppend(&how, " ", op);
  }
  return {std::move(input), how};
}

std::string Mutator::MutateOnce(std::string& text, Rng& rng) const {
  const size_t room = Room(text.size());
  auto pick_token = [&](const std::vector<std::string>& own) -> const std::string& {
    return !own.empty() && rng.Chance(60) ? rng.Pick(own) : rng.Pick(CommonTokens());
  };
  switch (rng.Below(16)) {
    case 0: {
      if (text.empty()) return "flip(empty)";
      for (size_t k = 1 + rng.Below(4); k > 0; --k)
        text[rng.Below(text.size())] ^= static_cast<char>(1u << rng.Below(8));
      return "flip";
    }
    case 1:
      if (text.empty()) return "byte(empty)";
      text[rng.Below(text.size())] = static_cast<char>(rng.Next());
      return "byte";
    case 2: {
      std::string bytes(1 + rng.Below(8), '\0');
      for (char& c : bytes) c = static_cast<char>(rng.Next());
      text.insert(rng.Below(text.size() + 1), bytes);
      return "insert";
    }
    case 3: {
      const Span r = RandomRange(text, rng, rng.Chance(80) ? 16 : text.size() / 4 + 1);
      text.erase(r.begin, r.end - r.begin);
      return "delete";
    }
    case 4: {
      const Span r = RandomRange(text, rng, 64);
      const std::string piece = text.substr(r.begin, r.end - r.begin);
      text.insert(rng.Below(text.size() + 1), piece);
      return "duplicate";
    }
    case 5: {
      const std::string& other = texts_[rng.Below(texts_.size())];
      const size_t cut = rng.Below(text.size() + 1), from = rng.Below(other.size() + 1);
      text = text.substr(0, cut) + other.substr(from);
      return "splice";
    }
    case 6:
      text.insert(rng.Below(text.size() + 1), pick_token(options_.dictionary));
      return "token";
    case 7: {
      const std::vector<Span> tokens = Tokens(text);
      if (tokens.empty()) return "swap(none)";
      const Span t = rng.Pick(tokens);
      text.replace(t.begin, t.end - t.begin, pick_token(options_.dictionary));
      return "swap";
    }
    case 8: {
      std::vector<Span> runs;
      for (size_t i = 0; i < text.size();) {
        if (text[i] >= '0' && text[i] <= '9') {
          size_t j = i;
          while (j < text.size() && ((text[j] >= '0' && text[j] <= '9') || text[j] == '.')) ++j;
          runs.push_back({i, j});
          i = j;
        } else {
          ++i;
        }
      }
      if (runs.empty()) return "number(none)";
      const Span r = rng.Pick(runs);
      text.replace(r.begin, r.end - r.begin, rng.Pick(Numbers()));
      return "number";
    }
    case 9:
      text.resize(rng.Below(text.size() + 1));
      return "truncate";
    case 10: {
      std::vector<Span> lines = Lines(text);
      const Span line = rng.Pick(lines);
      const std::string content = text.substr(line.begin, line.end - line.begin);
      switch (rng.Below(4)) {
        case 0:
          text.insert(line.begin, content + "\n");
          return "line-dup";
        case 1:
          text.erase(line.begin, std::min(text.size(), line.end + 1) - line.begin);
          return "line-delete";
        case 2: {
          const Span other = rng.Pick(lines);
          if (other.begin == line.begin) return "line-swap(same)";
          const std::string second = text.substr(other.begin, other.end - other.begin);
          const bool first_is_line = line.begin < other.begin;
          const Span a = first_is_line ? line : other, b = first_is_line ? other : line;
          const std::string& a_text = first_is_line ? content : second;
          const std::string& b_text = first_is_line ? second : content;
          text.replace(b.begin, b.end - b.begin, a_text);
          text.replace(a.begin, a.end - a.begin, b_text);
          return "line-swap";
        }
        default: {
          const size_t indent = Indent(text, line);
          text.replace(line.begin, indent, std::string(rng.Below(9), rng.Chance(90) ? ' ' : '\t'));
          return "line-indent";
        }
      }
    }
    case 11: {
      const Span r = RandomRange(text, rng, 64);
      const size_t len = std::max<size_t>(r.end - r.begin, 1);
      const size_t times = std::min<size_t>(kRepeats[rng.Below(std::size(kRepeats))], room / len);
      const std::string piece = r.end > r.begin ? text.substr(r.begin, len) : std::string("a");
      std::string repeated;
      repeated.reserve(times * len);
      for (size_t i = 0; i < times; ++i) repeated += piece;
      text.insert(r.end, repeated);
      return absl::StrCat("repeat x", times);
    }
    case 12: {
      const std::vector<Span> tokens = Tokens(text);
      const Span t =
          tokens.empty() || rng.Chance(20) ? RandomRange(text, rng, 64) : rng.Pick(tokens);
      const auto [open, close] = kBrackets[rng.Below(std::size(kBrackets))];
      const int depth = kDepths[rng.Below(std::size(kDepths))];
      Wrap(text, t, open, close, static_cast<size_t>(depth), room);
      return absl::StrCat("wrap '", open, "' x", depth);
    }
    case 13: {
      const Span line = rng.Pick(Lines(text));
      const int depth = kDepths[rng.Below(std::size(kDepths))];
      if (rng.Chance(50)) {
        YamlNest(text, line, static_cast<size_t>(std::min(depth, 2000)), room);
        return absl::StrCat("yaml-nest x", depth);
      }
      DashNest(text, line, static_cast<size_t>(depth), room);
      return absl::StrCat("dash-nest x", depth);
    }
    case 14: {
      const size_t n = std::min(kLongTokens[rng.Below(std::size(kLongTokens))], room);
      const char fill = "A9\\\"%.-(["[rng.Below(9)];
      text.insert(rng.Below(text.size() + 1), n, fill);
      return absl::StrCat("long x", n);
    }
    default: {
      for (size_t k = 1 + rng.Below(3); k > 0; --k)
        text.insert(rng.Below(text.size() + 1), rng.Pick(ControlBytes()));
      return "control";
    }
  }
}

}  // namespace infersweep::fuzz
