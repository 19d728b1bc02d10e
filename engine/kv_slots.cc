#include "engine/kv_slots.h"

#include "absl/strings/str_cat.h"

namespace infersweep {

void KvSlotAllocator::Reset(int slots, int max_tokens) {
  max_tokens_ = max_tokens;
  in_use_.assign(slots, false);
  length_.assign(slots, 0);
}

absl::StatusOr<int> KvSlotAllocator::Acquire() {
  for (int s = 0; s < slots(); ++s) {
    if (in_use_[s]) continue;
    in_use_[s] = true;
    length_[s] = 0;
    return s;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("no free KV slot: all ", slots(), " hold sequences"));
}

absl::Status KvSlotAllocator::Release(int slot) {
  if (!in_use(slot))
    return absl::InvalidArgumentError(
        absl::StrCat("KV slot ", slot, " holds no sequence (slots: ", slots(), ")"));
  in_use_[slot] = false;
  length_[slot] = 0;
  return absl::OkStatus();
}

absl::Status KvSlotAllocator::CheckAppend(int slot, int n) const {
  if (!in_use(slot))
    return absl::InvalidArgumentError(
        absl::StrCat("KV slot ", slot, " holds no sequence (slots: ", slots(), ")"));
  if (n <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("KV slot ", slot, ": a step feeds at least one token, got ", n));
  if (length_[slot] + n > max_tokens_)
    return absl::OutOfRangeError(absl::StrCat("KV slot ", slot, ": ", length_[slot], " + ", n,
                                              " tokens exceed its max_tokens ", max_tokens_));
  return absl::OkStatus();
}

std::vector<int> KvSlotAllocator::InUse() const {
  std::vector<int> used;
  for (int s = 0; s < slots(); ++s)
    if (in_use_[s]) used.push_back(s);
  return used;
}

std::optional<std::pair<int, int>> KvSlotAllocator::TwoLowestHoldingTokens() const {
  std::vector<int> holding;
  for (int slot : InUse())
    if (length_[slot] > 0) holding.push_back(slot);
  if (holding.size() < 2) return std::nullopt;
  return std::pair{holding[0], holding[1]};
}

}  // namespace infersweep
