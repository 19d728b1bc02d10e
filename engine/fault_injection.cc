#include "engine/fault_injection.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/quant/codecs.h"
#include "engine/quant/layout.h"

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
    {FaultInjection::Kind::kBadQuantScale, "bad-quant-scale", true},
    {FaultInjection::Kind::kStuckToken, "stuck-token", true},
    {FaultInjection::Kind::kSegv, "segv", false},
    {FaultInjection::Kind::kAbort, "abort", false},
    {FaultInjection::Kind::kHang, "hang", false},
    {FaultInjection::Kind::kDelay, "delay", true},
    {FaultInjection::Kind::kBadState, "bad-state", true},
    {FaultInjection::Kind::kKvSlotSwap, "kv-slot-swap", true},
    {FaultInjection::Kind::kStateSlotSwap, "state-slot-swap", true},
    {FaultInjection::Kind::kRankKill, "rank-kill", true},
    {FaultInjection::Kind::kRankHang, "rank-hang", true},
    {FaultInjection::Kind::kHogGpuMemory, "hog-gpu-memory", true},
};

std::atomic<int> process_rank{-1};

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
    std::string value = kv.second;
    if (k.kind == FaultInjection::Kind::kBadQuantScale) {  // F[@WEIGHT]
      std::pair<std::string, std::string> at = absl::StrSplit(value, absl::MaxSplits('@', 1));
      if (value.find('@') != std::string::npos) {
        if (at.second.empty())
          return absl::InvalidArgumentError(absl::StrCat(
              "--test-inject-fault ", std::string(text),
              ": the target after '@' is a weight's "
              "name, as bad-quant-scale:16@model.layers.1.mlp.experts.3.down_proj.weight"));
        fault.target = at.second;
      }
      value = at.first;
    }
    if (k.takes_value && !absl::SimpleAtod(value, &fault.value))
      return absl::InvalidArgumentError(absl::StrCat("--test-inject-fault ", std::string(text),
                                                     ": ", k.name, " needs a number, as ", k.name,
                                                     ":1"));
    if (k.kind == FaultInjection::Kind::kHogGpuMemory && !(fault.value > 0 && fault.value < 1))
      return absl::InvalidArgumentError(
          absl::StrCat("--test-inject-fault ", std::string(text),
                       ": hog-gpu-memory takes the fraction of free memory to hold, in (0, 1), "
                       "as hog-gpu-memory:0.9"));
    return fault;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--test-inject-fault: unknown fault '", std::string(text),
                   "' (known: nan-layer:L, zero-expert:E, bad-scale:F, bad-quant-scale:F[@WEIGHT], "
                   "stuck-token:T, segv, abort, hang, delay:S, bad-state:F, kv-slot-swap:S, "
                   "state-slot-swap:S, rank-kill:R, rank-hang:R, hog-gpu-memory:F)"));
}

std::string FaultInjectionString(const FaultInjection& fault) {
  for (const KindName& k : kKinds)
    if (k.kind == fault.kind)
      return k.takes_value ? absl::StrCat(k.name, ":", fault.value, fault.target.empty() ? "" : "@",
                                          fault.target)
                           : std::string(k.name);
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
    case FaultInjection::Kind::kRankKill:
      if (ProcessRank() == static_cast<int>(fault.value)) std::raise(SIGKILL);
      break;
    case FaultInjection::Kind::kRankHang:
      if (ProcessRank() == static_cast<int>(fault.value))
        while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
      break;
    default:
      break;
  }
}

void SetProcessRank(int rank) { process_rank = rank; }
int ProcessRank() { return process_rank; }

absl::Status CorruptQuantScale(ModelWeights& weights, const HostModel& host, double factor,
                               const std::string& name, std::vector<uint8_t>* storage) {
  MatrixRef* target = nullptr;
  if (!name.empty()) {
    auto named = WeightSlot(weights, host, name);
    if (!named.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("bad-quant-scale: ", named.status().message()));
    if (!(*named)->quantized())
      return absl::InvalidArgumentError(
          absl::StrCat("bad-quant-scale: ", name, " is not quantized"));
    target = *named;
  }
  for (LayerWeights& l : weights.layers) {
    for (MatrixRef* m : LayerLinears(l))
      if (target == nullptr && m->quantized()) target = m;
    if (target != nullptr) break;
  }
  if (target == nullptr) return absl::InvalidArgumentError("bad-quant-scale: no quantized linear");
  const QuantRef& q = target->quant;
  const bool byte_scales = q.format == QuantFormat::kNvfp4 || q.format == QuantFormat::kMxfp4;
  const size_t element = byte_scales ? 1 : DTypeSize(q.scale_dtype);
  const size_t count = static_cast<size_t>(QuantScaleCount(q.format, target->rows, target->cols));
  const auto* scale = static_cast<const uint8_t*>(q.scale);
  storage->assign(scale, scale + count * element);
  uint8_t* first = storage->data();
  if (q.format == QuantFormat::kNvfp4) {
    *first = FloatToE4M3(static_cast<float>(E4M3ToFloat(*first) * factor));
  } else if (q.format == QuantFormat::kMxfp4) {
    const long shifted = *first + std::lround(std::log2(factor));
    *first = static_cast<uint8_t>(std::clamp(shifted, 0L, 254L));
  } else if (q.scale_dtype == DType::kF32) {
    const float value = LoadAsFloat(first, DType::kF32, 0) * static_cast<float>(factor);
    std::memcpy(first, &value, sizeof value);
  } else if (q.scale_dtype == DType::kBF16) {
    const uint16_t value =
        FloatToBf16(LoadAsFloat(first, DType::kBF16, 0) * static_cast<float>(factor));
    std::memcpy(first, &value, sizeof value);
  } else {
    return absl::UnimplementedError(absl::StrCat(
        "bad-quant-scale: ", DTypeName(q.scale_dtype).data(), " scales are not corrupted"));
  }
  target->quant.scale = storage->data();
  return absl::OkStatus();
}

}  // namespace infersweep
