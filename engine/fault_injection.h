// TEST ONLY: deliberate faults that a backend under test can be told to commit, so the harness's
// verdicts (INCORRECT / CRASHED / TIMEOUT) are proven on real failure modes. Reached only through
// the clearly named `--test-inject-fault` flag; production requests leave it empty.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/weights.h"

namespace infersweep {

struct FaultInjection {
  enum class Kind {
    kNone,
    kNanLayer,    // "nan-layer:L"   one hidden-state element becomes NaN after layer L
    kZeroExpert,  // "zero-expert:E" routed expert E contributes zeros (every MoE layer)
    kBadScale,    // "bad-scale:F"   layer 0's attention output scaled by F (a wrong dequant scale)
    kBadQuantScale,  // "bad-quant-scale:F" one group's stored scale of the first quantized
                     //                     linear (layer 0) multiplied by F (quantized weights);
                     // "bad-quant-scale:F@WEIGHT" that of the linear WEIGHT instead, by its
                     // canonical name (model.layers.1.mlp.experts.3.down_proj.weight)
    kStuckToken,     // "stuck-token:T" token T always wins the logits ("!!!!!!")
    kSegv,           // "segv"          SIGSEGV on the first forward
    kAbort,          // "abort"         abort() on the first forward
    kHang,           // "hang"          the first forward never returns
    kDelay,          // "delay:S"       the config under test starts S seconds late (a slow trial
                     //                 with correct output and unchanged figures; harness only)
    kBadState,       // "bad-state:F"   the first linear-attention layer's recurrent state is
                     //                 multiplied by F as each forward starts (a state carried
                     //                 wrongly between steps; hybrid models, CPU)
    kKvSlotSwap,     // "kv-slot-swap:S" from forward step S on (0: the first), the first step
                     //                 with two sequences holding tokens swaps the KV caches
                     //                 (and linear states) of the two lowest such slots, once:
                     //                 a scheduler that gives a sequence another's slot (CPU)
    kStateSlotSwap,  // "state-slot-swap:S" as kv-slot-swap, the Gated DeltaNet layers'
                     //                 recurrent states alone: a sequence carries another's
                     //                 state into its next chunk (hybrid models; CPU and CUDA)
    kRankKill,       // "rank-kill:R"   the rank process R of a supervised trial SIGKILLs itself
                     //                 on its first forward (harness/rank_supervisor.h)
    kRankHang,       // "rank-hang:R"   the rank process R never returns from its first forward
    kHogGpuMemory,   // "hog-gpu-memory:F" before a CUDA trial's memory plan, the worker takes
                     //                 F (0 < F < 1) of the GPU's free memory and holds it for
                     //                 the trial: another tenant on the GPU (harness only)
  };
  Kind kind = Kind::kNone;
  double value = 0;
  std::string target;  // bad-quant-scale: a canonical weight name, or empty (the first linear)

  bool active() const { return kind != Kind::kNone; }
};

absl::StatusOr<FaultInjection> ParseFaultInjection(std::string_view text);
std::string FaultInjectionString(const FaultInjection& fault);

// Process-level faults (segv, abort, hang; rank-kill and rank-hang in the rank process they
// name): called at the start of every Forward.
void MaybeCommitProcessFault(const FaultInjection& fault);

// The rank this process runs in a supervised trial (harness/rank_supervisor.h), set once by the
// rank worker; -1 (the default) in every other process, where no rank fault fires.
void SetProcessRank(int rank);
int ProcessRank();

// bad-quant-scale: re-points one quantized linear of `weights` at a copy of its scales, held in
// `storage`, whose first scale (one group; the whole tensor for fp8_tensor) is multiplied by
// `factor` and rounded back into its stored type (E8M0 scales move by the nearest power of two).
// The linear is `target` (a canonical weight name of `host`, FaultInjection::target), or with an
// empty target the first quantized one (layer order: q, k, v, o, MLP, experts). A target that
// `host` lacks, or one that is not quantized, is an InvalidArgument error that says which.
// `weights` is a copy of host.weights (host weights only).
absl::Status CorruptQuantScale(ModelWeights& weights, const HostModel& host, double factor,
                               const std::string& target, std::vector<uint8_t>* storage);

}  // namespace infersweep
