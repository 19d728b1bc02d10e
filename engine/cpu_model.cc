#include "engine/cpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "engine/kv_slots.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/gated_delta.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/routing.h"

namespace infersweep {
namespace {

// Tokens per chunk of the chunked gated delta rule (prefill).
constexpr int kGatedDeltaChunk = 64;

int FirstLinearLayer(const ModelConfig& config) {
  for (int l = 0; l < config.num_layers; ++l)
    if (config.AttentionKind(l) == LayerAttention::kLinear) return l;
  return -1;
}

class CpuModel final : public Model {
 public:
  CpuModel(const HostModel& host, const CpuModelOptions& options, ModelWeights faulty_weights,
           std::vector<uint8_t> faulty_scale)
      : config_(host.config),
        faulty_weights_(std::move(faulty_weights)),
        faulty_scale_(std::move(faulty_scale)),
        w_(faulty_scale_.empty() ? host.weights : faulty_weights_),
        options_(options),
        fault_(options.fault) {
    cpu::SetNumThreads(options.threads);
  }

  const ModelConfig& config() const override { return config_; }
  std::string device() const override { return "cpu"; }
  int position() const override { return position_; }

  absl::Status StartBatch(int batch, int max_tokens) override {
    if (batch <= 0 || max_tokens <= 0)
      return absl::InvalidArgumentError("StartBatch: batch and max_tokens must be positive");
    AllocateState(batch, max_tokens);
    serving_ = false;
    batch_ = batch;
    position_ = 0;
    // A lockstep batch is its slots 0..batch-1, all occupied, all at position_.
    for (int b = 0; b < batch; ++b) (void)slots_.Acquire();
    return absl::OkStatus();
  }

  absl::Status Forward(std::span<const int32_t> tokens, int n, LogitsMode mode,
                       std::vector<float>* logits) override {
    RETURN_IF_ERROR(ValidateForwardArgs(config_, batch_, capacity_, position_, tokens, n));
    std::vector<SequenceRows> seqs;
    for (int b = 0; b < batch_; ++b) seqs.push_back({b, position_, static_cast<int64_t>(b) * n, n});
    Step(seqs, tokens, mode == LogitsMode::kAll, logits);
    for (int b = 0; b < batch_; ++b) slots_.Advance(b, n);
    position_ += n;
    return absl::OkStatus();
  }

  absl::Status StartServing(int slots, int max_tokens) override {
    if (slots <= 0 || max_tokens <= 0)
      return absl::InvalidArgumentError("StartServing: slots and max_tokens must be positive");
    AllocateState(slots, max_tokens);
    serving_ = true;
    batch_ = 0;  // no lockstep batch: Forward refuses until the next StartBatch
    position_ = 0;
    return absl::OkStatus();
  }

  absl::StatusOr<int> AdmitSequence() override {
    if (!serving_) return absl::FailedPreconditionError("AdmitSequence before StartServing");
    ASSIGN_OR_RETURN(auto slot, slots_.Acquire());
    // A linear-attention layer's state is the sequence's whole past: a new one starts at zero.
    // The KV cache needs no clearing: attention reads a slot only up to its sequence's length.
    const int64_t history = std::max(config_.linear_conv_kernel_dim - 1, 0);
    const int64_t conv = history * config_.linear_conv_dim();
    const int64_t state = static_cast<int64_t>(config_.linear_num_value_heads) *
                          config_.linear_key_head_dim * config_.linear_value_head_dim;
    for (int l = 0; l < config_.num_layers; ++l) {
      if (config_.AttentionKind(l) != LayerAttention::kLinear) continue;
      std::fill_n(conv_state_[l].data() + slot * conv, conv, 0.f);
      std::fill_n(recurrent_state_[l].data() + slot * state, state, 0.f);
    }
    return slot;
  }

  absl::Status RetireSequence(int slot) override {
    if (!serving_) return absl::FailedPreconditionError("RetireSequence before StartServing");
    return slots_.Release(slot);
  }

  absl::Status RaggedStep(std::span<const RaggedChunk> chunks,
                          std::vector<float>* last_logits) override {
    if (!serving_) return absl::FailedPreconditionError("RaggedStep before StartServing");
    RETURN_IF_ERROR(ValidateRaggedChunks(config_, slots_, chunks));
    std::vector<SequenceRows> seqs;
    std::vector<int32_t> tokens;
    for (const RaggedChunk& c : chunks) {
      const int n = static_cast<int>(c.tokens.size());
      seqs.push_back({c.slot, slots_.length(c.slot), static_cast<int64_t>(tokens.size()), n});
      tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
    }
    Step(seqs, tokens, /*all_rows=*/false, last_logits);
    for (const RaggedChunk& c : chunks) slots_.Advance(c.slot, static_cast<int>(c.tokens.size()));
    return absl::OkStatus();
  }

 private:
  // The rows of one step, sequence by sequence: sequence `slot` takes rows [row_begin,
  // row_begin + n) at positions start, start + 1, ... A lockstep batch is B sequences at one
  // position; a ragged step mixes positions and lengths.
  struct SequenceRows {
    int slot;
    int start;
    int64_t row_begin;
    int n;
  };

  // Room for `slots` sequences of `max_tokens` tokens. Full-attention layers keep a KV cache;
  // linear-attention layers a conv state (the last K-1 inputs) and a recurrent state per slot,
  // all zero at the start.
  void AllocateState(int slots, int max_tokens) {
    // The thread pool is the process's: another model built since this one (the reference, in
    // a trial) may have resized it. Each batch runs on this model's own count.
    cpu::SetNumThreads(options_.threads);
    capacity_ = max_tokens;
    slots_.Reset(slots, max_tokens);
    steps_ = 0;
    slots_swapped_ = false;
    const size_t per_layer = static_cast<size_t>(slots) * max_tokens * config_.kv_dim();
    const size_t conv_per_layer = static_cast<size_t>(slots) *
                                  std::max(config_.linear_conv_kernel_dim - 1, 0) *
                                  config_.linear_conv_dim();
    const size_t state_per_layer = static_cast<size_t>(slots) * config_.linear_num_value_heads *
                                   config_.linear_key_head_dim * config_.linear_value_head_dim;
    k_cache_.assign(config_.num_layers, {});
    v_cache_.assign(config_.num_layers, {});
    conv_state_.assign(config_.num_layers, {});
    recurrent_state_.assign(config_.num_layers, {});
    for (int l = 0; l < config_.num_layers; ++l) {
      if (config_.AttentionKind(l) == LayerAttention::kLinear) {
        conv_state_[l].assign(conv_per_layer, 0.f);
        recurrent_state_[l].assign(state_per_layer, 0.f);
      } else {
        k_cache_[l].assign(per_layer, 0.f);
        v_cache_[l].assign(per_layer, 0.f);
      }
    }
  }

  // kv-slot-swap and state-slot-swap (TEST ONLY): from step `value` on, the first step with two
  // sequences that hold tokens swaps the caches and states (state-slot-swap: the recurrent states
  // alone) of the two lowest such slots once, as a scheduler that loses track of which slot is
  // whose would.
  void MaybeSwapSlots() {
    const int64_t step = steps_++;
    const bool states_only = fault_.kind == FaultInjection::Kind::kStateSlotSwap;
    if ((fault_.kind != FaultInjection::Kind::kKvSlotSwap && !states_only) || slots_swapped_ ||
        step < static_cast<int64_t>(fault_.value))
      return;
    const auto pair = slots_.TwoLowestHoldingTokens();
    if (!pair) return;
    const auto [a, b] = *pair;
    auto swap_slot_rows = [&](std::vector<float>& v, int64_t per_slot) {
      std::swap_ranges(v.begin() + a * per_slot, v.begin() + (a + 1) * per_slot,
                       v.begin() + b * per_slot);
    };
    const int slots = slots_.slots();
    for (int l = 0; l < config_.num_layers; ++l) {
      std::vector<std::vector<float>*> swapped = {&recurrent_state_[l]};
      if (!states_only)
        swapped = {&k_cache_[l], &v_cache_[l], &conv_state_[l], &recurrent_state_[l]};
      for (auto* v : swapped)
        if (!v->empty()) swap_slot_rows(*v, static_cast<int64_t>(v->size()) / slots);
    }
    slots_swapped_ = true;
  }

  // One forward pass over the rows of `seqs` (tokens in row order), appending to each
  // sequence's slot; logits of every row (all_rows) or of each sequence's last row.
  void Step(const std::vector<SequenceRows>& seqs, std::span<const int32_t> tokens, bool all_rows,
            std::vector<float>* logits) {
    MaybeCommitProcessFault(options_.fault);
    MaybeSwapSlots();
    if (LaunchRecording()) RecordThreadsFallback();
    const int64_t rows = static_cast<int64_t>(tokens.size());
    const int64_t hidden = config_.hidden_size;
    std::vector<float> x(rows * hidden);
    // The launch log (core/launch_log.h) counts each op once per call over all rows; the
    // matmuls record their variant themselves (cpu::Matmul).
    RecordLaunch("embedding");
    for (int64_t r = 0; r < rows; ++r) cpu::DecodeRow(w_.embed, tokens[r], x.data() + r * hidden);
    // Each row's slot and position.
    std::vector<int> row_slot(rows), row_pos(rows);
    for (const SequenceRows& s : seqs)
      for (int t = 0; t < s.n; ++t) {
        row_slot[s.row_begin + t] = s.slot;
        row_pos[s.row_begin + t] = s.start + t;
      }

    for (int l = 0; l < config_.num_layers; ++l) {
      if (config_.AttentionKind(l) == LayerAttention::kLinear) {
        LinearAttention(l, seqs, rows, x);
      } else {
        Attention(l, row_slot, row_pos, x);
      }
      FeedForward(l, rows, x);
      if (fault_.kind == FaultInjection::Kind::kNanLayer && l == static_cast<int>(fault_.value))
        x[0] = std::numeric_limits<float>::quiet_NaN();
    }

    // Final norm and lm_head on the rows whose logits were asked for.
    std::vector<float> picked;
    int64_t out_rows = rows;
    if (all_rows) {
      picked = std::move(x);
    } else {
      out_rows = static_cast<int64_t>(seqs.size());
      picked.resize(out_rows * hidden);
      for (size_t i = 0; i < seqs.size(); ++i)
        std::copy_n(x.data() + (seqs[i].row_begin + seqs[i].n - 1) * hidden, hidden,
                    picked.data() + i * hidden);
    }
    RecordLaunch("rmsnorm");
    Norm(picked.data(), out_rows, hidden, w_.final_norm, picked.data());
    // The vocabulary, or a tensor-parallel rank's shard of it.
    logits->resize(out_rows * w_.lm_head.rows);
    cpu::Matmul(options_.matmul, picked.data(), out_rows, w_.lm_head, {}, logits->data());
    if (fault_.kind == FaultInjection::Kind::kStuckToken) {
      const int vocab = config_.vocab_size, stuck = static_cast<int>(fault_.value) % vocab;
      for (int64_t r = 0; r < out_rows; ++r) {
        float* row = logits->data() + r * vocab;
        row[stuck] = *std::max_element(row, row + vocab) + 1.f;
      }
    }
  }

  // A decoder RMSNorm: gain w, or (1 + w) for zero-centred models.
  void Norm(const float* in, int64_t rows, int64_t n, const MatrixRef& gain, float* out) const {
    if (config_.zero_centered_norm) {
      cpu::RmsNormZeroCentered(in, rows, n, gain, config_.rms_norm_eps, out);
    } else {
      cpu::RmsNorm(in, rows, n, gain, config_.rms_norm_eps, out);
    }
  }

  // x += o_proj(attention(q, k, v)) for every row; appends this step's k and v to the cache.
  // Row r belongs to the sequence in slot row_slot[r] at position row_pos[r], and attends to
  // that slot's positions [0, row_pos[r]]. Gated attention multiplies the attention output by
  // sigmoid(gate) before o_proj.
  void Attention(int l, const std::vector<int>& row_slot, const std::vector<int>& row_pos,
                 std::vector<float>& x) {
    const LayerWeights& lw = w_.layers[l];
    const int64_t rows = static_cast<int64_t>(row_slot.size()), hidden = config_.hidden_size;
    const int64_t q_dim = config_.q_dim(), kv_dim = config_.kv_dim();
    const int head_dim = config_.head_dim, rotary_dim = config_.rotary_dim();
    std::vector<float> xn(rows * hidden), q(rows * q_dim), k(rows * kv_dim), v(rows * kv_dim);
    std::vector<float> gate;
    RecordLaunch("rmsnorm");
    Norm(x.data(), rows, hidden, lw.input_norm, xn.data());
    if (config_.attn_output_gate) {
      // q_proj rows are [q_h | gate_h] per head.
      std::vector<float> q_gate(rows * 2 * q_dim);
      cpu::Matmul(options_.matmul, xn.data(), rows, lw.q, lw.q_bias, q_gate.data());
      gate.resize(rows * q_dim);
      for (int64_t r = 0; r < rows; ++r)
        for (int h = 0; h < config_.num_q_heads; ++h) {
          const float* src = q_gate.data() + r * 2 * q_dim + h * 2 * head_dim;
          std::copy_n(src, head_dim, q.data() + r * q_dim + h * head_dim);
          std::copy_n(src + head_dim, head_dim, gate.data() + r * q_dim + h * head_dim);
        }
    } else {
      cpu::Matmul(options_.matmul, xn.data(), rows, lw.q, lw.q_bias, q.data());
    }
    cpu::Matmul(options_.matmul, xn.data(), rows, lw.k, lw.k_bias, k.data());
    cpu::Matmul(options_.matmul, xn.data(), rows, lw.v, lw.v_bias, v.data());

    float* k_cache = k_cache_[l].data();
    float* v_cache = v_cache_[l].data();
    RecordLaunch(config_.qk_norm ? "qk_norm_rope_append" : "rope_append");
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = row_slot[r], pos = row_pos[r];
      float* qr = q.data() + r * q_dim;
      float* kr = k.data() + r * kv_dim;
      if (config_.qk_norm) {
        Norm(qr, config_.num_q_heads, head_dim, lw.q_norm, qr);
        Norm(kr, config_.num_kv_heads, head_dim, lw.k_norm, kr);
      }
      // Partial RoPE rotates the first rotary_dim dims of each head as a head of that size.
      for (int h = 0; h < config_.num_q_heads; ++h)
        cpu::ApplyRope(qr + h * head_dim, rotary_dim, pos, config_.rope_theta);
      for (int h = 0; h < config_.num_kv_heads; ++h)
        cpu::ApplyRope(kr + h * head_dim, rotary_dim, pos, config_.rope_theta);
      const int64_t slot = (b * capacity_ + pos) * kv_dim;
      std::copy_n(kr, kv_dim, k_cache + slot);
      std::copy_n(v.data() + r * kv_dim, kv_dim, v_cache + slot);
    }

    std::vector<float> attn(rows * q_dim);
    RecordLaunch("attention");
    cpu::ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(capacity_);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = row_slot[r], pos = row_pos[r];
        const int64_t base = b * capacity_ * kv_dim;
        cpu::AttendCausal(q.data() + r * q_dim, k_cache + base, v_cache + base, pos,
                          config_.num_q_heads, config_.num_kv_heads, head_dim, scores.data(),
                          attn.data() + r * q_dim);
      }
    });
    if (config_.attn_output_gate) {
      RecordLaunch("attention_gate");
      for (int64_t i = 0; i < rows * q_dim; ++i) attn[i] *= cpu::Sigmoid(gate[i]);
    }
    std::vector<float> o(rows * hidden);
    cpu::Matmul(options_.matmul, attn.data(), rows, lw.o, lw.o_bias, o.data());
    AllReduce(o);
    const float scale = (fault_.kind == FaultInjection::Kind::kBadScale && l == 0)
                            ? static_cast<float>(fault_.value)
                            : 1.f;
    for (int64_t i = 0; i < rows * hidden; ++i) x[i] += scale * o[i];
  }

  // x += out_proj(gated_norm(gated_delta_rule(conv(q, k, v)), z)) for every row: a Gated
  // DeltaNet layer. Advances each sequence's conv and recurrent state (those of its slot) by its
  // n tokens; a sequence of several tokens runs the chunked form of the rule, one of a single
  // token the recurrent one.
  void LinearAttention(int l, const std::vector<SequenceRows>& seqs, int64_t rows,
                       std::vector<float>& x) {
    const LinearAttentionWeights& la = w_.layers[l].linear_attn;
    const int64_t hidden = config_.hidden_size;
    const int key_heads = config_.linear_num_key_heads,
              value_heads = config_.linear_num_value_heads;
    const int dk = config_.linear_key_head_dim, dv = config_.linear_value_head_dim;
    const int64_t key_dim = config_.linear_key_dim(), value_dim = config_.linear_value_dim();
    const int64_t conv_dim = config_.linear_conv_dim();
    const int64_t history = config_.linear_conv_kernel_dim - 1;
    std::vector<float> xn(rows * hidden), qkv(rows * conv_dim), z(rows * value_dim),
        b(rows * value_heads), a(rows * value_heads);
    RecordLaunch("rmsnorm");
    Norm(x.data(), rows, hidden, w_.layers[l].input_norm, xn.data());
    cpu::Matmul(options_.matmul, xn.data(), rows, la.in_proj_qkv, {}, qkv.data());
    cpu::Matmul(options_.matmul, xn.data(), rows, la.in_proj_z, {}, z.data());
    cpu::Matmul(options_.matmul, xn.data(), rows, la.in_proj_b, {}, b.data());
    cpu::Matmul(options_.matmul, xn.data(), rows, la.in_proj_a, {}, a.data());

    RecordLaunch("causal_conv");
    std::vector<float> mixed(rows * conv_dim);
    for (const SequenceRows& s : seqs)
      cpu::CausalConvSilu(qkv.data() + s.row_begin * conv_dim, s.n, conv_dim, la.conv,
                          conv_state_[l].data() + s.slot * history * conv_dim,
                          mixed.data() + s.row_begin * conv_dim);
    // q and k: L2-normalised per key head; q scaled by dk^-0.5.
    const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
    for (int64_t r = 0; r < rows; ++r) {
      float* qr = mixed.data() + r * conv_dim;
      cpu::L2NormalizeRows(qr, 2 * key_heads, dk);
      for (int64_t i = 0; i < key_dim; ++i) qr[i] *= q_scale;
    }
    // beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), per row and value head.
    std::vector<float> beta(rows * value_heads), g(rows * value_heads);
    for (int64_t r = 0; r < rows; ++r)
      for (int h = 0; h < value_heads; ++h) {
        const int64_t i = r * value_heads + h;
        beta[i] = cpu::Sigmoid(b[i]);
        const float a_log = LoadAsFloat(la.a_log.data, la.a_log.dtype, h);
        const float dt_bias = LoadAsFloat(la.dt_bias.data, la.dt_bias.dtype, h);
        g[i] = -std::exp(a_log) * cpu::Softplus(a[i] + dt_bias);
      }

    float* states = recurrent_state_[l].data();
    const int64_t state_size = static_cast<int64_t>(dk) * dv;
    if (fault_.kind == FaultInjection::Kind::kBadState && l == first_linear_layer_) {
      const float factor = static_cast<float>(fault_.value);
      for (float& s : recurrent_state_[l]) s *= factor;
    }
    // Value head h reads key head h / (value_heads / key_heads).
    const int per_key = value_heads / key_heads;
    std::vector<float> o(rows * value_dim);
    RecordLaunch("gated_delta_rule");
    int max_n = 0;
    for (const SequenceRows& s : seqs) max_n = std::max(max_n, s.n);
    cpu::ParallelFor(
        static_cast<int64_t>(seqs.size()) * value_heads, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> qh(max_n * dk), kh(max_n * dk), vh(max_n * dv), gh(max_n), bh(max_n),
              oh(max_n * dv);
          for (int64_t task = begin; task < end; ++task) {
            const SequenceRows& seq = seqs[task / value_heads];
            const int n = seq.n;
            const int h = static_cast<int>(task % value_heads), kv_head = h / per_key;
            for (int t = 0; t < n; ++t) {
              const int64_t r = seq.row_begin + t;
              const float* row = mixed.data() + r * conv_dim;
              std::copy_n(row + kv_head * dk, dk, qh.data() + t * dk);
              std::copy_n(row + key_dim + kv_head * dk, dk, kh.data() + t * dk);
              std::copy_n(row + 2 * key_dim + h * dv, dv, vh.data() + t * dv);
              gh[t] = g[r * value_heads + h];
              bh[t] = beta[r * value_heads + h];
            }
            float* state = states + (static_cast<int64_t>(seq.slot) * value_heads + h) * state_size;
            if (n == 1) {
              cpu::GatedDeltaRecurrent(qh.data(), kh.data(), vh.data(), gh.data(), bh.data(), n, dk,
                                       dv, state, oh.data());
            } else {
              cpu::GatedDeltaChunked(qh.data(), kh.data(), vh.data(), gh.data(), bh.data(), n, dk,
                                     dv, kGatedDeltaChunk, state, oh.data());
            }
            for (int t = 0; t < n; ++t)
              std::copy_n(oh.data() + t * dv, dv,
                          o.data() + (seq.row_begin + t) * value_dim + h * dv);
          }
        });
    RecordLaunch("gated_rmsnorm");
    cpu::RmsNormGated(o.data(), z.data(), rows * value_heads, dv, la.norm, config_.rms_norm_eps,
                      o.data());
    std::vector<float> y(rows * hidden);
    cpu::Matmul(options_.matmul, o.data(), rows, la.out_proj, {}, y.data());
    AllReduce(y);
    for (int64_t i = 0; i < rows * hidden; ++i) x[i] += y[i];
  }

  // y = down(silu(gate(x)) * up(x)) for `rows` rows of x.
  void GatedMlp(const ExpertWeights& e, const float* in, int64_t rows, float* y) {
    const int64_t inter = e.gate.rows;
    std::vector<float> g(rows * inter), u(rows * inter);
    cpu::Matmul(options_.matmul, in, rows, e.gate, {}, g.data());
    cpu::Matmul(options_.matmul, in, rows, e.up, {}, u.data());
    RecordLaunch("silu_mul");
    cpu::SiluMul(g.data(), u.data(), rows * inter, g.data());
    cpu::Matmul(options_.matmul, g.data(), rows, e.down, {}, y);
  }

  // x += mlp(post_attention_norm(x)): the dense MLP, or routed experts (+ gated shared expert).
  void FeedForward(int l, int64_t rows, std::vector<float>& x) {
    const LayerWeights& lw = w_.layers[l];
    const int64_t hidden = config_.hidden_size;
    std::vector<float> xn(rows * hidden), y(rows * hidden, 0.f);
    RecordLaunch("rmsnorm");
    Norm(x.data(), rows, hidden, lw.post_attention_norm, xn.data());
    if (!config_.IsMoeLayer(l)) {
      GatedMlp(lw.mlp, xn.data(), rows, y.data());
    } else {
      MoeExperts(lw, xn, rows, y);
    }
    AllReduce(y);
    for (int64_t i = 0; i < rows * hidden; ++i) x[i] += y[i];
  }

  void MoeExperts(const LayerWeights& lw, const std::vector<float>& xn, int64_t rows,
                  std::vector<float>& y) {
    const int64_t hidden = config_.hidden_size;
    const int num_experts = config_.num_experts, top_k = config_.num_experts_per_tok;
    std::vector<float> router_logits(rows * num_experts);
    cpu::Matmul(options_.matmul, xn.data(), rows, lw.router, {}, router_logits.data());
    // Per expert: the rows routed to it and their routing weights.
    std::vector<std::vector<std::pair<int64_t, float>>> assigned(num_experts);
    std::vector<int> chosen(top_k);
    std::vector<float> weights(top_k);
    RecordLaunch("router_topk");
    for (int64_t r = 0; r < rows; ++r) {
      cpu::TopKRouting(router_logits.data() + r * num_experts, num_experts, top_k,
                       config_.norm_topk_prob, chosen.data(), weights.data());
      for (int i = 0; i < top_k; ++i) assigned[chosen[i]].push_back({r, weights[i]});
    }
    RecordLaunch("moe_experts");  // the experts' own matmuls and silu_mul are counted too
    for (int e = 0; e < num_experts; ++e) {
      const auto& routed = assigned[e];
      // Under expert parallelism another rank holds expert e (its weights are empty here).
      if (routed.empty() || lw.experts[e].gate.empty()) continue;
      if (fault_.kind == FaultInjection::Kind::kZeroExpert && e == static_cast<int>(fault_.value))
        continue;
      const int64_t m = static_cast<int64_t>(routed.size());
      std::vector<float> in(m * hidden), out(m * hidden);
      for (int64_t i = 0; i < m; ++i)
        std::copy_n(xn.data() + routed[i].first * hidden, hidden, in.data() + i * hidden);
      GatedMlp(lw.experts[e], in.data(), m, out.data());
      for (int64_t i = 0; i < m; ++i) {
        float* yr = y.data() + routed[i].first * hidden;
        for (int64_t j = 0; j < hidden; ++j) yr[j] += routed[i].second * out[i * hidden + j];
      }
    }
    if (!lw.shared_expert.gate.empty()) {
      std::vector<float> shared(rows * hidden), gate(rows);
      GatedMlp(lw.shared_expert, xn.data(), rows, shared.data());
      cpu::Matmul(options_.matmul, xn.data(), rows, lw.shared_expert_gate, {}, gate.data());
      for (int64_t r = 0; r < rows; ++r) {
        const float s = cpu::Sigmoid(gate[r]);
        for (int64_t j = 0; j < hidden; ++j) y[r * hidden + j] += s * shared[r * hidden + j];
      }
    }
  }

  // A tensor-parallel rank's partial sums become the ranks' total; one rank's are already.
  void AllReduce(std::vector<float>& partial) {
    if (options_.collective == nullptr) return;
    RecordLaunch("allreduce");
    options_.collective->AllReduceSum(partial.data(), static_cast<int64_t>(partial.size()));
  }

  // The launch log's one CPU fallback: the process-wide pool running another thread count than
  // this model's `threads` (resized by a model built since its StartBatch).
  void RecordThreadsFallback() const {
    const int wanted = options_.threads > 0
                           ? options_.threads
                           : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (cpu::NumThreads() == wanted) return;
    RecordFallback(
        absl::StrCat("threads=", options_.threads > 0 ? absl::StrCat(options_.threads) : "all",
                     ": ran on ", cpu::NumThreads(), " threads (", wanted,
                     " configured; the shared pool was resized by another model)"));
  }

  const ModelConfig& config_;
  // bad-quant-scale (TEST ONLY): the host's views with one scale tensor swapped for a corrupted
  // copy; empty otherwise.
  ModelWeights faulty_weights_;
  std::vector<uint8_t> faulty_scale_;
  const ModelWeights& w_;
  CpuModelOptions options_;
  const FaultInjection fault_;
  // A lockstep batch (batch_ > 0) or serving (serving_): both keep their sequences in slots_.
  int batch_ = 0, capacity_ = 0, position_ = 0;
  bool serving_ = false;
  KvSlotAllocator slots_;
  int64_t steps_ = 0;           // forward passes since StartBatch or StartServing
  bool slots_swapped_ = false;  // kv-slot-swap has struck
  // Full-attention layers: [layer][slots, capacity, kv_dim]; empty for linear-attention layers.
  std::vector<std::vector<float>> k_cache_, v_cache_;
  // Linear-attention layers: [layer][slots, K-1, conv_dim] and [layer][slots, Hv, dk, dv], fp32;
  // empty for full-attention layers.
  std::vector<std::vector<float>> conv_state_, recurrent_state_;
  const int first_linear_layer_ = FirstLinearLayer(config_);
};

}  // namespace

std::unique_ptr<Model> MakeCpuModel(const HostModel& host, const CpuModelOptions& options) {
  ModelWeights faulty_weights;
  std::vector<uint8_t> faulty_scale;
  if (options.fault.kind == FaultInjection::Kind::kBadQuantScale) {
    faulty_weights = host.weights;
    // CreateModel checked that the weights take this fault; failing here is a broken invariant.
    if (auto s = CorruptQuantScale(faulty_weights, host, options.fault.value, options.fault.target,
                                   &faulty_scale);
        !s.ok()) {
      std::fprintf(stderr, "MakeCpuModel: %s\n", std::string(s.message()).c_str());
      std::abort();
    }
  }
  return std::make_unique<CpuModel>(host, options, std::move(faulty_weights),
                                    std::move(faulty_scale));
}

}  // namespace infersweep
