#include "engine/plan/memory_plan.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "api/status_macros.h"
#include "core/dtype.h"
#include "core/tensor_ref.h"
#include "engine/plan/attention_plan.h"
#include "engine/plan/collective_plan.h"
#include "engine/plan/linear_attention_plan.h"
#include "engine/plan/moe_plan.h"
#include "engine/tensor_spec.h"
#include "kernels/cuda/limits.h"
#include "kernels/cuda/scaled_layout.h"

namespace infersweep {
namespace {

constexpr int64_t kFloat = 4, kInt = 4, kPointer = 8;

// The weight format's logical linear: its [rows, cols] and whether it is a routed expert.
struct QuantLinear {
  int64_t rows = 0, cols = 0;
  bool expert = false;
  int layer = -1;
};

// What the planner reads of one config on one model, and the items it adds.
class Planner {
 public:
  Planner(const CudaOptions& options, const ModelConfig& full, const ModelConfig& rank,
          QuantFormat format, const MemoryWorkload& workload, MemoryPlan& plan)
      : o_(options), full_(full), c_(rank), format_(format), w_(workload), plan_(plan) {}

  absl::Status Run() {
    RETURN_IF_ERROR(Steps());
    RETURN_IF_ERROR(Weights());
    Copies();
    RETURN_IF_ERROR(KvCache());
    RecurrentState();
    Scratch();
    Workspaces();
    GraphPools();
    return absl::OkStatus();
  }

 private:
  void Add(MemoryPool pool, std::string name, int64_t bytes, bool allowance = false) {
    if (bytes > 0) plan_.items.push_back({pool, std::move(name), bytes, allowance});
  }
  bool quantized() const { return format_ != QuantFormat::kNone; }
  int tp() const { return o_.parallel.tp; }
  int top_k() const { return std::max(1, c_.num_experts_per_tok); }
  // The experts a rank holds whole: experts / tp at ep=on, else all (sharded at ep=off).
  int experts_held() const {
    return tp() > 1 && o_.parallel.expert_parallel ? c_.num_experts / tp() : c_.num_experts;
  }
  int moe_layers() const {
    int n = 0;
    for (int l = 0; l < c_.num_layers; ++l) n += c_.IsMoeLayer(l) ? 1 : 0;
    return n;
  }

  // The step sizes: decode rows (the batch) and the largest prefill step (the engine's lockstep
  // chunking, or the workload's chunk when smaller).
  absl::Status Steps() {
    if (w_.batch <= 0 || w_.context_tokens() <= 0 || w_.prompt_tokens < 0 ||
        w_.generated_tokens < 0 || w_.prefill_chunk_tokens < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("memory plan: batch ", w_.batch, ", ", w_.prompt_tokens, " prompt and ",
                       w_.generated_tokens, " generated tokens (a positive batch and context)"));
    plan_.tp = tp();
    plan_.capacity_tokens = w_.context_tokens();
    plan_.kv_sequences = w_.serving ? w_.batch + 1 : w_.batch;
    int chunk = w_.prompt_tokens;
    if (w_.prefill_chunk_tokens > 0) chunk = std::min(chunk, w_.prefill_chunk_tokens);
    // Only LogitsMode::kLast steps are chunked by the engine (CudaModel::Step).
    if (!w_.all_logits) chunk = std::min(chunk, LockstepPrefillChunkTokens(w_.batch, chunk));
    prefill_tokens_ = chunk;
    prefill_rows_ = w_.batch * chunk;
    if (w_.serving && w_.ragged_step_rows > 0) {
      if (w_.ragged_step_rows > std::numeric_limits<int>::max())
        return absl::InvalidArgumentError(absl::StrCat(
            "memory plan: a ragged step of ", w_.ragged_step_rows, " rows is beyond the engine's"));
      prefill_rows_ = static_cast<int>(w_.ragged_step_rows);
    }
    plan_.step_rows = std::max(w_.batch, prefill_rows_);
    plan_.logit_rows = w_.all_logits ? plan_.step_rows : w_.batch;
    return absl::OkStatus();
  }

  // UploadWeights (tp=1) and UploadShardWeights (tp > 1), engine/cuda/weight_upload.cc: every
  // stored tensor at its dtype's bytes, zero-centred norms also as fp32 gains, and per layer the
  // expert pointer tables. A rank's quantized linears are its shard's codes and scales: the
  // layout of the rank's shapes (ShardHostModel keeps them quantized on their scale grid).
  absl::Status Weights() {
    std::vector<TensorSpec> specs = ModelTensorSpecs(c_);
    if (quantized()) {
      ASSIGN_OR_RETURN(specs, QuantizedTensorSpecs(specs, [&](const TensorSpec& s) {
                         return IsQuantizable(s) ? format_ : QuantFormat::kNone;
                       }));
    }
    // Synthetic presets are bf16; a checkpoint's dense tensors are stored as its torch_dtype.
    const int64_t dense_bytes = c_.torch_dtype == "float32" ? 4 : 2;
    // tp > 1: the lm_head holds the rank's vocabulary rows (rank 0 takes one of the remainder);
    // ep=on: the rank holds experts / tp whole experts, the others' stay empty.
    const int64_t vocab_rows =
        tp() > 1 ? full_.vocab_size / tp() + (full_.vocab_size % tp() > 0 ? 1 : 0) : c_.vocab_size;
    int64_t dense = 0, codes = 0, scales = 0, gains = 0;
    for (const TensorSpec& s : specs) {
      if (s.optional) continue;  // the quantizer writes no activation scales
      if (s.expert >= experts_held()) continue;
      int64_t numel = s.numel();
      if (s.name == "lm_head.weight") numel = vocab_rows * c_.hidden_size;
      if (s.quant == QuantFormat::kNone) {
        dense += numel * dense_bytes;
        if (s.kind == WeightKind::kCenteredNorm) gains += numel * kFloat;
        continue;
      }
      const int64_t bytes = numel * DTypeSize(s.dtypes.front());
      (s.part == QuantPart::kData ? codes : scales) += bytes;
      if (s.part == QuantPart::kData)
        linears_.push_back({s.shape[0], s.fan_in, s.expert >= 0, s.layer});
    }
    const char* dense_name = dense_bytes == 4 ? "dense tensors (fp32)" : "dense tensors (bf16)";
    Add(MemoryPool::kWeights, dense_name, dense);
    Add(MemoryPool::kWeights, absl::StrCat(QuantFormatName(format_), " codes"), codes);
    Add(MemoryPool::kWeights, absl::StrCat(QuantFormatName(format_), " scales"), scales);
    Add(MemoryPool::kWeights, "zero-centred norm gains (fp32)", gains);
    // BuildExpertPointerTables: gate, up and down pointers of every expert slot a MoE layer, and
    // of the shared expert's slot.
    Add(MemoryPool::kWeights, "expert pointer tables",
        int64_t{moe_layers()} * 3 * (c_.num_experts + 1) * kPointer);
    return absl::OkStatus();
  }

  // The MoE plan of the largest prefill step, on the experts as the runner finds them
  // (MoeRunner::LayerFacts).
  MoePlan PrefillMoePlan() const { return MoePlanAt(prefill_rows_, prefill_tokens_); }
  MoePlan MoePlanAt(int rows, int n) const {
    const int inter = c_.moe_intermediate_size, hidden = c_.hidden_size;
    MoeLayerFacts f;
    const bool view_codes = quantized() && !(o_.qgemm == QGemm::kDequantBf16);
    f.quantized_tables =
        quantized() && KeepsQuantCodes(o_.qgemm) && RoutesOnDevice(o_.moe) && c_.is_moe();
    if (f.quantized_tables) {
      f.gate = {format_, inter, hidden};
      f.up = {format_, inter, hidden};
      f.down = {format_, hidden, inter};
    }
    f.experts_quantized_alike = view_codes;
    f.experts_bf16 = !view_codes;
    f.router_f32_copy = UsesCublasLt(o_.gemm);
    f.shared_expert = c_.shared_expert_intermediate_size > 0;
    f.shared_down_cols = c_.shared_expert_intermediate_size;
    return PlanMoe(
        o_, {c_.num_experts, c_.num_experts_per_tok, hidden, inter}, f,
        {rows, n, /*gemv=*/n == 1 && UsesFusedGemv(o_.gemm) && cuda::GemvSupports(rows, hidden)});
  }

  void Copies() {
    const bool moe = c_.is_moe();
    if (quantized()) QuantViewCopies();
    // LinearRunner::QuantBf16Copy: qgemm=w4a16|w8a16 with cuBLASLt dequantize a quantized linear
    // into one bf16 buffer on prefill steps and decode steps of kQuantBf16CopyMinRows+ rows,
    // grown to the largest dense one (the experts too where they run the per-expert loop).
    constexpr int kQuantBf16CopyMinRows = 16;  // LinearRunner::kQuantBf16CopyMinRows
    const bool prefill = prefill_tokens_ > 1;
    if (quantized() && DequantizesInRegisters(o_.qgemm) && UsesCublasLt(o_.gemm) &&
        (prefill || w_.batch >= kQuantBf16CopyMinRows)) {
      // (Per-expert loop steps take the copy from 16 rows an expert: counted from 16 pairs.)
      const bool loop_experts =
          moe && ((prefill && PrefillMoePlan().experts == MoeExperts::kLoop) ||
                  (int64_t{w_.batch} * top_k() >= kQuantBf16CopyMinRows &&
                   MoePlanAt(w_.batch, 1).experts == MoeExperts::kLoop));
      int64_t largest = 0;
      for (const QuantLinear& q : linears_)
        if (!q.expert || loop_experts) largest = std::max(largest, q.rows * q.cols);
      Add(MemoryPool::kCopies,
          "bf16 copy of the largest quantized linear (w4a16/w8a16 on cuBLASLt)", largest * 2);
    }
    // MoeRunner::PrefillExpertCopies: a layer's experts (those the rank holds) dequantized to
    // bf16 for the grouped kernels, one layer at a time, with their pointer table (every expert's
    // slot) and per layer the MatrixRef array.
    if (moe && quantized() && prefill && PrefillMoePlan().bf16_copies) {
      const int64_t e = c_.num_experts, held = experts_held();
      const int64_t per_matrix = int64_t{c_.moe_intermediate_size} * c_.hidden_size;
      Add(MemoryPool::kCopies, "MoE prefill: one layer's experts in bf16",
          3 * held * per_matrix * 2 + 3 * e * kPointer +
              int64_t{moe_layers()} * 3 * held * static_cast<int64_t>(sizeof(MatrixRef)));
    }
    // MoeRunner::MakeRouterCopies: cuBLASLt configs keep each (bf16) router in fp32.
    if (moe && UsesCublasLt(o_.gemm))
      Add(MemoryPool::kCopies, "MoE routers in fp32 (cuBLASLt)",
          int64_t{moe_layers()} * c_.num_experts * c_.hidden_size * kFloat);
    if (IsPersistent(o_.graphs)) PersistentCopies();
  }

  // BuildQuantView (engine/cuda/weight_upload.cc).
  void QuantViewCopies() {
    if (UsesScaledGemm(o_.qgemm)) {
      // ScaledGemm::Prepare and CudnnQuantGemm::Prepare: each quantized linear's scales in the
      // library's layout (fp8: fp32 per row or per 128x128 block; fp4: cuBLASLt's tiled E4M3
      // or UE8M0 scales), beside the codes as uploaded.
      int64_t bytes = 0;
      for (const QuantLinear& q : linears_) bytes += ScaledWeightScaleBytes(q);
      Add(MemoryPool::kCopies, absl::StrCat("qgemm=", AxisValueName(o_.qgemm), ": weight scales"),
          bytes);
      return;
    }
    const int64_t e = c_.num_experts + 1;  // the experts' entries and the shared expert's
    if (!KeepsQuantCodes(o_.qgemm)) {
      // qgemm=dequant_bf16: each quantized linear replaced by a bf16 copy (the codes stay, the
      // shared upload keeps them for the reference).
      int64_t bytes = 0;
      for (const QuantLinear& q : linears_) bytes += q.rows * q.cols * 2;
      Add(MemoryPool::kCopies, "qgemm=dequant_bf16: bf16 copies of the quantized linears", bytes);
      if (RoutesOnDevice(o_.moe) && c_.is_moe())
        Add(MemoryPool::kCopies, "device-routed expert tables",
            int64_t{moe_layers()} * 3 * e * kPointer);
      return;
    }
    // BuildExpertTables on the codes: per projection, codes | scales | scale_2 of every expert.
    if (RoutesOnDevice(o_.moe) && c_.is_moe())
      Add(MemoryPool::kCopies, "device-routed expert tables",
          int64_t{moe_layers()} * 3 * 3 * e * kPointer);
  }

  int64_t ScaledWeightScaleBytes(const QuantLinear& q) const {
    switch (o_.qgemm) {
      case QGemm::kCudnn:  // fp32 per row (FP8; cuDNN's FP4 graphs refuse before any upload)
        return format_ == QuantFormat::kNvfp4 || format_ == QuantFormat::kMxfp4 ? 0
                                                                                : q.rows * kFloat;
      case QGemm::kFp8CublasLt:
        if (format_ == QuantFormat::kFp8Tensor || format_ == QuantFormat::kFp8Channel ||
            q.cols <= kFp8BlockSize)
          return q.rows * kFloat;
        return cuda::Fp8BlockScaleCount(q.rows, q.cols) * kFloat;
      case QGemm::kNativeFp4: {
        const int64_t group = format_ == QuantFormat::kNvfp4 ? kNvfp4GroupSize : kMxfp4GroupSize;
        return cuda::TiledScaleCount(q.rows, q.cols / group);
      }
      default:
        return 0;
    }
  }

  // PersistentDecoder::Prepare (engine/cuda/persistent_decode.cc): the bf16 build tiles every
  // down projection into a copy and transposes each router; FP4 group scales whose rows are
  // not 16-byte multiples are copied into padded rows, and fp8 block-128's are expanded to rows.
  void PersistentCopies() {
    const bool bf16_build = !quantized() || o_.qgemm == QGemm::kDequantBf16;
    int64_t tiles = 0, routers = 0, padded = 0;
    for (int l = 0; l < c_.num_layers; ++l) {
      const bool moe = c_.IsMoeLayer(l);
      if (bf16_build) {
        tiles += moe ? int64_t{c_.num_experts} * c_.hidden_size * c_.moe_intermediate_size * 2
                     : int64_t{c_.hidden_size} * c_.intermediate_size * 2;
        if (moe) routers += int64_t{c_.num_experts} * c_.hidden_size * 2;
      }
    }
    // FP4 rows of group scales already 16-byte multiples are read in place; fp8 block-128's are
    // always expanded.
    if (!bf16_build && cuda::PersistentStreamsGroupScales(format_))
      for (const QuantLinear& q : linears_) {
        const int64_t rounded = cuda::PersistentGroupRowBytes(format_, q.cols);
        if (format_ == QuantFormat::kFp8Block128 ||
            q.cols / cuda::PersistentGroupWeights(format_) != rounded)
          padded += q.rows * rounded;
      }
    Add(MemoryPool::kCopies, "graphs=persistent: tiled down projections (bf16)", tiles);
    Add(MemoryPool::kCopies, "graphs=persistent: transposed routers (bf16)", routers);
    Add(MemoryPool::kCopies, "graphs=persistent: padded group scales (FP4, fp8 block-128)", padded);
  }

  // AttentionRunner::AllocateCache: K and V of every full-attention layer, per sequence and
  // token, at the plan's bytes an element; fp8 adds a fp32 scale per token and kv head to each.
  absl::Status KvCache() {
    ASSIGN_OR_RETURN(attention_, PlanAttention(o_, {c_.num_q_heads, c_.num_kv_heads, c_.head_dim}));
    int cache_layers = 0;
    for (int l = 0; l < c_.num_layers; ++l)
      cache_layers += c_.AttentionKind(l) == LayerAttention::kFull ? 1 : 0;
    const int64_t token_slots = int64_t{cache_layers} * plan_.kv_sequences * plan_.capacity_tokens;
    Add(MemoryPool::kKvCache, absl::StrCat("K and V (", AxisValueName(attention_.kv), ")"),
        2 * token_slots * c_.kv_dim() * attention_.kv_bytes_per_element);
    if (attention_.kv_scales)
      Add(MemoryPool::kKvCache, "K and V scales (fp32 per token and kv head)",
          2 * token_slots * c_.num_kv_heads * kFloat);
    return absl::OkStatus();
  }

  // LinearAttentionRunner::AllocateState: per linear-attention layer and sequence (serving: per
  // slot and the spare, as the KV cache), the conv's last kernel - 1 inputs and the [value heads,
  // key dim, value dim] recurrent state, in fp32.
  void RecurrentState() {
    int state_layers = 0;
    for (int l = 0; l < c_.num_layers; ++l)
      state_layers += c_.AttentionKind(l) == LayerAttention::kLinear ? 1 : 0;
    const int64_t sequences = int64_t{state_layers} * plan_.kv_sequences;
    Add(MemoryPool::kRecurrentState, "conv state",
        sequences * std::max(c_.linear_conv_kernel_dim - 1, 0) * c_.linear_conv_dim() * kFloat);
    Add(MemoryPool::kRecurrentState, "recurrent state",
        sequences * c_.linear_num_value_heads * c_.linear_key_head_dim * c_.linear_value_head_dim *
            kFloat);
  }

  // Each runner's AllocateScratch at the largest step (CudaModel::EnsureScratch grows, never
  // shrinks, so the largest step's buffers stay).
  void Scratch() {
    const int64_t r = plan_.step_rows, out = plan_.logit_rows, hidden = c_.hidden_size;
    const int64_t k = top_k(), q_dim = c_.q_dim(), kv_dim = c_.kv_dim();
    const bool sharded_vocab = tp() > 1;
    // CudaModel: the residual stream, logits (CollectiveRunner::LogitsCount pads a rank's to a
    // multiple of 4), tokens, last rows, position, ragged (int2) and the greedy keys and tickets.
    const int64_t logits = sharded_vocab ? (out * c_.vocab_size + 3) / 4 * 4 : out * c_.vocab_size;
    Add(MemoryPool::kScratch, "model: residual stream and logits", (r * hidden + logits) * kFloat);
    Add(MemoryPool::kScratch, "model: step inputs and greedy picks",
        (2 * r + 1) * kInt + r * 2 * kInt + out * (8 + 4));
    // LinearRunner: xn, o, y [rows, hidden]; gate, up [rows, widest intermediate]; bf16 staging.
    const int64_t inter = std::max(
        {c_.intermediate_size, c_.moe_intermediate_size, c_.shared_expert_intermediate_size, 1});
    const int64_t widest = std::max({hidden, q_dim, inter, int64_t{c_.linear_value_dim()}});
    Add(MemoryPool::kScratch, "linear runner",
        (3 * r * hidden + 2 * r * inter) * kFloat + std::max(r * widest, r * k * hidden) * 2);
    // AttentionRunner: q, k, v, the fused qkv, attn, scores (the plan's), the gated heads and
    // cuDNN's bf16 q/o staging; the RoPE table (capacity x rotary_dim / 2 float2) and cuDNN's
    // sequence lengths.
    const int64_t q_rows = c_.attn_output_gate ? 2 * q_dim : q_dim;
    const int64_t gated = c_.attn_output_gate ? r * q_dim : 0;
    const int64_t scores =
        AttentionScoreFloats(attention_, {c_.num_q_heads, c_.num_kv_heads, c_.head_dim},
                             static_cast<int>(r), plan_.capacity_tokens);
    Add(MemoryPool::kScratch, "attention runner: projections and outputs",
        (r * q_dim + r * kv_dim + r * (q_rows + 2 * kv_dim) + r * kv_dim + r * q_dim + 2 * gated +
         (attention_.cudnn_io ? r * q_dim : 0)) *
            kFloat);
    Add(MemoryPool::kScratch,
        absl::StrCat("attention runner: scores (attention=", AxisValueName(o_.attention), ")"),
        scores * kFloat);
    Add(MemoryPool::kScratch, "RoPE table",
        int64_t{plan_.capacity_tokens} * (c_.rotary_dim() / 2) * 8 +
            (attention_.path == AttentionPath::kCudnn
                 ? 2 * int64_t{plan_.kv_sequences} * kInt +
                       int64_t{plan_.kv_sequences} * q_dim * kFloat  // serving's per-slot Q, O
                 : 0));
    // LinearAttentionRunner: projected, mixed [rows, conv]; z, out [rows, value]; a, b, g, beta
    // [rows, value heads] (fp32); the decode kernel's key-head arrival counts [rows, key heads].
    if (c_.has_linear_attention())
      Add(MemoryPool::kScratch, "linear attention runner",
          r *
                  (2 * int64_t{c_.linear_conv_dim()} + 2 * int64_t{c_.linear_value_dim()} +
                   4 * int64_t{c_.linear_num_value_heads}) *
                  kFloat +
              r * c_.linear_num_key_heads * kInt);
    // linear_attn=chunked: the chunked form's terms for every row.
    if (c_.has_linear_attention() && PlanLinearAttention(o_).delta_rule == DeltaRulePath::kChunked)
      Add(MemoryPool::kScratch, "linear attention runner: chunked delta rule terms",
          cuda::GatedDeltaChunkedScratchFloats(r, c_.linear_num_value_heads, c_.linear_key_head_dim,
                                               c_.linear_value_head_dim) *
              kFloat);
    // MoeRunner (allocated for dense models too): router logits, pair weights, h, out, in,
    // route weights (fp32); ids, route index, positions, offsets (int); bf16 xn and h.
    // A shared expert adds a logit and a pair slot a row (MoeShared::kFoldedPair).
    const int64_t experts = std::max(c_.num_experts, 1),
                  moe_inter = std::max(c_.moe_intermediate_size, 1),
                  shared = c_.shared_expert_intermediate_size > 0 ? 1 : 0, slots = k + shared;
    Add(MemoryPool::kScratch, "MoE runner",
        (r * (experts + shared) + 1 + r * slots + r * slots * moe_inter + 2 * r * k * hidden +
         r * k) * kFloat +
            (r * slots + 2 * r * k + std::max(c_.num_experts, 0) + 1) * kInt + r * hidden * 2 +
            r * k * (2 * moe_inter + hidden) * 2);
    // qgemm=w8a8: the linear runner's E4M3 input rows and scales (GemmFp8Mma), and the MoE
    // runner's x and h codes and scales.
    if (QuantizesActivationsFp8(o_.qgemm) && quantized())
      Add(MemoryPool::kScratch, "qgemm=w8a8: E4M3 activations and their scales",
          r * widest + r * kFloat + r * hidden + r * k * moe_inter + (r + r * k) * kFloat);
    // CollectiveRunner: the blocks' partial sums, and a rank's lm_head shard of logits.
    if (o_.parallel.RunsCollective())
      Add(MemoryPool::kScratch, "collective: partial sums", r * hidden * kFloat);
    if (sharded_vocab) {
      const int64_t vocab_rows = full_.vocab_size / tp() + (full_.vocab_size % tp() > 0 ? 1 : 0);
      Add(MemoryPool::kScratch, "collective: lm_head shard logits", out * vocab_rows * kFloat);
    }
    if (quantized() && UsesScaledGemm(o_.qgemm)) ScaledGemmScratch();
    if (IsPersistent(o_.graphs)) {
      // PersistentDecoder's buffer: the expert pointer tables (codes, factors, FP4 and fp8
      // block-128 groups);
      // its layer tables, partials and counters are the kernel's (not counted here).
      const int kinds = !quantized() || o_.qgemm == QGemm::kDequantBf16 ? 1
                        : cuda::PersistentStreamsGroupScales(format_)   ? 3
                                                                        : 2;
      int64_t mlps = 0;
      for (int l = 0; l < c_.num_layers; ++l) mlps += c_.IsMoeLayer(l) ? c_.num_experts : 1;
      Add(MemoryPool::kScratch, "graphs=persistent: expert tables", mlps * 3 * kinds * kPointer);
    }
  }

  // ScaledGemm::Run (kernels/cuda/gemm_scaled.cc) and CudnnQuantGemm::Grow: the activations
  // quantized for the widest K at the largest step, with their scales (ScaledGemm grows by at
  // least half again, so after smaller steps it may hold up to 1.5x this).
  void ScaledGemmScratch() {
    const int64_t r = plan_.step_rows;
    int64_t widest_k = 0;
    for (const QuantLinear& q : linears_) widest_k = std::max(widest_k, q.cols);
    const bool fp4 = format_ == QuantFormat::kNvfp4 || format_ == QuantFormat::kMxfp4;
    int64_t codes = r * widest_k, scales = r * kFloat;
    if (o_.qgemm == QGemm::kNativeFp4 && fp4) {
      codes = r * widest_k / 2;
      scales = cuda::TiledScaleCount(
          r, widest_k / (format_ == QuantFormat::kNvfp4 ? kNvfp4GroupSize : kMxfp4GroupSize));
    } else if (o_.qgemm == QGemm::kFp8CublasLt && format_ == QuantFormat::kFp8Block128) {
      scales = r * CeilDiv64(widest_k, cuda::kFp8ActivationGroup) * kFloat;
    }
    Add(MemoryPool::kScratch, absl::StrCat("qgemm=", AxisValueName(o_.qgemm), ": activation codes"),
        codes + scales);
  }

  void Workspaces() {
    // CublasLtGemm::Create's and ScaledGemm::Create's default workspace (32 << 20 each).
    constexpr int64_t kLibraryWorkspace = int64_t{32} << 20;
    if (UsesCublasLt(o_.gemm))
      Add(MemoryPool::kWorkspaces, "cuBLASLt workspace", kLibraryWorkspace);
    if (quantized() && (o_.qgemm == QGemm::kFp8CublasLt || o_.qgemm == QGemm::kNativeFp4))
      Add(MemoryPool::kWorkspaces, "scaled GEMM workspace (cuBLASLt)", kLibraryWorkspace + 16);
    // cuda::CublasGroupedGemm: a cuBLAS handle (its own workspace) and 3 pointer arrays an expert.
    if (c_.is_moe() && UsesCublasGrouped(o_)) {
      Add(MemoryPool::kWorkspaces, "cuBLAS grouped GEMM handle", kCublasHandleWorkspaceBytes,
          /*allowance=*/true);
      Add(MemoryPool::kWorkspaces, "cuBLAS grouped GEMM pointer arrays",
          3 * int64_t{c_.num_experts} * kPointer);
    }
    if (attention_.path == AttentionPath::kCudnn)
      Add(MemoryPool::kWorkspaces, "cuDNN attention workspace", kCudnnWorkspaceAllowanceBytes,
          /*allowance=*/true);
    if (quantized() && o_.qgemm == QGemm::kCudnn)
      Add(MemoryPool::kWorkspaces, "cuDNN matmul workspace", kCudnnWorkspaceAllowanceBytes,
          /*allowance=*/true);
    // The collective: custom and fused all-reduces hold a peer buffer (signals, then staging:
    // kRankMessageBytes in a rank process, a step's partial sums at tp=1); nccl its own.
    // Signals: 3 flags x 64 blocks x 8 ranks + 64 call counts, uint32, rounded to 4 KiB.
    constexpr int64_t kSignalBytes = (int64_t{(3 * 64 * 8 + 64) * 4} + 4095) / 4096 * 4096;
    // allreduce=reference (the CPU's) is refused before a CUDA model is made: no buffers.
    const CollectivePlan collective =
        PlanCollective(o_.parallel, tp() > 1, int64_t{plan_.step_rows} * c_.hidden_size * kFloat)
            .value_or(CollectivePlan{});
    switch (collective.transport) {
      case CollectiveTransport::kNone:
        break;
      case CollectiveTransport::kPeerBuffers:
        Add(MemoryPool::kWorkspaces, "all-reduce peer buffer",
            kSignalBytes + collective.max_message_bytes);
        break;
      case CollectiveTransport::kNccl:
        Add(MemoryPool::kWorkspaces, "NCCL buffers", kNcclAllowanceBytes, /*allowance=*/true);
        break;
    }
  }

  // CudaModel keeps one decode graph a batch size and step kind (logits or greedy tokens).
  void GraphPools() {
    if (!CapturesDecode(o_.graphs)) return;
    Add(MemoryPool::kGraphPools, "decode graphs (logits and greedy steps)",
        2 * kGraphAllowanceBytes, /*allowance=*/true);
  }

  const CudaOptions& o_;
  const ModelConfig& full_;
  const ModelConfig& c_;
  const QuantFormat format_;
  const MemoryWorkload& w_;
  MemoryPlan& plan_;
  int prefill_tokens_ = 0, prefill_rows_ = 0;
  std::vector<QuantLinear> linears_;  // the rank's quantized linears
  AttentionPlan attention_;
};

}  // namespace

const char* MemoryPoolName(MemoryPool pool) {
  switch (pool) {
    case MemoryPool::kWeights:
      return "weights";
    case MemoryPool::kCopies:
      return "copies";
    case MemoryPool::kKvCache:
      return "KV";
    case MemoryPool::kRecurrentState:
      return "recurrent state";
    case MemoryPool::kScratch:
      return "scratch";
    case MemoryPool::kWorkspaces:
      return "workspaces";
    case MemoryPool::kGraphPools:
      return "graph pools";
  }
  return "?";
}

int64_t MemoryPlan::bytes(MemoryPool pool) const {
  int64_t sum = 0;
  for (const MemoryItem& item : items)
    if (item.pool == pool) sum += item.bytes;
  return sum;
}

int64_t MemoryPlan::total_bytes() const {
  int64_t sum = 0;
  for (const MemoryItem& item : items) sum += item.bytes;
  return sum;
}

int64_t MemoryPlan::item_bytes(MemoryPool pool, std::string_view name) const {
  for (const MemoryItem& item : items)
    if (item.pool == pool && item.name == name) return item.bytes;
  return 0;
}

ModelConfig RankModelConfig(const ModelConfig& c, int tp, bool expert_parallel) {
  if (tp <= 1) return c;
  ModelConfig rc = c;
  rc.num_q_heads = c.num_q_heads / tp;
  rc.num_kv_heads = c.num_kv_heads >= tp ? c.num_kv_heads / tp : 1;
  rc.intermediate_size = c.intermediate_size / tp;
  rc.moe_intermediate_size =
      expert_parallel ? c.moe_intermediate_size : c.moe_intermediate_size / tp;
  rc.shared_expert_intermediate_size = c.shared_expert_intermediate_size / tp;
  rc.linear_num_key_heads = c.linear_num_key_heads / tp;
  rc.linear_num_value_heads = c.linear_num_value_heads / tp;
  return rc;
}

absl::StatusOr<MemoryPlan> PlanMemory(const CudaOptions& options, const ModelConfig& model,
                                      QuantFormat weights, const MemoryWorkload& workload) {
  const int tp = std::max(1, options.parallel.tp);
  const ModelConfig rank = RankModelConfig(model, tp, options.parallel.expert_parallel);
  MemoryPlan plan;
  RETURN_IF_ERROR(Planner(options, model, rank, weights, workload, plan).Run());
  return plan;
}

absl::StatusOr<MemoryPlan> PlanMemory(const BackendConfig& normalized, const ModelConfig& model,
                                      std::string_view weight_format,
                                      const MemoryWorkload& workload) {
  ASSIGN_OR_RETURN(CudaOptions options, ParseCudaOptions(normalized));
  QuantFormat format = QuantFormat::kNone;
  if (!weight_format.empty() && weight_format != "bf16") {
    const std::optional<QuantFormat> parsed = QuantFormatFromName(weight_format);
    if (!parsed)
      return absl::InvalidArgumentError(
          absl::StrCat("memory plan: weight format \"", std::string(weight_format),
                       "\" is not one of bf16, ", QuantFormatNames()));
    format = *parsed;
  }
  return PlanMemory(options, model, format, workload);
}

bool Fits(const MemoryPlan& plan, int64_t free_bytes) { return plan.total_bytes() <= free_bytes; }

std::string FormatMemoryBytes(int64_t bytes) {
  constexpr double kKiB = 1024.0, kMiB = kKiB * 1024, kGiB = kMiB * 1024;
  const double b = static_cast<double>(bytes);
  if (b >= kGiB) return absl::StrFormat("%.2f GiB", b / kGiB);
  if (b >= kMiB) return absl::StrFormat("%.1f MiB", b / kMiB);
  if (b >= kKiB) return absl::StrFormat("%.1f KiB", b / kKiB);
  return absl::StrCat(bytes, " B");
}

std::string MemoryNeedsText(const MemoryPlan& plan) {
  std::vector<std::string> pools;
  for (MemoryPool pool : kMemoryPools)
    pools.push_back(absl::StrCat(MemoryPoolName(pool), " ", FormatMemoryBytes(plan.bytes(pool))));
  return absl::StrCat("needs ", FormatMemoryBytes(plan.total_bytes()), " on the device",
                      plan.tp > 1 ? absl::StrCat(" a rank (tp=", plan.tp, ")") : std::string(),
                      " (", absl::StrJoin(pools, ", "), ")");
}

std::string MemoryVerdictText(const MemoryPlan& plan, int64_t free_bytes) {
  return absl::StrCat(MemoryNeedsText(plan), ", ", FormatMemoryBytes(free_bytes), " free");
}

}  // namespace infersweep
