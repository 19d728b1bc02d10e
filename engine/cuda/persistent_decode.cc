#include "engine/cuda/persistent_decode.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "api/status_macros.h"
#include "core/dtype.h"
#include "core/quant/format.h"
#include "core/tensor_ref.h"
#include "engine/cuda/device_util.h"
#include "engine/cuda/persistent_debug.h"
#include "kernels/cuda/limits.h"

namespace infersweep {

QuantFormat PersistentStreamFormat(QuantFormat weights, QGemm qgemm) {
  return qgemm == QGemm::kDequantBf16 ? QuantFormat::kNone : weights;
}

cuda::PersistentDecodeShape PersistentDecodeShapeFor(const ModelConfig& c, QuantFormat format) {
  cuda::PersistentDecodeShape shape;
  shape.format = format;
  shape.num_layers = c.num_layers;
  shape.hidden = c.hidden_size;
  shape.q_heads = c.num_q_heads;
  shape.kv_heads = c.num_kv_heads;
  shape.head_dim = c.head_dim;
  shape.num_experts = c.is_moe() ? c.num_experts : 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const bool moe = c.IsMoeLayer(l);
    shape.max_top_k = std::max(shape.max_top_k, moe ? c.num_experts_per_tok : 1);
    shape.max_inter =
        std::max(shape.max_inter, moe ? c.moe_intermediate_size : c.intermediate_size);
  }
  return shape;
}

std::string PersistentDecodeRefusal(const ModelConfig& c, QuantFormat format) {
  const std::string prefix = "graphs=persistent: ";
  // The kernel's bulk copies take 16-byte rows: 8 bf16 weights, 16 fp8 codes, 32 fp4 codes.
  const int row_align = format == QuantFormat::kNone ? 8 : IsFp4(format) ? 32 : 16;
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string where = absl::StrCat(prefix, "layer ", l, ": ");
    if (c.AttentionKind(l) == LayerAttention::kLinear)
      return where + "Gated DeltaNet linear attention, which the persistent kernel does not stream";
    if (c.attn_output_gate) return where + "gated attention (a sigmoid gate on its output)";
    if (c.rotary_dim() != c.head_dim) return where + "partial RoPE";
    if (c.attention_bias) return where + "attention biases";
    const bool moe = c.IsMoeLayer(l);
    if (moe && c.shared_expert_intermediate_size > 0) return where + "a shared expert";
    const int inter = moe ? c.moe_intermediate_size : c.intermediate_size;
    if (format == QuantFormat::kNone)
      if (const std::string why = cuda::PersistentDownTilesUnsupported(c.hidden_size, inter);
          !why.empty())
        return where + why;
    if (inter % row_align)
      return absl::StrCat(where, "MLP width ", inter, " is not a multiple of ", row_align,
                          " (16-byte rows)");
  }
  if (const std::string why =
          cuda::PersistentDecodeUnsupported(PersistentDecodeShapeFor(c, format));
      !why.empty())
    return prefix + why;
  return "";
}

PersistentDecoder::PersistentDecoder(const RunnerContext& context)
    : config_(context.config),
      w_(context.weights),
      options_(context.options),
      fault_(context.fault),
      stream_(context.stream) {}

// graphs=persistent: builds the kernel's per-layer tables on the device, for a model that
// CudaModelRefusal let through (layer kinds and shapes). Unimplemented (UNSUPPORTED to the
// harness) with the reason for what only the weights tell: linears not all bf16 or not all in
// the streamed format, misaligned rows, no GPU memory for the tiled copies. A quantized model
// streams its view: dequant_bf16's bf16 copies, or (w8a16, w4a16) the codes, fp8_tensor /
// fp8_channel / fp8_block128 / nvfp4 / mxfp4, with their scales.
absl::Status PersistentDecoder::Prepare(bool quantized_view) {
  const ModelConfig& c = config_;
  auto unsupported = [](const std::string& why) {
    return absl::UnimplementedError(absl::StrCat("graphs=persistent: ", why));
  };
  // The registry leaves qgemm=dequant_bf16 (bf16 copies), w8a16, w8a8 and w4a16 (the codes).
  QuantFormat format = QuantFormat::kNone;
  DType scale_dtype = DType::kF32;
  if (quantized_view && options_.qgemm != QGemm::kDequantBf16 && !w_.layers.empty()) {
    format = w_.layers[0].q.quant.format;
    scale_dtype = w_.layers[0].q.quant.scale_dtype;
  }
  const cuda::PersistentDecodeShape shape = PersistentDecodeShapeFor(c, format);
  const DType norm_dtype = w_.layers.empty() ? DType::kBF16 : w_.layers[0].input_norm.dtype;
  std::vector<cuda::PersistentLayer> layers(c.num_layers);
  std::vector<cuda::PersistentQuant> quant(c.num_layers);
  // Per layer and projection (gate, up, down), one entry per expert (or the dense MLP): the
  // codes, then (quantized) the factor sources, then (FP4, fp8 block-128) the group scales.
  // Uploaded below;
  // the layers point into them.
  std::vector<std::array<std::array<std::vector<const void*>, 3>, 3>> tables(c.num_layers);
  // FP4 group scales (a byte per 16 weights for nvfp4, per 32 for mxfp4) whose rows are not a
  // multiple of 16 bytes are copied into padded rows (the kernel's bulk copies take 16-byte
  // pieces); the rest are read in place. fp8 block-128's scales ([ceil(rows / 128),
  // ceil(cols / 128)], any scale dtype) are expanded to a row of fp32 scales a weight row, padded
  // to 16 bytes: the kernel streams a row's scales behind its codes.
  auto groups_of = [&](const MatrixRef& m) -> absl::StatusOr<const void*> {
    if (format == QuantFormat::kFp8Block128) {
      const int64_t blocks = CeilDiv64(m.cols, kFp8BlockSize);
      const int64_t row_floats = cuda::PersistentGroupRowBytes(format, m.cols) / 4;
      std::vector<uint8_t> scales(static_cast<size_t>(CeilDiv64(m.rows, kFp8BlockSize) * blocks *
                                                      DTypeSize(m.quant.scale_dtype)));
      CUDA_OR_DIE(cudaMemcpy(scales.data(), m.quant.scale, scales.size(), cudaMemcpyDeviceToHost));
      std::vector<float> rows(static_cast<size_t>(m.rows * row_floats), 0.f);
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t b = 0; b < blocks; ++b)
          rows[r * row_floats + b] =
              LoadAsFloat(scales.data(), m.quant.scale_dtype,
                          QuantScaleIndex(format, m.cols, r, b * kFp8BlockSize));
      ASSIGN_OR_RETURN(auto copy, copies_.Allocate<float>(rows.size()));
      CUDA_OR_DIE(
          cudaMemcpy(copy, rows.data(), rows.size() * sizeof(float), cudaMemcpyHostToDevice));
      return copy;
    }
    const int64_t row_bytes = m.cols / cuda::PersistentGroupWeights(format),
                  padded = cuda::PersistentGroupRowBytes(format, m.cols);
    if (row_bytes == padded) return m.quant.scale;
    ASSIGN_OR_RETURN(auto copy, copies_.Allocate<uint8_t>(static_cast<size_t>(m.rows * padded)));
    CUDA_OR_DIE(cudaMemset(copy, 0, m.rows * padded));
    CUDA_OR_DIE(cudaMemcpy2D(copy, padded, m.quant.scale, row_bytes, row_bytes, m.rows,
                             cudaMemcpyDeviceToDevice));
    return copy;
  };
  // The kernel streams the router's column i with o's row i (PersistentLayer::router).
  auto transposed = [&](const MatrixRef& m) -> absl::StatusOr<const uint16_t*> {
    std::vector<uint16_t> rows(static_cast<size_t>(m.numel())), columns(rows.size());
    CUDA_OR_DIE(cudaMemcpy(rows.data(), m.data, rows.size() * 2, cudaMemcpyDeviceToHost));
    for (int64_t e = 0; e < m.rows; ++e)
      for (int64_t i = 0; i < m.cols; ++i) columns[i * m.rows + e] = rows[e * m.cols + i];
    ASSIGN_OR_RETURN(auto copy, copies_.Allocate<uint16_t>(columns.size()));
    CUDA_OR_DIE(cudaMemcpy(copy, columns.data(), columns.size() * 2, cudaMemcpyHostToDevice));
    return copy;
  };
  // The bf16 build's down projections, tiled for the gate/up phase that folds them in
  // (cuda::PersistentDownTiles): one copy a layer, every expert's (or the dense MLP's) in turn.
  auto down_tiles = [&](const std::vector<std::array<const MatrixRef*, 3>>& mlps)
      -> absl::StatusOr<std::vector<const void*>> {
    const MatrixRef& first = *mlps[0][2];
    ASSIGN_OR_RETURN(auto copy,
                     copies_.Allocate<uint16_t>(static_cast<size_t>(first.numel()) * mlps.size()));
    std::vector<const void*> tiles;
    for (const auto& mlp : mlps) {
      const MatrixRef& down = *mlp[2];
      if (down.rows != first.rows || down.cols != first.cols)
        return absl::InternalError("experts of one layer with different down shapes");
      uint16_t* dst = copy + first.numel() * static_cast<int64_t>(tiles.size());
      cuda::PersistentDownTiles(static_cast<const uint16_t*>(down.data), dst,
                                static_cast<int>(down.rows), static_cast<int>(down.cols), stream_);
      tiles.push_back(dst);
    }
    CUDA_OR_DIE(cudaStreamSynchronize(stream_));
    return tiles;
  };
  auto factor_of = [&](const MatrixRef& m) {
    return format == QuantFormat::kNvfp4 ? m.quant.global_scale : m.quant.scale;
  };
  // The tiled copies double the down projections in GPU memory (19.3 GB on qwen3-30b-a3b):
  // a GPU that cannot hold them gets the reason, not an allocation failure halfway through.
  if (format == QuantFormat::kNone) {
    size_t tile_bytes = 0;
    for (int l = 0; l < c.num_layers; ++l) {
      const LayerWeights& lw = w_.layers[l];
      if (c.IsMoeLayer(l))
        for (const ExpertWeights& e : lw.experts) tile_bytes += e.down.numel() * 2;
      else
        tile_bytes += lw.mlp.down.numel() * 2;
    }
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) == cudaSuccess && tile_bytes > free)
      return unsupported(absl::StrFormat(
          "bf16: the tiled copies of the down projections need %.1f GB of GPU memory, %.1f GB "
          "free",
          tile_bytes / 1e9, free / 1e9));
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = w_.layers[l];
    const std::string where = absl::StrCat("layer ", l, ": ");
    std::vector<const MatrixRef*> linears = {&lw.q, &lw.k, &lw.v, &lw.o};
    const bool moe = c.IsMoeLayer(l);
    if (moe) {
      for (const ExpertWeights& e : lw.experts)
        for (const MatrixRef* m : {&e.gate, &e.up, &e.down}) linears.push_back(m);
    } else {
      for (const MatrixRef* m : {&lw.mlp.gate, &lw.mlp.up, &lw.mlp.down}) linears.push_back(m);
    }
    for (const MatrixRef* m : linears) {
      const bool aligned = reinterpret_cast<uintptr_t>(m->data) % 16 == 0;
      if (format == QuantFormat::kNone && (m->dtype != DType::kBF16 || m->quantized() || !aligned))
        return unsupported(where + "every linear must be bf16 with 16-byte aligned rows");
      if (format != QuantFormat::kNone &&
          (m->quant.format != format || m->quant.scale_dtype != scale_dtype || !aligned))
        return unsupported(
            absl::StrCat(where, "every linear but the router must be ", QuantFormatName(format),
                         " with one scale dtype and 16-byte aligned codes (a checkpoint's excluded "
                         "modules stay dense)"));
    }
    if (moe && (lw.router.dtype != DType::kBF16 || lw.router.quantized() ||
                reinterpret_cast<uintptr_t>(lw.router.data) % 16 != 0))
      return unsupported(where + "the router must be bf16 with 16-byte aligned rows");
    for (const MatrixRef* m : {&lw.input_norm, &lw.post_attention_norm, &lw.q_norm, &lw.k_norm})
      if (!m->empty() && m->dtype != norm_dtype)
        return unsupported(where + "the norm gains must share one dtype");
    cuda::PersistentLayer& p = layers[l];
    p.q = lw.q.data;
    p.k = lw.k.data;
    p.v = lw.v.data;
    p.o = lw.o.data;
    if (format != QuantFormat::kNone) {
      const MatrixRef* attention[4] = {&lw.q, &lw.k, &lw.v, &lw.o};
      for (int i = 0; i < 4; ++i) {
        quant[l].factor[i] = factor_of(*attention[i]);
        if (!cuda::PersistentStreamsGroupScales(format)) continue;
        ASSIGN_OR_RETURN(auto groups, groups_of(*attention[i]));
        quant[l].groups[i] = groups;
      }
    }
    std::vector<std::array<const MatrixRef*, 3>> mlps;  // each expert's, or the dense MLP
    if (moe)
      for (const ExpertWeights& e : lw.experts) mlps.push_back({&e.gate, &e.up, &e.down});
    else
      mlps.push_back({&lw.mlp.gate, &lw.mlp.up, &lw.mlp.down});
    std::vector<const void*> tiled;
    if (format == QuantFormat::kNone) {
      ASSIGN_OR_RETURN(auto tiles, down_tiles(mlps));
      tiled = std::move(tiles);
    }
    for (size_t e = 0; e < mlps.size(); ++e)
      for (int proj = 0; proj < 3; ++proj) {
        const auto& mlp = mlps[e];
        tables[l][proj][0].push_back(proj == 2 && !tiled.empty() ? tiled[e] : mlp[proj]->data);
        if (format == QuantFormat::kNone) continue;
        tables[l][proj][1].push_back(factor_of(*mlp[proj]));
        if (!cuda::PersistentStreamsGroupScales(format)) continue;
        ASSIGN_OR_RETURN(auto groups, groups_of(*mlp[proj]));
        tables[l][proj][2].push_back(groups);
      }
    p.input_norm = lw.input_norm.data;
    p.post_norm = lw.post_attention_norm.data;
    if (c.qk_norm) {
      p.q_norm = lw.q_norm.data;
      p.k_norm = lw.k_norm.data;
    }
    if (moe) {
      ASSIGN_OR_RETURN(auto router, transposed(lw.router));
      p.router = router;
      p.inter = c.moe_intermediate_size;
      p.top_k = c.num_experts_per_tok;
    } else {
      p.inter = static_cast<int>(lw.mlp.gate.rows);
      p.top_k = 1;
    }
    ApplyPersistentFaults(fault_, l, p);  // TEST ONLY
  }
  // One device buffer: the layer tables, the experts' pointer tables, h, x_mlp, x_adds,
  // attention's partials, the counters (and the TEST ONLY timeline).
  std::vector<const void*> pointers;  // every table, in order
  for (const auto& layer : tables)
    for (const auto& projection : layer)
      for (const auto& table : projection)
        pointers.insert(pointers.end(), table.begin(), table.end());
  const size_t layers_bytes = layers.size() * sizeof(cuda::PersistentLayer);
  const size_t quant_bytes =
      format == QuantFormat::kNone ? 0 : quant.size() * sizeof(cuda::PersistentQuant);
  const size_t tables_bytes = pointers.size() * sizeof(void*);
  const size_t h_bytes = static_cast<size_t>(shape.max_top_k) * shape.max_inter * sizeof(float);
  const size_t x_mlp_bytes = static_cast<size_t>(c.hidden_size) * sizeof(float);
  // The bf16 build's spread-out down sums; the quantized builds have none, which keeps their
  // buffer layout (and kernel arguments) free of a region they never read.
  const size_t x_adds_bytes =
      format == QuantFormat::kNone ? cuda::PersistentAddFloats(c.hidden_size) * sizeof(float) : 0;
  const char* timeline_path = PersistentTimelinePath();  // TEST ONLY
  const size_t timeline_bytes = timeline_path ? PersistentTimelineBytes(c.num_layers) : 0;
  const size_t partial_bytes = cuda::PersistentDecodePartialFloats(shape) * sizeof(float);
  const size_t counter_bytes = cuda::PersistentDecodeCounters(shape) * sizeof(unsigned);
  const size_t total = layers_bytes + quant_bytes + tables_bytes + h_bytes + x_mlp_bytes +
                       x_adds_bytes + partial_bytes + counter_bytes + 6 * 256 + timeline_bytes;
  RETURN_IF_ERROR(buffer_.Allocate(total));
  char* base = buffer_.get();
  const void** device_tables = reinterpret_cast<const void**>(base + layers_bytes + quant_bytes);
  for (int l = 0, at = 0; l < c.num_layers; ++l)
    for (int proj = 0; proj < 3; ++proj)
      for (int kind = 0; kind < 3; ++kind) {
        const void* const* table = device_tables + at;
        at += static_cast<int>(tables[l][proj][kind].size());
        if (kind == 0)
          (proj == 0 ? layers[l].gate : proj == 1 ? layers[l].up : layers[l].down) = table;
        if (kind == 1) quant[l].expert_factor[proj] = table;
        if (kind == 2) quant[l].expert_groups[proj] = table;
      }
  CUDA_OR_DIE(cudaMemcpy(base, layers.data(), layers_bytes, cudaMemcpyHostToDevice));
  if (quant_bytes)
    CUDA_OR_DIE(cudaMemcpy(base + layers_bytes, quant.data(), quant_bytes, cudaMemcpyHostToDevice));
  if (tables_bytes)
    CUDA_OR_DIE(cudaMemcpy(device_tables, pointers.data(), tables_bytes, cudaMemcpyHostToDevice));
  args_.shape = shape;
  args_.quant =
      quant_bytes ? reinterpret_cast<const cuda::PersistentQuant*>(base + layers_bytes) : nullptr;
  args_.scale_dtype = scale_dtype;
  args_.layers = reinterpret_cast<const cuda::PersistentLayer*>(base);
  args_.renormalize = c.norm_topk_prob;
  args_.eps = c.rms_norm_eps;
  args_.norm_dtype = norm_dtype;
  // After the tables, each 256-byte aligned: h, x_mlp, x_adds, the attention partials, the
  // counters, the timeline.
  size_t offset = layers_bytes + quant_bytes + tables_bytes;
  auto take = [&](size_t bytes) {
    offset = (offset + 255) / 256 * 256;
    char* p = base + offset;
    offset += bytes;
    return p;
  };
  args_.h = reinterpret_cast<float*>(take(h_bytes));
  args_.x_mlp = reinterpret_cast<float*>(take(x_mlp_bytes));
  if (x_adds_bytes) {
    args_.x_adds = reinterpret_cast<float*>(take(x_adds_bytes));
    CUDA_OR_DIE(cudaMemset(args_.x_adds, 0, x_adds_bytes));  // (each layer's o zeroes them)
  }
  args_.partials = reinterpret_cast<float*>(take(partial_bytes));
  args_.barrier = reinterpret_cast<unsigned*>(take(counter_bytes));
  if (timeline_path) {
    timeline_path_ = timeline_path;
    args_.timeline = reinterpret_cast<unsigned long long*>(take(timeline_bytes));
    CUDA_OR_DIE(cudaMemset(args_.timeline, 0, timeline_bytes));
  }
  // The copies and memsets above ran on the legacy stream, which the step's non-blocking stream
  // does not wait for: they finish before the first step reads them.
  CUDA_OR_DIE(cudaDeviceSynchronize());
  return absl::OkStatus();
}

void PersistentDecoder::Launch(float* x, char* k_cache, char* v_cache, int capacity,
                               const float2* rope, const int* position, float* qkv, float* attn,
                               float* logits) {
  cuda::PersistentDecodeArgs a = args_;
  a.x = x;
  a.k_cache = reinterpret_cast<uint16_t*>(k_cache);
  a.v_cache = reinterpret_cast<uint16_t*>(v_cache);
  a.capacity = capacity;
  a.rope = rope;
  a.position = position;
  a.qkv = qkv;
  a.attn = attn;
  a.logits = logits;
  cuda::PersistentDecode(a, stream_, /*counters_zeroed=*/true);
  CHECK_LAUNCH();
}

void PersistentDecoder::ReportTimeline() const {
  ReportPersistentTimeline(args_, config_.num_layers, timeline_path_);
}

}  // namespace infersweep
