#include "engine/cuda/attention_runner.h"

#include <algorithm>

#include "api/status_macros.h"
#include "core/unreachable.h"
#include "engine/cuda/device_util.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/ops.h"

namespace infersweep {

AttentionRunner::AttentionRunner(const RunnerContext& context, LinearRunner& linear)
    : config_(context.config),
      w_(context.weights),
      options_(context.options),
      fault_(context.fault),
      stream_(context.stream),
      linear_(linear),
      heads_{config_.num_q_heads, config_.num_kv_heads, config_.head_dim},
      plan_([this] {
        // The model refusal asked the same plan before the model was built.
        absl::StatusOr<AttentionPlan> plan = PlanAttention(options_, heads_);
        if (!plan.ok()) Unreachable("AttentionRunner: the model refusal let a refused plan by");
        return *plan;
      }()),
      cache_index_(config_.LayerSlots(LayerAttention::kFull)),
      cache_layers_(*std::max_element(cache_index_.begin(), cache_index_.end()) + 1) {}

cuda::KvDtype AttentionRunner::kv_dtype() const {
  switch (plan_.kv) {
    case KvCache::kBf16:
      return cuda::KvDtype::kBf16;
    case KvCache::kFp8:
      return cuda::KvDtype::kFp8;
    case KvCache::kFp32:
      return cuda::KvDtype::kFp32;
  }
  Unreachable("AttentionRunner::kv_dtype");
}

absl::Status AttentionRunner::AllocateCache(int batch, int max_tokens) {
  // The old cache and table go first: the new ones may need their memory.
  for (DeviceBuffer<char>* b : {&k_cache_, &v_cache_}) b->reset();
  for (DeviceBuffer<float>* b : {&k_scale_, &v_scale_}) b->reset();
  rope_.reset();
  batch_ = capacity_ = 0;
  // Partial RoPE rotates the first rotary_dim dims as a head of that size: its table.
  const int rotary_dim = config_.rotary_dim();
  RETURN_IF_ERROR(rope_.Allocate(static_cast<size_t>(max_tokens) * (rotary_dim / 2)));
  cuda::BuildRopeTable(max_tokens, rotary_dim, config_.rope_theta, rope_.get(), stream_);
  CHECK_LAUNCH();
  const size_t elems = static_cast<size_t>(cache_layers_) * batch * max_tokens * config_.kv_dim();
  RETURN_IF_ERROR(k_cache_.Allocate(elems * kv_cache_bytes_per_element()));
  RETURN_IF_ERROR(v_cache_.Allocate(elems * kv_cache_bytes_per_element()));
  if (plan_.kv_scales) {
    const size_t scales =
        static_cast<size_t>(cache_layers_) * batch * max_tokens * config_.num_kv_heads;
    RETURN_IF_ERROR(k_scale_.Allocate(scales));
    RETURN_IF_ERROR(v_scale_.Allocate(scales));
  }
  batch_ = batch;
  capacity_ = max_tokens;
  if (plan_.zero_cache) {
    CUDA_OR_DIE(cudaMemsetAsync(k_cache_.get(), 0, elems * kv_cache_bytes_per_element(), stream_));
    CUDA_OR_DIE(cudaMemsetAsync(v_cache_.get(), 0, elems * kv_cache_bytes_per_element(), stream_));
  }
  switch (plan_.path) {
    case AttentionPath::kNaive:
    case AttentionPath::kFlash:
      break;
    case AttentionPath::kCudnn: {
      // The decode plan is made here, outside any graph capture; a prefill's on first use.
      cudnn_.reset();
      RETURN_IF_ERROR(seq_lens_.Allocate(2 * static_cast<size_t>(batch)));
      ASSIGN_OR_RETURN(auto made, CudnnAttention::Create({config_.num_q_heads, config_.num_kv_heads,
                                                          config_.head_dim, max_tokens},
                                                         stream_));
      cudnn_ = std::move(made);
      RETURN_IF_ERROR(cudnn_->Prepare(batch, 1));
      // Serving: the decode rows' bf16 Q and O as rows of their slots, every slot one query.
      RETURN_IF_ERROR(slot_io_.Allocate(static_cast<size_t>(batch) * config_.q_dim()));
      break;
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionRunner::AllocateScratch(int rows, int capacity) {
  const size_t r = rows, q_dim = config_.q_dim(), kv_dim = config_.kv_dim();
  const size_t scores = static_cast<size_t>(AttentionScoreFloats(plan_, heads_, rows, capacity));
  // Gated attention: q_proj's output is [q_h | gate_h] per head, twice q_dim.
  const size_t q_rows = config_.attn_output_gate ? 2 * q_dim : q_dim;
  const size_t gated = config_.attn_output_gate ? r * q_dim : 0;
  const size_t cudnn_io = plan_.cudnn_io ? r * q_dim : 0;
  return AllocateBuffers<float>({{&q_, r * q_dim},
                                 {&k_, r * kv_dim},
                                 {&qkv_, r * (q_rows + 2 * kv_dim)},
                                 {&v_, r * kv_dim},
                                 {&attn_, r * q_dim},
                                 {&scores_, scores},
                                 {&q_gated_, 2 * gated},
                                 {&cudnn_io_, cudnn_io}});
}

void AttentionRunner::FreeScratch() {
  for (DeviceBuffer<float>* b : {&q_, &k_, &v_, &qkv_, &attn_, &scores_, &q_gated_, &cudnn_io_})
    b->reset();
}

absl::Status AttentionRunner::Run(int l, int rows, int n, bool gemv, float* x, float* out,
                                  const int* d_position, const RaggedRows* ragged) {
  const int hidden = config_.hidden_size, q_dim = config_.q_dim(), kv_dim = config_.kv_dim();
  const float eps = config_.rms_norm_eps;
  float* const xn = linear_.xn();
  const LayerWeights& lw = w_.layers[l];
  const bool gated = config_.attn_output_gate;
  float* const q_raw = gated ? q_gated_.get() : q_.get();  // q_proj's output
  cuda::QkvRows projected{q_raw, static_cast<int>(lw.q.rows), k_.get(), v_.get(), kv_dim};
  if (gemv) {  // input RMSNorm, q, k, v (+ biases): one launch
    LinearRunner::FusedGemv a = LinearRunner::GemvInput(x, rows, hidden, lw.input_norm, eps);
    LinearRunner::AddSegment(a, lw.q, lw.q_bias, q_raw);
    LinearRunner::AddSegment(a, lw.k, lw.k_bias, k_.get());
    LinearRunner::AddSegment(a, lw.v, lw.v_bias, v_.get());
    RETURN_IF_ERROR(linear_.RunGemv(a, /*projection=*/true));
  } else {
    const uint16_t* xb = linear_.NormAndPrepare(x, rows, hidden, lw.input_norm, eps);
    if (linear_.QkvContiguous(lw)) {  // one GEMM into [rows, q | k | v]
      const int q_rows = static_cast<int>(lw.q.rows), width = q_rows + 2 * kv_dim;
      const MatrixRef qkv{lw.q.data, DType::kBF16, width, lw.q.cols};
      RETURN_IF_ERROR(linear_.cublaslt()->Run(xb, rows, qkv, qkv_.get(), stream_));
      projected = {qkv_.get(), width, qkv_.get() + q_rows, qkv_.get() + q_rows + kv_dim, width};
    } else {
      RETURN_IF_ERROR(linear_.Gemm(xn, xb, rows, lw.q, lw.q_bias, q_raw));
      RETURN_IF_ERROR(linear_.Gemm(xn, xb, rows, lw.k, lw.k_bias, k_.get()));
      RETURN_IF_ERROR(linear_.Gemm(xn, xb, rows, lw.v, lw.v_bias, v_.get()));
    }
  }
  // Gated attention: q_proj's rows are [q_h | gate_h] per head; the RoPE kernel reads the q halves
  // and the output gate the others, in place.
  const float* const gated_rows = projected.q;
  const int gated_stride = projected.q_stride;
  if (gated) projected.q_head_stride = 2 * config_.head_dim;
  const cuda::KvCache cache = LayerCache(l);
  const MatrixRef q_norm = config_.qk_norm ? lw.q_norm : MatrixRef{};
  const MatrixRef k_norm = config_.qk_norm ? lw.k_norm : MatrixRef{};
  const int2* row_map = ragged ? ragged->rows : nullptr;
  const int rope_n = ragged ? 1 : n;
  if (config_.rotary_dim() != config_.head_dim)
    cuda::QkNormPartialRopeAppend(projected, q_.get(), rows, rope_n, config_.num_q_heads,
                                  config_.num_kv_heads, config_.head_dim, config_.rotary_dim(),
                                  q_norm, k_norm, eps, rope_.get(), d_position, cache, stream_,
                                  row_map);
  else
    cuda::QkNormRopeAppend(projected, q_.get(), rows, rope_n, config_.num_q_heads,
                           config_.num_kv_heads, config_.head_dim, q_norm, k_norm, eps, rope_.get(),
                           d_position, cache, stream_, row_map);
  if (!ragged) {
    RETURN_IF_ERROR(Attend(cache, 0, rows, n, d_position, nullptr));
  } else {
    if (ragged->decode_rows > 0)
      RETURN_IF_ERROR(Attend(cache, 0, ragged->decode_rows, 1, d_position, row_map));
    // A prefill chunk is a lockstep chunk of one sequence: its slot's cache, its first row's
    // position (the pair's .y) as the chunk's position.
    for (const RaggedRows::Chunk& c : ragged->chunks) {
      RETURN_IF_ERROR(Attend(SlotCache(cache, c.slot), c.first_row, c.tokens, c.tokens,
                             reinterpret_cast<const int*>(ragged->rows + c.first_row) + 1,
                             nullptr));
    }
  }
  if (gated)
    cuda::SigmoidGateHeads(attn_.get(), gated_rows, gated_stride, rows, config_.num_q_heads,
                           config_.head_dim, stream_);
  CHECK_LAUNCH();
  const bool bad_scale = fault_.kind == FaultInjection::Kind::kBadScale && l == 0;
  const float o_scale = bad_scale ? static_cast<float>(fault_.value) : 1.f;
  if (gemv) {  // o projection added straight into `out` (the residual stream or its partial)
    LinearRunner::FusedGemv a = LinearRunner::GemvInput(attn_.get(), rows, q_dim, {});
    LinearRunner::AddSegment(a, lw.o, lw.o_bias, out);
    a.accumulate = true;
    a.scale = o_scale;
    RETURN_IF_ERROR(linear_.RunGemv(a, /*projection=*/true));
  } else {
    const uint16_t* ab = linear_.PrepareInput(attn_.get(), static_cast<int64_t>(rows) * q_dim);
    RETURN_IF_ERROR(linear_.GemmAccumulate(attn_.get(), ab, rows, lw.o, lw.o_bias, o_scale, out));
  }
  CHECK_LAUNCH();
  return absl::OkStatus();
}

cuda::KvCache AttentionRunner::LayerCache(int l) const {
  const size_t layer_rows = static_cast<size_t>(cache_index_[l]) * batch_ * capacity_;
  const size_t layer_bytes = layer_rows * config_.kv_dim() * kv_cache_bytes_per_element();
  const size_t layer_scales = layer_rows * config_.num_kv_heads;
  return {k_cache_.get() + layer_bytes,
          v_cache_.get() + layer_bytes,
          kv_dtype(),
          capacity_,
          k_scale_ ? k_scale_.get() + layer_scales : nullptr,
          v_scale_ ? v_scale_.get() + layer_scales : nullptr};
}

cuda::KvCache AttentionRunner::SlotCache(const cuda::KvCache& layer, int slot) const {
  const size_t slot_rows = static_cast<size_t>(slot) * capacity_;
  const size_t slot_bytes = slot_rows * config_.kv_dim() * kv_cache_bytes_per_element();
  const size_t slot_scales = slot_rows * config_.num_kv_heads;
  return {static_cast<char*>(layer.k) + slot_bytes,
          static_cast<char*>(layer.v) + slot_bytes,
          layer.dtype,
          capacity_,
          layer.k_scale ? layer.k_scale + slot_scales : nullptr,
          layer.v_scale ? layer.v_scale + slot_scales : nullptr};
}

absl::Status AttentionRunner::Attend(const cuda::KvCache& cache, int first_row, int rows, int n,
                                     const int* d_position, const int2* ragged) {
  const size_t offset = static_cast<size_t>(first_row) * config_.q_dim();
  switch (plan_.path) {
    case AttentionPath::kCudnn: {
      const int q_dim = config_.q_dim();
      if (ragged != nullptr) {
        // A ragged step's decode rows: each row's query goes to its slot's row of a batch of every
        // slot (the cache's `batch_`, spare included), each slot one query over its own KV
        // length (1 where no row decodes), and the outputs come back to the rows. One plan, made
        // with the cache, serves every such step and its graph's replays.
        uint16_t* q = reinterpret_cast<uint16_t*>(slot_io_.get());
        uint16_t* o = q + static_cast<int64_t>(batch_) * q_dim;
        cuda::SlotLengths(ragged, rows, batch_, seq_lens_.get(), seq_lens_.get() + batch_, stream_);
        cuda::RowsToSlotsBf16(q_.get() + offset, rows, q_dim, ragged, q, stream_);
        RETURN_IF_ERROR(cudnn_->Run(q, cache.k, cache.v, seq_lens_.get(), seq_lens_.get() + batch_,
                                    batch_, 1, o));
        cuda::SlotsToRowsF32(o, rows, q_dim, ragged, attn_.get() + offset, stream_);
        return absl::OkStatus();
      }
      // A lockstep chunk: `rows` is `batch` sequences of n tokens, sequence b in cache slot b (a
      // ragged step's prefill chunk: one sequence, its slot's cache).
      const int batch = rows / n;
      const int64_t count = static_cast<int64_t>(rows) * config_.q_dim();
      uint16_t* q = reinterpret_cast<uint16_t*>(cudnn_io_.get());
      uint16_t* o = q + count;
      cuda::SequenceLengths(d_position, n, batch, seq_lens_.get(), seq_lens_.get() + batch,
                            stream_);
      cuda::ToBf16(q_.get() + offset, count, q, stream_);
      RETURN_IF_ERROR(
          cudnn_->Run(q, cache.k, cache.v, seq_lens_.get(), seq_lens_.get() + batch, batch, n, o));
      cuda::UpcastToF32({o, DType::kBF16, rows, config_.q_dim()}, attn_.get() + offset, stream_);
      return absl::OkStatus();
    }
    case AttentionPath::kFlash:
      cuda::AttentionFlash(q_.get() + offset, cache, rows, n, config_.num_q_heads,
                           config_.num_kv_heads, config_.head_dim, d_position,
                           cuda::FlashSplits(rows, config_.num_kv_heads, capacity_), scores_.get(),
                           attn_.get() + offset, stream_, ragged);
      return absl::OkStatus();
    case AttentionPath::kNaive:
      cuda::AttentionNaive(q_.get() + offset, static_cast<const float*>(cache.k),
                           static_cast<const float*>(cache.v), rows, n, config_.num_q_heads,
                           config_.num_kv_heads, config_.head_dim, d_position, capacity_,
                           scores_.get(), attn_.get() + offset, stream_, ragged);
      return absl::OkStatus();
  }
  Unreachable("AttentionRunner::Attend");
}

}  // namespace infersweep
