#include "engine/cuda/linear_attention_runner.h"

#include <algorithm>

#include "api/status_macros.h"
#include "engine/cuda/device_util.h"
#include "engine/plan/linear_attention_plan.h"
#include "kernels/cuda/gated_delta.h"

namespace infersweep {
namespace {

cuda::GatedDeltaShape ShapeOf(const ModelConfig& c, int batch, int n) {
  cuda::GatedDeltaShape s;
  s.batch = batch;
  s.n = n;
  s.key_heads = c.linear_num_key_heads;
  s.value_heads = c.linear_num_value_heads;
  s.key_dim = c.linear_key_head_dim;
  s.value_dim = c.linear_value_head_dim;
  s.kernel = c.linear_conv_kernel_dim;
  return s;
}

}  // namespace

LinearAttentionRunner::LinearAttentionRunner(const RunnerContext& context, LinearRunner& linear)
    : config_(context.config),
      w_(context.weights),
      options_(context.options),
      fault_(context.fault),
      stream_(context.stream),
      linear_(linear),
      state_index_(config_.LayerSlots(LayerAttention::kLinear)),
      state_layers_(*std::max_element(state_index_.begin(), state_index_.end()) + 1),
      first_linear_layer_(static_cast<int>(std::find(state_index_.begin(), state_index_.end(), 0) -
                                           state_index_.begin())) {}

namespace {
int64_t ConvStateFloats(const ModelConfig& c) {
  return static_cast<int64_t>(std::max(c.linear_conv_kernel_dim - 1, 0)) * c.linear_conv_dim();
}
int64_t RecurrentStateFloats(const ModelConfig& c) {
  return static_cast<int64_t>(c.linear_num_value_heads) * c.linear_key_head_dim *
         c.linear_value_head_dim;
}
}  // namespace

absl::Status LinearAttentionRunner::AllocateState(int batch) {
  conv_state_.reset();
  recurrent_state_.reset();
  batch_ = 0;
  if (state_layers_ == 0) return absl::OkStatus();
  const size_t sequences = static_cast<size_t>(state_layers_) * batch;
  RETURN_IF_ERROR(
      AllocateBuffers<float>({{&conv_state_, sequences * ConvStateFloats(config_)},
                              {&recurrent_state_, sequences * RecurrentStateFloats(config_)}}));
  batch_ = batch;
  return absl::OkStatus();
}

void LinearAttentionRunner::ResetState() {
  if (batch_ == 0) return;
  const int64_t sequences = static_cast<int64_t>(state_layers_) * batch_;
  if (conv_state_)
    CUDA_OR_DIE(cudaMemsetAsync(conv_state_.get(), 0,
                                sequences * ConvStateFloats(config_) * sizeof(float), stream_));
  CUDA_OR_DIE(cudaMemsetAsync(recurrent_state_.get(), 0,
                              sequences * RecurrentStateFloats(config_) * sizeof(float), stream_));
}

void LinearAttentionRunner::SwapRecurrentStates(int a, int b) {
  const int64_t per_slot = RecurrentStateFloats(config_);
  for (int layer = 0; layer < state_layers_; ++layer) {
    float* base = recurrent_state_.get() + static_cast<int64_t>(layer) * batch_ * per_slot;
    cuda::SwapInPlace(base + a * per_slot, base + b * per_slot, per_slot, stream_);
  }
  CHECK_LAUNCH();
}

absl::Status LinearAttentionRunner::AllocateScratch(int rows) {
  if (!config_.has_linear_attention()) return absl::OkStatus();
  const size_t r = rows, conv = config_.linear_conv_dim(), value = config_.linear_value_dim(),
               heads = config_.linear_num_value_heads, key_heads = config_.linear_num_key_heads;
  RETURN_IF_ERROR(AllocateBuffers<float>({{&projected_, r * conv},
                                          {&mixed_, r * conv},
                                          {&z_, r * value},
                                          {&a_, r * heads},
                                          {&b_, r * heads},
                                          {&g_, r * heads},
                                          {&beta_, r * heads},
                                          {&out_, r * value}}));
  if (PlanLinearAttention(options_).delta_rule == DeltaRulePath::kChunked)
    RETURN_IF_ERROR(chunk_terms_.Allocate(cuda::GatedDeltaChunkedScratchFloats(
        rows, config_.linear_num_value_heads, config_.linear_key_head_dim,
        config_.linear_value_head_dim)));
  RETURN_IF_ERROR(arrivals_.Allocate(r * key_heads));
  CUDA_OR_DIE(cudaMemsetAsync(arrivals_.get(), 0, r * key_heads * sizeof(unsigned), stream_));
  return absl::OkStatus();
}

void LinearAttentionRunner::FreeScratch() {
  for (DeviceBuffer<float>* b :
       {&projected_, &mixed_, &z_, &a_, &b_, &g_, &beta_, &out_, &chunk_terms_})
    b->reset();
  arrivals_.reset();
}

cuda::GatedDeltaChunkScratch LinearAttentionRunner::ChunkTerms(int rows) const {
  const int64_t key =
      static_cast<int64_t>(rows) * config_.linear_num_value_heads * config_.linear_key_head_dim;
  cuda::GatedDeltaChunkScratch terms;
  terms.w = chunk_terms_.get();
  terms.q = terms.w + key;
  terms.u = terms.q + key;
  terms.g = terms.u + static_cast<int64_t>(rows) * config_.linear_num_value_heads *
                          config_.linear_value_head_dim;
  return terms;
}

absl::Status LinearAttentionRunner::Run(int l, int rows, int n, bool gemv, float* x, float* out,
                                        const RaggedRows* ragged) {
  const LayerWeights& lw = w_.layers[l];
  const LinearAttentionWeights& la = lw.linear_attn;
  const int hidden = config_.hidden_size, value_dim = config_.linear_value_dim();
  const float eps = config_.rms_norm_eps;
  const cuda::GatedDeltaShape shape = ShapeOf(config_, batch_, n);
  // Input RMSNorm, then in_proj_qkv, z, b and a: one GEMV launch of four segments.
  if (gemv) {
    LinearRunner::FusedGemv g = LinearRunner::GemvInput(x, rows, hidden, lw.input_norm, eps);
    LinearRunner::AddSegment(g, la.in_proj_qkv, {}, projected_.get());
    LinearRunner::AddSegment(g, la.in_proj_z, {}, z_.get());
    LinearRunner::AddSegment(g, la.in_proj_b, {}, b_.get());
    LinearRunner::AddSegment(g, la.in_proj_a, {}, a_.get());
    RETURN_IF_ERROR(linear_.RunGemv(g));
  } else {
    const uint16_t* xb = linear_.NormAndPrepare(x, rows, hidden, lw.input_norm, eps);
    const float* xn = linear_.xn();
    for (auto [w, y] :
         {std::pair{&la.in_proj_qkv, projected_.get()}, std::pair{&la.in_proj_z, z_.get()},
          std::pair{&la.in_proj_b, b_.get()}, std::pair{&la.in_proj_a, a_.get()}})
      RETURN_IF_ERROR(linear_.Gemm(xn, xb, rows, *w, {}, y));
  }
  const int slot = state_index_[l];
  const LinearAttentionPlan plan = PlanLinearAttention(options_);
  float* conv_state = conv_state_ ? conv_state_.get() + static_cast<int64_t>(slot) * batch_ *
                                                            ConvStateFloats(config_)
                                  : nullptr;
  float* recurrent_state =
      recurrent_state_.get() + static_cast<int64_t>(slot) * batch_ * RecurrentStateFloats(config_);
  // The sequences of the step, each a run of the rows with its own states: a lockstep batch is
  // one launch over `batch_` sequences of n rows; a ragged step's decode rows are one launch of
  // one-row sequences, and each prefill chunk a launch of its own.
  struct Sequences {
    int first_row;
    cuda::GatedDeltaShape shape;
  };
  std::vector<Sequences> launches;
  if (!ragged) {
    launches.push_back({0, shape});
  } else {
    cuda::GatedDeltaShape decode = ShapeOf(config_, ragged->decode_rows, 1);
    decode.ragged = ragged->rows;
    if (ragged->decode_rows > 0) launches.push_back({0, decode});
    for (const RaggedRows::Chunk& c : ragged->chunks) {
      cuda::GatedDeltaShape chunk = ShapeOf(config_, 1, c.tokens);
      chunk.ragged = ragged->rows + c.first_row;
      launches.push_back({c.first_row, chunk});
    }
  }
  if (fault_.kind == FaultInjection::Kind::kBadState && l == first_linear_layer_)
    cuda::ScaleInPlace(recurrent_state, static_cast<float>(fault_.value),
                       static_cast<int64_t>(batch_) * RecurrentStateFloats(config_), stream_);
  // With plan.decode_fused the one-row sequences (a lockstep decode step, or a ragged step's
  // decode rows, which come first) run as one GatedDeltaDecode launch; the kernel chain below
  // takes the rest, rows [chain_row, rows).
  int chain_row = 0;
  if (plan.decode_fused && (ragged ? ragged->decode_rows > 0 : n == 1)) {
    const Sequences decode = launches.front();
    launches.erase(launches.begin());
    cuda::GatedDeltaDecodeOperands ops;
    ops.projected = projected_.get();
    ops.z = z_.get();
    ops.a = a_.get();
    ops.b = b_.get();
    ops.conv = la.conv;
    ops.a_log = la.a_log;
    ops.dt_bias = la.dt_bias;
    ops.norm = la.norm;
    ops.eps = eps;
    ops.conv_state = conv_state;
    ops.state = recurrent_state;
    ops.key_head_arrivals = arrivals_.get();
    ops.out = out_.get();
    cuda::GatedDeltaDecode(ops, decode.shape, stream_);
    chain_row = decode.shape.batch;
  }
  const int chain_rows = rows - chain_row;
  const int64_t conv_width = shape.conv_channels();
  const int heads = config_.linear_num_value_heads;
  if (chain_rows > 0) {
    for (const Sequences& s : launches) {
      const int64_t at = s.first_row;
      cuda::CausalConv(projected_.get() + at * conv_width, s.shape, la.conv, plan.silu_in_conv,
                       conv_state, mixed_.get() + at * conv_width, stream_);
    }
    if (!plan.silu_in_conv)
      cuda::SiluInPlace(mixed_.get() + chain_row * conv_width,
                        static_cast<int64_t>(chain_rows) * conv_width, stream_);
    cuda::GatedDeltaShape all_rows = shape;  // the gates run a block a row, whatever the sequences
    all_rows.batch = chain_rows;
    all_rows.n = 1;
    cuda::GatedDeltaGates(mixed_.get() + chain_row * conv_width, a_.get() + chain_row * heads,
                          b_.get() + chain_row * heads, la.a_log, la.dt_bias, all_rows,
                          g_.get() + chain_row * heads, beta_.get() + chain_row * heads, stream_);
    for (const Sequences& s : launches) {
      const int64_t at = s.first_row;
      const float* mixed = mixed_.get() + at * conv_width;
      const float* g = g_.get() + at * heads;
      const float* beta = beta_.get() + at * heads;
      float* o = out_.get() + at * value_dim;
      switch (plan.delta_rule) {
        case DeltaRulePath::kChunked:
          if (s.shape.n >= cuda::kGatedDeltaChunkedMinTokens) {
            cuda::GatedDeltaChunked(mixed, g, beta, s.shape, ChunkTerms(s.shape.rows()),
                                    recurrent_state, o, stream_);
            break;
          }
          [[fallthrough]];
        case DeltaRulePath::kFused:
          cuda::GatedDeltaFused(mixed, g, beta, s.shape, recurrent_state, o, stream_);
          break;
        case DeltaRulePath::kReference:
          cuda::GatedDeltaReference(mixed, g, beta, s.shape, recurrent_state, o, stream_);
          break;
      }
    }
    float* chain_out = out_.get() + static_cast<int64_t>(chain_row) * value_dim;
    cuda::RmsNormGated(chain_out, z_.get() + static_cast<int64_t>(chain_row) * value_dim,
                       static_cast<int64_t>(chain_rows) * heads, config_.linear_value_head_dim,
                       la.norm, eps, chain_out, stream_);
  }
  CHECK_LAUNCH();
  // out_proj, added into `out` (the residual stream or its partial).
  if (gemv) {
    LinearRunner::FusedGemv g = LinearRunner::GemvInput(out_.get(), rows, value_dim, {});
    LinearRunner::AddSegment(g, la.out_proj, {}, out);
    g.accumulate = true;
    RETURN_IF_ERROR(linear_.RunGemv(g));
  } else {
    const uint16_t* ob = linear_.PrepareInput(out_.get(), static_cast<int64_t>(rows) * value_dim);
    RETURN_IF_ERROR(linear_.GemmAccumulate(out_.get(), ob, rows, la.out_proj, {}, 1.f, out));
  }
  CHECK_LAUNCH();
  return absl::OkStatus();
}

}  // namespace infersweep
