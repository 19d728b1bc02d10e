#include "engine/cuda/moe_runner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "engine/cuda/device_util.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"

namespace infersweep {
MoeRunner::MoeRunner(const RunnerContext& context, LinearRunner& linear, const DeviceWeights* dw,
                     const QuantView* view, std::unique_ptr<cuda::CublasGroupedGemm> grouped)
    : config_(context.config),
      w_(context.weights),
      options_(context.options),
      fault_(context.fault),
      stream_(context.stream),
      linear_(linear),
      dw_(dw),
      view_(view),
      grouped_(std::move(grouped)) {
  for (const LayerWeights& lw : w_.layers) {
    absl::StatusOr<HeldExperts> held = HeldExpertRange(lw.experts);
    if (!held.ok() && held_status_.ok())
      held_status_ = absl::FailedPreconditionError(
          absl::StrCat("layer ", held_.size(), ": ", held.status().message()));
    held_.push_back(held.value_or(HeldExperts{}));
  }
}

absl::Status MoeRunner::AllocateScratch(int rows) {
  const size_t r = rows, hidden = config_.hidden_size, k = std::max(1, config_.num_experts_per_tok);
  const size_t moe_inter = std::max(config_.moe_intermediate_size, 1);
  // A shared expert may run as one more pair a row (MoeShared::kFoldedPair): its gate's logit
  // after the router's, its slot after the top-k's.
  const size_t shared = config_.shared_expert_intermediate_size > 0 ? 1 : 0, slots = k + shared;
  for (auto [buffer, count] :
       {std::pair{&router_, r * (std::max(config_.num_experts, 1) + shared) + 1},
        std::pair{&expert_weights_, r * slots}, std::pair{&moe_h_, r * slots * moe_inter},
        std::pair{&moe_out_, r * k * hidden}, std::pair{&moe_in_, r * k * hidden},
        std::pair{&route_weight_, r * k}})
    RETURN_IF_ERROR(buffer->Allocate(count));
  for (auto [buffer, count] :
       {std::pair{&expert_ids_, r * slots}, std::pair{&route_index_, r * k},
        std::pair{&pair_position_, r * k},
        std::pair{&expert_offsets_, static_cast<size_t>(std::max(config_.num_experts, 0) + 1)}})
    RETURN_IF_ERROR(buffer->Allocate(count));
  RETURN_IF_ERROR(xn_bf16_.Allocate(r * hidden));
  RETURN_IF_ERROR(moe_bf16_.Allocate(r * k * (2 * moe_inter + hidden)));
  // qgemm=w8a8's grouped kernels: the input rows and the pairs' h as E4M3 codes, a scale each.
  if (QuantizesActivationsFp8(options_.qgemm)) {
    RETURN_IF_ERROR(fp8_codes_.Allocate(r * hidden + r * k * moe_inter));
    RETURN_IF_ERROR(fp8_scales_.Allocate(r + r * k));
  }
  // The fused router's block count, zero between launches (each launch's last block resets it).
  RETURN_IF_ERROR(topk_counter_.Allocate(1));
  CUDA_OR_DIE(cudaMemsetAsync(topk_counter_.get(), 0, sizeof(unsigned), stream_));
  return absl::OkStatus();
}

void MoeRunner::FreeScratch() {
  for (DeviceBuffer<float>* b :
       {&router_, &expert_weights_, &moe_h_, &moe_out_, &moe_in_, &route_weight_})
    b->reset();
  for (DeviceBuffer<int>* b : {&expert_ids_, &route_index_, &pair_position_, &expert_offsets_})
    b->reset();
  xn_bf16_.reset();
  moe_bf16_.reset();
  fp8_codes_.reset();
  fp8_scales_.reset();
  topk_counter_.reset();
}

// fp32 copies of the MoE routers for cuBLASLt's fp32 GEMM (Router), made once, outside any
// graph capture: 1 MB a layer on qwen3-30b-a3b.
absl::Status MoeRunner::MakeRouterCopies() {
  if (!linear_.cublaslt() || !config_.is_moe() || !router_f32_.empty()) return absl::OkStatus();
  // Kept only when every copy is made: a failure frees the ones before it.
  std::vector<DeviceBuffer<float>> copies(config_.num_layers);
  for (int l = 0; l < config_.num_layers; ++l) {
    const MatrixRef& wr = w_.layers[l].router;
    if (wr.empty() || wr.quantized()) continue;  // the reference GEMM dequantizes those
    RETURN_IF_ERROR(copies[l].Allocate(static_cast<size_t>(wr.rows * wr.cols)));
    cuda::UpcastToF32(wr, copies[l].get(), stream_);
    CHECK_LAUNCH();
  }
  router_f32_ = std::move(copies);
  return absl::OkStatus();
}

// The layer's experts as the plan sees them (engine/plan/moe_plan.h), from the ones held here.
MoeLayerFacts MoeRunner::LayerFacts(int l) const {
  const LayerWeights& lw = w_.layers[l];
  const HeldExperts& held = held_[l];
  MoeLayerFacts f;
  f.quantized_tables = view_ && !view_->quant_tables.empty() &&
                       view_->quant_tables[l][0].format != QuantFormat::kNone;
  if (f.quantized_tables) {
    auto shape = [](const cuda::QuantExpertTable& t) {
      return cuda::QuantMatrixShape{t.format, t.rows, t.cols};
    };
    f.gate = shape(view_->quant_tables[l][0]);
    f.up = shape(view_->quant_tables[l][1]);
    f.down = shape(view_->quant_tables[l][2]);
  }
  f.experts_quantized_alike = ExpertsQuantizedAlike(l);
  f.experts_bf16 = held.count() > 0 && lw.experts[held.begin].gate.dtype == DType::kBF16 &&
                   !lw.experts[held.begin].gate.quantized();
  f.router_f32_copy = !router_f32_.empty() && router_f32_[l];
  f.shared_expert = !lw.shared_expert.gate.empty();
  f.shared_down_cols = static_cast<int>(lw.shared_expert.down.cols);
  // The per-pair kernels read the view's tables where it built them, else the shared upload's.
  const std::vector<bool>& in_table =
      view_ && !view_->shared_in_table.empty() ? view_->shared_in_table : dw_->shared_in_table;
  f.shared_in_tables = static_cast<size_t>(l) < in_table.size() && in_table[l];
  if (f.shared_in_tables && f.quantized_tables)  // the down kernel stages top-k + 1 slots
    f.shared_in_tables =
        cuda::MoeQuantSupports(view_->quant_tables[l][2], config_.num_experts_per_tok + 1);
  return f;
}

// One plan a step (PlanMoe) decides the router, the experts and the shared expert; the switches
// below run what it says. Prefill chunks group rows by expert so each expert's weights are read
// once, not once per token.
absl::Status MoeRunner::Run(int l, int rows, int n, bool gemv, float* x, float* out) {
  RETURN_IF_ERROR(held_status_);
  const LayerWeights& lw = w_.layers[l];
  const HeldExperts& held = held_[l];
  const int hidden = config_.hidden_size, k = config_.num_experts_per_tok;
  const int inter = config_.moe_intermediate_size;
  const int64_t elems = static_cast<int64_t>(rows) * hidden;
  const int skip =
      fault_.kind == FaultInjection::Kind::kZeroExpert ? static_cast<int>(fault_.value) : -1;
  const bool recording = LaunchRecording();
  const MoePlan plan = PlanMoe(options_, {config_.num_experts, k, hidden, inter}, LayerFacts(l),
                               {rows, n, gemv, recording});
  for (const std::string& f : plan.fallbacks) RecordFallback(f);
  // A quantized model's view holds its own bf16 tables (dequant_bf16's copies).
  const bool own = view_ && !view_->gate_table.empty();

  switch (plan.router) {
    case MoeRouter::kFusedGemv: {  // RMSNorm + router in one launch; it leaves xn normalised
      LinearRunner::FusedGemv a =
          LinearRunner::GemvInput(x, rows, hidden, lw.post_attention_norm, config_.rms_norm_eps);
      a.normed_out = linear_.xn();
      LinearRunner::AddSegment(a, lw.router, {}, router_.get());
      // The top-k in the same launch: its last block picks the experts (cuda::GemvTopK).
      a.topk.counter = topk_counter_.get();
      a.topk.expert_ids = expert_ids_.get();
      a.topk.expert_weights = expert_weights_.get();
      a.topk.num_experts = config_.num_experts;
      a.topk.k = k;
      a.topk.renormalize = config_.norm_topk_prob;
      if (plan.shared == MoeShared::kFoldedPair) {
        // The shared expert's gate logit after the router's, its pair after the top-k's.
        float* shared_logit = router_.get() + static_cast<int64_t>(rows) * config_.num_experts;
        LinearRunner::AddSegment(a, lw.shared_expert_gate, {}, shared_logit);
        a.topk.shared_logit = shared_logit;
      }
      RETURN_IF_ERROR(linear_.RunGemv(a));
      if (plan.bf16_input) cuda::ToBf16(linear_.xn(), elems, xn_bf16_.get(), stream_);
      break;
    }
    case MoeRouter::kCublasLtF32:
    case MoeRouter::kRouterKernel:
    case MoeRouter::kReference:
      cuda::RmsNorm(x, rows, hidden, lw.post_attention_norm, config_.rms_norm_eps, linear_.xn(),
                    stream_, plan.bf16_input ? xn_bf16_.get() : nullptr);
      RETURN_IF_ERROR(Router(l, rows, plan.router));
      break;
  }
  if (plan.router != MoeRouter::kFusedGemv)
    cuda::RouterTopK(router_.get(), rows, config_.num_experts, k, config_.norm_topk_prob,
                     expert_ids_.get(), expert_weights_.get(), stream_);

  // Pairs a row, and the end of the expert range, of the per-pair kernels: with the shared
  // expert folded in, one more pair a row, on the tables' entry after the experts'
  // (kFoldedPair needs every expert held, so held.end is num_experts).
  const bool folded = plan.shared == MoeShared::kFoldedPair;
  const int slots = folded ? k + 1 : k, end = folded ? held.end + 1 : held.end;
  switch (plan.experts) {
    case MoeExperts::kGrouped: {
      std::array<const uint16_t* const*, 3> tables{};
      const bool fp8 = plan.grouped == cuda::MoeGroupedKernel::kFp8Mma4 ||
                       plan.grouped == cuda::MoeGroupedKernel::kFp8Mma8 ||
                       plan.grouped == cuda::MoeGroupedKernel::kFp8Wgmma;
      const bool quant = fp8 || plan.grouped == cuda::MoeGroupedKernel::kQuantMma4 ||
                         plan.grouped == cuda::MoeGroupedKernel::kQuantMma8 ||
                         plan.grouped == cuda::MoeGroupedKernel::kQuantWgmma;
      if (plan.bf16_copies) {
        ASSIGN_OR_RETURN(tables, PrefillExpertCopies(l));
      } else if (!quant) {
        tables =
            own ? std::array<const uint16_t* const*, 3>{view_->gate_table[l], view_->up_table[l],
                                                        view_->down_table[l]}
                : std::array<const uint16_t* const*, 3>{dw_->gate_table[l], dw_->up_table[l],
                                                        dw_->down_table[l]};
      }
      cuda::MoeGroupedArgs a;
      a.kernel = plan.grouped;
      a.x_bf16 = xn_bf16_.get();
      a.rows = rows;
      a.k = k;
      a.num_experts = config_.num_experts;
      a.hidden = hidden;
      a.inter = inter;
      a.expert_ids = expert_ids_.get();
      a.expert_weights = expert_weights_.get();
      a.skip_expert = skip;
      a.expert_begin = held.begin;
      a.expert_end = held.end;
      a.gate = tables[0];
      a.up = tables[1];
      a.down = tables[2];
      a.offsets = expert_offsets_.get();
      a.sorted_pairs = route_index_.get();
      a.h = moe_bf16_.get();
      a.out = moe_out_.get();
      a.y = out;
      if (quant) a.quant = view_->quant_tables[l].data();
      if (fp8) {
        a.x_f32 = linear_.xn();
        a.x_fp8 = fp8_codes_.get();
        a.h_fp8 = fp8_codes_.get() + static_cast<int64_t>(rows) * hidden;
        a.x_scale = fp8_scales_.get();
        a.h_scale = fp8_scales_.get() + rows;
      }
      cuda::MoeGrouped(a, stream_);
      CHECK_LAUNCH();
      break;
    }
    case MoeExperts::kPerPairQuantGemv: {
      const std::array<cuda::QuantExpertTable, 3>& t = view_->quant_tables[l];
      cuda::MoeGateUpQuant(linear_.xn(), rows, slots, expert_ids_.get(), held.begin, end, t[0],
                           t[1], moe_h_.get(), stream_);
      cuda::MoeDownCombineQuant(moe_h_.get(), rows, slots, expert_ids_.get(),
                                expert_weights_.get(), skip, held.begin, end, t[2], out, stream_);
      CHECK_LAUNCH();
      break;
    }
    case MoeExperts::kPerPairGemv:
      cuda::MoeGateUp(linear_.xn(), rows, slots, expert_ids_.get(), held.begin, end,
                      own ? view_->gate_table[l] : dw_->gate_table[l],
                      own ? view_->up_table[l] : dw_->up_table[l], hidden, inter, moe_h_.get(),
                      stream_);
      cuda::MoeDownCombine(moe_h_.get(), rows, slots, expert_ids_.get(), expert_weights_.get(),
                           skip, held.begin, end, own ? view_->down_table[l] : dw_->down_table[l],
                           hidden, inter, out, stream_);
      CHECK_LAUNCH();
      break;
    case MoeExperts::kCublasGrouped:
    case MoeExperts::kLoop: {
      // The routing read on the host (a sync), then one grouped GEMM per projection over every
      // expert, or one gather + MLP + scatter per expert.
      const HostRouting routing = RouteOnHost(rows, skip, held);
      if (plan.experts == MoeExperts::kCublasGrouped) {
        RETURN_IF_ERROR(GroupedExperts(lw, rows, routing, out));
      } else {
        CUDA_OR_DIE(
            cudaMemsetAsync(linear_.y(), 0, static_cast<size_t>(elems) * sizeof(float), stream_));
        for (int e = 0; e < config_.num_experts; ++e) {
          const auto [first, count] = routing.spans[e];
          if (count == 0) continue;
          cuda::GatherRows(linear_.xn(), route_index_.get() + first, count, hidden, moe_in_.get(),
                           stream_);
          const uint16_t* gb =
              linear_.PrepareInput(moe_in_.get(), static_cast<int64_t>(count) * hidden);
          RETURN_IF_ERROR(linear_.Mlp(lw.experts[e], moe_in_.get(), gb, count, moe_out_.get()));
          cuda::ScatterAddRows(moe_out_.get(), route_index_.get() + first,
                               route_weight_.get() + first, count, hidden, linear_.y(), stream_);
          CHECK_LAUNCH();
        }
        cuda::AddScaled(out, linear_.y(), 1.f, elems, stream_);
      }
      // The routing's host vectors must outlive the async copies from them.
      CUDA_OR_DIE(cudaStreamSynchronize(stream_));
      break;
    }
  }

  switch (plan.shared) {
    case MoeShared::kNone:
    case MoeShared::kFoldedPair:  // ran with the routed experts' pairs
      break;
    case MoeShared::kFusedGemv:
      // gate, up and the shared gate in one GEMV over the normalised input; down into o.
      RETURN_IF_ERROR(linear_.MlpGemv(lw.shared_expert, linear_.xn(), rows, lw.shared_expert_gate,
                                      router_.get(), linear_.o()));
      cuda::AddSigmoidGated(out, linear_.o(), router_.get(), rows, hidden, stream_);
      CHECK_LAUNCH();
      break;
    case MoeShared::kUnfused: {
      const uint16_t* sb = linear_.PrepareInput(linear_.xn(), static_cast<int64_t>(rows) * hidden);
      RETURN_IF_ERROR(linear_.Mlp(lw.shared_expert, linear_.xn(), sb, rows, linear_.o()));
      // Mlp reused the bf16 staging buffer: convert the input again for the gate.
      sb = linear_.PrepareInput(linear_.xn(), static_cast<int64_t>(rows) * hidden);
      RETURN_IF_ERROR(
          linear_.Gemm(linear_.xn(), sb, rows, lw.shared_expert_gate, {}, router_.get()));
      cuda::AddSigmoidGated(out, linear_.o(), router_.get(), rows, hidden, stream_);
      CHECK_LAUNCH();
      break;
    }
  }
  return absl::OkStatus();
}

absl::Status MoeRunner::Router(int l, int rows, MoeRouter path) {
  const MatrixRef& wr = w_.layers[l].router;
  switch (path) {
    case MoeRouter::kCublasLtF32:
      return linear_.cublaslt()->RunF32(linear_.xn(), rows, router_f32_[l].get(),
                                        static_cast<int>(wr.rows), static_cast<int>(wr.cols),
                                        router_.get(), stream_);
    case MoeRouter::kRouterKernel:
      cuda::RouterGemm(linear_.xn(), rows, wr, router_.get(), stream_);
      break;
    case MoeRouter::kReference:
      cuda::GemmReference(linear_.xn(), rows, wr, {}, router_.get(), stream_);
      break;
    case MoeRouter::kFusedGemv:
      return absl::InternalError("MoeRunner::Router: the fused GEMV runs the router itself");
  }
  CHECK_LAUNCH();
  return absl::OkStatus();
}

MoeRunner::HostRouting MoeRunner::RouteOnHost(int rows, int skip, const HeldExperts& held) {
  const int k = config_.num_experts_per_tok;
  std::vector<int> ids(static_cast<size_t>(rows) * k);
  std::vector<float> weights(ids.size());
  CUDA_OR_DIE(cudaMemcpyAsync(ids.data(), expert_ids_.get(), ids.size() * sizeof(int),
                              cudaMemcpyDeviceToHost, stream_));
  CUDA_OR_DIE(cudaMemcpyAsync(weights.data(), expert_weights_.get(), ids.size() * sizeof(float),
                              cudaMemcpyDeviceToHost, stream_));
  CUDA_OR_DIE(cudaStreamSynchronize(stream_));
  HostRouting r;
  r.pair_position.assign(ids.size(), -1);
  r.spans.assign(config_.num_experts, {0, 0});
  // Counting sort by expert, pairs in order within an expert: O(pairs + experts). (Scanning
  // every pair once per expert would take 2M steps a layer at prefill 2048.) Pairs of experts
  // that do not run here are left out: their experts' spans stay empty.
  for (size_t p = 0; p < ids.size(); ++p)
    if (RunsExpert(held, skip, ids[p])) ++r.spans[ids[p]].second;
  int next = 0;
  for (auto& [first, count] : r.spans) {
    first = next;
    next += count;
  }
  r.index.resize(next);
  r.index_weight.resize(next);
  std::vector<int> fill(config_.num_experts, 0);
  for (size_t p = 0; p < ids.size(); ++p) {
    const int e = ids[p];
    if (!RunsExpert(held, skip, e)) continue;
    const int position = r.spans[e].first + fill[e]++;
    r.pair_position[p] = position;
    r.index[position] = static_cast<int>(p / k);
    r.index_weight[position] = weights[p];
  }
  CUDA_OR_DIE(cudaMemcpyAsync(route_index_.get(), r.index.data(), r.index.size() * sizeof(int),
                              cudaMemcpyHostToDevice, stream_));
  CUDA_OR_DIE(cudaMemcpyAsync(route_weight_.get(), r.index_weight.data(),
                              r.index.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
  if (grouped_)  // only the grouped runner's combine reads it
    CUDA_OR_DIE(cudaMemcpyAsync(pair_position_.get(), r.pair_position.data(),
                                r.pair_position.size() * sizeof(int), cudaMemcpyHostToDevice,
                                stream_));
  return r;
}

// moe=grouped: every routed pair's row gathered in expert order, then gate, up and down each as
// one cuBLAS grouped GEMM over the experts (bf16 in and out), then x += the weighted sum of each
// row's pairs. bf16 buffers: the gathered input in the bf16 staging, gate | up | h in moe_bf16_,
// the pairs' outputs after it.
absl::Status MoeRunner::GroupedExperts(const LayerWeights& lw, int rows, const HostRouting& routing,
                                       float* x) {
  const int hidden = config_.hidden_size, inter = config_.moe_intermediate_size;
  const int pairs = static_cast<int>(routing.index.size());
  if (pairs == 0) return absl::OkStatus();
  // The norm wrote xn in bf16 too (Moe): gather those rows, half the bytes of fp32 rows and no
  // conversion after.
  cuda::GatherRowsBf16(xn_bf16_.get(), route_index_.get(), pairs, hidden, linear_.bf16(), stream_);
  const uint16_t* xb = linear_.bf16();
  const int64_t h_elems = static_cast<int64_t>(pairs) * inter;
  uint16_t* gate = moe_bf16_.get();
  uint16_t* up = gate + h_elems;
  uint16_t* out = up + h_elems;  // [pairs, hidden]
  std::vector<cuda::GroupedProblem> gate_problems, up_problems, down_problems;
  for (int e = 0; e < config_.num_experts; ++e) {
    const auto [first, count] = routing.spans[e];
    if (count == 0) continue;
    const ExpertWeights& w = lw.experts[e];
    const int64_t in_row = static_cast<int64_t>(first) * hidden,
                  h_row = static_cast<int64_t>(first) * inter;
    gate_problems.push_back(
        {xb + in_row, static_cast<const uint16_t*>(w.gate.data), gate + h_row, count});
    up_problems.push_back(
        {xb + in_row, static_cast<const uint16_t*>(w.up.data), up + h_row, count});
    // silu(gate) * up is written over gate: the down projection's input.
    down_problems.push_back(
        {gate + h_row, static_cast<const uint16_t*>(w.down.data), out + in_row, count});
  }
  RETURN_IF_ERROR(grouped_->Run(gate_problems, inter, hidden, stream_));
  RETURN_IF_ERROR(grouped_->Run(up_problems, inter, hidden, stream_));
  cuda::SiluMulBf16(gate, up, h_elems, gate, stream_);
  RETURN_IF_ERROR(grouped_->Run(down_problems, hidden, inter, stream_));
  cuda::CombinePairsBf16(out, pair_position_.get(), expert_weights_.get(), rows,
                         config_.num_experts_per_tok, hidden, x, stream_);
  CHECK_LAUNCH();
  return absl::OkStatus();
}

// Whether every expert matrix of layer l held here is quantized, gate and up [inter, hidden] and
// down [hidden, inter]: what PrefillExpertCopies takes. A checkpoint that left some experts dense
// keeps the per-expert loop.
bool MoeRunner::ExpertsQuantizedAlike(int l) const {
  const int64_t inter = config_.moe_intermediate_size, hidden = config_.hidden_size;
  const HeldExperts& held = held_[l];
  if (held.count() == 0) return false;
  for (int e = held.begin; e < held.end; ++e) {
    const ExpertWeights& x = w_.layers[l].experts[e];
    for (const MatrixRef* w : {&x.gate, &x.up, &x.down})
      if (!w->quantized() || w->rows * w->cols != inter * hidden ||
          w->cols != (w == &x.down ? inter : hidden))
        return false;
  }
  return true;
}

// Layer l's experts held here dequantized into the expert scratch; its gate, up and down tables
// (null for the experts not held, which the grouped kernels never index).
absl::StatusOr<std::array<const uint16_t* const*, 3>> MoeRunner::PrefillExpertCopies(int l) {
  const int experts = config_.num_experts;
  const HeldExperts& held = held_[l];
  const int count = held.count();
  const size_t per_matrix =
      static_cast<size_t>(config_.moe_intermediate_size) * config_.hidden_size;
  if (!prefill_experts_) {
    // Copy m of held expert e is matrix m * count + (e - begin) of the scratch.
    RETURN_IF_ERROR(prefill_experts_.Allocate(3 * count * per_matrix));
    std::vector<const uint16_t*> list(3 * experts, nullptr);
    for (int m = 0; m < 3; ++m)
      for (int e = held.begin; e < held.end; ++e)
        list[m * experts + e] =
            prefill_experts_.get() + static_cast<size_t>(m * count + e - held.begin) * per_matrix;
    RETURN_IF_ERROR(prefill_expert_tables_.Allocate(list.size()));
    CUDA_OR_DIE(cudaMemcpy(prefill_expert_tables_.get(), list.data(), list.size() * sizeof(list[0]),
                           cudaMemcpyHostToDevice));
    prefill_tables_held_ = held;
  } else if (prefill_tables_held_.begin != held.begin || prefill_tables_held_.end != held.end) {
    return absl::UnimplementedError(absl::StrCat(
        "layer ", l, " holds experts [", held.begin, ", ", held.end, "), an earlier layer [",
        prefill_tables_held_.begin, ", ", prefill_tables_held_.end,
        "): the prefill copies' tables are made for one run of experts"));
  }
  // The layer's 3 x count quantized experts as one device array (made at the layer's first
  // prefill), dequantized in one launch: 384 launches a layer cost more than the bytes.
  if (prefill_expert_refs_.empty()) prefill_expert_refs_.resize(config_.num_layers);
  if (!prefill_expert_refs_[l]) {
    const LayerWeights& lw = w_.layers[l];
    std::vector<MatrixRef> refs;
    for (int m = 0; m < 3; ++m)
      for (int e = held.begin; e < held.end; ++e)
        refs.push_back(m == 0   ? lw.experts[e].gate
                       : m == 1 ? lw.experts[e].up
                                : lw.experts[e].down);
    DeviceBuffer<MatrixRef> d;
    RETURN_IF_ERROR(d.Allocate(refs.size()));
    CUDA_OR_DIE(
        cudaMemcpy(d.get(), refs.data(), refs.size() * sizeof(MatrixRef), cudaMemcpyHostToDevice));
    prefill_expert_refs_[l] = std::move(d);
  }
  const MatrixRef& shape = w_.layers[l].experts[held.begin].gate;
  cuda::DequantizeManyToBf16(prefill_expert_refs_[l].get(), 3 * count, shape.rows, shape.cols,
                             prefill_experts_.get(), stream_);
  CHECK_LAUNCH();
  const uint16_t* const* tables = prefill_expert_tables_.get();
  return std::array<const uint16_t* const*, 3>{tables, tables + experts, tables + 2 * experts};
}

}  // namespace infersweep
