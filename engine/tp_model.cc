#include "engine/tp_model.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/backend_config.h"
#include "api/status_macros.h"
#include "core/launch_log.h"
#include "kernels/cpu/allreduce.h"
#include "kernels/cpu/parallel.h"

namespace infersweep {
namespace {

// A range of rows or columns: [begin, begin + count).
struct Range {
  int64_t begin = 0, count = 0;
};

// How a quantized matrix's scales tile it (QuantScaleIndex's layouts as a grid): each scale
// covers `tile_rows` rows and `tile_cols` columns of elements (0: all of them), and the grid holds
// `rows` x `cols` scales, row-major.
struct ScaleGrid {
  int64_t tile_rows = 0, tile_cols = 0;
  int64_t rows = 1, cols = 1;

  explicit ScaleGrid(const MatrixRef& m) {
    switch (m.quant.format) {
      case QuantFormat::kFp8Channel:
        tile_rows = 1;
        break;
      case QuantFormat::kFp8Block128:
        tile_rows = tile_cols = kFp8BlockSize;
        break;
      case QuantFormat::kNvfp4:
        tile_rows = 1;
        tile_cols = kNvfp4GroupSize;
        break;
      case QuantFormat::kMxfp4:
        tile_rows = 1;
        tile_cols = kMxfp4GroupSize;
        break;
      default:  // kFp8Tensor: one scale
        break;
    }
    if (tile_rows > 0) rows = CeilDiv64(m.rows, tile_rows);
    if (tile_cols > 0) cols = CeilDiv64(m.cols, tile_cols);
  }
};

// Bytes of `elements` consecutive codes of a row of quantized m: FP4 packs two a byte.
int64_t CodeBytes(const MatrixRef& m, int64_t elements) {
  return IsFp4(m.quant.format) ? elements / 2 : elements * DTypeSize(m.dtype);
}

const uint8_t* Bytes(const void* p) { return static_cast<const uint8_t*>(p); }

// Slices of host weights for one rank, viewing them where the slice is contiguous in memory and
// copying it into `owned` where it is not. A quantized matrix stays quantized, its codes and
// scales sliced alike, where every cut falls on its scale grid (a K cut on a whole 16- or
// 32-column group, a block-128 cut on a block); a cut inside a scale group or block has no exact
// quantized form, so that slice is decoded exactly to fp32 and named in `off_grid`. A dry slicer
// copies nothing and returns shapes only: it finds the off-grid cuts (QuantizedShardRefusal).
class Slicer {
 public:
  Slicer(std::vector<std::vector<uint8_t>>* owned, std::vector<std::string>* off_grid, int rank,
         bool dry)
      : owned_(owned), off_grid_(off_grid), rank_(rank), dry_(dry) {}

  // The canonical name prefix of the weights sliced next ("model.layers.3."), for off_grid.
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }

  // Rows [r.begin, r.end) of m (`name`: its module under the prefix, "self_attn.q_proj"): a
  // view, of the codes and scales too for a quantized matrix cut on its scale grid.
  MatrixRef Rows(const MatrixRef& m, Range r, const std::string& name = {}) {
    if (m.empty()) return m;
    if (m.quantized()) return StackRows(m, {r}, name);
    MatrixRef out = m;
    out.data = Bytes(m.data) + r.begin * m.cols * DTypeSize(m.dtype);
    out.rows = r.count;
    return out;
  }

  // Several row ranges of m, stacked in order: a copy of the dtype's bytes for dense weights; of
  // the codes and their scale rows for quantized ones on their scale grid (a view for one
  // range); else exact fp32.
  MatrixRef StackRows(const MatrixRef& m, const std::vector<Range>& ranges,
                      const std::string& name = {}) {
    if (m.empty()) return m;
    int64_t rows = 0;
    for (const Range& r : ranges) rows += r.count;
    if (dry_) {
      if (m.quantized()) RowsOnGrid(m, ranges, name);
      return Shape(m, rows, m.cols);
    }
    if (m.quantized()) {
      if (RowsOnGrid(m, ranges, name)) return QuantizedRows(m, ranges, rows);
      std::vector<float> decoded(m.cols);
      float* out = NewF32(rows * m.cols);
      int64_t row = 0;
      for (const Range& r : ranges)
        for (int64_t i = r.begin; i < r.begin + r.count; ++i, ++row) {
          cpu::DecodeRow(m, i, decoded.data());
          std::copy_n(decoded.data(), m.cols, out + row * m.cols);
        }
      return {out, DType::kF32, rows, m.cols, {}};
    }
    return {StackRowBytes(m.data, m.cols * DTypeSize(m.dtype), ranges, rows),
            m.dtype,
            rows,
            m.cols,
            {}};
  }

  // The rows `ranges` of `row_bytes` bytes each from `data`, stacked in a copy `rows` rows long.
  const uint8_t* StackRowBytes(const void* data, int64_t row_bytes,
                               const std::vector<Range>& ranges, int64_t rows) {
    std::vector<uint8_t>& bytes = owned_->emplace_back(rows * row_bytes);
    int64_t row = 0;
    for (const Range& r : ranges) {
      std::memcpy(bytes.data() + row * row_bytes, Bytes(data) + r.begin * row_bytes,
                  r.count * row_bytes);
      row += r.count;
    }
    return bytes.data();
  }

  // Columns [c.begin, c.end) of m: a view of a dense vector (one row), else a copy; a quantized
  // matrix's codes and scale columns where the cut is on its scale grid, else exact fp32.
  MatrixRef Cols(const MatrixRef& m, Range c, const std::string& name = {}) {
    if (m.empty()) return m;
    if (m.rows == 1 && !m.quantized()) {
      MatrixRef out = m;
      out.data = Bytes(m.data) + c.begin * DTypeSize(m.dtype);
      out.cols = c.count;
      return out;
    }
    if (dry_) {
      if (m.quantized()) ColsOnGrid(m, c, name);
      return Shape(m, m.rows, c.count);
    }
    if (m.quantized()) {
      if (ColsOnGrid(m, c, name)) return QuantizedCols(m, c);
      std::vector<float> decoded(m.cols);
      float* out = NewF32(m.rows * c.count);
      for (int64_t i = 0; i < m.rows; ++i) {
        cpu::DecodeRow(m, i, decoded.data());
        std::copy_n(decoded.data() + c.begin, c.count, out + i * c.count);
      }
      return {out, DType::kF32, m.rows, c.count, {}};
    }
    const int64_t elem = DTypeSize(m.dtype);
    std::vector<uint8_t>& bytes = owned_->emplace_back(m.rows * c.count * elem);
    for (int64_t i = 0; i < m.rows; ++i)
      std::memcpy(bytes.data() + i * c.count * elem, Bytes(m.data) + (i * m.cols + c.begin) * elem,
                  c.count * elem);
    return {bytes.data(), m.dtype, m.rows, c.count, {}};
  }

  // A gated MLP (dense or one expert) sharded on its intermediate dimension: gate and up by
  // rows, down by columns. `module`: its name under the prefix ("mlp.experts.3.").
  ExpertWeights Mlp(const ExpertWeights& e, int tp, int rank, const std::string& module) {
    if (e.gate.empty()) return e;
    const int64_t share = e.gate.rows / tp;
    const Range r{rank * share, share};
    return {Rows(e.gate, r, module + "gate_proj"), Rows(e.up, r, module + "up_proj"),
            Cols(e.down, r, module + "down_proj")};
  }

 private:
  // m's shape alone (a dry slicer's answer).
  static MatrixRef Shape(const MatrixRef& m, int64_t rows, int64_t cols) {
    MatrixRef out = m;
    out.data = nullptr;
    out.rows = rows;
    out.cols = cols;
    return out;
  }

  // Whether every range starts on a scale-row boundary of m and lands on one of the stack (so
  // that the stack's scale rows are m's, whole); if not, names the first range that does not.
  bool RowsOnGrid(const MatrixRef& m, const std::vector<Range>& ranges, const std::string& name) {
    const ScaleGrid grid(m);
    if (grid.tile_rows <= 1) return true;
    int64_t at = 0;
    for (const Range& r : ranges) {
      if (r.begin % grid.tile_rows != 0 || at % grid.tile_rows != 0) {
        OffGrid(m, name,
                absl::StrCat("rows [", r.begin, ", ", r.begin + r.count, ")",
                             ranges.size() > 1 ? absl::StrCat(" (at row ", at, " of its stack)")
                                               : std::string(),
                             " start inside a ", grid.tile_rows, "-row scale block"));
        return false;
      }
      at += r.count;
    }
    return true;
  }

  // Whether the cut starts on a scale-column boundary of m and (FP4, whose groups all fill)
  // keeps whole groups; if not, says so.
  bool ColsOnGrid(const MatrixRef& m, Range c, const std::string& name) {
    const ScaleGrid grid(m);
    if (grid.tile_cols <= 1) return true;
    const bool whole = !IsFp4(m.quant.format) || c.count % grid.tile_cols == 0;
    if (c.begin % grid.tile_cols == 0 && whole) return true;
    OffGrid(
        m, name,
        absl::StrCat("columns [", c.begin, ", ", c.begin + c.count, ")",
                     c.begin % grid.tile_cols != 0 ? " start inside" : " end inside", " a ",
                     grid.tile_cols, "-column scale ", IsFp4(m.quant.format) ? "group" : "block"));
    return false;
  }

  void OffGrid(const MatrixRef& m, const std::string& name, const std::string& cut) {
    off_grid_->push_back(absl::StrCat(prefix_, name, ".weight (", QuantFormatName(m.quant.format),
                                      " [", m.rows, ", ", m.cols, "]): rank ", rank_, "'s ", cut));
  }

  // The stacked rows of a quantized m on its scale grid: its codes' rows, and its scale rows
  // (those of the tiles the ranges cover; a per-tensor scale shared); one range is a view.
  MatrixRef QuantizedRows(const MatrixRef& m, const std::vector<Range>& ranges, int64_t rows) {
    const ScaleGrid grid(m);
    const int64_t row_bytes = CodeBytes(m, m.cols);
    const int64_t scale_row_bytes = grid.cols * DTypeSize(m.quant.scale_dtype);
    MatrixRef out = m;
    out.rows = rows;
    if (ranges.size() == 1) {
      const Range& r = ranges.front();
      out.data = Bytes(m.data) + r.begin * row_bytes;
      if (grid.tile_rows > 0)
        out.quant.scale = Bytes(m.quant.scale) + r.begin / grid.tile_rows * scale_row_bytes;
      return out;
    }
    out.data = StackRowBytes(m.data, row_bytes, ranges, rows);
    if (grid.tile_rows == 0) return out;
    std::vector<uint8_t> scales;
    for (const Range& r : ranges) {
      const int64_t first = r.begin / grid.tile_rows;
      const int64_t end = CeilDiv64(r.begin + r.count, grid.tile_rows);
      const uint8_t* from = Bytes(m.quant.scale);
      scales.insert(scales.end(), from + first * scale_row_bytes, from + end * scale_row_bytes);
    }
    out.quant.scale = owned_->emplace_back(std::move(scales)).data();
    return out;
  }

  // Columns c of a quantized m on its scale grid: each row's codes and scale columns of the
  // groups or blocks c covers (per-row and per-tensor scales shared).
  MatrixRef QuantizedCols(const MatrixRef& m, Range c) {
    const ScaleGrid grid(m);
    MatrixRef out = m;
    out.cols = c.count;
    const int64_t row_bytes = CodeBytes(m, m.cols), begin = CodeBytes(m, c.begin),
                  count = CodeBytes(m, c.count);
    std::vector<uint8_t>& codes = owned_->emplace_back(m.rows * count);
    for (int64_t i = 0; i < m.rows; ++i)
      std::memcpy(codes.data() + i * count, Bytes(m.data) + i * row_bytes + begin, count);
    out.data = codes.data();
    if (grid.tile_cols == 0) return out;
    const int64_t size = DTypeSize(m.quant.scale_dtype);
    const int64_t first = c.begin / grid.tile_cols;
    const int64_t width = CeilDiv64(c.begin + c.count, grid.tile_cols) - first;
    std::vector<uint8_t>& scales = owned_->emplace_back(grid.rows * width * size);
    for (int64_t i = 0; i < grid.rows; ++i)
      std::memcpy(scales.data() + i * width * size,
                  Bytes(m.quant.scale) + (i * grid.cols + first) * size, width * size);
    out.quant.scale = scales.data();
    return out;
  }

  float* NewF32(int64_t n) {
    std::vector<uint8_t>& bytes = owned_->emplace_back(n * sizeof(float));
    return reinterpret_cast<float*>(bytes.data());
  }

  std::vector<std::vector<uint8_t>>* owned_;
  std::vector<std::string>* off_grid_;
  const int rank_;
  const bool dry_;
  std::string prefix_;
};

// The rows of `heads` consecutive heads from `first_head` on, `dim` rows a head.
Range HeadRows(int64_t first_head, int64_t heads, int64_t dim) {
  return {first_head * dim, heads * dim};
}

// The adapter that lets one rank's CPU model reach the shared all-reduce.
class RankAllReduce final : public RankCollective {
 public:
  RankAllReduce(cpu::ThreadAllReduce* allreduce, int rank) : allreduce_(allreduce), rank_(rank) {}
  void AllReduceSum(float* data, int64_t n) override { allreduce_->Sum(rank_, data, n); }

 private:
  cpu::ThreadAllReduce* allreduce_;
  const int rank_;
};

class TensorParallelCpuModel final : public Model {
 public:
  TensorParallelCpuModel(const HostModel& host, std::vector<std::unique_ptr<RankShard>> shards,
                         const TensorParallelOptions& options)
      : host_(host), shards_(std::move(shards)), allreduce_(options.tp) {
    for (int r = 0; r < options.tp; ++r) {
      collectives_.push_back(std::make_unique<RankAllReduce>(&allreduce_, r));
      CpuModelOptions rank_options;
      rank_options.matmul = options.matmul;
      rank_options.threads = 0;
      if (r == 0) rank_options.fault = options.fault;
      rank_options.collective = collectives_.back().get();
      ranks_.push_back(MakeCpuModel(*shards_[r]->host, rank_options));
    }
  }

  const ModelConfig& config() const override { return host_.config; }
  std::string device() const override { return "cpu"; }
  int position() const override { return ranks_[0]->position(); }

  absl::Status StartBatch(int batch, int max_tokens) override {
    for (auto& rank : ranks_) RETURN_IF_ERROR(rank->StartBatch(batch, max_tokens));
    batch_ = batch;
    capacity_ = max_tokens;
    return absl::OkStatus();
  }

  absl::Status Forward(std::span<const int32_t> tokens, int n, LogitsMode mode,
                       std::vector<float>* logits) override {
    // Checked here, before any rank starts: a rank that failed alone would leave the others
    // waiting in the all-reduce.
    RETURN_IF_ERROR(ValidateForwardArgs(host_.config, batch_, capacity_, position(), tokens, n));
    return RunRanksAndGather(
        [&](Model& rank, std::vector<float>* partial) {
          return rank.Forward(tokens, n, mode, partial);
        },
        logits);
  }

  // Serving: every rank holds the same slots (each rank's allocator sees the same admissions and
  // retirements) and runs the same ragged step on its shard, the all-reduces between them as in
  // a lockstep step; the lm_head's shards gather into each chunk's last row of logits.
  absl::Status StartServing(int slots, int max_tokens) override {
    for (auto& rank : ranks_) RETURN_IF_ERROR(rank->StartServing(slots, max_tokens));
    batch_ = 0;  // no lockstep batch until the next StartBatch
    capacity_ = max_tokens;
    return absl::OkStatus();
  }
  absl::StatusOr<int> AdmitSequence() override {
    ASSIGN_OR_RETURN(const int slot, ranks_[0]->AdmitSequence());
    for (size_t r = 1; r < ranks_.size(); ++r) {
      ASSIGN_OR_RETURN(const int other, ranks_[r]->AdmitSequence());
      if (other != slot)
        return absl::InternalError(absl::StrCat("tp: rank ", r, " admitted a sequence to slot ",
                                                other, ", rank 0 to slot ", slot));
    }
    return slot;
  }
  absl::Status RetireSequence(int slot) override {
    for (auto& rank : ranks_) RETURN_IF_ERROR(rank->RetireSequence(slot));
    return absl::OkStatus();
  }
  absl::Status RaggedStep(std::span<const RaggedChunk> chunks,
                          std::vector<float>* last_logits) override {
    // The ranks check the chunks the same way before their first all-reduce (they hold the same
    // slots), so a refused step is refused by all of them and none waits.
    return RunRanksAndGather(
        [&](Model& rank, std::vector<float>* partial) { return rank.RaggedStep(chunks, partial); },
        last_logits);
  }

 private:
  // Runs `step` on every rank at once (rank 0 on the caller's thread, so an active launch log
  // records its ops), then gathers the lm_head's vocabulary shards of the rows each returned.
  absl::Status RunRanksAndGather(
      const std::function<absl::Status(Model&, std::vector<float>*)>& step,
      std::vector<float>* logits) {
    const int tp = static_cast<int>(ranks_.size());
    std::vector<std::vector<float>> partial(tp);
    std::vector<absl::Status> status(tp);
    auto run_rank = [&](int r) {
      cpu::ScopedInlineParallelFor own_thread;
      status[r] = step(*ranks_[r], &partial[r]);
    };
    {
      std::vector<std::jthread> threads;
      for (int r = 1; r < tp; ++r) threads.emplace_back(run_rank, r);
      run_rank(0);
    }
    for (const absl::Status& s : status)
      if (!s.ok()) return s;
    RecordLaunch("gather_logits");
    const int64_t vocab = host_.config.vocab_size;
    const int64_t rows =
        static_cast<int64_t>(partial[0].size()) / shards_[0]->host->weights.lm_head.rows;
    logits->resize(rows * vocab);
    for (int r = 0; r < tp; ++r) {
      const int64_t width = shards_[r]->host->weights.lm_head.rows;
      for (int64_t i = 0; i < rows; ++i)
        std::copy_n(partial[r].data() + i * width, width,
                    logits->data() + i * vocab + shards_[r]->vocab_begin);
    }
    return absl::OkStatus();
  }

  const HostModel& host_;
  std::vector<std::unique_ptr<RankShard>> shards_;
  cpu::ThreadAllReduce allreduce_;
  std::vector<std::unique_ptr<RankAllReduce>> collectives_;
  std::vector<std::unique_ptr<Model>> ranks_;
  int batch_ = 0, capacity_ = 0;
};

}  // namespace

namespace {

// Checks what ShardHostModel and QuantizedShardRefusal take.
absl::Status CheckShardable(const HostModel& host, int tp, int rank, bool expert_parallel) {
  if (tp < 1 || rank < 0 || rank >= tp)
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of tp=", tp, " is no rank"));
  if (std::string why = TensorParallelRefusal(host.config, tp, expert_parallel); !why.empty())
    return absl::InvalidArgumentError(why);
  if (!host.host_materialized)
    return absl::FailedPreconditionError("ShardHostModel: the host weights are not materialized");
  return absl::OkStatus();
}

// Cuts rank `rank`'s shard of `host` into `shard` through `slice`.
void CutShard(const HostModel& host, int tp, int rank, bool expert_parallel, Slicer& slice,
              RankShard& shard) {
  const ModelConfig& c = host.config;
  shard.rank = rank;
  shard.host = std::make_unique<HostModel>();
  HostModel& out = *shard.host;
  out.source = host.source;
  out.seed = host.seed;
  out.quant_format = host.quant_format;
  out.is_synthetic = host.is_synthetic;

  // The rank's shapes: its heads and intermediate sizes; KV heads fewer than the ranks are
  // replicated, one per rank.
  ModelConfig& rc = out.config;
  rc = c;
  const int q_heads = c.num_q_heads / tp;
  const int kv_heads = c.num_kv_heads >= tp ? c.num_kv_heads / tp : 1;
  const int first_q = rank * q_heads;
  const int first_kv = c.num_kv_heads >= tp ? rank * kv_heads : rank * c.num_kv_heads / tp;
  rc.num_q_heads = q_heads;
  rc.num_kv_heads = kv_heads;
  rc.intermediate_size = c.intermediate_size / tp;
  rc.moe_intermediate_size =
      expert_parallel ? c.moe_intermediate_size : c.moe_intermediate_size / tp;
  rc.shared_expert_intermediate_size = c.shared_expert_intermediate_size / tp;
  const int key_heads = c.linear_num_key_heads / tp, value_heads = c.linear_num_value_heads / tp;
  rc.linear_num_key_heads = key_heads;
  rc.linear_num_value_heads = value_heads;
  const int experts_per_rank = c.num_experts / tp;

  const ModelWeights& w = host.weights;
  ModelWeights& rw = out.weights;
  rw.embed = w.embed;
  rw.final_norm = w.final_norm;
  // The vocabulary split as evenly as it goes: the first (vocab % tp) ranks take one row more.
  const int64_t vocab = w.lm_head.rows, base = vocab / tp, extra = vocab % tp;
  shard.vocab_begin = rank * base + std::min<int64_t>(rank, extra);
  rw.lm_head = slice.Rows(w.lm_head, {shard.vocab_begin, base + (rank < extra ? 1 : 0)}, "lm_head");

  const int64_t head_dim = c.head_dim;
  // q_proj rows are [q_h | gate_h] per head with a gated attention output.
  const int64_t q_rows_per_head = head_dim * (c.attn_output_gate ? 2 : 1);
  for (int l = 0; l < c.num_layers; ++l) {
    slice.set_prefix(absl::StrCat("model.layers.", l, "."));
    const LayerWeights& lw = w.layers[l];
    LayerWeights& rl = rw.layers.emplace_back();
    rl.input_norm = lw.input_norm;
    rl.post_attention_norm = lw.post_attention_norm;
    if (c.AttentionKind(l) == LayerAttention::kLinear) {
      const LinearAttentionWeights& la = lw.linear_attn;
      LinearAttentionWeights& ra = rl.linear_attn;
      const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
      const int64_t key_dim = c.linear_key_dim();
      const Range q = HeadRows(rank * key_heads, key_heads, dk);
      const Range v = HeadRows(rank * value_heads, value_heads, dv);
      // in_proj_qkv and the conv's channels are [q | k | v]: the rank's q, k and v heads.
      const std::vector<Range> qkv = {
          q, {key_dim + q.begin, q.count}, {2 * key_dim + v.begin, v.count}};
      ra.in_proj_qkv = slice.StackRows(la.in_proj_qkv, qkv, "linear_attn.in_proj_qkv");
      ra.conv = slice.StackRows(la.conv, qkv, "linear_attn.conv1d");
      ra.in_proj_z = slice.Rows(la.in_proj_z, v, "linear_attn.in_proj_z");
      const Range heads{rank * value_heads, value_heads};
      ra.in_proj_b = slice.Rows(la.in_proj_b, heads, "linear_attn.in_proj_b");
      ra.in_proj_a = slice.Rows(la.in_proj_a, heads, "linear_attn.in_proj_a");
      ra.dt_bias = slice.Cols(la.dt_bias, heads);
      ra.a_log = slice.Cols(la.a_log, heads);
      ra.norm = la.norm;
      ra.out_proj = slice.Cols(la.out_proj, v, "linear_attn.out_proj");
    } else {
      const Range q = HeadRows(first_q, q_heads, q_rows_per_head);
      const Range kv = HeadRows(first_kv, kv_heads, head_dim);
      rl.q = slice.Rows(lw.q, q, "self_attn.q_proj");
      rl.q_bias = slice.Cols(lw.q_bias, q);
      rl.k = slice.Rows(lw.k, kv, "self_attn.k_proj");
      rl.k_bias = slice.Cols(lw.k_bias, kv);
      rl.v = slice.Rows(lw.v, kv, "self_attn.v_proj");
      rl.v_bias = slice.Cols(lw.v_bias, kv);
      rl.q_norm = lw.q_norm;
      rl.k_norm = lw.k_norm;
      rl.o = slice.Cols(lw.o, HeadRows(first_q, q_heads, head_dim), "self_attn.o_proj");
      // The bias joins the sum once: rank 0 adds it to its partial.
      if (rank == 0) rl.o_bias = lw.o_bias;
    }
    if (!c.IsMoeLayer(l)) {
      rl.mlp = slice.Mlp(lw.mlp, tp, rank, "mlp.");
      continue;
    }
    rl.router = lw.router;
    rl.experts.resize(lw.experts.size());
    for (int e = 0; e < static_cast<int>(lw.experts.size()); ++e) {
      if (!expert_parallel) {
        rl.experts[e] = slice.Mlp(lw.experts[e], tp, rank, absl::StrCat("mlp.experts.", e, "."));
      } else if (e / experts_per_rank == rank) {
        rl.experts[e] = lw.experts[e];  // whole; the other ranks' experts stay empty here
      }
    }
    rl.shared_expert = slice.Mlp(lw.shared_expert, tp, rank, "mlp.shared_expert.");
    rl.shared_expert_gate = lw.shared_expert_gate;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<RankShard>> ShardHostModel(const HostModel& host, int tp, int rank,
                                                          bool expert_parallel) {
  RETURN_IF_ERROR(CheckShardable(host, tp, rank, expert_parallel));
  auto shard = std::make_unique<RankShard>();
  Slicer slice(&shard->owned, &shard->off_grid, rank, /*dry=*/false);
  CutShard(host, tp, rank, expert_parallel, slice, *shard);
  return shard;
}

absl::StatusOr<std::string> QuantizedShardRefusal(const HostModel& host, int tp,
                                                  bool expert_parallel) {
  if (host.quant_format == QuantFormat::kNone) return std::string();
  std::vector<std::string> off_grid;
  for (int rank = 0; rank < tp; ++rank) {
    RETURN_IF_ERROR(CheckShardable(host, tp, rank, expert_parallel));
    RankShard shard;
    std::vector<std::vector<uint8_t>> unused;
    Slicer slice(&unused, &off_grid, rank, /*dry=*/true);
    CutShard(host, tp, rank, expert_parallel, slice, shard);
  }
  if (off_grid.empty()) return std::string();
  constexpr size_t kNamed = 3;
  const size_t more = off_grid.size() > kNamed ? off_grid.size() - kNamed : 0;
  off_grid.resize(std::min(off_grid.size(), kNamed));
  return absl::StrCat("tp=", tp, " cuts ", off_grid.size() + more,
                      " quantized weight slices inside their scale groups or blocks, where no "
                      "quantized shard holds them exactly: ",
                      absl::StrJoin(off_grid, "; "),
                      more > 0 ? absl::StrCat("; and ", more, " more") : "");
}

absl::StatusOr<std::unique_ptr<Model>> MakeTensorParallelCpuModel(
    const HostModel& host, const TensorParallelOptions& options) {
  using Kind = FaultInjection::Kind;
  const Kind fault = options.fault.kind;
  if (fault != Kind::kNone && fault != Kind::kSegv && fault != Kind::kAbort &&
      fault != Kind::kHang && fault != Kind::kDelay && fault != Kind::kRankKill &&
      fault != Kind::kRankHang)
    return absl::InvalidArgumentError(
        absl::StrCat("tp=", options.tp,
                     ": weight and numeric faults run on tp=1 models only (segv, abort, hang, "
                     "delay, rank-kill and rank-hang run at any tp)"));
  if (std::string why = TensorParallelRefusal(host.config, options.tp, options.expert_parallel);
      !why.empty())
    return absl::UnimplementedError(why);
  std::vector<std::unique_ptr<RankShard>> shards;
  for (int r = 0; r < options.tp; ++r) {
    ASSIGN_OR_RETURN(auto shard, ShardHostModel(host, options.tp, r, options.expert_parallel));
    shards.push_back(std::move(shard));
  }
  return std::make_unique<TensorParallelCpuModel>(host, std::move(shards), options);
}

}  // namespace infersweep
