#include "engine/rank_context.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "api/status_macros.h"

namespace infersweep {
namespace {

RankContext& Context() {
  static RankContext context;
  return context;
}

// INFERSWEEP_RANK_DEVICES as device numbers; none when it is unset.
absl::StatusOr<std::vector<int>> TestRankDevices() {
  const char* env = std::getenv("INFERSWEEP_RANK_DEVICES");
  std::vector<int> devices;
  if (env == nullptr || *env == '\0') return devices;
  for (absl::string_view part : absl::StrSplit(env, ',')) {
    int device = -1;
    if (!absl::SimpleAtoi(part, &device) || device < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("INFERSWEEP_RANK_DEVICES='", env, "': '", part, "' is not a GPU number"));
    devices.push_back(device);
  }
  return devices;
}

}  // namespace

void SetRankContext(RankContext context) { Context() = std::move(context); }
const RankContext& CurrentRankContext() { return Context(); }

absl::StatusOr<std::vector<int>> RankDevices(int ranks) {
  ASSIGN_OR_RETURN(auto listed, TestRankDevices());
  if (listed.empty()) {
    std::vector<int> devices(ranks);
    for (int r = 0; r < ranks; ++r) devices[r] = r;
    return devices;
  }
  if (static_cast<int>(listed.size()) != ranks)
    return absl::InvalidArgumentError(absl::StrCat("INFERSWEEP_RANK_DEVICES lists ", listed.size(),
                                                   " GPUs for ", ranks, " ranks"));
  return listed;
}

int TestRankDeviceCount(int gpu_count) {
  auto listed = TestRankDevices();
  if (!listed.ok()) return 0;
  for (int device : *listed)
    if (device >= gpu_count) return 0;
  return static_cast<int>(listed->size());
}

std::string HexBytes(const char* data, size_t n) {
  return absl::BytesToHexString(absl::string_view(data, n));
}

absl::Status BytesFromHex(const std::string& hex, char* out, size_t n) {
  if (hex.size() != 2 * n)
    return absl::InvalidArgumentError(
        absl::StrCat("bootstrap line: ", hex.size(), " hex digits, not ", 2 * n));
  for (char c : hex)
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)))
      return absl::InvalidArgumentError(
          absl::StrCat("bootstrap line: '", std::string(1, c), "' is not a hex digit"));
  const std::string bytes = absl::HexStringToBytes(hex);
  std::copy(bytes.begin(), bytes.end(), out);
  return absl::OkStatus();
}

}  // namespace infersweep
