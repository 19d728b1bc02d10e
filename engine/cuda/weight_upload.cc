#include "engine/cuda/weight_upload.h"

#include <cuda_runtime.h>

#include <chrono>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "engine/cuda/cudnn_matmul.h"
#include "engine/cuda/device_util.h"
#include "engine/quant/layout.h"
#include "engine/synthetic.h"
#include "kernels/cuda/ops.h"

namespace infersweep {
namespace {

// Copies a list of device pointers into a device array owned by `buffers`.
absl::StatusOr<const void**> UploadPointers(const std::vector<const void*>& list,
                                            DeviceAllocations& buffers) {
  ASSIGN_OR_RETURN(auto d, buffers.Allocate<const void*>(list.size()));
  CUDA_OR_DIE(cudaMemcpy(d, list.data(), list.size() * sizeof(void*), cudaMemcpyHostToDevice));
  return d;
}

// The quantized kernels read codes in 16-byte loads.
bool CodesAligned(const MatrixRef& m) { return reinterpret_cast<uintptr_t>(m.data) % 16 == 0; }

// The device table of one projection of a layer's quantized experts; the experts this model does
// not hold (ep=on: `held` is the rank's run) keep null entries. Its last entry, index
// num_experts, is `shared`'s (the shared expert's projection) when given, else null.
absl::StatusOr<cuda::QuantExpertTable> MakeQuantExpertTable(
    const std::vector<ExpertWeights>& experts, const HeldExperts& held, const MatrixRef* shared,
    MatrixRef ExpertWeights::*projection, DeviceAllocations& buffers) {
  const MatrixRef& first = experts[held.begin].*projection;
  cuda::QuantExpertTable t;
  t.format = first.quant.format;
  t.scale_dtype = first.quant.scale_dtype;
  t.rows = static_cast<int>(first.rows);
  t.cols = static_cast<int>(first.cols);
  const size_t e_count = experts.size() + 1;  // the experts, then the shared expert's entry
  std::vector<const void*> list(3 * e_count, nullptr);  // codes | scales | scale_2
  auto fits = [&](const MatrixRef& m) {
    return m.quant.format == t.format && m.quant.scale_dtype == t.scale_dtype && m.rows == t.rows &&
           m.cols == t.cols && CodesAligned(m);
  };
  auto add = [&](size_t e, const MatrixRef& m) {
    list[e] = m.data;
    list[e_count + e] = m.quant.scale;
    list[2 * e_count + e] = m.quant.global_scale;
  };
  for (size_t e = held.begin; e < static_cast<size_t>(held.end); ++e) {
    const MatrixRef& m = experts[e].*projection;
    if (!fits(m))
      return absl::UnimplementedError(
          "moe=fused needs every expert in one format, scale dtype and shape, with 16-byte "
          "aligned codes");
    add(e, m);
  }
  if (shared != nullptr) {  // BuildExpertTables passes one only where it fits
    if (!fits(*shared))
      return absl::InternalError("the shared expert does not fit the experts' table");
    add(experts.size(), *shared);
  }
  ASSIGN_OR_RETURN(auto d, UploadPointers(list, buffers));
  t.codes = d;
  t.scales = d + e_count;
  if (t.format == QuantFormat::kNvfp4) t.global_scales = d + 2 * e_count;
  return t;
}

// moe=fused's expert tables from the view's weights: the quantized experts' (w4a16, w8a16) or
// pointer tables of bf16 experts (dequant_bf16's copies, or experts a checkpoint left dense).
absl::Status BuildExpertTables(const ModelConfig& config, QuantView& view) {
  for (size_t l = 0; l < view.weights.layers.size(); ++l) {
    const LayerWeights& layer = view.weights.layers[l];
    const std::vector<ExpertWeights>& experts = layer.experts;
    ASSIGN_OR_RETURN(const HeldExperts held, HeldExpertRange(experts));
    std::array<cuda::QuantExpertTable, 3> quant{};
    std::vector<const void*> lists[3];
    // A shared expert whose quantized codes are not 16-byte aligned keeps its own launches
    // rather than an entry.
    const ExpertWeights& se = layer.shared_expert;
    const bool shared = SharedExpertFitsExpertTables(layer, held) &&
                        (!se.gate.quantized() ||
                         (CodesAligned(se.gate) && CodesAligned(se.up) && CodesAligned(se.down)));
    view.shared_in_table.push_back(shared);
    if (held.count() > 0 && experts[held.begin].gate.quantized()) {
      const std::pair<MatrixRef ExpertWeights::*, int> parts[] = {
          {&ExpertWeights::gate, 1},
          {&ExpertWeights::up, 1},
          {&ExpertWeights::down, config.num_experts_per_tok}};
      for (int p = 0; p < 3; ++p) {
        const MatrixRef* shared_part = shared ? &(layer.shared_expert.*parts[p].first) : nullptr;
        ASSIGN_OR_RETURN(auto t, MakeQuantExpertTable(experts, held, shared_part, parts[p].first,
                                                      view.buffers));
        if (!cuda::MoeQuantSupports(t, parts[p].second))
          return absl::UnimplementedError(absl::StrCat(
              "moe=fused on quantized experts needs K % 32 (FP4) or % 16 (FP8) and top-k x K x 4 "
              "bytes of staged activations <= ",
              cuda::kMoeMaxSharedBytes, " (expert [", t.rows, ", ", t.cols, "])"));
        quant[p] = t;
      }
    } else if (held.count() > 0 && experts[held.begin].gate.dtype != DType::kBF16) {
      return absl::UnimplementedError("moe=fused takes bf16 or quantized experts");
    } else {
      for (const ExpertWeights& e : experts) {
        lists[0].push_back(e.gate.data);
        lists[1].push_back(e.up.data);
        lists[2].push_back(e.down.data);
      }
      if (!experts.empty()) {  // the shared expert's entry, index num_experts
        lists[0].push_back(shared ? layer.shared_expert.gate.data : nullptr);
        lists[1].push_back(shared ? layer.shared_expert.up.data : nullptr);
        lists[2].push_back(shared ? layer.shared_expert.down.data : nullptr);
      }
    }
    view.quant_tables.push_back(quant);
    for (auto [list, table] :
         {std::pair{&lists[0], &view.gate_table}, std::pair{&lists[1], &view.up_table},
          std::pair{&lists[2], &view.down_table}}) {
      ASSIGN_OR_RETURN(auto d, UploadPointers(*list, view.buffers));
      table->push_back(reinterpret_cast<const uint16_t**>(d));
    }
  }
  return absl::OkStatus();
}

// Per layer, device tables of its experts' gate, up and down pointers (empty for dense layers),
// which the device-indexed MoE kernels read.
absl::Status BuildExpertPointerTables(DeviceWeights& dw) {
  for (const LayerWeights& layer : dw.weights.layers) {
    std::vector<const uint16_t*> gate, up, down;
    auto add = [&](const ExpertWeights& e) {
      gate.push_back(static_cast<const uint16_t*>(e.gate.data));
      up.push_back(static_cast<const uint16_t*>(e.up.data));
      down.push_back(static_cast<const uint16_t*>(e.down.data));
    };
    for (const ExpertWeights& e : layer.experts) add(e);
    // A MoE layer's shared expert entry (index num_experts), null where it does not fit.
    const absl::StatusOr<HeldExperts> held = HeldExpertRange(layer.experts);
    const bool shared = held.ok() && SharedExpertFitsExpertTables(layer, *held);
    if (!layer.experts.empty()) add(shared ? layer.shared_expert : ExpertWeights{});
    dw.shared_in_table.push_back(shared);
    for (auto [list, table] : {std::pair{&gate, &dw.gate_table}, std::pair{&up, &dw.up_table},
                               std::pair{&down, &dw.down_table}}) {
      ASSIGN_OR_RETURN(auto d, dw.buffers.Allocate<const uint16_t*>(list->size()));
      CUDA_OR_DIE(
          cudaMemcpy(d, list->data(), list->size() * sizeof(void*), cudaMemcpyHostToDevice));
      table->push_back(d);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<DeviceWeights>> UploadWeights(HostModel& host) {
  if (host.device_weights) return std::static_pointer_cast<DeviceWeights>(host.device_weights);
  const auto start = std::chrono::steady_clock::now();
  // Quantized models are quantized on the host (or read so): upload what the host holds.
  const bool quantized = host.quant_format != QuantFormat::kNone;
  if (quantized) RETURN_IF_ERROR(MaterializeHostWeights(host));
  auto dw = std::make_shared<DeviceWeights>();
  dw->tensors = host.tensors;
  // A layer's q, k and v weights share one allocation, back to back, when all three are dense
  // bf16: the cuBLASLt configs then run them as one GEMM (CudaModel::QkvContiguous).
  std::vector<uint8_t*> placed(host.specs.size(), nullptr);
  std::map<int, std::array<int, 3>> qkv;  // layer -> spec indices of q, k, v
  for (size_t i = 0; i < host.specs.size(); ++i) {
    const TensorSpec& spec = host.specs[i];
    const char* suffixes[3] = {"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                               "self_attn.v_proj.weight"};
    for (int j = 0; j < 3; ++j)
      if (spec.layer >= 0 && spec.quant == QuantFormat::kNone &&
          host.tensors[i].dtype == DType::kBF16 && absl::EndsWith(spec.name, suffixes[j])) {
        auto [it, added] = qkv.try_emplace(spec.layer, std::array<int, 3>{-1, -1, -1});
        it->second[j] = static_cast<int>(i);
      }
  }
  auto bytes_of = [&](size_t i) {
    return static_cast<size_t>(host.specs[i].numel()) * DTypeSize(host.tensors[i].dtype);
  };
  std::vector<std::array<int, 3>> groups;
  std::vector<bool> grouped(host.specs.size(), false);
  for (const auto& [layer, index] : qkv) {
    if (index[0] < 0 || index[1] < 0 || index[2] < 0) continue;
    groups.push_back(index);
    for (int i : index) grouped[i] = true;
  }
  // Every tensor in one arena: sized first, then carved in the same order.
  size_t arena_bytes = 0;
  for (const auto& index : groups)
    arena_bytes +=
        DeviceArena::Aligned(bytes_of(index[0]) + bytes_of(index[1]) + bytes_of(index[2]));
  for (size_t i = 0; i < host.specs.size(); ++i)
    if (!grouped[i]) arena_bytes += DeviceArena::Aligned(bytes_of(i));
  DeviceArena arena;
  RETURN_IF_ERROR(arena.Reserve(dw->buffers, arena_bytes));
  for (const auto& index : groups) {
    ASSIGN_OR_RETURN(uint8_t * buffer,
                     arena.Carve(bytes_of(index[0]) + bytes_of(index[1]) + bytes_of(index[2])));
    size_t offset = 0;
    for (int i : index) {
      placed[i] = buffer + offset;
      offset += bytes_of(i);
    }
  }
  for (size_t i = 0; i < host.specs.size(); ++i) {
    const TensorSpec& spec = host.specs[i];
    const HostTensor& t = host.tensors[i];
    const size_t bytes = bytes_of(i);
    if (!placed[i]) {
      ASSIGN_OR_RETURN(uint8_t * buffer, arena.Carve(bytes));
      placed[i] = buffer;
    }
    uint8_t* const buffer = placed[i];
    dw->tensors[i].data = buffer;
    if (host.is_synthetic && !quantized) {  // generated in place: bit-identical to the CPU's
      TensorSpec source = spec;
      const bool tied = host.config.tie_word_embeddings && spec.name == "lm_head.weight";
      if (tied) source.kind = WeightKind::kEmbedding;
      const SyntheticInit init = SyntheticInitFor(source);
      const uint64_t key = SyntheticStream(
          host.seed, HashTensorName(SyntheticSourceName(spec, host.config.tie_word_embeddings)));
      cuda::GenerateSyntheticBf16(key, init.scale, init.offset, spec.numel(),
                                  reinterpret_cast<uint16_t*>(buffer), nullptr);
      CHECK_LAUNCH();
    } else {
      CUDA_OR_DIE(cudaMemcpy(buffer, t.data, bytes, cudaMemcpyHostToDevice));
    }
  }
  // Zero-centred norms (qwen3_next, qwen3_5) scale by (1 + w): their gains go up as that sum in
  // fp32, the same value the CPU reference forms, and every norm kernel applies them as plain
  // gains.
  for (size_t i = 0; i < host.specs.size(); ++i) {
    if (host.specs[i].kind != WeightKind::kCenteredNorm) continue;
    HostTensor& t = dw->tensors[i];
    const int64_t n = host.specs[i].numel();
    ASSIGN_OR_RETURN(auto gain, dw->buffers.Allocate<float>(n));
    cuda::UpcastToF32(MatrixRef{t.data, t.dtype, 1, n}, gain, nullptr, 1.f);
    CHECK_LAUNCH();
    t.data = gain;
    t.dtype = DType::kF32;
  }
  ASSIGN_OR_RETURN(auto bound, BindWeights(host.config, host.specs, dw->tensors));
  dw->weights = std::move(bound);
  RETURN_IF_ERROR(BuildExpertPointerTables(*dw));
  CUDA_OR_DIE(cudaDeviceSynchronize());
  dw->load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  host.device_upload_seconds = dw->load_seconds;
  host.device_weights = dw;
  return dw;
}

absl::StatusOr<std::shared_ptr<DeviceWeights>> UploadShardWeights(const HostModel& host,
                                                                  const ModelWeights& shard) {
  const auto start = std::chrono::steady_clock::now();
  std::map<const void*, int64_t> centered;  // host pointer -> elements of a zero-centred norm
  for (size_t i = 0; i < host.specs.size(); ++i)
    if (host.specs[i].kind == WeightKind::kCenteredNorm)
      centered[host.tensors[i].data] = host.specs[i].numel();
  auto dw = std::make_shared<DeviceWeights>();
  // Two passes over the shard: the first sizes the arena every matrix is carved from, the second
  // carves and copies.
  bool sizing = true;
  size_t arena_bytes = 0;
  DeviceArena arena;
  // `bytes` at `from` into a piece of the arena of their own (nullptr while sizing).
  auto copy = [&](const void* from, size_t bytes) -> absl::StatusOr<uint8_t*> {
    if (sizing) {
      arena_bytes += DeviceArena::Aligned(bytes);
      return nullptr;
    }
    ASSIGN_OR_RETURN(uint8_t * at, arena.Carve(bytes));
    CUDA_OR_DIE(cudaMemcpy(at, from, bytes, cudaMemcpyHostToDevice));
    return at;
  };
  // A quantized matrix as UploadWeights places a checkpoint's: its codes, its scale tensor and
  // its global and input scales, each a piece of the arena, m pointed at all of them.
  auto upload_quantized = [&](MatrixRef& m) -> absl::Status {
    QuantRef& q = m.quant;
    const int64_t row_bytes = IsFp4(q.format) ? m.cols / 2 : m.cols * DTypeSize(m.dtype);
    ASSIGN_OR_RETURN(uint8_t * codes, copy(m.data, static_cast<size_t>(m.rows * row_bytes)));
    ASSIGN_OR_RETURN(uint8_t * scale,
                     copy(q.scale, static_cast<size_t>(QuantScaleCount(q.format, m.rows, m.cols) *
                                                       DTypeSize(q.scale_dtype))));
    uint8_t* global = nullptr;
    uint8_t* input = nullptr;
    if (q.global_scale) {
      ASSIGN_OR_RETURN(global, copy(q.global_scale, sizeof(float)));
    }
    if (q.input_scale) {
      ASSIGN_OR_RETURN(input, copy(q.input_scale, sizeof(float)));
    }
    if (sizing) return absl::OkStatus();
    m.data = codes;
    q.scale = scale;
    if (q.global_scale) q.global_scale = global;
    if (q.input_scale) q.input_scale = input;
    return absl::OkStatus();
  };
  // Copies m to `at` (in_group: its place in a group counted whole) or to a piece of the arena of
  // its own, and points m there.
  auto upload = [&](MatrixRef& m, uint8_t* at = nullptr, bool in_group = false) -> absl::Status {
    if (m.empty()) return absl::OkStatus();
    if (m.quantized()) return upload_quantized(m);
    const size_t bytes = static_cast<size_t>(m.numel()) * DTypeSize(m.dtype);
    if (sizing) {
      if (!in_group) arena_bytes += DeviceArena::Aligned(bytes);
      return absl::OkStatus();
    }
    if (!at) {
      ASSIGN_OR_RETURN(at, arena.Carve(bytes));
    }
    CUDA_OR_DIE(cudaMemcpy(at, m.data, bytes, cudaMemcpyHostToDevice));
    const auto norm = centered.find(m.data);
    m.data = at;
    if (norm != centered.end() && norm->second == m.numel()) {
      ASSIGN_OR_RETURN(auto gain, dw->buffers.Allocate<float>(m.numel()));
      cuda::UpcastToF32(MatrixRef{m.data, m.dtype, 1, m.numel()}, gain, nullptr, 1.f);
      CHECK_LAUNCH();
      m.data = gain;
      m.dtype = DType::kF32;
    }
    return absl::OkStatus();
  };
  auto upload_mlp = [&](ExpertWeights& e) -> absl::Status {
    for (MatrixRef* m : {&e.gate, &e.up, &e.down}) RETURN_IF_ERROR(upload(*m));
    return absl::OkStatus();
  };
  ModelWeights& w = dw->weights;
  auto walk = [&]() -> absl::Status {
    w = shard;
    for (MatrixRef* m : {&w.embed, &w.final_norm, &w.lm_head}) RETURN_IF_ERROR(upload(*m));
    for (LayerWeights& l : w.layers) {
      const bool qkv_together = !l.q.empty() && !l.k.empty() && !l.v.empty() &&
                                l.q.dtype == DType::kBF16 && l.k.dtype == DType::kBF16 &&
                                l.v.dtype == DType::kBF16 && !l.q.quantized() && !l.k.quantized() &&
                                !l.v.quantized();
      if (qkv_together) {
        const size_t bytes = static_cast<size_t>(l.q.numel() + l.k.numel() + l.v.numel()) * 2;
        uint8_t* at = nullptr;
        if (sizing) {
          arena_bytes += DeviceArena::Aligned(bytes);
        } else {
          ASSIGN_OR_RETURN(at, arena.Carve(bytes));
        }
        for (MatrixRef* m : {&l.q, &l.k, &l.v}) {
          const size_t part = static_cast<size_t>(m->numel()) * 2;
          RETURN_IF_ERROR(upload(*m, at, /*in_group=*/true));
          if (!sizing) at += part;
        }
      } else {
        for (MatrixRef* m : {&l.q, &l.k, &l.v}) RETURN_IF_ERROR(upload(*m));
      }
      LinearAttentionWeights& la = l.linear_attn;
      for (auto list :
           {std::vector<MatrixRef*>{&l.input_norm, &l.post_attention_norm, &l.router,
                                    &l.shared_expert_gate},
            std::vector<MatrixRef*>{&l.q_bias, &l.k_bias, &l.v_bias, &l.q_norm, &l.k_norm, &l.o,
                                    &l.o_bias},
            std::vector<MatrixRef*>{&la.in_proj_qkv, &la.in_proj_z, &la.in_proj_b, &la.in_proj_a,
                                    &la.conv, &la.dt_bias, &la.a_log, &la.norm, &la.out_proj}})
        for (MatrixRef* m : list) RETURN_IF_ERROR(upload(*m));
      RETURN_IF_ERROR(upload_mlp(l.mlp));
      RETURN_IF_ERROR(upload_mlp(l.shared_expert));
      for (ExpertWeights& e : l.experts) RETURN_IF_ERROR(upload_mlp(e));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(walk());
  RETURN_IF_ERROR(arena.Reserve(dw->buffers, arena_bytes));
  sizing = false;
  RETURN_IF_ERROR(walk());
  RETURN_IF_ERROR(BuildExpertPointerTables(*dw));
  CUDA_OR_DIE(cudaDeviceSynchronize());
  dw->load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return dw;
}

absl::StatusOr<std::unique_ptr<QuantView>> BuildQuantView(HostModel& host, const DeviceWeights& dw,
                                                          const CudaOptions& options,
                                                          const FaultInjection& fault) {
  const QGemm qgemm = options.qgemm;
  auto view = std::make_unique<QuantView>();
  view->weights = dw.weights;
  if (fault.kind == FaultInjection::Kind::kBadQuantScale) {
    // Corrupt a host copy the CPU's way, find which linear it hit, upload that scale alone.
    ModelWeights host_copy = host.weights;
    std::vector<uint8_t> corrupted;
    RETURN_IF_ERROR(CorruptQuantScale(host_copy, host, fault.value, fault.target, &corrupted));
    for (size_t l = 0; l < host_copy.layers.size(); ++l) {
      const std::vector<MatrixRef*> host_linears = LayerLinears(host_copy.layers[l]);
      const std::vector<MatrixRef*> view_linears = LayerLinears(view->weights.layers[l]);
      for (size_t i = 0; i < host_linears.size(); ++i) {
        if (host_linears[i]->quant.scale != corrupted.data()) continue;
        ASSIGN_OR_RETURN(auto scale, view->buffers.Allocate<uint8_t>(corrupted.size()));
        CUDA_OR_DIE(cudaMemcpy(scale, corrupted.data(), corrupted.size(), cudaMemcpyHostToDevice));
        view_linears[i]->quant.scale = scale;
      }
    }
  }
  if (UsesScaledGemm(qgemm)) {  // codes as uploaded, scales rearranged
    if (qgemm == QGemm::kCudnn) {
      ASSIGN_OR_RETURN(auto cudnn, CudnnQuantGemm::Create());
      view->scaled = std::move(cudnn);
    } else {
      ASSIGN_OR_RETURN(auto scaled, cuda::ScaledGemm::Create(qgemm == QGemm::kFp8CublasLt
                                                                 ? cuda::ScaledGemmKind::kFp8
                                                                 : cuda::ScaledGemmKind::kFp4));
      view->scaled = std::move(scaled);
    }
    for (LayerWeights& layer : view->weights.layers)
      for (MatrixRef* m : LayerLinears(layer))
        if (m->quantized()) RETURN_IF_ERROR(view->scaled->Prepare(*m));
    CUDA_OR_DIE(cudaDeviceSynchronize());
    return view;
  }
  // The reference dequantizes as it reads (GemmReference), so it keeps the codes too.
  const bool keep_codes = KeepsQuantCodes(qgemm);
  if (keep_codes) {
    if (RoutesOnDevice(options.moe) && host.config.is_moe())
      RETURN_IF_ERROR(BuildExpertTables(host.config, *view));
    return view;
  }
  // dequant_bf16: a bf16 copy of every quantized linear, all in one arena.
  size_t arena_bytes = 0;
  for (LayerWeights& layer : view->weights.layers)
    for (MatrixRef* m : LayerLinears(layer))
      if (m->quantized())
        arena_bytes += DeviceArena::Aligned(static_cast<size_t>(m->rows * m->cols) * 2);
  DeviceArena arena;
  RETURN_IF_ERROR(arena.Reserve(view->buffers, arena_bytes));
  for (LayerWeights& layer : view->weights.layers)
    for (MatrixRef* m : LayerLinears(layer)) {
      if (!m->quantized()) continue;
      const size_t count = static_cast<size_t>(m->rows * m->cols);
      ASSIGN_OR_RETURN(uint8_t * bytes, arena.Carve(count * 2));
      auto* buffer = reinterpret_cast<uint16_t*>(bytes);
      cuda::DequantizeToBf16(*m, buffer, nullptr);
      CHECK_LAUNCH();
      *m = MatrixRef{buffer, DType::kBF16, m->rows, m->cols};
    }
  CUDA_OR_DIE(cudaDeviceSynchronize());
  if (RoutesOnDevice(options.moe) && host.config.is_moe())
    RETURN_IF_ERROR(BuildExpertTables(host.config, *view));
  return view;
}

}  // namespace infersweep
