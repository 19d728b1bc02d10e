// A tensor-parallel rank process (harness/rank_supervisor.h): which rank of how many it is, the
// GPU it runs on, and how it trades one line with every other rank through the trial's parent
// (the ranks' bootstrap: rank 0's ncclUniqueId, or every rank's CUDA IPC handle of its
// all-reduce peer buffer). The rank worker sets it before its trial; CreateModel joins the
// ranks' collective through it when it builds a CUDA model with tp > 1.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace infersweep {

// Sends this rank's line to the parent and returns every rank's, in rank order (its own
// included), once all of them have sent theirs. Called by every rank, once per collective joined.
using RankExchange =
    std::function<absl::StatusOr<std::vector<std::string>>(const std::string& mine)>;

struct RankContext {
  int rank = 0;
  int ranks = 1;  // 1: not a rank process (the worker, the CLI)
  RankExchange exchange;
};

// The process's rank context: set once by the rank worker, read by CreateModel.
void SetRankContext(RankContext context);
const RankContext& CurrentRankContext();

// The GPU of each of `ranks` rank processes: rank r on GPU r, or (TEST ONLY) the comma-separated
// list in INFERSWEEP_RANK_DEVICES ("0,0": two ranks on GPU 0, so that one GPU checks tp=2 with
// allreduce=custom across processes; NCCL takes one rank a GPU). InvalidArgument for a list
// that is not `ranks` device numbers.
absl::StatusOr<std::vector<int>> RankDevices(int ranks);

// TEST ONLY: how many ranks INFERSWEEP_RANK_DEVICES places on this host's `gpu_count` GPUs (its
// entries, where every one names a GPU there); 0 when it is unset or names a missing GPU. The
// preflight counts them as the GPUs a tp trial may use.
int TestRankDeviceCount(int gpu_count);

// Makes rank `rank` of `ranks`'s GPU (RankDevices) current, before the process's first other
// CUDA call. A GPU this host does not have is left to the preflight, which refuses the trial
// naming the host's GPU count; nothing to do in a build without CUDA.
absl::Status UseRankDevice(int rank, int ranks);

// Lowercase hex of n bytes, and back: the bootstrap bytes travel as text lines.
std::string HexBytes(const char* data, size_t n);
// InvalidArgument unless `hex` is 2n hex digits.
absl::Status BytesFromHex(const std::string& hex, char* out, size_t n);

}  // namespace infersweep
