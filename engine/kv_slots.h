// The KV slots of a model that serves (continuous batching): which slots are free, and how many
// tokens the sequence in each occupied slot holds. A sequence takes a slot when it is admitted and
// gives it back when it retires; its cache rows live in that slot until then.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace infersweep {

class KvSlotAllocator {
 public:
  // `slots` free slots of room for `max_tokens` tokens each.
  void Reset(int slots, int max_tokens);

  // The lowest free slot (so a run's slot assignment is reproducible), now holding an empty
  // sequence; ResourceExhausted when every slot is taken.
  absl::StatusOr<int> Acquire();
  absl::Status Release(int slot);

  // OK when `slot` holds a sequence with room for `n` more tokens; the error names the slot.
  absl::Status CheckAppend(int slot, int n) const;
  // Records `n` tokens appended to the slot's sequence (after CheckAppend).
  void Advance(int slot, int n) { length_[slot] += n; }

  int slots() const { return static_cast<int>(length_.size()); }
  int max_tokens() const { return max_tokens_; }
  bool in_use(int slot) const { return slot >= 0 && slot < slots() && in_use_[slot]; }
  int length(int slot) const { return length_[slot]; }
  // Occupied slots, lowest first.
  std::vector<int> InUse() const;
  // The two lowest slots whose sequences hold tokens (what the slot-swap faults swap), if two do.
  std::optional<std::pair<int, int>> TwoLowestHoldingTokens() const;

 private:
  int max_tokens_ = 0;
  std::vector<bool> in_use_;
  std::vector<int> length_;
};

}  // namespace infersweep
