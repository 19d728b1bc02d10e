// TEST ONLY: deliberate faults that a backend under test can be told to commit, so the harness's
// verdicts (INCORRECT / CRASHED / TIMEOUT) are proven on real failure modes. Reached only through
// the clearly named `--test-inject-fault` flag; production requests leave it empty.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace infersweep {

struct FaultInjection {
  enum class Kind {
    kNone,
    kNanLayer,    // "nan-layer:L"   one hidden-state element becomes NaN after layer L
    kZeroExpert,  // "zero-expert:E" routed expert E contributes zeros (every MoE layer)
    kBadScale,    // "bad-scale:F"   layer 0's attention output scaled by F (a wrong dequant scale)
    kStuckToken,  // "stuck-token:T" token T always wins the logits ("!!!!!!")
    kSegv,        // "segv"          SIGSEGV on the first forward
    kAbort,       // "abort"         abort() on the first forward
    kHang,        // "hang"          the first forward never returns
    kDelay,       // "delay:S"       the config under test starts S seconds late (a slow trial
                  //                 with correct output and unchanged figures; harness only)
  };
  Kind kind = Kind::kNone;
  double value = 0;

  bool active() const { return kind != Kind::kNone; }
};

absl::StatusOr<FaultInjection> ParseFaultInjection(std::string_view text);
std::string FaultInjectionString(const FaultInjection& fault);

// Process-level faults (segv, abort, hang): called at the start of every Forward.
void MaybeCommitProcessFault(const FaultInjection& fault);

}  // namespace infersweep
