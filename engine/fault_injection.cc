#include "engine/fault_injection.h"

#include <csignal>
#include <cstdlib>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace infersweep {
namespace {

struct KindName {
  FaultInjection::Kind kind;
  const char* name;
  bool takes_value;
};
constexpr KindName kKinds[] = {
    {FaultInjection::Kind::kNanLayer, "nan-layer", true},
    {FaultInjection::Kind::kZeroExpert, "zero-expert", true},
    {FaultInjection::Kind::kBadScale, "bad-scale", true},
    {FaultInjection::Kind::kStuckToken, "stuck-token", true},
    {FaultInjection::Kind::kSegv, "segv", false},
    {FaultInjection::Kind::kAbort, "abort", false},
    {FaultInjection::Kind::kHang, "hang", false},
    {FaultInjection::Kind::kDelay, "delay", true},
};

}  // namespace

absl::StatusOr<FaultInjection> ParseFaultInjection(std::string_view text) {
  FaultInjection fault;
  if (text.empty() || text == "none") return fault;
  // Debian 12's Abseil has its own string_view: split into std::strings.
  std::pair<std::string, std::string> kv =
      absl::StrSplit(absl::string_view(text.data(), text.size()), absl::MaxSplits(':', 1));
  for (const KindName& k : kKinds) {
    if (k.name != kv.first) continue;
    fault.kind = k.kind;
    if (k.takes_value && !absl::SimpleAtod(kv.second, &fault.value))
      return absl::InvalidArgumentError(absl::StrCat("--test-inject-fault ", std::string(text), ": ",
                                                     k.name, " needs a number, as ", k.name, ":1"));
    return fault;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--test-inject-fault: unknown fault '", std::string(text),
                   "' (known: nan-layer:L, zero-expert:E, bad-scale:F, stuck-token:T, segv, abort, "
                   "hang, delay:S)"));
}

std::string FaultInjectionString(const FaultInjection& fault) {
  for (const KindName& k : kKinds)
    if (k.kind == fault.kind) return k.takes_value ? absl::StrCat(k.name, ":", fault.value) : std::string(k.name);
  return "none";
}

void MaybeCommitProcessFault(const FaultInjection& fault) {
  switch (fault.kind) {
    case FaultInjection::Kind::kSegv:
      std::raise(SIGSEGV);
      break;
    case FaultInjection::Kind::kAbort:
      std::abort();
    case FaultInjection::Kind::kHang:
      while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
    default:
      break;
  }
}

}  // namespace infersweep
