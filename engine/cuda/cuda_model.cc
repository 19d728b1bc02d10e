#include "engine/cuda/cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "engine/cuda/attention_runner.h"
#include "engine/cuda/collective_runner.h"
#include "engine/cuda/communicator.h"
#include "engine/cuda/device_util.h"
#include "engine/cuda/linear_attention_runner.h"
#include "engine/cuda/linear_runner.h"
#include "engine/cuda/moe_runner.h"
#include "engine/cuda/persistent_decode.h"
#include "engine/cuda/runner_context.h"
#include "engine/cuda/weight_upload.h"
#include "engine/plan/memory_plan.h"
#include "engine/plan/step_plan.h"
#include "engine/tp_model.h"
#include "kernels/cuda/gemm_cublaslt.h"
#include "kernels/cuda/moe_grouped.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sm100a/test_kernel.h"

namespace infersweep {
namespace {

cudaStream_t MakeStream() {
  cudaStream_t stream = nullptr;
  CUDA_OR_DIE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

// A CUDA model: the step's orchestration (inputs, the layers through the linear, attention and
// MoE runners or the persistent kernel, final norm and lm_head, logits or greedy tokens) and
// CUDA graphs of decode steps. The runners own their scratch; the model owns the residual
// stream, the logits and the pinned staging buffers. A tensor-parallel rank's model runs its
// shard (`config` holds the rank's head counts and sizes, the lm_head its vocabulary rows from
// `vocab_begin` on) through the ranks' communicator.
class CudaModel final : public Model {
 public:
  CudaModel(const ModelConfig& config, std::shared_ptr<DeviceWeights> weights,
            const CudaOptions& options, const FaultInjection& fault,
            std::unique_ptr<cuda::CublasLtGemm> gemm,
            std::unique_ptr<cuda::CublasGroupedGemm> grouped, std::unique_ptr<QuantView> view,
            const CudaRank& rank = {}, int64_t vocab_begin = 0)
      : config_(config),
        dw_(std::move(weights)),
        view_(std::move(view)),
        w_(view_ ? view_->weights : dw_->weights),
        options_(options),
        fault_(fault),
        stream_(MakeStream()),
        context_{config_, w_, options_, fault_, stream_},
        linear_(context_, std::move(gemm), view_.get()),
        attention_(context_, linear_),
        linear_attention_(context_, linear_),
        moe_(context_, linear_, dw_.get(), view_.get(), std::move(grouped)),
        persistent_(context_),
        collective_(context_, rank.comm, rank.max_message_bytes, vocab_begin, w_.lm_head.rows) {
    CUDA_OR_DIE(cudaEventCreate(&step_start_));
    CUDA_OR_DIE(cudaEventCreate(&step_end_));
  }

  ~CudaModel() override {
    DestroyGraphs();
    FreeScratch();
    cudaEventDestroy(step_start_);
    cudaEventDestroy(step_end_);
    // The runners free their buffers after this (cudaFree needs no stream).
    cudaStreamDestroy(stream_);
  }

  const ModelConfig& config() const override { return config_; }
  std::string device() const override { return "cuda:0"; }
  int position() const override { return position_; }
  double graph_capture_seconds() const override { return capture_seconds_; }
  std::optional<double> last_forward_device_ms() const override { return last_step_ms_; }
  double kv_cache_bytes_per_element() const override {
    return attention_.kv_read_bytes_per_element();
  }
  std::optional<int64_t> device_memory_used_bytes() const override {
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) return std::nullopt;
    return static_cast<int64_t>(total - free);
  }

  absl::Status StartBatch(int batch, int max_tokens) override {
    if (batch <= 0 || max_tokens <= 0)
      return absl::InvalidArgumentError("StartBatch: batch and max_tokens must be positive");
    if (batch != batch_ || max_tokens != capacity_) {
      DestroyGraphs();
      RETURN_IF_ERROR(attention_.AllocateCache(batch, max_tokens));
      RETURN_IF_ERROR(linear_attention_.AllocateState(batch));
      // A library GEMM's plans for the decode batch's rows, before its graph is captured.
      if (view_ && view_->scaled) RETURN_IF_ERROR(view_->scaled->PrepareRows(batch));
    }
    linear_attention_.ResetState();
    RETURN_IF_ERROR(moe_.MakeRouterCopies());
    serving_ = false;
    batch_ = batch;
    capacity_ = max_tokens;
    position_ = 0;
    return absl::OkStatus();
  }

  // Serving: the KV cache holds `slots` sequences and one spare, where the padding rows of a
  // graph bucket write.
  absl::Status StartServing(int slots, int max_tokens) override {
    if (slots <= 0 || max_tokens <= 0)
      return absl::InvalidArgumentError("StartServing: slots and max_tokens must be positive");
    DestroyGraphs();
    RETURN_IF_ERROR(attention_.AllocateCache(slots + 1, max_tokens));
    // The Gated DeltaNet layers' conv and recurrent states, per slot and the spare; a sequence's
    // first row (position 0) starts them from zero, so admission needs no clearing.
    RETURN_IF_ERROR(linear_attention_.AllocateState(slots + 1));
    RETURN_IF_ERROR(moe_.MakeRouterCopies());
    slots_.Reset(slots, max_tokens);
    ragged_steps_ = 0;
    states_swapped_ = false;
    serving_ = true;
    batch_ = 0;  // no lockstep batch: Forward refuses until the next StartBatch
    capacity_ = max_tokens;
    position_ = 0;
    return absl::OkStatus();
  }
  absl::StatusOr<int> AdmitSequence() override {
    if (!serving_) return absl::FailedPreconditionError("AdmitSequence before StartServing");
    return slots_.Acquire();  // the KV cache is read only up to the sequence's length
  }
  absl::Status RetireSequence(int slot) override {
    if (!serving_) return absl::FailedPreconditionError("RetireSequence before StartServing");
    return slots_.Release(slot);
  }
  absl::Status RaggedStep(std::span<const RaggedChunk> chunks,
                          std::vector<float>* last_logits) override {
    return Ragged(chunks, last_logits, nullptr);
  }
  absl::StatusOr<double> RankZeroValue(double value) override {
    return collective_.RankZeroValue(value);
  }
  absl::Status RaggedStepGreedy(std::span<const RaggedChunk> chunks,
                                std::vector<int32_t>* next) override {
    return Ragged(chunks, nullptr, next);
  }

  // graphs=persistent: the kernel's tables, built once at model creation.
  absl::Status PreparePersistentDecode() { return persistent_.Prepare(view_ != nullptr); }

  absl::Status Forward(std::span<const int32_t> tokens, int n, LogitsMode mode,
                       std::vector<float>* logits) override {
    return Step(tokens, n, mode, logits, nullptr);
  }
  // The greedy pick runs on the device after the lm_head (cuda::GreedyTokens), and the host reads
  // one token a sequence instead of the logits.
  absl::Status ForwardGreedy(std::span<const int32_t> tokens, int n,
                             std::vector<int32_t>* next) override {
    return Step(tokens, n, LogitsMode::kLast, nullptr, next);
  }

 private:
  // One step: the logits to *logits, or (next non-null) each sequence's greedy token to *next.
  absl::Status Step(std::span<const int32_t> tokens, int n, LogitsMode mode,
                    std::vector<float>* logits, std::vector<int32_t>* next) {
    RETURN_IF_ERROR(ValidateForwardArgs(config_, batch_, capacity_, position_, tokens, n));
    const bool greedy = next != nullptr;
    if (greedy && batch_ > 65535)  // cuda::GreedyTokens runs a grid row a sequence
      return absl::InvalidArgumentError(
          absl::StrCat("ForwardGreedy: batch ", batch_, " exceeds 65535 sequences"));
    if (mode == LogitsMode::kLast && n > 1 && static_cast<int64_t>(batch_) * n > kMaxStepRows)
      return ChunkedPrefill(tokens, n, logits, next);
    MaybeCommitProcessFault(fault_);
    const int rows = batch_ * n;
    const int out_rows = mode == LogitsMode::kAll ? rows : batch_;
    RETURN_IF_ERROR(EnsureScratch(rows, out_rows));
    // Inputs go through pinned staging buffers so a captured graph can replay the copies.
    std::copy(tokens.begin(), tokens.end(), h_tokens_.get());
    *h_position_.get() = position_;
    for (int b = 0; b < batch_; ++b) h_last_rows_.get()[b] = b * n + n - 1;

    const bool use_graph = CapturesStep(options_, n, mode == LogitsMode::kLast);
    RETURN_IF_ERROR(RunStep(use_graph, 2 * batch_ + (greedy ? 1 : 0),
                            [&] { return EnqueueStep(rows, n, batch_, mode, greedy, nullptr); }));
    if (persistent_.timeline() && n == 1 && batch_ == 1) persistent_.ReportTimeline();  // TEST ONLY
    if (greedy)
      next->assign(h_next_.get(), h_next_.get() + out_rows);
    else
      logits->assign(h_logits_.get(),
                     h_logits_.get() + static_cast<size_t>(out_rows) * config_.vocab_size);
    position_ += n;
    return absl::OkStatus();
  }

  // A lockstep prefill of more than kMaxStepRows rows, as steps of whole-token chunks per
  // sequence (kMaxStepRows / batch tokens each), so a step's activations stay those of
  // kMaxStepRows rows: at batch 64 and 4096-token prompts, one step would hold 262,144 rows
  // (~45 GB of scratch on qwen3-30b-a3b). Each chunk attends to the ones before it through the
  // cache, as a step after a prefill does; the last chunk's outputs are the step's, its device
  // time the chunks' sum.
  absl::Status ChunkedPrefill(std::span<const int32_t> tokens, int n, std::vector<float>* logits,
                              std::vector<int32_t>* next) {
    const int chunk = std::max(1, kMaxStepRows / batch_);
    std::vector<int32_t> piece, discarded;
    double device_ms = 0;
    for (int start = 0; start < n; start += chunk) {
      const int len = std::min(chunk, n - start);
      piece.resize(static_cast<size_t>(batch_) * len);
      for (int b = 0; b < batch_; ++b)
        std::copy_n(tokens.begin() + static_cast<size_t>(b) * n + start, len,
                    piece.begin() + static_cast<size_t>(b) * len);
      const bool last = start + len == n;
      RETURN_IF_ERROR(
          Step(piece, len, LogitsMode::kLast, last ? logits : nullptr, last ? next : &discarded));
      device_ms += last_step_ms_.value_or(0);
    }
    last_step_ms_ = device_ms;
    return absl::OkStatus();
  }

  // Runs a step's kernels, `enqueue`, eagerly or (use_graph) as the CUDA graph kept under
  // `graph_key`, captured on first use; waits for it and keeps its device time.
  template <typename Enqueue>
  absl::Status RunStep(bool use_graph, int graph_key, const Enqueue& enqueue) {
    // The fast GEMV configs chain their kernels with programmatic dependent launch.
    cuda::SetProgrammaticLaunch(UsesFusedGemv(options_.gemm));
    struct ResetLaunchMode {
      ~ResetLaunchMode() { cuda::SetProgrammaticLaunch(false); }
    } reset_launch_mode;
    if (use_graph) {
      auto it = graphs_.find(graph_key);
      if (it == graphs_.end()) {
        const auto start = std::chrono::steady_clock::now();
        cudaGraph_t graph;
        // The launch log of the capture (core/launch_log.h), recorded whether or not anything
        // records now: every replay runs exactly these kernels and records them as it runs.
        LaunchRecorder& captured = graph_launches_[graph_key];
        captured.Clear();
        ScopedLaunchRecording record_capture(&captured);
        CUDA_OR_DIE(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
        if (auto s = enqueue(); !s.ok()) {
          cudaStreamEndCapture(stream_, &graph);
          return s;
        }
        CUDA_OR_DIE(cudaStreamEndCapture(stream_, &graph));
        cudaGraphExec_t exec;
        CUDA_OR_DIE(cudaGraphInstantiate(&exec, graph, 0));
        cudaGraphDestroy(graph);
        it = graphs_.emplace(graph_key, exec).first;
        capture_seconds_ +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      CUDA_OR_DIE(cudaEventRecord(step_start_, stream_));
      CUDA_OR_DIE(cudaGraphLaunch(it->second, stream_));
      RecordGraphReplay(graph_launches_[graph_key]);
    } else {
      CUDA_OR_DIE(cudaEventRecord(step_start_, stream_));
      RETURN_IF_ERROR(enqueue());
    }
    CUDA_OR_DIE(cudaEventRecord(step_end_, stream_));
    CUDA_OR_DIE(cudaStreamSynchronize(stream_));
    float step_ms = 0;
    CUDA_OR_DIE(cudaEventElapsedTime(&step_ms, step_start_, step_end_));
    last_step_ms_ = step_ms;
    return absl::OkStatus();
  }

  // A ragged step: the logits of each chunk's last token to *logits ([chunks, vocab]), or (next
  // non-null) its greedy token to *next. The rows go decode rows first, then the prefill chunks;
  // a step of decode rows only replays the graph of its bucket (the next power of two of rows),
  // the rows past the decodes padding rows of the spare slot.
  absl::Status Ragged(std::span<const RaggedChunk> chunks, std::vector<float>* logits,
                      std::vector<int32_t>* next) {
    if (!serving_) return absl::FailedPreconditionError("RaggedStep before StartServing");
    RETURN_IF_ERROR(ValidateRaggedChunks(config_, slots_, chunks));
    MaybeCommitProcessFault(fault_);
    MaybeSwapStates();
    std::vector<int> order;  // step order -> chunk index
    for (size_t i = 0; i < chunks.size(); ++i)
      if (chunks[i].tokens.size() == 1) order.push_back(static_cast<int>(i));
    const int decodes = static_cast<int>(order.size());
    int longest = 1, tokens = decodes;
    for (size_t i = 0; i < chunks.size(); ++i)
      if (chunks[i].tokens.size() > 1) {
        order.push_back(static_cast<int>(i));
        longest = std::max(longest, static_cast<int>(chunks[i].tokens.size()));
        tokens += static_cast<int>(chunks[i].tokens.size());
      }
    const bool use_graph = CapturesStep(options_, longest, /*last_logits_only=*/true);
    int rows = tokens, sequences = static_cast<int>(chunks.size());
    if (use_graph) {
      rows = 1;
      while (rows < decodes) rows *= 2;
      sequences = rows;
    }
    RETURN_IF_ERROR(EnsureScratch(rows, sequences));
    RaggedRows plan;
    plan.rows = d_ragged_.get();
    plan.decode_rows = use_graph ? rows : decodes;
    int row = 0;
    for (int k = 0; k < static_cast<int>(order.size()); ++k) {
      const RaggedChunk& c = chunks[order[k]];
      const int length = slots_.length(c.slot);
      const int count = static_cast<int>(c.tokens.size());
      if (count > 1) plan.chunks.push_back({row, count, c.slot});
      for (int t = 0; t < count; ++t, ++row) {
        h_tokens_.get()[row] = c.tokens[t];
        h_ragged_.get()[row] = make_int2(c.slot, length + t);
      }
      h_last_rows_.get()[k] = row - 1;
    }
    for (; row < rows; ++row) {  // padding rows: token 0 at position 0 of the spare slot
      h_tokens_.get()[row] = 0;
      h_ragged_.get()[row] = make_int2(slots_.slots(), 0);
      h_last_rows_.get()[row] = row;
    }
    const bool greedy = next != nullptr;
    RETURN_IF_ERROR(RunStep(use_graph, -(2 * rows + (greedy ? 1 : 0)) - 1, [&] {
      return EnqueueStep(rows, longest, sequences, LogitsMode::kLast, greedy, &plan);
    }));
    const size_t vocab = config_.vocab_size;
    if (greedy) {
      next->resize(chunks.size());
      for (size_t k = 0; k < chunks.size(); ++k) (*next)[order[k]] = h_next_.get()[k];
    } else {
      logits->resize(chunks.size() * vocab);
      for (size_t k = 0; k < chunks.size(); ++k)
        std::copy_n(h_logits_.get() + k * vocab, vocab, logits->data() + order[k] * vocab);
    }
    for (const RaggedChunk& c : chunks) slots_.Advance(c.slot, static_cast<int>(c.tokens.size()));
    return absl::OkStatus();
  }

  // state-slot-swap (TEST ONLY): from ragged step `value` on, the first step with two sequences
  // holding tokens swaps the recurrent states of the two lowest such slots once, as a scheduler
  // that hands a sequence another's state would.
  void MaybeSwapStates() {
    const int64_t step = ragged_steps_++;
    if (fault_.kind != FaultInjection::Kind::kStateSlotSwap || states_swapped_ ||
        step < static_cast<int64_t>(fault_.value))
      return;
    const auto pair = slots_.TwoLowestHoldingTokens();
    if (!pair) return;
    linear_attention_.SwapRecurrentStates(pair->first, pair->second);
    states_swapped_ = true;
  }

  // One forward pass: embeddings, every layer, final norm, lm_head, then the logits to pinned
  // memory or (greedy) each sequence's greedy token.
  // `sequences`: the rows of logits (kLast), each the last row of its sequence; `ragged`: the
  // rows' slots and positions of a ragged step (null: a lockstep batch, n rows a sequence).
  absl::Status EnqueueStep(int rows, int n, int sequences, LogitsMode mode, bool greedy,
                           const RaggedRows* ragged) {
    const int hidden = config_.hidden_size, q_dim = config_.q_dim();
    const float eps = config_.rms_norm_eps;
    // graphs=persistent, batch-1 decode: every layer in one cooperative kernel. Otherwise (and
    // for prefill chunks and larger batches) a chain of kernels per layer.
    const StepPlan step =
        PlanStep(options_,
                 {rows, n, ragged != nullptr, std::max({hidden, q_dim, config_.linear_value_dim()}),
                  linear_.MaxIntermediate(), persistent_.ready(), LaunchRecording()});
    const bool persistent = step.layers == StepLayers::kPersistent;
    // The token ids and position, read from pinned host memory by the step's first kernel, which
    // also gathers the embedding rows and zeroes the persistent kernel's barrier counters: one
    // launch in place of two copies, an embedding kernel and a memset.
    cuda::StepInputArgs in{h_tokens_.get(),   h_position_.get(), rows,    d_tokens_.get(),
                           d_position_.get(), w_.embed,          x_.get()};
    if (persistent) {
      in.zero = persistent_.barrier();
      in.zero_count = persistent_.counters();
    }
    if (ragged) {
      in.host_ragged = h_ragged_.get();
      in.ragged = d_ragged_.get();
    }
    cuda::StepInputs(in, stream_);
    CHECK_LAUNCH();
    // gemm=fused|tma: decode steps take our GEMV path, with the norms and residual adds fused in.
    linear_.set_prefill(n > 1);
    const bool gemv = step.fused_gemv;
    // The launch log's fallbacks (core/launch_log.h), filled while it records.
    for (const std::string& fallback : step.fallbacks) RecordFallback(fallback);
    if (persistent)
      persistent_.Launch(x_.get(), attention_.k_cache(), attention_.v_cache(), capacity_,
                         attention_.rope(), d_position_.get(), attention_.qkv(), attention_.attn(),
                         moe_.router());
    // The blocks add their outputs into x_ (the residual stream); with a communicator (tp > 1,
    // or a named allreduce at tp=1) into partial_, which the seam sums over the ranks before
    // the residual add, as row-parallel o and down projections need.
    float* const x = x_.get();
    float* const out = collective_.active() ? collective_.partial() : x;
    for (int l = 0; l < (persistent ? 0 : config_.num_layers); ++l) {
      if (collective_.active()) collective_.ClearPartial(rows);
      if (config_.AttentionKind(l) == LayerAttention::kLinear) {
        RETURN_IF_ERROR(linear_attention_.Run(l, rows, n, gemv, x, out, ragged));
      } else if (auto s = attention_.Run(l, rows, n, gemv, x, out, d_position_.get(), ragged);
                 !s.ok()) {
        return s;
      }
      RETURN_IF_ERROR(collective_.ReduceIntoResidual(x, rows));
      if (collective_.active()) collective_.ClearPartial(rows);
      if (config_.IsMoeLayer(l)) {
        RETURN_IF_ERROR(moe_.Run(l, rows, n, gemv, x, out));
      } else if (auto s = linear_.DenseMlp(w_.layers[l], rows, gemv, x, out); !s.ok()) {
        return s;
      }
      RETURN_IF_ERROR(collective_.ReduceIntoResidual(x, rows));
      if (fault_.kind == FaultInjection::Kind::kNanLayer && l == static_cast<int>(fault_.value))
        cuda::SetNan(x, stream_);
      CHECK_LAUNCH();
    }
    const int out_rows = mode == LogitsMode::kAll ? rows : sequences;
    const float* final_in = x_.get();
    if (mode == LogitsMode::kLast && rows != sequences) {  // (else x's rows are the last ones)
      CUDA_OR_DIE(cudaMemcpyAsync(d_last_rows_.get(), h_last_rows_.get(), sequences * sizeof(int),
                                  cudaMemcpyHostToDevice, stream_));
      cuda::GatherRows(x_.get(), d_last_rows_.get(), sequences, hidden, linear_.o(), stream_);
      final_in = linear_.o();
    }
    // A rank's lm_head writes its vocabulary shard's logits, gathered below into full rows.
    float* const lm_out = collective_.sharded_vocab() ? collective_.shard_logits() : logits_.get();
    // gemm=fused|tma: the final norm and the lm_head in one GEMV launch (a vocabulary-sized
    // matrix is streamed: cuda::GemvStreams), for the decode rows and a prefill's last rows, in
    // place of a norm kernel and cuBLASLt's GEMM: the streamed GEMV reads a vocabulary-sized
    // lm_head as fast as cuBLASLt does, with two kernels fewer (docs/PERFORMANCE.md).
    if (UsesFusedGemv(options_.gemm) && cuda::GemvSupports(out_rows, hidden)) {
      LinearRunner::FusedGemv g =
          LinearRunner::GemvInput(final_in, out_rows, hidden, w_.final_norm, eps);
      LinearRunner::AddSegment(g, w_.lm_head, {}, lm_out);
      RETURN_IF_ERROR(linear_.RunGemv(g));
    } else {
      if (UsesFusedGemv(options_.gemm) && LaunchRecording())
        RecordFallback(absl::StrCat("gemm=", linear_.GemmValue(), ": lm_head, ",
                                    GemvRefusal(out_rows, hidden),
                                    ": final norm and lm_head unfused (cuBLASLt for bf16 "
                                    "weights), not the fused GEMV"));
      const uint16_t* fb = linear_.NormAndPrepare(final_in, out_rows, hidden, w_.final_norm, eps);
      RETURN_IF_ERROR(linear_.Gemm(linear_.xn(), fb, out_rows, w_.lm_head, {}, lm_out));
    }
    if (collective_.sharded_vocab())
      RETURN_IF_ERROR(collective_.GatherLogits(logits_.get(), out_rows));
    if (fault_.kind == FaultInjection::Kind::kStuckToken)
      cuda::ForceToken(logits_.get(), out_rows, config_.vocab_size,
                       static_cast<int>(fault_.value) % config_.vocab_size, stream_);
    CHECK_LAUNCH();
    if (greedy) {
      cuda::GreedyTokens(logits_.get(), out_rows, config_.vocab_size, greedy_scratch_,
                         h_next_.get(), stream_);
      CHECK_LAUNCH();
    } else {
      CUDA_OR_DIE(
          cudaMemcpyAsync(h_logits_.get(), logits_.get(),
                          static_cast<size_t>(out_rows) * config_.vocab_size * sizeof(float),
                          cudaMemcpyDeviceToHost, stream_));
    }
    return absl::OkStatus();
  }

  // Scratch for `rows` rows and `out_rows` rows of logits, grown (never shrunk) on demand: the
  // model's own, then each runner's. Logits buffers are sized by the rows whose logits are
  // returned (prefill of 64 x 512 tokens returns 64 rows, not 32768).
  absl::Status EnsureScratch(int rows, int out_rows) {
    if (rows <= scratch_rows_ && out_rows <= logit_rows_ && capacity_ <= scratch_capacity_)
      return absl::OkStatus();
    rows = std::max(rows, scratch_rows_);
    out_rows = std::max(out_rows, logit_rows_);
    DestroyGraphs();  // they point at old buffers
    FreeScratch();
    const size_t r = rows;
    RETURN_IF_ERROR(x_.Allocate(r * config_.hidden_size));
    RETURN_IF_ERROR(logits_.Allocate(collective_.LogitsCount(out_rows)));
    RETURN_IF_ERROR(collective_.AllocateScratch(rows, out_rows));
    RETURN_IF_ERROR(linear_.AllocateScratch(rows));
    RETURN_IF_ERROR(attention_.AllocateScratch(rows, capacity_));
    RETURN_IF_ERROR(linear_attention_.AllocateScratch(rows));
    RETURN_IF_ERROR(moe_.AllocateScratch(rows));
    RETURN_IF_ERROR(d_tokens_.Allocate(r));
    RETURN_IF_ERROR(d_last_rows_.Allocate(r));
    RETURN_IF_ERROR(d_position_.Allocate(1));
    RETURN_IF_ERROR(d_ragged_.Allocate(r));
    RETURN_IF_ERROR(h_ragged_.Allocate(r));
    RETURN_IF_ERROR(h_tokens_.Allocate(r));
    RETURN_IF_ERROR(h_last_rows_.Allocate(r));
    RETURN_IF_ERROR(h_position_.Allocate(1));
    RETURN_IF_ERROR(h_logits_.Allocate(static_cast<size_t>(out_rows) * config_.vocab_size));
    RETURN_IF_ERROR(h_next_.Allocate(out_rows));
    // The kernels read and write these host buffers through their device mappings.
    for (void* p : {static_cast<void*>(h_tokens_.get()), static_cast<void*>(h_position_.get()),
                    static_cast<void*>(h_next_.get()), static_cast<void*>(h_ragged_.get())}) {
      void* mapped = nullptr;
      CUDA_OR_DIE(cudaHostGetDevicePointer(&mapped, p, 0));
      if (mapped != p)
        return absl::InternalError(
            "pinned host memory is not mapped at its own address (no unified addressing?): the "
            "step kernels cannot read it");
    }
    RETURN_IF_ERROR(greedy_keys_.Allocate(out_rows));
    RETURN_IF_ERROR(greedy_tickets_.Allocate(out_rows));
    greedy_scratch_.keys = greedy_keys_.get();
    greedy_scratch_.tickets = greedy_tickets_.get();
    // On the step's stream: a cudaMemset runs on the legacy stream, which stream_ (non-blocking)
    // does not wait for, so the first greedy step could read keys not yet zeroed.
    CUDA_OR_DIE(
        cudaMemsetAsync(greedy_scratch_.keys, 0, out_rows * sizeof(unsigned long long), stream_));
    CUDA_OR_DIE(cudaMemsetAsync(greedy_scratch_.tickets, 0, out_rows * sizeof(unsigned), stream_));
    scratch_rows_ = rows;
    logit_rows_ = out_rows;
    scratch_capacity_ = capacity_;
    return absl::OkStatus();
  }

  void DestroyGraphs() {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    graphs_.clear();
    graph_launches_.clear();
  }

  void FreeScratch() {
    linear_.FreeScratch();
    attention_.FreeScratch();
    linear_attention_.FreeScratch();
    moe_.FreeScratch();
    collective_.FreeScratch();
    for (DeviceBuffer<float>* b : {&x_, &logits_}) b->reset();
    for (DeviceBuffer<int>* b : {&d_tokens_, &d_last_rows_, &d_position_}) b->reset();
    d_ragged_.reset();
    greedy_keys_.reset();
    greedy_tickets_.reset();
    greedy_scratch_ = {};
    h_tokens_.reset();
    h_last_rows_.reset();
    h_position_.reset();
    h_logits_.reset();
    h_next_.reset();
    h_ragged_.reset();
    scratch_rows_ = 0;
    logit_rows_ = 0;
  }

  const ModelConfig config_;
  std::shared_ptr<DeviceWeights> dw_;
  std::unique_ptr<QuantView> view_;  // quantized models only
  const ModelWeights& w_;
  const CudaOptions options_;
  const FaultInjection fault_;  // TEST ONLY
  cudaStream_t stream_ = nullptr;
  const RunnerContext context_;
  LinearRunner linear_;
  AttentionRunner attention_;
  LinearAttentionRunner linear_attention_;
  MoeRunner moe_;
  PersistentDecoder persistent_;  // graphs=persistent: ready() once prepared
  int batch_ = 0, capacity_ = 0, position_ = 0, scratch_rows_ = 0, scratch_capacity_ = 0,
      logit_rows_ = 0;
  DeviceBuffer<float> x_;       // [rows, hidden]: the residual stream
  DeviceBuffer<float> logits_;  // [out_rows, vocab] (padded: CollectiveRunner::LogitsCount)
  CollectiveRunner collective_;
  DeviceBuffer<int> d_tokens_, d_last_rows_, d_position_;
  PinnedBuffer<int32_t> h_tokens_;
  PinnedBuffer<int> h_last_rows_, h_position_;
  PinnedBuffer<float> h_logits_;
  PinnedBuffer<int32_t> h_next_;  // ForwardGreedy's tokens, written by cuda::GreedyTokens
  DeviceBuffer<unsigned long long> greedy_keys_;
  DeviceBuffer<unsigned> greedy_tickets_;
  cuda::GreedyScratch greedy_scratch_{};  // views of the two above
  DeviceBuffer<int2> d_ragged_;           // ragged steps: each row's (KV slot, position)
  PinnedBuffer<int2> h_ragged_;  // its pinned staging copy, read by the step's first kernel
  bool serving_ = false;
  KvSlotAllocator slots_;        // serving: the sequences' slots and lengths
  int64_t ragged_steps_ = 0;     // since StartServing (state-slot-swap counts them)
  bool states_swapped_ = false;  // state-slot-swap has struck
  // Lockstep decode graphs by 2 * batch + (greedy step); ragged decode buckets by
  // -(2 * rows + (greedy step)) - 1.
  std::map<int, cudaGraphExec_t> graphs_;
  std::map<int, LaunchRecorder> graph_launches_;  // what each graph's capture launched
  double capture_seconds_ = 0;
  cudaEvent_t step_start_ = nullptr, step_end_ = nullptr;
  std::optional<double> last_step_ms_;
  // A lockstep step's rows (ChunkedPrefill); the memory plan sizes scratch by them.
  static constexpr int kMaxStepRows = kMaxLockstepStepRows;
};

// TEST ONLY (test_kernel=sm100a): the sm_100a-only kernel, launched once; where the binary has
// no image for the GPU the launch's error comes back as Unimplemented, in the driver's words.
absl::Status RunSm100aTestKernel() {
  DeviceBuffer<int> flag;
  if (!flag.Allocate(1).ok())
    return absl::ResourceExhaustedError("test_kernel=sm100a: cudaMalloc failed");
  cudaError_t e = cuda::LaunchSm100aTestKernel(flag.get(), nullptr);
  int value = 0;
  if (e == cudaSuccess) e = cudaMemcpy(&value, flag.get(), sizeof(int), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess)
    return absl::UnimplementedError(absl::StrCat("test_kernel=sm100a: launch failed (",
                                                 cudaGetErrorName(e), ": ", cudaGetErrorString(e),
                                                 ")"));
  if (value != 100)
    return absl::InternalError(absl::StrCat("test_kernel=sm100a: the kernel wrote ", value));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> MakeCudaModel(HostModel& host, const CudaOptions& options,
                                                     const FaultInjection& fault,
                                                     const CudaRank& rank) {
  const int tp = options.parallel.tp;
  if (const std::string why = CudaModelRefusal(host.config, host.quant_format, options);
      !why.empty())
    return absl::UnimplementedError(why);
  // tp > 1: this rank's shard of the host's weights, cut on the host as the CPU reference cuts
  // it, then uploaded.
  std::unique_ptr<RankShard> shard;
  if (tp > 1) {
    if (!rank.comm)
      return absl::UnimplementedError(
          absl::StrCat("tp=", tp,
                       ": the CUDA engine runs tp > 1 in rank processes, each given its rank's "
                       "communicator (JoinCudaRank); none was given"));
    if (rank.comm->ranks() != tp)
      return absl::InvalidArgumentError(absl::StrCat("tp=", tp, ": the rank's communicator joins ",
                                                     rank.comm->ranks(), " ranks"));
    if (fault.kind == FaultInjection::Kind::kBadQuantScale)
      return absl::InvalidArgumentError(absl::StrCat(
          "tp=", tp,
          ": bad-quant-scale corrupts a scale tensor of the whole model, which no rank holds "
          "(each holds its shard); it runs at tp=1"));
    RETURN_IF_ERROR(MaterializeHostWeights(host));
    // Every rank judges every rank's cuts, so that all of them refuse together, before any
    // weight is sliced or uploaded.
    auto off_grid = QuantizedShardRefusal(host, tp, options.parallel.expert_parallel);
    if (!off_grid.ok()) return absl::UnimplementedError(off_grid.status().message());
    if (!off_grid->empty())
      return absl::UnimplementedError(
          absl::StrCat("device=cuda runs quantized shards only (the CPU reference decodes such "
                       "cuts exactly to fp32): ",
                       *off_grid));
    auto made = ShardHostModel(host, tp, rank.comm->rank(), options.parallel.expert_parallel);
    if (!made.ok()) return absl::UnimplementedError(made.status().message());
    shard = *std::move(made);
    if (const std::string why =
            CudaModelRefusal(shard->host->config, shard->host->quant_format, options);
        !why.empty())
      return absl::UnimplementedError(absl::StrCat("rank shard: ", why));
  }
  if (options.test_kernel == TestKernel::kSm100a) RETURN_IF_ERROR(RunSm100aTestKernel());
  const ModelConfig& c = shard ? shard->host->config : host.config;
  ASSIGN_OR_RETURN(auto weights,
                   shard ? UploadShardWeights(host, shard->host->weights) : UploadWeights(host));
  std::unique_ptr<cuda::CublasLtGemm> gemm;
  if (UsesCublasLt(options.gemm)) {
    ASSIGN_OR_RETURN(auto made, cuda::CublasLtGemm::Create());
    gemm = std::move(made);
  }
  std::unique_ptr<QuantView> view;
  if (host.quant_format != QuantFormat::kNone) {
    ASSIGN_OR_RETURN(auto made,
                     BuildQuantView(shard ? *shard->host : host, *weights, options, fault));
    view = std::move(made);
  }
  std::unique_ptr<cuda::CublasGroupedGemm> grouped;
  // moe=fused also takes long prefill chunks to the grouped GEMMs (bf16 experts, cuBLAS configs).
  if (c.is_moe() && (options.moe == Moe::kGrouped ||
                     (options.moe == Moe::kFused && UsesCublasLt(options.gemm)))) {
    ASSIGN_OR_RETURN(auto made, cuda::CublasGroupedGemm::Create());
    grouped = std::move(made);
  }
  auto model = std::make_unique<CudaModel>(c, std::move(weights), options, fault, std::move(gemm),
                                           std::move(grouped), std::move(view), rank,
                                           shard ? shard->vocab_begin : 0);
  if (IsPersistent(options.graphs)) RETURN_IF_ERROR(model->PreparePersistentDecode());
  return std::unique_ptr<Model>(std::move(model));
}

absl::StatusOr<std::vector<uint8_t>> CopyDeviceTensorToHost(HostModel& host, size_t index) {
  ASSIGN_OR_RETURN(auto weights, UploadWeights(host));
  if (index >= host.specs.size()) return absl::OutOfRangeError("tensor index");
  const HostTensor& t = weights->tensors[index];
  std::vector<uint8_t> bytes(static_cast<size_t>(host.specs[index].numel()) * DTypeSize(t.dtype));
  CUDA_OR_DIE(cudaMemcpy(bytes.data(), t.data, bytes.size(), cudaMemcpyDeviceToHost));
  return bytes;
}

}  // namespace infersweep
