// The engine's device-independent interface: a batch of sequences advancing in lockstep, and
// (where an engine implements it) serving: sequences in KV slots advancing through ragged steps.
//
// Every backend (the CPU reference, the GPU reference, the fast GPU configs) implements this, so
// the harness can drive and compare them identically.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "api/model_config.h"
#include "engine/kv_slots.h"

namespace infersweep {

// One sequence's share of a ragged step: `tokens` fed to the sequence in KV slot `slot`, from the
// position that sequence has reached (a decode row is one token; a prefill chunk several).
struct RaggedChunk {
  int slot = 0;
  std::span<const int32_t> tokens;
};

enum class LogitsMode {
  kLast,  // logits of each sequence's last fed token: [batch, vocab]
  kAll,   // logits of every fed token: [batch, n, vocab]
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  // "cpu" or "cuda:<ordinal>".
  virtual std::string device() const = 0;

  // Starts `batch` empty sequences, each with room for `max_tokens` tokens.
  virtual absl::Status StartBatch(int batch, int max_tokens) = 0;
  // Feeds `n` tokens to every sequence (tokens is [batch, n], row-major), appending to the KV
  // cache, and returns float32 logits on the host.
  virtual absl::Status Forward(std::span<const int32_t> tokens, int n, LogitsMode mode,
                               std::vector<float>* logits) = 0;
  // Feeds `n` tokens to every sequence as Forward does, and returns each sequence's greedy next
  // token ([batch]: Greedy of its last row's logits) instead of the logits. Timed decode loops use
  // it: an engine picks the token where the logits are and hands back ids, not a vocabulary of
  // floats a sequence. The default runs Forward and picks on the host. `next` may alias `tokens`'
  // storage: the tokens are consumed first.
  virtual absl::Status ForwardGreedy(std::span<const int32_t> tokens, int n,
                                     std::vector<int32_t>* next);
  // Tokens already fed to each sequence of the current batch.
  virtual int position() const = 0;

  // Serving (continuous batching). StartServing reserves `slots` KV slots of room for
  // `max_tokens` tokens each, all free, and ends any lockstep batch. AdmitSequence puts a new,
  // empty sequence in a free slot and returns the slot; RetireSequence frees it. Between the two
  // the sequence advances through RaggedSteps, whose chunks sit at different positions and KV
  // lengths (decode rows beside a chunk of another sequence's prefill); a slot appears at most
  // once a step. RaggedStep returns float32 logits of each chunk's last token ([chunks, vocab]);
  // RaggedStepGreedy each chunk's greedy next token instead ([chunks]).
  // The defaults refuse with the reason (Unimplemented): an engine that runs lockstep batches only.
  virtual absl::Status StartServing(int slots, int max_tokens);
  virtual absl::StatusOr<int> AdmitSequence();
  virtual absl::Status RetireSequence(int slot);
  virtual absl::Status RaggedStep(std::span<const RaggedChunk> chunks,
                                  std::vector<float>* last_logits);
  // The default runs RaggedStep and picks on the host.
  virtual absl::Status RaggedStepGreedy(std::span<const RaggedChunk> chunks,
                                        std::vector<int32_t>* next);
  // Rank 0's `value` on every rank of a model whose tensor-parallel ranks are processes (each
  // passes its own; the serving scheduler's clock and its decisions from measured figures, so
  // that every rank plans the same steps and none waits in a collective the others skip);
  // `value` itself in a model of one process.
  virtual absl::StatusOr<double> RankZeroValue(double value) { return value; }
  // Seconds spent capturing CUDA graphs so far (0 where there are none).
  virtual double graph_capture_seconds() const { return 0; }
  // Device time of the last Forward or ForwardGreedy, from events recorded on its stream around
  // the whole step (inputs, kernels or graph replay, the logits' or the tokens' way to the host);
  // nullopt on devices without events.
  virtual std::optional<double> last_forward_device_ms() const { return std::nullopt; }
  // Device memory in use now (total - free, whole device); nullopt on the CPU.
  virtual std::optional<int64_t> device_memory_used_bytes() const { return std::nullopt; }
  // Bytes decode attention reads per element of the KV cache (the roofline counts them): 4 for
  // fp32, 2 for bf16, 1 + 4 / head_dim for fp8 (codes and their per-head scales).
  virtual double kv_cache_bytes_per_element() const { return 4; }
};

// Checks the arguments every Forward implementation must check (batch started, shape, id range,
// capacity). `capacity` is the max_tokens of the current batch.
absl::Status ValidateForwardArgs(const ModelConfig& config, int batch, int capacity, int position,
                                 std::span<const int32_t> tokens, int n);

// Checks a ragged step's chunks (engines that serve): at least one; each of an occupied slot with
// room for its tokens, no slot twice, every token id in the vocabulary. The error names the slot.
absl::Status ValidateRaggedChunks(const ModelConfig& config, const KvSlotAllocator& slots,
                                  std::span<const RaggedChunk> chunks);

}  // namespace infersweep
