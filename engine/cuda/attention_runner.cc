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

AttentionRunner::~AttentionRunner() {
  FreeScratch();
  FreeCache();
  if (rope_) cudaFree(rope_);
  if (seq_lens_) cudaFree(seq_lens_);
}

void AttentionRunner::FreeCache() {
  for (void* p : {static_cast<void*>(k_cache_), static_cast<void*>(v_cache_),
                  static_cast<void*>(k_scale_), static_cast<void*>(v_scale_)})
    if (p) cudaFree(p);
  k_cache_ = v_cache_ = nullptr;
  k_scale_ = v_scale_ = nullptr;
}

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
  FreeCache();
  if (rope_) cudaFree(rope_);
  rope_ = nullptr;
  batch_ = capacity_ = 0;
  // Partial RoPE rotates the first rotary_dim dims as a head of that size: its table.
  const int rotary_dim = config_.rotary_dim();
  auto rope = DeviceAlloc<float2>(static_cast<size_t>(max_tokens) * (rotary_dim / 2));
  if (!rope.ok()) return rope.status();
  rope_ = *rope;
  cuda::BuildRopeTable(max_tokens, rotary_dim, config_.rope_theta, rope_, stream_);
  CHECK_LAUNCH();
  const size_t elems = static_cast<size_t>(cache_layers_) * batch * max_tokens * config_.kv_dim();
  auto k = DeviceAlloc<char>(elems * kv_cache_bytes_per_element());
  if (!k.ok()) return k.status();
  k_cache_ = *k;
  auto v = DeviceAlloc<char>(elems * kv_cache_bytes_per_element());
  if (!v.ok()) return v.status();
  v_cache_ = *v;
  if (plan_.kv_scales) {
    const size_t scales =
        static_cast<size_t>(cache_layers_) * batch * max_tokens * config_.num_kv_heads;
    auto k_scale = DeviceAlloc<float>(scales);
    if (!k_scale.ok()) return k_scale.status();
    k_scale_ = *k_scale;
    auto v_scale = DeviceAlloc<float>(scales);
    if (!v_scale.ok()) return v_scale.status();
    v_scale_ = *v_scale;
  }
  batch_ = batch;
  capacity_ = max_tokens;
  if (plan_.zero_cache) {
    CUDA_OR_DIE(cudaMemsetAsync(k_cache_, 0, elems * kv_cache_bytes_per_element(), stream_));
    CUDA_OR_DIE(cudaMemsetAsync(v_cache_, 0, elems * kv_cache_bytes_per_element(), stream_));
  }
  switch (plan_.path) {
    case AttentionPath::kNaive:
    case AttentionPath::kFlash:
      break;
    case AttentionPath::kCudnn: {
      // The decode plan is made here, outside any graph capture; a prefill's on first use.
      cudnn_.reset();
      if (seq_lens_) cudaFree(seq_lens_);
      seq_lens_ = nullptr;
      auto lens = DeviceAlloc<int32_t>(2 * static_cast<size_t>(batch));
      if (!lens.ok()) return lens.status();
      seq_lens_ = *lens;
      auto made = CudnnAttention::Create(
          {config_.num_q_heads, config_.num_kv_heads, config_.head_dim, max_tokens}, stream_);
      if (!made.ok()) return made.status();
      cudnn_ = std::move(*made);
      if (auto s = cudnn_->Prepare(batch, 1); !s.ok()) return s;
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
  return AllocateFloatBuffers({{&q_, r * q_dim},
                               {&k_, r * kv_dim},
                               {&qkv_, r * (q_rows + 2 * kv_dim)},
                               {&v_, r * kv_dim},
                               {&attn_, r * q_dim},
                               {&scores_, scores},
                               {&q_gated_, 2 * gated},
                               {&gate_, gated},
                               {&cudnn_io_, cudnn_io}});
}

void AttentionRunner::FreeScratch() {
  FreeFloatBuffers({&q_, &k_, &v_, &qkv_, &attn_, &scores_, &q_gated_, &gate_, &cudnn_io_});
}

absl::Status AttentionRunner::Run(int l, int rows, int n, bool gemv, float* x, float* out,
                                  const int* d_position, const RaggedRows* ragged) {
  const int hidden = config_.hidden_size, q_dim = config_.q_dim(), kv_dim = config_.kv_dim();
  const float eps = config_.rms_norm_eps;
  float* const xn = linear_.xn();
  const LayerWeights& lw = w_.layers[l];
  const bool gated = config_.attn_output_gate;
  float* const q_raw = gated ? q_gated_ : q_;  // q_proj's output
  cuda::QkvRows projected{q_raw, static_cast<int>(lw.q.rows), k_, v_, kv_dim};
  if (gemv) {  // input RMSNorm, q, k, v (+ biases): one launch
    LinearRunner::FusedGemv a = LinearRunner::GemvInput(x, rows, hidden, lw.input_norm, eps);
    LinearRunner::AddSegment(a, lw.q, lw.q_bias, q_raw);
    LinearRunner::AddSegment(a, lw.k, lw.k_bias, k_);
    LinearRunner::AddSegment(a, lw.v, lw.v_bias, v_);
    if (auto s = linear_.RunGemv(a, /*projection=*/true); !s.ok()) return s;
  } else {
    const uint16_t* xb = linear_.NormAndPrepare(x, rows, hidden, lw.input_norm, eps);
    if (linear_.QkvContiguous(lw)) {  // one GEMM into [rows, q | k | v]
      const int q_rows = static_cast<int>(lw.q.rows), width = q_rows + 2 * kv_dim;
      const MatrixRef qkv{lw.q.data, DType::kBF16, width, lw.q.cols};
      if (auto s = linear_.cublaslt()->Run(xb, rows, qkv, qkv_, stream_); !s.ok()) return s;
      projected = {qkv_, width, qkv_ + q_rows, qkv_ + q_rows + kv_dim, width};
    } else {
      if (auto s = linear_.Gemm(xn, xb, rows, lw.q, lw.q_bias, q_raw); !s.ok()) return s;
      if (auto s = linear_.Gemm(xn, xb, rows, lw.k, lw.k_bias, k_); !s.ok()) return s;
      if (auto s = linear_.Gemm(xn, xb, rows, lw.v, lw.v_bias, v_); !s.ok()) return s;
    }
  }
  if (gated) {  // [q_h | gate_h] per head -> q_ and gate_
    cuda::SplitGatedQuery(projected.q, projected.q_stride, rows, config_.num_q_heads,
                          config_.head_dim, q_, gate_, stream_);
    projected.q = q_;
    projected.q_stride = q_dim;
  }
  const cuda::KvCache cache = LayerCache(l);
  const MatrixRef q_norm = config_.qk_norm ? lw.q_norm : MatrixRef{};
  const MatrixRef k_norm = config_.qk_norm ? lw.k_norm : MatrixRef{};
  const int2* row_map = ragged ? ragged->rows : nullptr;
  const int rope_n = ragged ? 1 : n;
  if (config_.rotary_dim() != config_.head_dim)
    cuda::QkNormPartialRopeAppend(projected, q_, rows, rope_n, config_.num_q_heads,
                                  config_.num_kv_heads, config_.head_dim, config_.rotary_dim(),
                                  q_norm, k_norm, eps, rope_, d_position, cache, stream_, row_map);
  else
    cuda::QkNormRopeAppend(projected, q_, rows, rope_n, config_.num_q_heads, config_.num_kv_heads,
                           config_.head_dim, q_norm, k_norm, eps, rope_, d_position, cache, stream_,
                           row_map);
  if (!ragged) {
    if (auto s = Attend(cache, 0, rows, n, d_position, nullptr); !s.ok()) return s;
  } else {
    if (ragged->decode_rows > 0)
      if (auto s = Attend(cache, 0, ragged->decode_rows, 1, d_position, row_map); !s.ok()) return s;
    // A prefill chunk is a lockstep chunk of one sequence: its slot's cache, its first row's
    // position (the pair's .y) as the chunk's position.
    for (const RaggedRows::Chunk& c : ragged->chunks) {
      if (auto s = Attend(SlotCache(cache, c.slot), c.first_row, c.tokens, c.tokens,
                          reinterpret_cast<const int*>(ragged->rows + c.first_row) + 1, nullptr);
          !s.ok())
        return s;
    }
  }
  if (gated) cuda::SigmoidGate(attn_, gate_, static_cast<int64_t>(rows) * q_dim, stream_);
  CHECK_LAUNCH();
  const bool bad_scale = fault_.kind == FaultInjection::Kind::kBadScale && l == 0;
  const float o_scale = bad_scale ? static_cast<float>(fault_.value) : 1.f;
  if (gemv) {  // o projection added straight into `out` (the residual stream or its partial)
    LinearRunner::FusedGemv a = LinearRunner::GemvInput(attn_, rows, q_dim, {});
    LinearRunner::AddSegment(a, lw.o, lw.o_bias, out);
    a.accumulate = true;
    a.scale = o_scale;
    if (auto s = linear_.RunGemv(a, /*projection=*/true); !s.ok()) return s;
  } else {
    const uint16_t* ab = linear_.PrepareInput(attn_, static_cast<int64_t>(rows) * q_dim);
    if (auto s = linear_.GemmAccumulate(attn_, ab, rows, lw.o, lw.o_bias, o_scale, out); !s.ok())
      return s;
  }
  CHECK_LAUNCH();
  return absl::OkStatus();
}

cuda::KvCache AttentionRunner::LayerCache(int l) const {
  const size_t layer_rows = static_cast<size_t>(cache_index_[l]) * batch_ * capacity_;
  const size_t layer_bytes = layer_rows * config_.kv_dim() * kv_cache_bytes_per_element();
  const size_t layer_scales = layer_rows * config_.num_kv_heads;
  return {k_cache_ + layer_bytes,
          v_cache_ + layer_bytes,
          kv_dtype(),
          capacity_,
          k_scale_ ? k_scale_ + layer_scales : nullptr,
          v_scale_ ? v_scale_ + layer_scales : nullptr};
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
      // Lockstep rows only (plan_.ragged_rows is false: StartServing refuses): `rows` is `batch`
      // sequences of n tokens, sequence b in cache slot b.
      if (ragged != nullptr) Unreachable("attention=cudnn on ragged rows");
      const int batch = rows / n;
      const int64_t count = static_cast<int64_t>(rows) * config_.q_dim();
      uint16_t* q = reinterpret_cast<uint16_t*>(cudnn_io_);
      uint16_t* o = q + count;
      cuda::SequenceLengths(d_position, n, batch, seq_lens_, seq_lens_ + batch, stream_);
      cuda::ToBf16(q_ + offset, count, q, stream_);
      RETURN_IF_ERROR(cudnn_->Run(q, cache.k, cache.v, seq_lens_, seq_lens_ + batch, batch, n, o));
      cuda::UpcastToF32({o, DType::kBF16, rows, config_.q_dim()}, attn_ + offset, stream_);
      return absl::OkStatus();
    }
    case AttentionPath::kFlash:
      cuda::AttentionFlash(q_ + offset, cache, rows, n, config_.num_q_heads, config_.num_kv_heads,
                           config_.head_dim, d_position,
                           cuda::FlashSplits(rows, config_.num_kv_heads, capacity_), scores_,
                           attn_ + offset, stream_, ragged);
      return absl::OkStatus();
    case AttentionPath::kNaive:
      cuda::AttentionNaive(q_ + offset, static_cast<const float*>(cache.k),
                           static_cast<const float*>(cache.v), rows, n, config_.num_q_heads,
                           config_.num_kv_heads, config_.head_dim, d_position, capacity_, scores_,
                           attn_ + offset, stream_, ragged);
      return absl::OkStatus();
  }
  Unreachable("AttentionRunner::Attend");
}

}  // namespace infersweep
