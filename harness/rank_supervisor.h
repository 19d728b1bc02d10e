// A trial over rank processes: one child process a tensor-parallel rank, each started on pipes
// as the trial runner starts its worker (harness/child_process.h), whatever the rank runs. The
// protocol, one JSON object a line:
//   1. parent -> every rank (stdin): {"rank": r, "ranks": n, "handshake": h, "request": {...}};
//   2. exchange rounds, zero or more, each one collective join of the ranks (engine/
//      rank_context.h): every rank writes {"exchange": "<its line>"} on stdout; once all n
//      have, the parent writes {"exchange": ["<rank 0's>", ..., "<rank n-1's>"]} to every
//      rank's stdin. CUDA ranks bootstrap so: nccl from rank 0's ncclUniqueId (the others send
//      ""), custom and fused from every rank's peer buffer IPC handle, each in hex. The id is
//      made in rank 0, not in the parent, so that NCCL's bootstrap root dies with the trial's
//      processes whatever becomes of them;
//   3. every rank -> parent (stdout): one TrialResult line;
//   4. the parent closes every rank's stdin; a rank exits at the EOF.
// The parent's verdict:
//   - a rank that dies makes the trial CRASHED, naming the rank and how it died ("rank 1 killed
//     by signal 9 (SIGKILL: Killed)"); every other rank still running is SIGKILLed and reaped;
//   - no result from some rank by the workload's timeout makes it TIMEOUT naming the ranks that
//     had not answered; every rank is SIGKILLed and reaped;
//   - a rank answering other than OK gives its result ("rank r: " before the reason of a rank
//     other than 0) at once, the ranks still running SIGKILLed and reaped (they may wait on it
//     in a collective that never completes);
//   - every rank answering OK gives rank 0's result.
// No rank's communicator is aborted from inside: the ranks that outlive a dead peer are
// SIGKILLed, and the driver frees their GPU contexts, NCCL's and the peer buffers included.
// No rank process outlives the call, and none outlives the thread that started it
// (PR_SET_PDEATHSIG).
#pragma once

#include <sys/types.h>

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/trial.h"
#include "harness/child_process.h"

namespace infersweep {

struct RankSupervisorOptions {
  // argv of every rank process: it reads one assignment JSON line on stdin ({"rank", "ranks",
  // "handshake", "request"}) and writes one TrialResult JSON line on stdout. Default:
  // {"/proc/self/exe", "rank-worker"} (RankWorkerMain).
  std::vector<std::string> rank_argv;
  int stderr_tail_lines = 40;
  // Called with the progress lines ranks print on stderr as "#progress <json>".
  std::function<void(const std::string&)> on_progress;
  // Set in every rank process's environment (the trial's CUDA_VISIBLE_DEVICES).
  EnvOverrides env;
};

// What one rank process did.
struct RankRun {
  int rank = 0;
  pid_t pid = -1;     // reaped before RunRankTrial returns
  std::string ended;  // "answered", or how it died or was ended
  std::string stderr_tail;
};

struct SupervisedTrial {
  TrialResult result;
  std::vector<RankRun> ranks;
};

// The trial `request` over `ranks` rank processes (1..8), as above. Never fails: a rank that
// cannot be started is ERROR.
SupervisedTrial RunRankTrial(const TrialRequest& request, int ranks, const std::string& handshake,
                             RankSupervisorOptions options = {});

// How many rank processes a trial runs in: tp for a CUDA config with tp > 1 (one process a GPU,
// each running its shard); (TEST ONLY) tp for a trial asked to commit a rank fault (rank-kill:R,
// rank-hang:R), so that the CPU proves the supervision; 0 otherwise (one worker runs the whole
// trial, the CPU's tp > 1 as threads).
int RankProcesses(const TrialRequest& request);

// A rank's side of one exchange round (step 2 above): writes `mine` to `out`, reads the ranks'
// lines from `in`. Unavailable at EOF; InvalidArgument for a reply that is not `ranks` strings.
absl::StatusOr<std::vector<std::string>> ExchangeThroughParent(std::istream& in, std::ostream& out,
                                                               int ranks, const std::string& mine);

// The rank side: reads one assignment, records its rank for the rank faults (SetProcessRank),
// takes its GPU (UseRankDevice) for a CUDA config, sets its rank context (SetRankContext, its
// exchanges through this process's stdin and stdout), runs the trial and writes the result
// line. Every rank runs the whole trial: the reference, the judging and the timing; a CUDA
// rank's model under test is its shard, joined to the others' (CreateModel), and computes the
// full logits, so every rank judges the same outputs and calls its collectives in the same
// order. Returns the process exit code.
int RankWorkerMain();

}  // namespace infersweep
