#include "engine/model.h"
#include "api/status_macros.h"

#include "absl/strings/str_cat.h"
#include "core/launch_log.h"
#include "engine/sampler.h"

namespace infersweep {

absl::Status ValidateForwardArgs(const ModelConfig& config, int batch, int capacity, int position,
                                 std::span<const int32_t> tokens, int n) {
  if (batch <= 0) return absl::FailedPreconditionError("Forward before StartBatch");
  if (n <= 0) return absl::InvalidArgumentError(absl::StrCat("Forward: n must be > 0, got ", n));
  if (tokens.size() != static_cast<size_t>(batch) * n)
    return absl::InvalidArgumentError(
        absl::StrCat("Forward: got ", tokens.size(), " tokens, expected batch ", batch, " x ", n));
  if (position + n > capacity)
    return absl::OutOfRangeError(absl::StrCat("Forward: ", position, " + ", n,
                                              " tokens exceed the batch's max_tokens ", capacity));
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= config.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat("token id ", tokens[i], " at index ", i,
                                                     " outside vocabulary [0, ", config.vocab_size,
                                                     ")"));
  return absl::OkStatus();
}

absl::Status ValidateRaggedChunks(const ModelConfig& config, const KvSlotAllocator& slots,
                                  std::span<const RaggedChunk> chunks) {
  if (chunks.empty()) return absl::InvalidArgumentError("RaggedStep: no chunks");
  std::vector<bool> seen(slots.slots(), false);
  for (const RaggedChunk& c : chunks) {
    RETURN_IF_ERROR(slots.CheckAppend(c.slot, static_cast<int>(c.tokens.size())));
    if (seen[c.slot])
      return absl::InvalidArgumentError(
          absl::StrCat("RaggedStep: KV slot ", c.slot, " appears twice in one step"));
    seen[c.slot] = true;
    for (int32_t t : c.tokens)
      if (t < 0 || t >= config.vocab_size)
        return absl::InvalidArgumentError(absl::StrCat("RaggedStep: token id ", t, " of slot ",
                                                       c.slot, " outside vocabulary [0, ",
                                                       config.vocab_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status Model::ForwardGreedy(std::span<const int32_t> tokens, int n,
                                  std::vector<int32_t>* next) {
  std::vector<float> logits;
  RETURN_IF_ERROR(Forward(tokens, n, LogitsMode::kLast, &logits));
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  next->resize(logits.size() / vocab);
  RecordLaunch("greedy_pick");  // the launch log (core/launch_log.h): the host's pick
  for (size_t b = 0; b < next->size(); ++b) (*next)[b] = Greedy({logits.data() + b * vocab, vocab});
  return absl::OkStatus();
}

namespace {

absl::Status NoRaggedSteps(const Model& model) {
  return absl::UnimplementedError(absl::StrCat(
      "device=", model.device(),
      ": this engine runs lockstep batches only; ragged steps (continuous batching: sequences at "
      "different positions, admitted and retired between steps) are not implemented for it"));
}

}  // namespace

absl::Status Model::StartServing(int, int) { return NoRaggedSteps(*this); }
absl::StatusOr<int> Model::AdmitSequence() { return NoRaggedSteps(*this); }
absl::Status Model::RetireSequence(int) { return NoRaggedSteps(*this); }
absl::Status Model::RaggedStep(std::span<const RaggedChunk>, std::vector<float>*) {
  return NoRaggedSteps(*this);
}

absl::Status Model::RaggedStepGreedy(std::span<const RaggedChunk> chunks,
                                     std::vector<int32_t>* next) {
  std::vector<float> logits;
  RETURN_IF_ERROR(RaggedStep(chunks, &logits));
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  next->resize(chunks.size());
  RecordLaunch("greedy_pick");
  for (size_t c = 0; c < chunks.size(); ++c)
    (*next)[c] = Greedy({logits.data() + c * vocab, vocab});
  return absl::OkStatus();
}

}  // namespace infersweep
