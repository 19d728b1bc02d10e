// A trial over rank processes: one child process a tensor-parallel rank, each started on pipes
// as the trial runner starts its worker (harness/child_process.h), whatever the rank runs. The
// parent hands every rank its index, the rank count and the trial's handshake (for CUDA ranks,
// the ncclUniqueId the parent makes, which they join NCCL with) over its stdin, then waits for
// one result line from each rank:
//   - a rank that dies makes the trial CRASHED, naming the rank and how it died ("rank 1 killed
//     by signal 9 (SIGKILL: Killed)"); every other rank still running is SIGKILLed and reaped;
//   - no result from some rank by the workload's timeout makes it TIMEOUT naming the ranks that
//     had not answered; every rank is SIGKILLed and reaped;
//   - every rank answering gives rank 0's result, or the first other rank's that is not OK.
// No rank process outlives the call, and none outlives the thread that started it
// (PR_SET_PDEATHSIG).
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

#include "api/trial.h"

namespace infersweep {

struct RankSupervisorOptions {
  // argv of every rank process: it reads one assignment JSON line on stdin ({"rank", "ranks",
  // "handshake", "request"}) and writes one TrialResult JSON line on stdout. Default:
  // {"/proc/self/exe", "rank-worker"} (RankWorkerMain).
  std::vector<std::string> rank_argv;
  int stderr_tail_lines = 40;
  // Called with the progress lines ranks print on stderr as "#progress <json>".
  std::function<void(const std::string&)> on_progress;
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

// How many rank processes a trial runs in: (TEST ONLY) tp for a trial asked to commit a rank
// fault (rank-kill:R, rank-hang:R), so that the CPU proves the supervision; 0 otherwise (one
// worker runs the whole trial). CUDA configs with tp > 1 take one process a GPU here once the
// engine runs their shards: while it refuses them, tp processes would each load the host model
// only to report UNSUPPORTED, so one worker refuses them.
int RankProcesses(const TrialRequest& request);

// The rank side: reads one assignment, records its rank for the rank faults (SetProcessRank),
// runs the trial and writes the result line. On the CPU each rank runs the whole trial; a CUDA
// rank's share of a sharded model is not built (the CUDA engine refuses tp > 1, so its ranks
// report UNSUPPORTED). Returns the process exit code.
int RankWorkerMain();

}  // namespace infersweep
