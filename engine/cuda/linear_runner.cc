#include "engine/cuda/linear_runner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "core/unreachable.h"
#include "engine/cuda/device_util.h"
#include "kernels/cuda/compute_capability.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/sm90a/gemm_tma.h"
#include "kernels/cuda/sm90a/moe_wgmma.h"

namespace infersweep {
namespace {

// How the reference GEMM reads its inputs under a yardstick (CudaOptions::yardstick).
cuda::GemmInputs ReferenceInputs(Yardstick y) {
  switch (y) {
    case Yardstick::kNone:
      return cuda::GemmInputs::kExact;
    case Yardstick::kBf16:
      return cuda::GemmInputs::kBf16;
    case Yardstick::kE4m3:
      return cuda::GemmInputs::kE4m3Rows;
  }
  Unreachable("ReferenceInputs: a Yardstick outside its enum");
}

}  // namespace

LinearRunner::LinearRunner(const RunnerContext& context, std::unique_ptr<cuda::CublasLtGemm> gemm,
                           const QuantView* view)
    : config_(context.config),
      options_(context.options),
      stream_(context.stream),
      gemm_(std::move(gemm)),
      view_(view) {
  const absl::StatusOr<int> sm = CurrentComputeCapability("linear runner");
  wgmma_ = sm.ok() && *sm == 90;
}

// The most elements of a quantized linear that Gemm dequantizes into the bf16 copy: the dense
// projections, MLPs and lm_head (the experts run on their codes).
size_t LinearRunner::LargestQuantizedDense() const {
  if (!view_) return 0;
  size_t most = 0;
  auto consider = [&](const MatrixRef& m) {
    if (m.quantized()) most = std::max(most, static_cast<size_t>(m.numel()));
  };
  for (const LayerWeights& lw : view_->weights.layers) {
    for (const MatrixRef* m :
         {&lw.q, &lw.k, &lw.v, &lw.o, &lw.mlp.gate, &lw.mlp.up, &lw.mlp.down,
          &lw.shared_expert.gate, &lw.shared_expert.up, &lw.shared_expert.down,
          &lw.linear_attn.in_proj_qkv, &lw.linear_attn.in_proj_z, &lw.linear_attn.out_proj})
      consider(*m);
  }
  consider(view_->weights.lm_head);
  return most;
}

absl::Status LinearRunner::AllocateScratch(int rows) {
  // Decode batches of kQuantBf16CopyMinRows+ rows may dequantize into the copy inside captured
  // graphs, where it cannot grow (FP8 block-128, or more than kQuantMmaMaxRows rows): it is
  // reserved here.
  const bool register_dequant = DequantizesInRegisters(options_.qgemm);
  if (rows >= kQuantBf16CopyMinRows && gemm_ && register_dequant) {
    RETURN_IF_ERROR(ReserveBf16Copy(LargestQuantizedDense()));
  }
  const size_t r = rows, hidden = config_.hidden_size, k = std::max(1, config_.num_experts_per_tok);
  const size_t inter = MaxIntermediate();
  const size_t widest = std::max({hidden, static_cast<size_t>(config_.q_dim()), inter,
                                  static_cast<size_t>(config_.linear_value_dim())});
  for (auto [buffer, count] :
       {std::pair{&xn_, r * hidden}, std::pair{&o_, r * hidden}, std::pair{&y_, r * hidden},
        std::pair{&gate_, r * inter}, std::pair{&up_, r * inter}})
    RETURN_IF_ERROR(buffer->Allocate(count));
  // qgemm=w8a8: a GEMM's input rows as E4M3 codes and their scales (GemmFp8Mma).
  if (QuantizesActivationsFp8(options_.qgemm)) {
    RETURN_IF_ERROR(fp8_codes_.Allocate(r * widest));
    RETURN_IF_ERROR(fp8_scales_.Allocate(r));
  }
  // The bf16 staging holds a GEMM's input, or the MoE pairs' gathered rows (moe=grouped).
  return bf16_.Allocate(std::max(r * widest, r * k * hidden));
}

void LinearRunner::FreeScratch() {
  for (DeviceBuffer<float>* b : {&xn_, &o_, &y_, &gate_, &up_, &fp8_scales_}) b->reset();
  bf16_.reset();
  fp8_codes_.reset();
}

LinearPlan LinearRunner::Plan(const MatrixRef& w, int rows, bool bf16_input,
                              bool record_fallback) const {
  LinearWeightFacts facts;
  facts.dtype = w.dtype;
  facts.format = w.quantized() ? w.quant.format : QuantFormat::kNone;
  facts.rows = w.rows;
  facts.cols = w.cols;
  facts.codes_aligned = reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
  const LinearStep step{gemm_ != nullptr, rows, prefill_, bf16_input, wgmma_};
  LinearPlan plan = PlanLinear(options_, facts, step);
  if (record_fallback && LaunchRecording()) {
    const std::string fallback = LinearFallback(options_, plan, facts, step);
    if (!fallback.empty()) RecordFallback(fallback);
  }
  return plan;
}

absl::Status LinearRunner::Gemm(const float* x, const uint16_t* x_bf16, int rows,
                                const MatrixRef& w, const MatrixRef& bias, float* y) {
  const LinearPlan plan = Plan(w, rows, x_bf16 != nullptr, /*record_fallback=*/true);
  switch (plan.path) {
    case LinearPath::kScaledGemm:  // qgemm=fp8_cublaslt | native_fp4 | cudnn
      if (!view_ || !view_->scaled)
        return absl::InternalError("a scaled-GEMM linear without the view's scaled GEMM");
      RETURN_IF_ERROR(view_->scaled->Run(x, rows, w, y, stream_));
      break;
    case LinearPath::kQuantReference:  // exact dequantization; adds the bias itself
      cuda::GemmReference(x, rows, w, bias, y, stream_, ReferenceInputs(options_.yardstick));
      CHECK_LAUNCH();
      return absl::OkStatus();
    case LinearPath::kQuantBf16Copy: {  // tensor cores on a bf16 copy (QuantBf16Copy)
      ASSIGN_OR_RETURN(MatrixRef copy, QuantBf16Copy(w));
      RETURN_IF_ERROR(gemm_->Run(x_bf16, rows, copy, y, stream_));
      break;
    }
    case LinearPath::kQuantMma:
      // The codes decoded in registers onto tensor cores, every weight read once a pass of 32 or
      // 64 rows (the GEMV re-reads and re-decodes it every 4), K split over a block's warps.
      cuda::GemmQuantMma(x_bf16, rows, w, y, stream_);
      break;
    case LinearPath::kQuantFp8Mma:
      // qgemm=w8a8: the rows quantized to E4M3, then E4M3 x E4M3 tensor cores on the codes.
      cuda::GemmFp8Mma(x, rows, w, fp8_codes_.get(), fp8_scales_.get(), y, stream_);
      break;
    case LinearPath::kQuantFp8Wgmma:  // the same on Hopper's E4M3 wgmma, 128 x 128 tiles
      cuda::GemmFp8Wgmma(x, rows, w, fp8_codes_.get(), fp8_scales_.get(), y, stream_);
      break;
    case LinearPath::kQuantGemvFp4:
      cuda::GemvW4A16(x, rows, w, y, stream_);
      break;
    case LinearPath::kQuantGemvFp8:
      cuda::GemvW8A16(x, rows, w, y, stream_);
      break;
    case LinearPath::kCublasLt:
      RETURN_IF_ERROR(gemm_->Run(x_bf16, rows, w, y, stream_));
      break;
    case LinearPath::kReference:  // adds the bias itself
      cuda::GemmReference(x, rows, w, bias, y, stream_, ReferenceInputs(options_.yardstick));
      CHECK_LAUNCH();
      return absl::OkStatus();
    case LinearPath::kRefused:
      return absl::UnimplementedError(plan.refusal);
  }
  if (!bias.empty()) cuda::AddBias(y, rows, bias, stream_);
  CHECK_LAUNCH();
  return absl::OkStatus();
}

// y += scale * (x . W^T + bias): cuBLASLt adds into y itself (beta = 1) for bf16 W without a
// bias, one launch fewer than the product into o_ and a separate add.
absl::Status LinearRunner::GemmAccumulate(const float* x, const uint16_t* x_bf16, int rows,
                                          const MatrixRef& w, const MatrixRef& bias, float scale,
                                          float* y) {
  if (bias.empty() &&
      Plan(w, rows, x_bf16 != nullptr, /*record_fallback=*/false).path == LinearPath::kCublasLt) {
    RETURN_IF_ERROR(gemm_->Run(x_bf16, rows, w, y, stream_, scale, 1.f));
    CHECK_LAUNCH();
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Gemm(x, x_bf16, rows, w, bias, o_.get()));
  cuda::AddScaled(y, o_.get(), scale, static_cast<int64_t>(rows) * w.rows, stream_);
  CHECK_LAUNCH();
  return absl::OkStatus();
}

// q, k and v stored back to back (UploadWeights), dense bf16 without biases, under cuBLASLt:
// one GEMM for the three, where three small GEMMs would each pay a launch, a ramp and a tail.
bool LinearRunner::QkvContiguous(const LayerWeights& lw) const {
  const MatrixRef* parts[3] = {&lw.q, &lw.k, &lw.v};
  for (const MatrixRef* m : parts)
    if (m->dtype != DType::kBF16 || m->quantized() || m->cols != lw.q.cols) return false;
  const auto* q = static_cast<const uint16_t*>(lw.q.data);
  return gemm_ && lw.q_bias.empty() && lw.k_bias.empty() && lw.v_bias.empty() &&
         q + lw.q.rows * lw.q.cols == lw.k.data &&
         static_cast<const uint16_t*>(lw.k.data) + lw.k.rows * lw.k.cols == lw.v.data;
}

absl::Status LinearRunner::ReserveBf16Copy(size_t count) {
  if (count <= bf16_copy_count_) return absl::OkStatus();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream_, &capturing);
  if (capturing != cudaStreamCaptureStatusNone)
    return absl::InternalError(absl::StrCat("the bf16 copy of a quantized linear (", count,
                                            " elements) was not reserved before the capture"));
  // The old copy is freed first (cudaFree synchronises: nothing still reads it).
  bf16_copy_count_ = 0;
  RETURN_IF_ERROR(bf16_copy_.Allocate(count));
  bf16_copy_count_ = count;
  return absl::OkStatus();
}

// qgemm=w4a16|w8a16 prefill. The register-dequantizing GEMV and expert kernels are built for
// decode's few rows: through them a 512-token prompt would re-read every weight once per 4 rows,
// and the experts would take the host-synced per-expert loop (TTFT 1.55 s for NVFP4 qwen3-30b-a3b,
// 0.50 s for FP8). A prefill chunk instead dequantizes each quantized matrix, as it comes, into a
// bf16 scratch (the same exact dequantization as dequant_bf16, then one bf16 rounding) and runs the
// bf16 tensor-core paths: cuBLASLt for the dense projections, the grouped expert kernels for the
// MoE. The scratch (one dense matrix, and one layer's experts: 1.2 GB for qwen3-30b-a3b) is
// allocated at the first quantized prefill. Decode batches of more than kQuantMmaMaxRows rows
// (FP8 block-128: kQuantBf16CopyMinRows+) take the dense copy too (reserved by AllocateScratch);
// smaller ones keep the quantized kernels.
absl::StatusOr<MatrixRef> LinearRunner::QuantBf16Copy(const MatrixRef& w) {
  RETURN_IF_ERROR(ReserveBf16Copy(static_cast<size_t>(w.numel())));
  cuda::DequantizeToBf16(w, bf16_copy_.get(), stream_);
  CHECK_LAUNCH();
  return MatrixRef{bf16_copy_.get(), DType::kBF16, w.rows, w.cols};
}

const uint16_t* LinearRunner::PrepareInput(const float* x, int64_t count) {
  if (!gemm_) return nullptr;
  cuda::ToBf16(x, count, bf16_.get(), stream_);
  CHECK_LAUNCH();
  return bf16_.get();
}

const uint16_t* LinearRunner::NormAndPrepare(const float* x, int rows, int n, const MatrixRef& gain,
                                             float eps) {
  cuda::RmsNorm(x, rows, n, gain, eps, xn_.get(), stream_, gemm_ ? bf16_.get() : nullptr);
  CHECK_LAUNCH();
  return gemm_ ? bf16_.get() : nullptr;
}

// The attention projections' GEMV: TMA-streamed with gemm=tma (sm_90a), else register-streamed.
void LinearRunner::ProjectionGemv(const cuda::GemvArgs& a) {
  if (UsesTma(options_.gemm) && cuda::GemvTmaSupports(a.rows, a.k)) {
    cuda::GemvTma(a, stream_);
    return;
  }
  if (UsesTma(options_.gemm) && LaunchRecording())
    RecordFallback(absl::StrCat("gemm=tma: projection of ", a.rows, " rows, K=", a.k,
                                ": the register-streamed GEMV (GemvTmaSupports is false)"));
  cuda::Gemv(a, stream_);
}

int LinearRunner::MaxIntermediate() const {
  return std::max({config_.intermediate_size, config_.moe_intermediate_size,
                   config_.shared_expert_intermediate_size, 1});
}

// bf16 weights: our GEMV (TMA-streamed for the projections with gemm=tma). Quantized codes
// with qgemm=w4a16|w8a16: the quantized GEMV with the same fusions. Anything else (qgemm=
// reference, a shape the quantized GEMV does not take): RMSNorm into xn_ (the only normed_out
// in use), Gemm per segment, then the epilogue. Segments of different kinds (a quantized
// model's bf16 in_proj b and a, a checkpoint that left some projections dense) run a launch a
// kind.
absl::Status LinearRunner::RunGemv(const FusedGemv& g, bool projection) {
  enum class Kind { kBf16, kQuant, kOther };
  const bool in_registers = DequantizesInRegisters(options_.qgemm);
  auto kind = [in_registers](const MatrixRef& w) {
    if (w.quantized())
      return in_registers && cuda::QuantGemvSupports(w) ? Kind::kQuant : Kind::kOther;
    return w.dtype == DType::kBF16 ? Kind::kBf16 : Kind::kOther;
  };
  const Kind k0 = kind(g.w[0]);
  bool uniform = true;
  for (int s = 1; s < g.segments; ++s)
    uniform = uniform && kind(g.w[s]) == k0 && g.w[s].quant.format == g.w[0].quant.format;
  if (!uniform) {
    // A launch a kind of weight, its segments in order (a quantized in_proj's q|k|v and z in one,
    // its bf16 b and a in another); a router's top-k once after the last (below: it reads the
    // shared expert's logit, a later segment, too).
    bool launched[cuda::kGemvMaxSegments] = {};
    for (int s = 0; s < g.segments; ++s) {
      if (launched[s]) continue;
      FusedGemv group = g;
      group.segments = 0;
      group.topk = {};
      for (int t = s; t < g.segments; ++t) {
        if (launched[t] || kind(g.w[t]) != kind(g.w[s]) ||
            g.w[t].quant.format != g.w[s].quant.format)
          continue;
        group.seg[group.segments] = g.seg[t];
        group.w[group.segments] = g.w[t];
        group.bias[group.segments] = g.bias[t];
        ++group.segments;
        launched[t] = true;
      }
      RETURN_IF_ERROR(RunGemv(group, projection));
    }
  } else if (k0 == Kind::kBf16) {
    if (projection)
      ProjectionGemv(g);
    else
      cuda::Gemv(g, stream_);
  } else if (k0 == Kind::kQuant) {
    cuda::QuantGemvWeights qw;
    for (int s = 0; s < g.segments; ++s) qw.w[s] = g.w[s];
    cuda::GemvQuant(g, qw, stream_);
  } else {
    if (in_registers && LaunchRecording())
      for (int s = 0; s < g.segments; ++s)
        if (g.w[s].quantized())
          RecordFallback(absl::StrCat(
              "qgemm=", AxisValueName(options_.qgemm), ": weight [", g.w[s].rows, ", ", g.w[s].cols,
              "]: unfused (norm, unfused quantized GEMV, epilogue), not the fused quantized "
              "GEMV (QuantGemvSupports is false)"));
    const float* in = g.x;
    if (g.norm_gain) {
      cuda::RmsNorm(g.x, g.rows, g.k, MatrixRef{g.norm_gain, g.norm_dtype, 1, g.k}, g.norm_eps,
                    xn_.get(), stream_);
      in = xn_.get();
    }
    const uint16_t* in_bf16 = PrepareInput(in, static_cast<int64_t>(g.rows) * g.k);
    for (int s = 0; s < g.segments; ++s) {
      const cuda::GemvSegment& seg = g.seg[s];
      if (!g.accumulate && g.scale == 1.f) {
        RETURN_IF_ERROR(Gemm(in, in_bf16, g.rows, g.w[s], g.bias[s], seg.y));
        continue;
      }
      // y_ is free on the GEMV path; accumulating segments (o, down) are [rows, hidden].
      RETURN_IF_ERROR(Gemm(in, in_bf16, g.rows, g.w[s], g.bias[s], y_.get()));
      const int64_t count = static_cast<int64_t>(g.rows) * seg.n;
      if (!g.accumulate) CUDA_OR_DIE(cudaMemsetAsync(seg.y, 0, count * sizeof(float), stream_));
      cuda::AddScaled(seg.y, y_.get(), g.scale, count, stream_);
    }
  }
  // cuda::Gemv runs a router's top-k itself (GemvTopK); the other paths above do not.
  const bool topk_in_gemv = uniform && k0 == Kind::kBf16 && !projection;
  if (g.topk.counter && !topk_in_gemv)
    cuda::RouterTopK(g.seg[0].y, g.rows, g.topk.num_experts, g.topk.k, g.topk.renormalize,
                     g.topk.expert_ids, g.topk.expert_weights, stream_, g.topk.shared_logit);
  CHECK_LAUNCH();
  return absl::OkStatus();
}

LinearRunner::FusedGemv LinearRunner::GemvInput(const float* x, int rows, int k,
                                                const MatrixRef& norm, float eps) {
  FusedGemv a;
  a.x = x;
  a.rows = rows;
  a.k = k;
  a.norm_gain = norm.data;
  a.norm_dtype = norm.dtype;
  a.norm_eps = eps;
  return a;
}

void LinearRunner::AddSegment(FusedGemv& a, const MatrixRef& w, const MatrixRef& bias, float* y) {
  if (a.segments == cuda::kGemvMaxSegments)
    Unreachable("LinearRunner::AddSegment: more segments than the GEMV takes");
  a.w[a.segments] = w;
  a.bias[a.segments] = bias;
  cuda::GemvSegment& s = a.seg[a.segments++];
  s.w = static_cast<const uint16_t*>(w.data);
  s.bias = bias.data;
  s.bias_dtype = bias.dtype;
  s.y = y;
  s.n = static_cast<int>(w.rows);
  s.ld = s.n;
}

absl::Status LinearRunner::DenseMlp(const LayerWeights& lw, int rows, bool gemv, float* x,
                                    float* out) {
  const int hidden = config_.hidden_size;
  const int64_t elems = static_cast<int64_t>(rows) * hidden;
  if (gemv) {
    const int inter = static_cast<int>(lw.mlp.gate.rows);
    FusedGemv a = GemvInput(x, rows, hidden, lw.post_attention_norm, config_.rms_norm_eps);
    AddSegment(a, lw.mlp.gate, {}, gate_.get());
    AddSegment(a, lw.mlp.up, {}, up_.get());
    RETURN_IF_ERROR(RunGemv(a));
    cuda::SiluMul(gate_.get(), up_.get(), static_cast<int64_t>(rows) * inter, gate_.get(), stream_);
    FusedGemv d = GemvInput(gate_.get(), rows, inter, {});
    AddSegment(d, lw.mlp.down, {}, out);
    d.accumulate = true;
    RETURN_IF_ERROR(RunGemv(d));
    CHECK_LAUNCH();
    return absl::OkStatus();
  }
  cuda::RmsNorm(x, rows, hidden, lw.post_attention_norm, config_.rms_norm_eps, xn_.get(), stream_);
  const uint16_t* mb = PrepareInput(xn_.get(), elems);
  RETURN_IF_ERROR(Mlp(lw.mlp, xn_.get(), mb, rows, y_.get()));
  cuda::AddScaled(out, y_.get(), 1.f, elems, stream_);
  CHECK_LAUNCH();
  return absl::OkStatus();
}

absl::Status LinearRunner::MlpGemv(const ExpertWeights& e, const float* in, int rows,
                                   const MatrixRef& extra, float* extra_out, float* y) {
  const int hidden = static_cast<int>(e.gate.cols), inter = static_cast<int>(e.gate.rows);
  FusedGemv a = GemvInput(in, rows, hidden, {});
  AddSegment(a, e.gate, {}, gate_.get());
  AddSegment(a, e.up, {}, up_.get());
  if (!extra.empty()) AddSegment(a, extra, {}, extra_out);
  RETURN_IF_ERROR(RunGemv(a));
  cuda::SiluMul(gate_.get(), up_.get(), static_cast<int64_t>(rows) * inter, gate_.get(), stream_);
  FusedGemv d = GemvInput(gate_.get(), rows, inter, {});
  AddSegment(d, e.down, {}, y);
  return RunGemv(d);
}

absl::Status LinearRunner::Mlp(const ExpertWeights& e, const float* in, const uint16_t* in_bf16,
                               int rows, float* y) {
  const int inter = static_cast<int>(e.gate.rows);
  RETURN_IF_ERROR(Gemm(in, in_bf16, rows, e.gate, {}, gate_.get()));
  RETURN_IF_ERROR(Gemm(in, in_bf16, rows, e.up, {}, up_.get()));
  cuda::SiluMul(gate_.get(), up_.get(), static_cast<int64_t>(rows) * inter, gate_.get(), stream_);
  const uint16_t* hb = PrepareInput(gate_.get(), static_cast<int64_t>(rows) * inter);
  return Gemm(gate_.get(), hb, rows, e.down, {}, y);
}

}  // namespace infersweep
