// Reading a sweep spec's YAML: typed fields with "source:line: field: message" errors, and the
// checks on the raw text that yaml-cpp would report badly or not survive.
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "coordinator/sweep_spec.h"
#include "coordinator/sweep_spec_internal.h"

namespace infersweep::sweep_spec_internal {

int LineOf(const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  return m.is_null() ? 0 : m.line + 1;
}

std::string KindOf(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
      return "nothing (null)";
    case YAML::NodeType::Scalar:
      return absl::StrCat("the scalar '", n.Scalar(), "'");
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Undefined:
      return "nothing";
  }
  return "?";
}

absl::Status Parser::Error(int line, absl::string_view field, absl::string_view message) const {
  std::string where = line > 0 ? absl::StrCat(source_, ":", line) : source_;
  if (!field.empty()) absl::StrAppend(&where, ": ", field);
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", message));
}

absl::Status Parser::Error(const YAML::Node& at, absl::string_view field,
                           absl::string_view message) const {
  return Error(LineOf(at), field, message);
}

absl::StatusOr<std::vector<Entry>> Parser::MapEntries(const YAML::Node& node,
                                                      absl::string_view field) const {
  if (!node.IsMap()) return Error(node, field, absl::StrCat("expected a map, got ", KindOf(node)));
  std::vector<Entry> out;
  std::map<std::string, int> seen;
  for (auto it = node.begin(); it != node.end(); ++it) {
    // Copies: the iterator hands out a temporary pair.
    const YAML::Node k = it->first;
    const YAML::Node v = it->second;
    if (!k.IsScalar())
      return Error(k, field, absl::StrCat("keys must be scalars, got ", KindOf(k)));
    const std::string key = k.Scalar();
    if (auto [pos, inserted] = seen.emplace(key, LineOf(k)); !inserted)
      return Error(k, field,
                   absl::StrCat("duplicate key '", key, "' (first at line ", pos->second, ")"));
    out.push_back({key, k, v});
  }
  return out;
}

absl::StatusOr<std::string> Parser::Text(const YAML::Node& n, absl::string_view field) const {
  if (!n.IsScalar())
    return Error(n, field, absl::StrCat("expected a single value, got ", KindOf(n)));
  if (n.Scalar().empty()) return Error(n, field, "empty value");
  return n.Scalar();
}

absl::StatusOr<std::string> Parser::FreeText(const YAML::Node& n, absl::string_view field,
                                             size_t max_bytes) const {
  ASSIGN_OR_RETURN(std::string s, Text(n, field));
  if (s.size() > max_bytes)
    return Error(n, field,
                 absl::StrCat("'", s.substr(0, 32), "...' is ", s.size(),
                              " bytes long; the limit is ", max_bytes));
  for (const char c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      return Error(n, field,
                   absl::StrCat("contains a control character (byte 0x",
                                absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2),
                                "); keep it to one line of text"));
  return s;
}

absl::StatusOr<std::string> Parser::Word(const YAML::Node& n, absl::string_view field) const {
  ASSIGN_OR_RETURN(std::string s, FreeText(n, field, kMaxSweepWordBytes));
  if (s.find_first_of(",= \t\r\n") != std::string::npos)
    return Error(n, field, absl::StrCat("'", s, "' contains ',', '=' or whitespace"));
  return s;
}

absl::StatusOr<int64_t> Parser::Int(const YAML::Node& n, absl::string_view field, int64_t lo,
                                    int64_t hi) const {
  ASSIGN_OR_RETURN(std::string s, Text(n, field));
  int64_t v = 0;
  if (!absl::SimpleAtoi(s, &v)) return Error(n, field, absl::StrCat("'", s, "' is not an integer"));
  if (v < lo || v > hi) return Error(n, field, absl::StrCat(v, " is outside [", lo, ", ", hi, "]"));
  return v;
}

absl::StatusOr<bool> Parser::Bool(const YAML::Node& n, absl::string_view field) const {
  ASSIGN_OR_RETURN(std::string s, Text(n, field));
  bool v = false;
  if (!YAML::convert<bool>::decode(n, v))
    return Error(n, field, absl::StrCat("'", s, "' is not true or false"));
  return v;
}

absl::StatusOr<double> Parser::Number(const YAML::Node& n, absl::string_view field, double lo,
                                      double hi) const {
  ASSIGN_OR_RETURN(std::string s, Text(n, field));
  double v = 0;
  if (!absl::SimpleAtod(s, &v) || !std::isfinite(v))
    return Error(n, field, absl::StrCat("'", s, "' is not a number"));
  if (v < lo || v > hi) return Error(n, field, absl::StrCat(v, " is outside [", lo, ", ", hi, "]"));
  return v;
}

absl::StatusOr<std::vector<int64_t>> Parser::IntList(const YAML::Node& n, absl::string_view field,
                                                     int64_t lo, int64_t hi,
                                                     size_t max_count) const {
  std::vector<int64_t> out;
  if (n.IsSequence()) {
    if (n.size() == 0) return Error(n, field, "empty list");
    if (n.size() > max_count)
      return Error(n, field, absl::StrCat(n.size(), " values; at most ", max_count));
    for (const YAML::Node& item : n) {
      ASSIGN_OR_RETURN(int64_t v, Int(item, field, lo, hi));
      out.push_back(v);
    }
    return out;
  }
  ASSIGN_OR_RETURN(int64_t v, Int(n, field, lo, hi));
  out.push_back(v);
  return out;
}

namespace {

// "NUL", "ESC", ...: the name of a control byte in messages.
std::string ControlByteName(unsigned char c) {
  static constexpr const char* kNames[32] = {"NUL", "SOH", "STX", "ETX", "EOT", "ENQ", "ACK", "BEL",
                                             "BS",  "TAB", "LF",  "VT",  "FF",  "CR",  "SO",  "SI",
                                             "DLE", "DC1", "DC2", "DC3", "DC4", "NAK", "SYN", "ETB",
                                             "CAN", "EM",  "SUB", "ESC", "FS",  "GS",  "RS",  "US"};
  return c < 32 ? kNames[c] : "DEL";
}

}  // namespace

// What yaml-cpp reports badly, checked before it sees the text: a control byte (it names
// neither the byte nor where it is) and nesting deeper than kMaxSweepSpecDepth (it recurses
// per level and gives up at 500 with "bad file"). The nesting scan follows YAML as far as
// depth needs: block levels by indentation and "- " entries, flow collections by brackets
// outside quotes and comments, block scalars' bodies skipped. Where it is unsure it counts
// low; yaml-cpp's own limit stays behind it (ParseSpecUnsafe).
absl::Status CheckSpecText(absl::string_view yaml, const Parser& p) {
  auto error_at = [&](int line, size_t column, absl::string_view message) {
    return absl::InvalidArgumentError(
        absl::StrCat(p.source(), ":", line, ":", column, ": ", message));
  };
  {
    int line = 1;
    size_t line_start = 0;
    for (size_t i = 0; i < yaml.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(yaml[i]);
      if (c == '\n') {
        ++line;
        line_start = i + 1;
      } else if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7f) {
        return error_at(
            line, i - line_start + 1,
            absl::StrCat("control byte 0x", absl::Hex(c, absl::kZeroPad2), " (", ControlByteName(c),
                         "); a sweep spec is printable text (tabs and newlines "
                         "allowed)"));
      }
    }
  }
  std::vector<size_t> block;  // columns of the open block levels, innermost last
  int flow = 0;               // open flow collections, '[' and '{'
  char quote = 0;             // the quote of a quoted scalar still open at the end of a line
  constexpr size_t kNone = std::string::npos;
  size_t block_scalar_parent = kNone;  // in a block scalar's body: its parent's column
  int line = 0;
  for (absl::string_view rest = yaml; !rest.empty() || line == 0;) {
    ++line;
    const size_t nl = rest.find('\n');
    absl::string_view text = rest.substr(0, nl);
    rest = nl == absl::string_view::npos ? absl::string_view() : rest.substr(nl + 1);
    if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
    size_t indent = 0;
    while (indent < text.size() && text[indent] == ' ') ++indent;
    const bool blank = indent == text.size() || text[indent] == '#';
    if (block_scalar_parent != kNone) {
      if (blank || indent > block_scalar_parent) continue;
      block_scalar_parent = kNone;
    }
    auto too_deep = [&](size_t i) {
      return static_cast<int>(block.size()) + flow > kMaxSweepSpecDepth
                 ? error_at(line, i + 1,
                            absl::StrCat("YAML nested deeper than ", kMaxSweepSpecDepth,
                                         " levels; the limit is ", kMaxSweepSpecDepth))
                 : absl::OkStatus();
    };
    size_t pos = 0, node_start = 0, parent = 0;
    if (quote == 0 && flow == 0) {
      if (blank || text[0] == '%') continue;
      if (absl::StartsWith(text, "---") || absl::StartsWith(text, "...")) {
        block.clear();
        pos = 3;
        while (pos < text.size() && text[pos] == ' ') ++pos;
      } else {
        while (!block.empty() && block.back() >= indent) block.pop_back();
        pos = indent;
      }
      // "- " entries (and "? " / ": " of complex keys) open a level each.
      while (pos < text.size() && (text[pos] == '-' || text[pos] == '?' || text[pos] == ':') &&
             (pos + 1 == text.size() || text[pos + 1] == ' ')) {
        parent = pos;
        block.push_back(pos);
        RETURN_IF_ERROR(too_deep(pos));
        ++pos;
        while (pos < text.size() && text[pos] == ' ') ++pos;
      }
      if (pos < text.size() && text[pos] != '#') {
        block.push_back(pos);
        RETURN_IF_ERROR(too_deep(pos));
      }
      node_start = pos;
    } else {
      node_start = std::string::npos;
    }
    for (size_t i = pos; i < text.size(); ++i) {
      const char c = text[i];
      if (quote != 0) {
        if (quote == '"' && c == '\\') {
          ++i;
        } else if (c == quote) {
          if (quote == '\'' && i + 1 < text.size() && text[i + 1] == '\'') {
            ++i;  // '' is an escaped quote
          } else {
            quote = 0;
          }
        }
        continue;
      }
      if (c == '#' && (i == 0 || text[i - 1] == ' ' || text[i - 1] == '\t')) break;
      if (flow > 0) {
        if (c == '"' || c == '\'') {
          quote = c;
        } else if (c == '[' || c == '{') {
          ++flow;
          RETURN_IF_ERROR(too_deep(i));
        } else if (c == ']' || c == '}') {
          --flow;
        }
        continue;
      }
      // Block context: flow collections, quoted and block scalars begin only where a node does.
      if (i == node_start) {
        if (c == '&' || c == '!') {  // an anchor or a tag before the node
          while (i < text.size() && text[i] != ' ') ++i;
          while (i + 1 < text.size() && text[i + 1] == ' ') ++i;
          node_start = i + 1;
          continue;
        }
        if (c == '[' || c == '{') {
          ++flow;
          RETURN_IF_ERROR(too_deep(i));
          continue;
        }
        if (c == '"' || c == '\'') {
          quote = c;
          continue;
        }
        if (c == '|' || c == '>') {
          block_scalar_parent = parent;
          break;
        }
      }
      if (c == ':' && (i + 1 == text.size() || text[i + 1] == ' ' || text[i + 1] == '\t')) {
        parent = block.empty() ? 0 : block.back();
        size_t j = i + 1;
        while (j < text.size() && (text[j] == ' ' || text[j] == '\t')) ++j;
        node_start = j;
        i = j - 1;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace infersweep::sweep_spec_internal
