#include "engine/cuda/cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/launch_log.h"
#include "engine/cuda/persistent_decode.h"
#include "engine/quant/layout.h"
#include "engine/synthetic.h"
#include "kernels/cuda/gemm_cublaslt.h"
#include "kernels/cuda/moe_grouped.h"
#include "kernels/cuda/gemm_scaled.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/sm90a/decode_persistent.h"
#include "kernels/cuda/sm90a/gemm_tma.h"

namespace infersweep {
namespace {

// CUDA errors other than allocation failures are sticky: the context is lost, so the worker dies
// loudly (the harness reports CRASHED with this line in the stderr tail).
#define CUDA_OR_DIE(expr)                                                                      \
  do {                                                                                         \
    const cudaError_t _e = (expr);                                                             \
    if (_e != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "CUDA error %s (%s) at %s:%d: %s\n", cudaGetErrorName(_e),          \
                   cudaGetErrorString(_e), __FILE__, __LINE__, #expr);                         \
      std::abort();                                                                            \
    }                                                                                          \
  } while (0)
#define CHECK_LAUNCH() CUDA_OR_DIE(cudaGetLastError())

template <typename T>
absl::StatusOr<T*> DeviceAlloc(size_t count) {
  void* p = nullptr;
  if (count == 0) count = 1;
  const cudaError_t e = cudaMalloc(&p, count * sizeof(T));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", count * sizeof(T), " bytes: ", cudaGetErrorString(e)));
  }
  return static_cast<T*>(p);
}

// The model's weights on the device, shared by every CudaModel of one HostModel.
struct DeviceWeights {
  std::vector<void*> buffers;
  std::vector<HostTensor> tensors;  // device pointers, parallel to the specs
  ModelWeights weights;
  // Per MoE layer: device tables of expert weight pointers for the device-indexed kernels.
  std::vector<const uint16_t**> gate_table, up_table, down_table;
  double load_seconds = 0;

  ~DeviceWeights() {
    for (void* b : buffers) cudaFree(b);
    for (auto* t : gate_table) cudaFree(t);
    for (auto* t : up_table) cudaFree(t);
    for (auto* t : down_table) cudaFree(t);
  }
};

absl::StatusOr<std::shared_ptr<DeviceWeights>> UploadWeights(HostModel& host) {
  if (host.device_weights) return std::static_pointer_cast<DeviceWeights>(host.device_weights);
  const auto start = std::chrono::steady_clock::now();
  // Quantized models are quantized on the host (or read so): upload what the host holds.
  const bool quantized = host.quant_format != QuantFormat::kNone;
  if (quantized)
    if (auto s = MaterializeHostWeights(host); !s.ok()) return s;
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
  for (const auto& [layer, index] : qkv) {
    if (index[0] < 0 || index[1] < 0 || index[2] < 0) continue;
    size_t total = 0;
    for (int i : index) total += static_cast<size_t>(host.specs[i].numel()) * 2;
    auto buffer = DeviceAlloc<uint8_t>(total);
    if (!buffer.ok()) return buffer.status();
    dw->buffers.push_back(*buffer);
    size_t offset = 0;
    for (int i : index) {
      placed[i] = *buffer + offset;
      offset += static_cast<size_t>(host.specs[i].numel()) * 2;
    }
  }
  for (size_t i = 0; i < host.specs.size(); ++i) {
    const TensorSpec& spec = host.specs[i];
    const HostTensor& t = host.tensors[i];
    const size_t bytes = static_cast<size_t>(spec.numel()) * DTypeSize(t.dtype);
    if (!placed[i]) {
      auto buffer = DeviceAlloc<uint8_t>(bytes);
      if (!buffer.ok()) return buffer.status();
      dw->buffers.push_back(*buffer);
      placed[i] = *buffer;
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
  auto bound = BindWeights(host.config, host.specs, dw->tensors);
  if (!bound.ok()) return bound.status();
  dw->weights = std::move(*bound);
  for (const LayerWeights& layer : dw->weights.layers) {
    std::vector<const uint16_t*> gate, up, down;
    for (const ExpertWeights& e : layer.experts) {
      gate.push_back(static_cast<const uint16_t*>(e.gate.data));
      up.push_back(static_cast<const uint16_t*>(e.up.data));
      down.push_back(static_cast<const uint16_t*>(e.down.data));
    }
    for (auto [list, table] : {std::pair{&gate, &dw->gate_table}, std::pair{&up, &dw->up_table},
                               std::pair{&down, &dw->down_table}}) {
      auto d = DeviceAlloc<const uint16_t*>(list->size());
      if (!d.ok()) return d.status();
      CUDA_OR_DIE(cudaMemcpy(*d, list->data(), list->size() * sizeof(void*), cudaMemcpyHostToDevice));
      table->push_back(*d);
    }
  }
  CUDA_OR_DIE(cudaDeviceSynchronize());
  dw->load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  host.device_upload_seconds = dw->load_seconds;
  host.device_weights = dw;
  return dw;
}

// A model's own view of quantized weights (dequant_bf16: bf16 copies; reference, w4a16, w8a16,
// fp8_cublaslt, native_fp4: the codes as uploaded), with the TEST ONLY bad-quant-scale fault
// applied to it alone, so the shared weights (and the reference built on them) stay intact.
struct QuantView {
  ModelWeights weights;
  std::vector<void*> buffers;
  std::unique_ptr<cuda::ScaledGemm> scaled;  // fp8_cublaslt, native_fp4: scales in its layouts
  // moe=fused, per layer (empty for dense layers), built from `weights` so that the fault shows
  // there too: device pointer tables of dequant_bf16's bf16 copies of the experts, or the
  // quantized experts' tables (gate, up, down) for w4a16 / w8a16.
  std::vector<const uint16_t**> gate_table, up_table, down_table;
  std::vector<std::array<cuda::QuantExpertTable, 3>> quant_tables;
  ~QuantView() {
    for (void* b : buffers) cudaFree(b);
  }
};

// Copies a list of device pointers into a device array owned by `buffers`.
absl::StatusOr<const void**> UploadPointers(const std::vector<const void*>& list,
                                            std::vector<void*>& buffers) {
  auto d = DeviceAlloc<const void*>(list.size());
  if (!d.ok()) return d.status();
  buffers.push_back(*d);
  CUDA_OR_DIE(cudaMemcpy(*d, list.data(), list.size() * sizeof(void*), cudaMemcpyHostToDevice));
  return *d;
}

// The device table of one projection of a layer's quantized experts.
absl::StatusOr<cuda::QuantExpertTable> MakeQuantExpertTable(
    const std::vector<ExpertWeights>& experts, MatrixRef ExpertWeights::*projection,
    std::vector<void*>& buffers) {
  const MatrixRef& first = experts.front().*projection;
  cuda::QuantExpertTable t;
  t.format = first.quant.format;
  t.scale_dtype = first.quant.scale_dtype;
  t.rows = static_cast<int>(first.rows);
  t.cols = static_cast<int>(first.cols);
  const size_t e_count = experts.size();
  std::vector<const void*> list(3 * e_count, nullptr);  // codes | scales | scale_2
  for (size_t e = 0; e < e_count; ++e) {
    const MatrixRef& m = experts[e].*projection;
    if (m.quant.format != t.format || m.quant.scale_dtype != t.scale_dtype || m.rows != t.rows ||
        m.cols != t.cols || reinterpret_cast<uintptr_t>(m.data) % 16 != 0)
      return absl::UnimplementedError(
          "moe=fused needs every expert in one format, scale dtype and shape, with 16-byte "
          "aligned codes");
    list[e] = m.data;
    list[e_count + e] = m.quant.scale;
    list[2 * e_count + e] = m.quant.global_scale;
  }
  auto d = UploadPointers(list, buffers);
  if (!d.ok()) return d.status();
  t.codes = *d;
  t.scales = *d + e_count;
  if (t.format == QuantFormat::kNvfp4) t.global_scales = *d + 2 * e_count;
  return t;
}

// moe=fused's expert tables from the view's weights: the quantized experts' (w4a16, w8a16) or
// pointer tables of bf16 experts (dequant_bf16's copies, or experts a checkpoint left dense).
absl::Status BuildExpertTables(const ModelConfig& config, QuantView& view) {
  for (size_t l = 0; l < view.weights.layers.size(); ++l) {
    const std::vector<ExpertWeights>& experts = view.weights.layers[l].experts;
    std::array<cuda::QuantExpertTable, 3> quant{};
    std::vector<const void*> lists[3];
    if (!experts.empty() && experts.front().gate.quantized()) {
      const std::pair<MatrixRef ExpertWeights::*, int> parts[] = {
          {&ExpertWeights::gate, 1}, {&ExpertWeights::up, 1},
          {&ExpertWeights::down, config.num_experts_per_tok}};
      for (int p = 0; p < 3; ++p) {
        auto t = MakeQuantExpertTable(experts, parts[p].first, view.buffers);
        if (!t.ok()) return t.status();
        if (!cuda::MoeQuantSupports(*t, parts[p].second))
          return absl::UnimplementedError(absl::StrCat(
              "moe=fused on quantized experts needs K % 32 (FP4) or % 16 (FP8) and top-k x K x 4 "
              "bytes of staged activations <= ", cuda::kMoeMaxSharedBytes, " (expert [", t->rows,
              ", ", t->cols, "])"));
        quant[p] = *t;
      }
    } else if (!experts.empty() && experts.front().gate.dtype != DType::kBF16) {
      return absl::UnimplementedError("moe=fused takes bf16 or quantized experts");
    } else {
      for (const ExpertWeights& e : experts) {
        lists[0].push_back(e.gate.data);
        lists[1].push_back(e.up.data);
        lists[2].push_back(e.down.data);
      }
    }
    view.quant_tables.push_back(quant);
    for (auto [list, table] : {std::pair{&lists[0], &view.gate_table},
                               std::pair{&lists[1], &view.up_table},
                               std::pair{&lists[2], &view.down_table}}) {
      auto d = UploadPointers(*list, view.buffers);
      if (!d.ok()) return d.status();
      table->push_back(reinterpret_cast<const uint16_t**>(*d));
    }
  }
  return absl::OkStatus();
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
    if (auto s = CorruptQuantScale(host_copy, host, fault.value, fault.target, &corrupted); !s.ok())
      return s;
    for (size_t l = 0; l < host_copy.layers.size(); ++l) {
      const std::vector<MatrixRef*> host_linears = LayerLinears(host_copy.layers[l]);
      const std::vector<MatrixRef*> view_linears = LayerLinears(view->weights.layers[l]);
      for (size_t i = 0; i < host_linears.size(); ++i) {
        if (host_linears[i]->quant.scale != corrupted.data()) continue;
        auto scale = DeviceAlloc<uint8_t>(corrupted.size());
        if (!scale.ok()) return scale.status();
        view->buffers.push_back(*scale);
        CUDA_OR_DIE(cudaMemcpy(*scale, corrupted.data(), corrupted.size(), cudaMemcpyHostToDevice));
        view_linears[i]->quant.scale = *scale;
      }
    }
  }
  if (UsesScaledGemm(qgemm)) {  // codes as uploaded, scales rearranged
    auto scaled = cuda::ScaledGemm::Create(qgemm == QGemm::kFp8CublasLt ? cuda::ScaledGemmKind::kFp8
                                                                   : cuda::ScaledGemmKind::kFp4);
    if (!scaled.ok()) return scaled.status();
    view->scaled = std::move(*scaled);
    for (LayerWeights& layer : view->weights.layers)
      for (MatrixRef* m : LayerLinears(layer))
        if (m->quantized())
          if (auto s = view->scaled->Prepare(*m); !s.ok()) return s;
    CUDA_OR_DIE(cudaDeviceSynchronize());
    return view;
  }
  // The reference dequantizes as it reads (GemmReference), so it keeps the codes too.
  const bool keep_codes = KeepsQuantCodes(qgemm);
  if (keep_codes) {
    if (RoutesOnDevice(options.moe) && host.config.is_moe())
      if (auto s = BuildExpertTables(host.config, *view); !s.ok()) return s;
    return view;
  }
  for (LayerWeights& layer : view->weights.layers)
    for (MatrixRef* m : LayerLinears(layer)) {
      if (!m->quantized()) continue;
      const size_t count = static_cast<size_t>(m->rows * m->cols);
      auto buffer = DeviceAlloc<uint16_t>(count);
      if (!buffer.ok()) return buffer.status();
      view->buffers.push_back(*buffer);
      cuda::DequantizeToBf16(*m, *buffer, nullptr);
      CHECK_LAUNCH();
      *m = MatrixRef{*buffer, DType::kBF16, m->rows, m->cols};
    }
  CUDA_OR_DIE(cudaDeviceSynchronize());
  if (RoutesOnDevice(options.moe) && host.config.is_moe())
    if (auto s = BuildExpertTables(host.config, *view); !s.ok()) return s;
  return view;
}

// TEST ONLY (profiling, INFERSWEEP_PERSISTENT_TIMELINE=<file>): one persistent decode step's
// stamps (cuda::PersistentDecodeArgs::timeline) as a table of where a layer's time goes, per
// phase, averaged over the layers that have it: the phase's time (departure from its barrier
// minus departure from the previous one, mean over blocks), the blocks' mean and slowest work
// before arriving at the barrier, and what the barrier added after the slowest block arrived.
void WritePersistentTimeline(const std::string& path, const std::vector<unsigned long long>& t,
                             int blocks, int layers, int ring_bytes) {
  const int events = cuda::PersistentTimelineEvents(layers);
  constexpr int kPhases = cuda::kPersistentPhases;
  static const char* kNames[kPhases] = {"q/k/v", "attention", "o", "router", "gate/up", "down"};
  double time[kPhases] = {}, work_mean[kPhases] = {}, work_max[kPhases] = {}, count[kPhases] = {};
  auto at = [&](int b, int e) { return static_cast<double>(t[static_cast<size_t>(b) * events + e]); };
  int previous = 0;  // event of the previous departure (the kernel's start first)
  for (int l = 0; l < layers; ++l)
    for (int p = 0; p < kPhases; ++p) {
      const int arrive = 1 + (l * kPhases + p) * 2;
      if (at(0, arrive) == 0) continue;  // the router (no phase of its own)
      const bool last = l == layers - 1 && p == kPhases - 1;
      double sum_time = 0, sum_work = 0, max_work = 0;
      for (int b = 0; b < blocks; ++b) {
        const double work = at(b, arrive) - at(b, previous);
        sum_work += work;
        max_work = std::max(max_work, work);
        sum_time += (last ? at(b, arrive) : at(b, arrive + 1)) - at(b, previous);
      }
      time[p] += sum_time / blocks;
      work_mean[p] += sum_work / blocks;
      work_max[p] += max_work;
      count[p] += 1;
      previous = arrive + 1;
    }
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return;
  std::fprintf(f,
               "# persistent decode step, %d layers, %d blocks, %d-byte warp rings: us a layer, "
               "mean over layers\n",
               layers, blocks, ring_bytes);
  std::fprintf(f, "%-10s %8s %10s %10s %10s\n", "phase", "time", "work_mean", "work_max", "barrier");
  double total = 0;
  for (int p = 0; p < kPhases; ++p) {
    if (count[p] == 0) continue;
    const double n = count[p] * 1e3;  // ns -> us
    total += time[p] / n * count[p] / layers;
    std::fprintf(f, "%-10s %8.2f %10.2f %10.2f %10.2f\n", kNames[p], time[p] / n,
                 work_mean[p] / n, work_max[p] / n, (time[p] - work_max[p]) / n);
  }
  std::fprintf(f, "%-10s %8.2f\n", "layer", total);
  // Inside attention, from the block's departure from the q/k/v barrier: mean over the splits
  // (and the combining splits) and layers.
  double step[4] = {}, steps[4] = {};
  for (int l = 0; l < layers; ++l)
    for (int b = 0; b < blocks; ++b) {
      const int s0 = cuda::PersistentAttentionStamp(layers, l);
      // Departure from the barrier ending the q/k/v phase (phase 0 of the layer).
      double previous_stamp = at(b, 2 + l * kPhases * 2);
      for (int k = 0; k < cuda::kPersistentAttentionStamps; ++k) {
        if (at(b, s0 + k) == 0) break;  // no split in this block, or not the combining one
        step[k] += at(b, s0 + k) - previous_stamp;
        steps[k] += 1;
        previous_stamp = at(b, s0 + k);
      }
    }
  // Inside q/k/v, o and the MLP (PersistentStep), from the block's departure from the previous
  // barrier to its arrival at the phase's own: mean over blocks and layers.
  struct StepRow {
    const char* name;
    std::vector<std::pair<const char*, int>> steps;  // (name, PersistentStep; -1 the barrier)
    double sum[4] = {};
    double n[4] = {};
  };
  StepRow rows[] = {
      {"q/k/v", {{"staged", cuda::kQkvStaged}, {"rows", cuda::kQkvRows}, {"to barrier", -1}}},
      {"o", {{"staged", cuda::kOStaged}, {"rows", cuda::kORows}, {"to barrier", -1}}},
      {"MLP",
       {{"routed", cuda::kMlpRouted},
        {"first pair", cuda::kMlpFirstPair},
        {"pairs", cuda::kMlpPairs},
        {"to barrier", -1}}},
  };
  // The phases' indices (kNames): the MLP ends at gate/up's barrier in the quantized builds,
  // at down's in the bf16 one (gate/up's slots stay 0 there).
  constexpr int kQkv = 0, kAttention = 1, kO = 2, kGateUp = 4, kDown = 5;
  auto departure = [&](int l, int p) { return 2 + (l * kPhases + p) * 2; };
  // The MLP's steps per block too: whether a slow block starts late or streams slowly.
  std::vector<std::array<double, 4>> mlp_sum(blocks), mlp_n(blocks);
  for (int l = 0; l < layers; ++l)
    for (int b = 0; b < blocks; ++b)
      for (int r = 0; r < 3; ++r) {
        const int from = r == 0   ? (l == 0 ? 0 : departure(l - 1, kDown))
                         : r == 1 ? departure(l, kAttention)
                                  : departure(l, kO);
        const int phase_end = r == 0   ? kQkv
                              : r == 1 ? kO
                                       : (at(b, departure(l, kGateUp) - 1) ? kGateUp : kDown);
        double previous_stamp = at(b, from);
        for (size_t k = 0; k < rows[r].steps.size(); ++k) {
          const int step = rows[r].steps[k].second;
          const double now = step < 0 ? at(b, departure(l, phase_end) - 1)
                                      : at(b, cuda::PersistentStepStamp(layers, l) + step);
          if (now == 0 || previous_stamp == 0) break;
          rows[r].sum[k] += now - previous_stamp;
          rows[r].n[k] += 1;
          if (r == 2) mlp_sum[b][k] += now - previous_stamp, mlp_n[b][k] += 1;
          previous_stamp = now;
        }
      }
  // Per block (and the SM it ran on), the mean work of each phase that has a barrier: which
  // blocks hold the barriers up (on the H200 the slowest block differs from layer to layer).
  std::vector<std::string> per_block;
  for (int b = 0; b < blocks; ++b) {
    double work[kPhases] = {}, n[kPhases] = {};
    int from = 0;
    for (int l = 0; l < layers; ++l)
      for (int p = 0; p < kPhases; ++p) {
        const int arrive = 1 + (l * kPhases + p) * 2;
        if (at(b, arrive) == 0) continue;
        work[p] += at(b, arrive) - at(b, from);
        n[p] += 1;
        from = arrive + 1;
      }
    std::string line =
        absl::StrFormat("# block %3d sm %3llu:", b, t[static_cast<size_t>(b + 1) * events - 1]);
    for (int p = 0; p < kPhases; ++p)
      if (n[p]) absl::StrAppendFormat(&line, " %s %.2f", kNames[p], work[p] / n[p] / 1e3);
    absl::StrAppend(&line, " | MLP steps");
    for (int k = 0; k < 4; ++k)
      absl::StrAppendFormat(&line, " %.2f", mlp_n[b][k] ? mlp_sum[b][k] / mlp_n[b][k] / 1e3 : 0.0);
    per_block.push_back(line);
  }
  static const char* kSteps[] = {"loads+norm", "keys", "publish", "combine"};
  std::fprintf(f, "# attention steps (us, mean over splits):");
  for (int k = 0; k < cuda::kPersistentAttentionStamps; ++k)
    std::fprintf(f, " %s %.2f", kSteps[k], steps[k] ? step[k] / steps[k] / 1e3 : 0.0);
  std::fprintf(f, "\n");
  for (const StepRow& row : rows) {
    std::fprintf(f, "# %s steps (us, mean over blocks):", row.name);
    for (size_t k = 0; k < row.steps.size(); ++k)
      std::fprintf(f, " %s %.2f", row.steps[k].first, row.n[k] ? row.sum[k] / row.n[k] / 1e3 : 0.0);
    std::fprintf(f, "\n");
  }
  // The blocks whose first expert pair comes last, with their SMs (on the H200 the same ones in
  // every layer of a launch, and on one machine the same SMs from launch to launch: whole TPCs,
  // e.g. SMs 12-13, 28-29, ..., 120-121): their share of the MLP's slowest block.
  std::vector<std::pair<double, int>> first_pair;
  for (int b = 0; b < blocks; ++b)
    if (mlp_n[b][1]) first_pair.push_back({mlp_sum[b][1] / mlp_n[b][1] / 1e3, b});
  if (!first_pair.empty()) {
    std::sort(first_pair.begin(), first_pair.end());
    const size_t late = std::max<size_t>(1, first_pair.size() / 8);
    double late_mean = 0;
    std::string late_blocks;
    for (size_t i = first_pair.size() - late; i < first_pair.size(); ++i) {
      late_mean += first_pair[i].first / late;
      const int b = first_pair[i].second;
      absl::StrAppendFormat(&late_blocks, "%s%d/sm%llu", late_blocks.empty() ? "" : " ", b,
                            t[static_cast<size_t>(b + 1) * events - 1]);
    }
    std::fprintf(f,
                 "# MLP first pair (us, per block): median %.2f; the latest eighth %.2f "
                 "(block/SM %s)\n",
                 first_pair[first_pair.size() / 2].first, late_mean, late_blocks.c_str());
  }
  for (const std::string& line : per_block) std::fprintf(f, "%s\n", line.c_str());
  std::fclose(f);
}

class CudaModel final : public Model {
 public:
  CudaModel(const ModelConfig& config, std::shared_ptr<DeviceWeights> weights,
            const CudaOptions& options, const FaultInjection& fault, std::unique_ptr<cuda::CublasLtGemm> gemm,
            std::unique_ptr<cuda::CublasGroupedGemm> grouped, std::unique_ptr<QuantView> view)
      : config_(config), dw_(std::move(weights)), view_(std::move(view)),
        w_(view_ ? view_->weights : dw_->weights), options_(options), fault_(fault),
        gemm_(std::move(gemm)), grouped_(std::move(grouped)) {
    CUDA_OR_DIE(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_OR_DIE(cudaEventCreate(&step_start_));
    CUDA_OR_DIE(cudaEventCreate(&step_end_));
  }

  ~CudaModel() override {
    for (auto& [batch, exec] : graphs_) cudaGraphExecDestroy(exec);
    FreeScratch();
    if (k_cache_) cudaFree(k_cache_);
    if (v_cache_) cudaFree(v_cache_);
    if (rope_) cudaFree(rope_);
    for (void* p : {static_cast<void*>(prefill_dense_), static_cast<void*>(prefill_experts_),
                    static_cast<void*>(prefill_expert_tables_)})
      if (p) cudaFree(p);
    for (MatrixRef* p : prefill_expert_refs_)
      if (p) cudaFree(p);
    for (float* p : router_f32_)
      if (p) cudaFree(p);
    if (persistent_buffer_) cudaFree(persistent_buffer_);
    for (void* p : persistent_copies_) cudaFree(p);
    cudaEventDestroy(step_start_);
    cudaEventDestroy(step_end_);
    cudaStreamDestroy(stream_);
  }

  const ModelConfig& config() const override { return config_; }
  std::string device() const override { return "cuda:0"; }
  int position() const override { return position_; }
  double graph_capture_seconds() const override { return capture_seconds_; }
  std::optional<double> last_forward_device_ms() const override { return last_step_ms_; }
  int kv_cache_bytes_per_element() const override { return options_.kv_cache == KvCache::kBf16 ? 2 : 4; }
  std::optional<int64_t> device_memory_used_bytes() const override {
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) return std::nullopt;
    return static_cast<int64_t>(total - free);
  }

  absl::Status StartBatch(int batch, int max_tokens) override {
    if (batch <= 0 || max_tokens <= 0)
      return absl::InvalidArgumentError("StartBatch: batch and max_tokens must be positive");
    if (batch != batch_ || max_tokens != capacity_) {
      for (auto& [b, exec] : graphs_) cudaGraphExecDestroy(exec);
      graphs_.clear();
      graph_launches_.clear();
      if (k_cache_) cudaFree(k_cache_);
      if (v_cache_) cudaFree(v_cache_);
      k_cache_ = v_cache_ = nullptr;
      if (rope_) cudaFree(rope_);
      rope_ = nullptr;
      auto rope = DeviceAlloc<float2>(static_cast<size_t>(max_tokens) * (config_.head_dim / 2));
      if (!rope.ok()) return rope.status();
      rope_ = *rope;
      cuda::BuildRopeTable(max_tokens, config_.head_dim, config_.rope_theta, rope_, stream_);
      CHECK_LAUNCH();
      const size_t elems = static_cast<size_t>(config_.num_layers) * batch * max_tokens * config_.kv_dim();
      auto k = DeviceAlloc<char>(elems * kv_cache_bytes_per_element());
      if (!k.ok()) return k.status();
      k_cache_ = *k;
      auto v = DeviceAlloc<char>(elems * kv_cache_bytes_per_element());
      if (!v.ok()) return v.status();
      v_cache_ = *v;
    }
    if (auto s = MakeRouterCopies(); !s.ok()) return s;
    batch_ = batch;
    capacity_ = max_tokens;
    position_ = 0;
    return absl::OkStatus();
  }

  // fp32 copies of the MoE routers for cuBLASLt's fp32 GEMM (Router), made once, outside any
  // graph capture: 1 MB a layer on qwen3-30b-a3b.
  absl::Status MakeRouterCopies() {
    if (!gemm_ || !config_.is_moe() || !router_f32_.empty()) return absl::OkStatus();
    std::vector<float*> copies(config_.num_layers, nullptr);
    for (int l = 0; l < config_.num_layers; ++l) {
      const MatrixRef& wr = w_.layers[l].router;
      if (wr.empty() || wr.quantized()) continue;  // the reference GEMM dequantizes those
      auto copy = DeviceAlloc<float>(static_cast<size_t>(wr.rows * wr.cols));
      if (!copy.ok()) {
        for (float* p : copies)
          if (p) cudaFree(p);
        return copy.status();
      }
      copies[l] = *copy;
      cuda::UpcastToF32(wr, copies[l], stream_);
      CHECK_LAUNCH();
    }
    router_f32_ = std::move(copies);
    return absl::OkStatus();
  }

  // graphs=persistent: builds the kernel's per-layer tables on the device, for a model that
  // CudaModelRefusal let through (layer kinds and shapes). Unimplemented (UNSUPPORTED to the
  // harness) with the reason for what only the weights tell: linears not all bf16 or not all in
  // the streamed format, misaligned rows, no GPU memory for the tiled copies. A quantized model
  // streams its view: dequant_bf16's bf16 copies, or (w8a16, w4a16) the codes, fp8_tensor /
  // fp8_channel / nvfp4, with their scales.
  absl::Status PreparePersistentDecode() {
    const ModelConfig& c = config_;
    auto unsupported = [](const std::string& why) {
      return absl::UnimplementedError(absl::StrCat("graphs=persistent: ", why));
    };
    // The registry leaves qgemm=dequant_bf16 (bf16 copies), w8a16 and w4a16 (the codes).
    QuantFormat format = QuantFormat::kNone;
    DType scale_dtype = DType::kF32;
    if (view_ && options_.qgemm != QGemm::kDequantBf16 && !w_.layers.empty()) {
      format = w_.layers[0].q.quant.format;
      scale_dtype = w_.layers[0].q.quant.scale_dtype;
    }
    const cuda::PersistentDecodeShape shape = PersistentDecodeShapeFor(c, format);
    const DType norm_dtype = w_.layers.empty() ? DType::kBF16 : w_.layers[0].input_norm.dtype;
    std::vector<cuda::PersistentLayer> layers(c.num_layers);
    std::vector<cuda::PersistentQuant> quant(c.num_layers);
    // Per layer and projection (gate, up, down), one entry per expert (or the dense MLP): the
    // codes, then (quantized) the factor sources, then (nvfp4) the group scales. Uploaded below;
    // the layers point into them.
    std::vector<std::array<std::array<std::vector<const void*>, 3>, 3>> tables(c.num_layers);
    // nvfp4 group scales whose rows are not a multiple of 16 bytes are copied into padded rows
    // (the kernel's bulk copies take 16-byte pieces); the rest are read in place.
    auto groups_of = [&](const MatrixRef& m) -> absl::StatusOr<const void*> {
      const int64_t row_bytes = m.cols / 16, padded = (row_bytes + 15) / 16 * 16;
      if (row_bytes == padded) return m.quant.scale;
      auto copy = DeviceAlloc<uint8_t>(static_cast<size_t>(m.rows * padded));
      if (!copy.ok()) return copy.status();
      persistent_copies_.push_back(*copy);
      CUDA_OR_DIE(cudaMemset(*copy, 0, m.rows * padded));
      CUDA_OR_DIE(cudaMemcpy2D(*copy, padded, m.quant.scale, row_bytes, row_bytes, m.rows,
                               cudaMemcpyDeviceToDevice));
      return *copy;
    };
    // The kernel streams the router's column i with o's row i (PersistentLayer::router).
    auto transposed = [&](const MatrixRef& m) -> absl::StatusOr<const uint16_t*> {
      std::vector<uint16_t> rows(static_cast<size_t>(m.numel())), columns(rows.size());
      CUDA_OR_DIE(cudaMemcpy(rows.data(), m.data, rows.size() * 2, cudaMemcpyDeviceToHost));
      for (int64_t e = 0; e < m.rows; ++e)
        for (int64_t i = 0; i < m.cols; ++i) columns[i * m.rows + e] = rows[e * m.cols + i];
      auto copy = DeviceAlloc<uint16_t>(columns.size());
      if (!copy.ok()) return copy.status();
      persistent_copies_.push_back(*copy);
      CUDA_OR_DIE(cudaMemcpy(*copy, columns.data(), columns.size() * 2, cudaMemcpyHostToDevice));
      return *copy;
    };
    // The bf16 build's down projections, tiled for the gate/up phase that folds them in
    // (cuda::PersistentDownTiles): one copy a layer, every expert's (or the dense MLP's) in turn.
    auto down_tiles = [&](const std::vector<std::array<const MatrixRef*, 3>>& mlps)
        -> absl::StatusOr<std::vector<const void*>> {
      const MatrixRef& first = *mlps[0][2];
      auto copy = DeviceAlloc<uint16_t>(static_cast<size_t>(first.numel()) * mlps.size());
      if (!copy.ok()) return copy.status();
      persistent_copies_.push_back(*copy);
      std::vector<const void*> tiles;
      for (const auto& mlp : mlps) {
        const MatrixRef& down = *mlp[2];
        if (down.rows != first.rows || down.cols != first.cols)
          return absl::InternalError("experts of one layer with different down shapes");
        uint16_t* dst = *copy + first.numel() * static_cast<int64_t>(tiles.size());
        cuda::PersistentDownTiles(static_cast<const uint16_t*>(down.data), dst,
                                  static_cast<int>(down.rows), static_cast<int>(down.cols),
                                  stream_);
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
        if (format == QuantFormat::kNone &&
            (m->dtype != DType::kBF16 || m->quantized() || !aligned))
          return unsupported(where + "every linear must be bf16 with 16-byte aligned rows");
        if (format != QuantFormat::kNone &&
            (m->quant.format != format || m->quant.scale_dtype != scale_dtype || !aligned))
          return unsupported(absl::StrCat(
              where, "every linear but the router must be ", QuantFormatName(format),
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
          if (format != QuantFormat::kNvfp4) continue;
          auto groups = groups_of(*attention[i]);
          if (!groups.ok()) return groups.status();
          quant[l].groups[i] = *groups;
        }
      }
      std::vector<std::array<const MatrixRef*, 3>> mlps;  // each expert's, or the dense MLP
      if (moe)
        for (const ExpertWeights& e : lw.experts) mlps.push_back({&e.gate, &e.up, &e.down});
      else
        mlps.push_back({&lw.mlp.gate, &lw.mlp.up, &lw.mlp.down});
      std::vector<const void*> tiled;
      if (format == QuantFormat::kNone) {
        auto tiles = down_tiles(mlps);
        if (!tiles.ok()) return tiles.status();
        tiled = *std::move(tiles);
      }
      for (size_t e = 0; e < mlps.size(); ++e)
        for (int proj = 0; proj < 3; ++proj) {
          const auto& mlp = mlps[e];
          tables[l][proj][0].push_back(proj == 2 && !tiled.empty() ? tiled[e] : mlp[proj]->data);
          if (format == QuantFormat::kNone) continue;
          tables[l][proj][1].push_back(factor_of(*mlp[proj]));
          if (format != QuantFormat::kNvfp4) continue;
          auto groups = groups_of(*mlp[proj]);
          if (!groups.ok()) return groups.status();
          tables[l][proj][2].push_back(*groups);
        }
      p.input_norm = lw.input_norm.data;
      p.post_norm = lw.post_attention_norm.data;
      if (c.qk_norm) {
        p.q_norm = lw.q_norm.data;
        p.k_norm = lw.k_norm.data;
      }
      if (moe) {
        auto router = transposed(lw.router);
        if (!router.ok()) return router.status();
        p.router = *router;
        p.inter = c.moe_intermediate_size;
        p.top_k = c.num_experts_per_tok;
      } else {
        p.inter = static_cast<int>(lw.mlp.gate.rows);
        p.top_k = 1;
      }
      const FaultInjection& fault = fault_;
      if (fault.kind == FaultInjection::Kind::kBadScale && l == 0)
        p.o_scale = static_cast<float>(fault.value);
      if (fault.kind == FaultInjection::Kind::kZeroExpert) p.skip_expert = static_cast<int>(fault.value);
      p.nan_after = fault.kind == FaultInjection::Kind::kNanLayer && l == static_cast<int>(fault.value);
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
    // The bf16 build's spread-out down sums; none in the quantized builds, whose buffer layout
    // stays as it was (with it there, ahead of the partials and counters, nvfp4 measured 2.655
    // against 2.625 ms once, its kernel's PTX the same but for the argument struct's size; the
    // next session's alternating runs found no difference: 2.659 / 2.666 against 2.660 / 2.666).
    const size_t x_adds_bytes =
        format == QuantFormat::kNone
            ? cuda::PersistentAddFloats(c.hidden_size) * sizeof(float)
            : 0;
    const char* timeline_path = std::getenv("INFERSWEEP_PERSISTENT_TIMELINE");  // TEST ONLY
    const size_t timeline_bytes =
        timeline_path ? static_cast<size_t>(cuda::PersistentDecodeBlocks()) *
                            cuda::PersistentTimelineEvents(c.num_layers) * 8
                      : 0;
    const size_t partial_bytes = cuda::PersistentDecodePartialFloats(shape) * sizeof(float);
    const size_t counter_bytes = cuda::PersistentDecodeCounters(shape) * sizeof(unsigned);
    const size_t total = layers_bytes + quant_bytes + tables_bytes + h_bytes + x_mlp_bytes +
                         x_adds_bytes + partial_bytes + counter_bytes + 6 * 256 + timeline_bytes;
    auto buffer = DeviceAlloc<char>(total);
    if (!buffer.ok()) return buffer.status();
    persistent_buffer_ = *buffer;
    char* base = *buffer;
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
      CUDA_OR_DIE(
          cudaMemcpy(base + layers_bytes, quant.data(), quant_bytes, cudaMemcpyHostToDevice));
    if (tables_bytes)
      CUDA_OR_DIE(cudaMemcpy(device_tables, pointers.data(), tables_bytes, cudaMemcpyHostToDevice));
    persistent_.shape = shape;
    persistent_.quant =
        quant_bytes ? reinterpret_cast<const cuda::PersistentQuant*>(base + layers_bytes) : nullptr;
    persistent_.scale_dtype = scale_dtype;
    persistent_.layers = reinterpret_cast<const cuda::PersistentLayer*>(base);
    persistent_.renormalize = c.norm_topk_prob;
    persistent_.eps = c.rms_norm_eps;
    persistent_.norm_dtype = norm_dtype;
    // After the tables, each 256-byte aligned: h, x_mlp, x_adds, the attention partials, the
    // counters, the timeline.
    size_t offset = layers_bytes + quant_bytes + tables_bytes;
    auto take = [&](size_t bytes) {
      offset = (offset + 255) / 256 * 256;
      char* p = base + offset;
      offset += bytes;
      return p;
    };
    persistent_.h = reinterpret_cast<float*>(take(h_bytes));
    persistent_.x_mlp = reinterpret_cast<float*>(take(x_mlp_bytes));
    if (x_adds_bytes) {
      persistent_.x_adds = reinterpret_cast<float*>(take(x_adds_bytes));
      CUDA_OR_DIE(cudaMemset(persistent_.x_adds, 0, x_adds_bytes));  // (each layer's o zeroes them)
    }
    persistent_.partials = reinterpret_cast<float*>(take(partial_bytes));
    persistent_.barrier = reinterpret_cast<unsigned*>(take(counter_bytes));
    if (timeline_path) {
      persistent_timeline_path_ = timeline_path;
      persistent_.timeline = reinterpret_cast<unsigned long long*>(take(timeline_bytes));
      CUDA_OR_DIE(cudaMemset(persistent_.timeline, 0, timeline_bytes));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(std::span<const int32_t> tokens, int n, LogitsMode mode,
                       std::vector<float>* logits) override {
    return Step(tokens, n, mode, logits, nullptr);
  }
  // The greedy pick runs on the device after the lm_head (cuda::GreedyTokens), and the host reads
  // one token a sequence instead of the logits.
  absl::Status ForwardGreedy(std::span<const int32_t> tokens, int n,
                             std::vector<int32_t>* next) override {
    return Step(tokens, n, LogitsMode::kLast, nullptr, next);
  }

 private:
  // One step: the logits to *logits, or (next non-null) each sequence's greedy token to *next.
  absl::Status Step(std::span<const int32_t> tokens, int n, LogitsMode mode,
                    std::vector<float>* logits, std::vector<int32_t>* next) {
    if (auto s = ValidateForwardArgs(config_, batch_, capacity_, position_, tokens, n); !s.ok())
      return s;
    const bool greedy = next != nullptr;
    if (greedy && batch_ > 65535)  // cuda::GreedyTokens runs a grid row a sequence
      return absl::InvalidArgumentError(
          absl::StrCat("ForwardGreedy: batch ", batch_, " exceeds 65535 sequences"));
    MaybeCommitProcessFault(fault_);
    const int rows = batch_ * n;
    const int out_rows = mode == LogitsMode::kAll ? rows : batch_;
    if (auto s = EnsureScratch(rows, out_rows); !s.ok()) return s;
    // Inputs go through pinned staging buffers so a captured graph can replay the copies.
    std::copy(tokens.begin(), tokens.end(), h_tokens_);
    *h_position_ = position_;
    for (int b = 0; b < batch_; ++b) h_last_rows_[b] = b * n + n - 1;

    const bool use_graph = CapturesDecode(options_.graphs) && n == 1 && mode == LogitsMode::kLast;
    const int graph_key = 2 * batch_ + (greedy ? 1 : 0);
    // The fast GEMV configs chain their kernels with programmatic dependent launch.
    cuda::SetProgrammaticLaunch(UsesFusedGemv(options_.gemm));
    struct ResetLaunchMode {
      ~ResetLaunchMode() { cuda::SetProgrammaticLaunch(false); }
    } reset_launch_mode;
    if (use_graph) {
      auto it = graphs_.find(graph_key);
      if (it == graphs_.end()) {
        const auto start = std::chrono::steady_clock::now();
        cudaGraph_t graph;
        // The launch log of the capture (core/launch_log.h), recorded whether or not anything
        // records now: every replay runs exactly these kernels and records them as it runs.
        LaunchRecorder& captured = graph_launches_[graph_key];
        captured.Clear();
        ScopedLaunchRecording record_capture(&captured);
        CUDA_OR_DIE(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
        if (auto s = EnqueueStep(rows, n, mode, greedy); !s.ok()) {
          cudaStreamEndCapture(stream_, &graph);
          return s;
        }
        CUDA_OR_DIE(cudaStreamEndCapture(stream_, &graph));
        cudaGraphExec_t exec;
        CUDA_OR_DIE(cudaGraphInstantiate(&exec, graph, 0));
        cudaGraphDestroy(graph);
        it = graphs_.emplace(graph_key, exec).first;
        capture_seconds_ +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      CUDA_OR_DIE(cudaEventRecord(step_start_, stream_));
      CUDA_OR_DIE(cudaGraphLaunch(it->second, stream_));
      RecordGraphReplay(graph_launches_[graph_key]);
    } else {
      CUDA_OR_DIE(cudaEventRecord(step_start_, stream_));
      if (auto s = EnqueueStep(rows, n, mode, greedy); !s.ok()) return s;
    }
    CUDA_OR_DIE(cudaEventRecord(step_end_, stream_));
    CUDA_OR_DIE(cudaStreamSynchronize(stream_));
    float step_ms = 0;
    CUDA_OR_DIE(cudaEventElapsedTime(&step_ms, step_start_, step_end_));
    last_step_ms_ = step_ms;
    if (persistent_.timeline && n == 1 && batch_ == 1) {  // TEST ONLY
      const int blocks = cuda::PersistentDecodeBlocks();
      std::vector<unsigned long long> stamps(static_cast<size_t>(blocks) *
                                             cuda::PersistentTimelineEvents(config_.num_layers));
      CUDA_OR_DIE(cudaMemcpy(stamps.data(), persistent_.timeline, stamps.size() * 8,
                             cudaMemcpyDeviceToHost));
      WritePersistentTimeline(persistent_timeline_path_, stamps, blocks, config_.num_layers,
                              cuda::PersistentDecodeRingBytes(persistent_.shape));
      // Zeroed for the next step: a stamp left unwritten (a block that is not the combining split
      // this time) must not keep an older step's time.
      CUDA_OR_DIE(cudaMemset(persistent_.timeline, 0, stamps.size() * 8));
    }
    if (greedy)
      next->assign(h_next_, h_next_ + out_rows);
    else
      logits->assign(h_logits_, h_logits_ + static_cast<size_t>(out_rows) * config_.vocab_size);
    position_ += n;
    return absl::OkStatus();
  }

  // y = x . W^T (+ bias) through the configured GEMM. `x_bf16` is x already rounded to bf16
  // (cuBLASLt path), so one conversion serves several GEMMs on the same input.
  absl::Status Gemm(const float* x, const uint16_t* x_bf16, int rows, const MatrixRef& w,
                    const MatrixRef& bias, float* y) {
    if (w.quantized() && view_ && view_->scaled) {  // qgemm=fp8_cublaslt | native_fp4
      if (auto s = view_->scaled->Run(x, rows, w, y, stream_); !s.ok()) return s;
      if (!bias.empty()) cuda::AddBias(y, rows, bias, stream_);
    } else if (w.quantized() && options_.qgemm == QGemm::kReference) {  // exact dequantization
      cuda::GemmReference(x, rows, w, bias, y, stream_);
    } else if (w.quantized() && prefill_ && gemm_ && x_bf16) {
      // qgemm=w4a16|w8a16 on a prefill chunk: tensor cores on a bf16 copy (PrefillBf16Copy).
      if (LaunchRecording())
        RecordFallback(absl::StrCat("qgemm=", AxisValueName(options_.qgemm), ": prefill chunk of ", rows,
                                    " rows: quantized linears dequantized to bf16, then cuBLASLt"));
      auto copy = PrefillBf16Copy(w);
      if (!copy.ok()) return copy.status();
      if (auto s = gemm_->Run(x_bf16, rows, *copy, y, stream_); !s.ok()) return s;
      if (!bias.empty()) cuda::AddBias(y, rows, bias, stream_);
    } else if (w.quantized()) {  // qgemm=w4a16|w8a16 (dequant_bf16 replaced the codes at build)
      const bool fp4 =
          w.quant.format == QuantFormat::kNvfp4 || w.quant.format == QuantFormat::kMxfp4;
      if (fp4 ? !cuda::W4A16Supports(w) : !cuda::QuantGemvSupports(w))
        return absl::UnimplementedError(absl::StrCat(
            "qgemm=", AxisValueName(options_.qgemm), " needs K % 32 == 0 (FP4) or % 16 == 0 (FP8) (", w.rows,
            " x ", w.cols, ")"));
      if (fp4)
        cuda::GemvW4A16(x, rows, w, y, stream_);
      else
        cuda::GemvW8A16(x, rows, w, y, stream_);
      if (!bias.empty()) cuda::AddBias(y, rows, bias, stream_);
    } else if (gemm_ && w.dtype == DType::kBF16) {
      if (auto s = gemm_->Run(x_bf16, rows, w, y, stream_); !s.ok()) return s;
      if (!bias.empty()) cuda::AddBias(y, rows, bias, stream_);
    } else {
      if (gemm_ && !w.quantized() && LaunchRecording())
        RecordFallback(absl::StrCat("gemm=", GemmValue(), ": ", std::string(DTypeName(w.dtype)),
                                    " weight [", w.rows, ", ", w.cols,
                                    "]: the reference GEMM (cuBLASLt takes bf16 weights)"));
      cuda::GemmReference(x, rows, w, bias, y, stream_);
    }
    CHECK_LAUNCH();
    return absl::OkStatus();
  }
  // q, k and v stored back to back (UploadWeights), dense bf16 without biases, under cuBLASLt:
  // one GEMM for the three (at batch 64 three GEMMs measured 8.2 + 6.6 + 6.4 us).
  bool QkvContiguous(const LayerWeights& lw) const {
    const MatrixRef* parts[3] = {&lw.q, &lw.k, &lw.v};
    for (const MatrixRef* m : parts)
      if (m->dtype != DType::kBF16 || m->quantized() || m->cols != lw.q.cols) return false;
    const auto* q = static_cast<const uint16_t*>(lw.q.data);
    return gemm_ && lw.q_bias.empty() && lw.k_bias.empty() && lw.v_bias.empty() &&
           q + lw.q.rows * lw.q.cols == lw.k.data &&
           static_cast<const uint16_t*>(lw.k.data) + lw.k.rows * lw.k.cols == lw.v.data;
  }

  // y += scale * (x . W^T + bias): cuBLASLt adds into y itself (beta = 1) for bf16 W without a
  // bias, one launch fewer than the product into o_ and a separate add.
  absl::Status GemmAccumulate(const float* x, const uint16_t* x_bf16, int rows, const MatrixRef& w,
                              const MatrixRef& bias, float scale, float* y) {
    if (gemm_ && w.dtype == DType::kBF16 && !w.quantized() && bias.empty()) {
      if (auto s = gemm_->Run(x_bf16, rows, w, y, stream_, scale, 1.f); !s.ok()) return s;
      CHECK_LAUNCH();
      return absl::OkStatus();
    }
    if (auto s = Gemm(x, x_bf16, rows, w, bias, o_); !s.ok()) return s;
    cuda::AddScaled(y, o_, scale, static_cast<int64_t>(rows) * w.rows, stream_);
    CHECK_LAUNCH();
    return absl::OkStatus();
  }
  // qgemm=w4a16|w8a16 prefill. The register-dequantizing GEMV and expert kernels are built for
  // decode's few rows: a 512-token prompt through them re-read every weight once per 4 rows, and
  // the experts took the host-synced per-expert loop (TTFT 1.55 s for NVFP4 qwen3-30b-a3b, 0.50 s
  // for FP8). A prefill chunk instead dequantizes each quantized matrix, as it comes, into a bf16
  // scratch (the same exact dequantization as dequant_bf16, then one bf16 rounding) and runs the
  // bf16 tensor-core paths: cuBLASLt for the dense projections, the grouped expert kernels for
  // the MoE. The scratch (one dense matrix, and one layer's experts: 1.2 GB for qwen3-30b-a3b) is
  // allocated at the first quantized prefill. Decode steps keep the quantized kernels.
  absl::StatusOr<MatrixRef> PrefillBf16Copy(const MatrixRef& w) {
    const size_t count = static_cast<size_t>(w.numel());
    if (count > prefill_dense_count_) {
      if (prefill_dense_) cudaFree(prefill_dense_);  // synchronises: nothing still reads it
      prefill_dense_ = nullptr;
      auto buffer = DeviceAlloc<uint16_t>(count);
      if (!buffer.ok()) return buffer.status();
      prefill_dense_ = *buffer;
      prefill_dense_count_ = count;
    }
    cuda::DequantizeToBf16(w, prefill_dense_, stream_);
    CHECK_LAUNCH();
    return MatrixRef{prefill_dense_, DType::kBF16, w.rows, w.cols};
  }
  // Whether every expert matrix of layer l is quantized, gate and up [inter, hidden] and down
  // [hidden, inter]: what PrefillExpertCopies takes. A checkpoint that left some experts dense
  // keeps the per-expert loop.
  bool ExpertsQuantizedAlike(int l) const {
    const int64_t inter = config_.moe_intermediate_size, hidden = config_.hidden_size;
    for (const ExpertWeights& x : w_.layers[l].experts)
      for (const MatrixRef* w : {&x.gate, &x.up, &x.down})
        if (!w->quantized() || w->rows * w->cols != inter * hidden ||
            w->cols != (w == &x.down ? inter : hidden))
          return false;
    return true;
  }
  // Layer l's experts dequantized into the expert scratch; its gate, up and down tables.
  absl::StatusOr<std::array<const uint16_t* const*, 3>> PrefillExpertCopies(int l) {
    const int experts = config_.num_experts;
    const size_t per_matrix = static_cast<size_t>(config_.moe_intermediate_size) * config_.hidden_size;
    if (!prefill_experts_) {
      auto buffer = DeviceAlloc<uint16_t>(3 * experts * per_matrix);
      if (!buffer.ok()) return buffer.status();
      prefill_experts_ = *buffer;
      std::vector<const uint16_t*> list(3 * experts);
      for (size_t i = 0; i < list.size(); ++i) list[i] = prefill_experts_ + i * per_matrix;
      auto tables = DeviceAlloc<const uint16_t*>(list.size());
      if (!tables.ok()) return tables.status();
      prefill_expert_tables_ = *tables;
      CUDA_OR_DIE(cudaMemcpy(prefill_expert_tables_, list.data(), list.size() * sizeof(list[0]),
                             cudaMemcpyHostToDevice));
    }
    // The layer's 3E quantized experts as one device array (made at the layer's first prefill),
    // dequantized in one launch: 384 launches a layer cost more than the bytes.
    if (prefill_expert_refs_.empty()) prefill_expert_refs_.assign(config_.num_layers, nullptr);
    if (!prefill_expert_refs_[l]) {
      const LayerWeights& lw = w_.layers[l];
      std::vector<MatrixRef> refs;
      for (int m = 0; m < 3; ++m)
        for (int e = 0; e < experts; ++e)
          refs.push_back(m == 0 ? lw.experts[e].gate : m == 1 ? lw.experts[e].up : lw.experts[e].down);
      auto d = DeviceAlloc<MatrixRef>(refs.size());
      if (!d.ok()) return d.status();
      CUDA_OR_DIE(cudaMemcpy(*d, refs.data(), refs.size() * sizeof(MatrixRef), cudaMemcpyHostToDevice));
      prefill_expert_refs_[l] = *d;
    }
    const MatrixRef& shape = w_.layers[l].experts[0].gate;
    cuda::DequantizeManyToBf16(prefill_expert_refs_[l], 3 * experts, shape.rows, shape.cols,
                               prefill_experts_, stream_);
    CHECK_LAUNCH();
    return std::array<const uint16_t* const*, 3>{prefill_expert_tables_, prefill_expert_tables_ + experts,
                                                 prefill_expert_tables_ + 2 * experts};
  }
  const uint16_t* PrepareInput(const float* x, int64_t count) {
    if (!gemm_) return nullptr;
    cuda::ToBf16(x, count, bf16_, stream_);
    CHECK_LAUNCH();
    return bf16_;
  }
  // xn_ = RMSNorm(x) * gain, and its bf16 copy for cuBLASLt in the same launch (PrepareInput's
  // result: null without cuBLASLt).
  const uint16_t* NormAndPrepare(const float* x, int rows, int n, const MatrixRef& gain, float eps) {
    cuda::RmsNorm(x, rows, n, gain, eps, xn_, stream_, gemm_ ? bf16_ : nullptr);
    CHECK_LAUNCH();
    return gemm_ ? bf16_ : nullptr;
  }

  // One forward pass: embeddings, every layer, final norm, lm_head, then the logits to pinned
  // memory or (greedy) each sequence's greedy token.
  absl::Status EnqueueStep(int rows, int n, LogitsMode mode, bool greedy) {
    const int hidden = config_.hidden_size, q_dim = config_.q_dim(), kv_dim = config_.kv_dim();
    const float eps = config_.rms_norm_eps;
    // graphs=persistent, batch-1 decode: every layer in one cooperative kernel. Otherwise (and
    // for prefill chunks and larger batches) a chain of kernels per layer.
    const bool persistent = persistent_.layers && rows == 1 && n == 1;
    // The token ids and position, read from pinned host memory by the step's first kernel, which
    // gathers the embedding rows and zeroes the persistent kernel's barrier counters, where two
    // copy nodes, the embedding kernel and a memset node ran. With the greedy pick on the device
    // (no logits copy), H200 qwen3-30b-a3b batch 1, graphs=persistent, same call: 2.555 / 2.553
    // -> 2.531 / 2.530 ms; the kernel chain at batch 64 21.574 -> 20.881 (docs/PERFORMANCE.md).
    cuda::StepInputArgs in{h_tokens_, h_position_, rows, d_tokens_, d_position_, w_.embed, x_};
    if (persistent) {
      in.zero = persistent_.barrier;
      in.zero_count = cuda::PersistentDecodeCounters(persistent_.shape);
    }
    cuda::StepInputs(in, stream_);
    CHECK_LAUNCH();
    const size_t layer_kv = static_cast<size_t>(batch_) * capacity_ * kv_dim;
    // gemm=fused|tma: decode steps take our GEMV path, with the norms and residual adds fused in.
    prefill_ = n > 1;
    const bool gemv = UsesFusedGemv(options_.gemm) &&
                      cuda::GemvSupports(rows, std::max(hidden, q_dim)) &&
                      cuda::GemvSupports(rows, MaxIntermediate());
    if (LaunchRecording()) {  // the launch log's fallbacks (core/launch_log.h)
      if (UsesFusedGemv(options_.gemm) && !gemv && !persistent)
        RecordFallback(absl::StrCat(
            "gemm=", GemmValue(), ": ", n > 1 ? "prefill chunk, " : "decode, ",
            GemvRefusal(rows, std::max({hidden, q_dim, MaxIntermediate()})),
            ": the layers' linears unfused (cuBLASLt for bf16 weights), not the fused GEMV"));
      if (persistent_.layers && n == 1 && rows > 1)
        RecordFallback(absl::StrCat("graphs=persistent: decode of ", rows,
                                    " rows: the graphs=on kernel chain (the persistent kernel "
                                    "takes batch 1)"));
    }
    if (persistent) {
      cuda::PersistentDecodeArgs a = persistent_;
      a.x = x_;
      a.k_cache = reinterpret_cast<uint16_t*>(k_cache_);
      a.v_cache = reinterpret_cast<uint16_t*>(v_cache_);
      a.capacity = capacity_;
      a.rope = rope_;
      a.position = d_position_;
      a.qkv = qkv_;
      a.attn = attn_;
      a.logits = router_;
      cuda::PersistentDecode(a, stream_, /*counters_zeroed=*/true);
      CHECK_LAUNCH();
    }
    for (int l = 0; l < (persistent ? 0 : config_.num_layers); ++l) {
      const LayerWeights& lw = w_.layers[l];
      cuda::QkvRows projected{q_, q_dim, k_, v_, kv_dim};
      if (gemv) {  // input RMSNorm, q, k, v (+ biases): one launch
        FusedGemv a = GemvInput(x_, rows, hidden, lw.input_norm, eps);
        AddSegment(a, lw.q, lw.q_bias, q_);
        AddSegment(a, lw.k, lw.k_bias, k_);
        AddSegment(a, lw.v, lw.v_bias, v_);
        if (auto s = RunGemv(a, /*projection=*/true); !s.ok()) return s;
      } else {
        const uint16_t* xb = NormAndPrepare(x_, rows, hidden, lw.input_norm, eps);
        if (QkvContiguous(lw)) {  // one GEMM into [rows, q | k | v]
          const int width = q_dim + 2 * kv_dim;
          const MatrixRef qkv{lw.q.data, DType::kBF16, width, lw.q.cols};
          if (auto s = gemm_->Run(xb, rows, qkv, qkv_, stream_); !s.ok()) return s;
          projected = {qkv_, width, qkv_ + q_dim, qkv_ + q_dim + kv_dim, width};
        } else {
          if (auto s = Gemm(xn_, xb, rows, lw.q, lw.q_bias, q_); !s.ok()) return s;
          if (auto s = Gemm(xn_, xb, rows, lw.k, lw.k_bias, k_); !s.ok()) return s;
          if (auto s = Gemm(xn_, xb, rows, lw.v, lw.v_bias, v_); !s.ok()) return s;
        }
      }
      const size_t layer_offset = l * layer_kv * kv_cache_bytes_per_element();
      const cuda::KvCache cache{k_cache_ + layer_offset, v_cache_ + layer_offset,
                                options_.kv_cache == KvCache::kBf16, capacity_};
      cuda::QkNormRopeAppend(projected, q_, rows, n, config_.num_q_heads, config_.num_kv_heads,
                             config_.head_dim, config_.qk_norm ? lw.q_norm : MatrixRef{},
                             config_.qk_norm ? lw.k_norm : MatrixRef{}, eps, rope_, d_position_,
                             cache, stream_);
      if (options_.attention == Attention::kFlash) {
        cuda::AttentionFlash(q_, cache, rows, n, config_.num_q_heads, config_.num_kv_heads,
                             config_.head_dim, d_position_,
                             cuda::FlashSplits(rows, config_.num_kv_heads, capacity_), scores_,
                             attn_, stream_);
      } else {
        cuda::AttentionNaive(q_, static_cast<const float*>(cache.k),
                             static_cast<const float*>(cache.v), rows, n, config_.num_q_heads,
                             config_.num_kv_heads, config_.head_dim, d_position_, capacity_,
                             scores_, attn_, stream_);
      }
      CHECK_LAUNCH();
      const bool bad_scale = fault_.kind == FaultInjection::Kind::kBadScale && l == 0;
      const float o_scale = bad_scale ? static_cast<float>(fault_.value) : 1.f;
      if (gemv) {  // o projection added straight into the residual stream
        FusedGemv a = GemvInput(attn_, rows, q_dim, {});
        AddSegment(a, lw.o, lw.o_bias, x_);
        a.accumulate = true;
        a.scale = o_scale;
        if (auto s = RunGemv(a, /*projection=*/true); !s.ok()) return s;
      } else {
        const uint16_t* ab = PrepareInput(attn_, static_cast<int64_t>(rows) * q_dim);
        if (auto s = GemmAccumulate(attn_, ab, rows, lw.o, lw.o_bias, o_scale, x_); !s.ok())
          return s;
      }
      CHECK_LAUNCH();
      // The MLP or MoE block adds its output into x_ (the residual stream).
      if (config_.IsMoeLayer(l)) {
        if (auto s = Moe(l, rows, n, gemv); !s.ok()) return s;
      } else if (auto s = DenseMlp(lw, rows, gemv); !s.ok()) {
        return s;
      }
      if (fault_.kind == FaultInjection::Kind::kNanLayer && l == static_cast<int>(fault_.value))
        cuda::SetNan(x_, stream_);
      CHECK_LAUNCH();
    }
    const int out_rows = mode == LogitsMode::kAll ? rows : batch_;
    const float* final_in = x_;
    if (mode == LogitsMode::kLast && n > 1) {  // (one token a sequence: x's rows are the last)
      CUDA_OR_DIE(cudaMemcpyAsync(d_last_rows_, h_last_rows_, batch_ * sizeof(int), cudaMemcpyHostToDevice, stream_));
      cuda::GatherRows(x_, d_last_rows_, batch_, hidden, o_, stream_);
      final_in = o_;
    }
    // gemm=fused|tma: the final norm and the lm_head in one GEMV launch (a vocabulary-sized
    // matrix is streamed: cuda::GemvStreams), for the decode rows and a prefill's last rows,
    // where a norm kernel and cuBLASLt's GEMM ran. H200, qwen3-30b-a3b batch 1 (ncu): the
    // lm_head's 622 MB in 146.7 us (4.24 TB/s) against cuBLASLt's 148.6, and with the norm and
    // row-gather kernels gone the graphs=persistent step 2.574 / 2.578 -> 2.559 / 2.556 ms (two
    // rounds, one call; docs/PERFORMANCE.md).
    if (UsesFusedGemv(options_.gemm) && cuda::GemvSupports(out_rows, hidden)) {
      FusedGemv g = GemvInput(final_in, out_rows, hidden, w_.final_norm, eps);
      AddSegment(g, w_.lm_head, {}, logits_);
      if (auto s = RunGemv(g); !s.ok()) return s;
    } else {
      if (UsesFusedGemv(options_.gemm) && LaunchRecording())
        RecordFallback(absl::StrCat("gemm=", GemmValue(), ": lm_head, ",
                                    GemvRefusal(out_rows, hidden),
                                    ": final norm and lm_head unfused (cuBLASLt for bf16 "
                                    "weights), not the fused GEMV"));
      const uint16_t* fb = NormAndPrepare(final_in, out_rows, hidden, w_.final_norm, eps);
      if (auto s = Gemm(xn_, fb, out_rows, w_.lm_head, {}, logits_); !s.ok()) return s;
    }
    if (fault_.kind == FaultInjection::Kind::kStuckToken)
      cuda::ForceToken(logits_, out_rows, config_.vocab_size,
                       static_cast<int>(fault_.value) % config_.vocab_size, stream_);
    CHECK_LAUNCH();
    if (greedy) {
      cuda::GreedyTokens(logits_, out_rows, config_.vocab_size, greedy_scratch_, h_next_, stream_);
      CHECK_LAUNCH();
    } else {
      CUDA_OR_DIE(cudaMemcpyAsync(
          h_logits_, logits_, static_cast<size_t>(out_rows) * config_.vocab_size * sizeof(float),
          cudaMemcpyDeviceToHost, stream_));
    }
    return absl::OkStatus();
  }

  // The attention projections' GEMV: TMA-streamed with gemm=tma (sm_90a), else register-streamed.
  void ProjectionGemv(const cuda::GemvArgs& a) {
    if (UsesTma(options_.gemm) && cuda::GemvTmaSupports(a.rows, a.k)) {
      cuda::GemvTma(a, stream_);
      return;
    }
    if (UsesTma(options_.gemm) && LaunchRecording())
      RecordFallback(absl::StrCat("gemm=tma: projection of ", a.rows, " rows, K=", a.k,
                                  ": the register-streamed GEMV (GemvTmaSupports is false)"));
    cuda::Gemv(a, stream_);
  }

  // The gemm axis's value, for the launch log's fallback lines.
  const char* GemmValue() const {
    return AxisValueName(options_.gemm);
  }
  // Why the fused GEMV does not take `rows` rows of width up to `k` (GemvSupports is false).
  static std::string GemvRefusal(int rows, int k) {
    if (rows > cuda::kGemvMaxRows) return absl::StrCat(rows, " rows (> ", cuda::kGemvMaxRows, ")");
    return absl::StrCat(rows, " rows of K up to ", k,
                        " (the GEMV takes K % 8 == 0 and rows x K x 4 bytes of shared memory up "
                        "to ",
                        cuda::kGemvMaxSharedBytes, ")");
  }

  int MaxIntermediate() const {
    return std::max({config_.intermediate_size, config_.moe_intermediate_size,
                     config_.shared_expert_intermediate_size, 1});
  }
  // A fused GEMV launch (gemm=fused|tma, decode rows): the kernel's args plus each segment's
  // weights and bias, whose kind picks the kernel (RunGemv).
  struct FusedGemv : cuda::GemvArgs {
    MatrixRef w[3];
    MatrixRef bias[3];
  };
  // bf16 weights: our GEMV (TMA-streamed for the projections with gemm=tma). Quantized codes
  // with qgemm=w4a16|w8a16: the quantized GEMV with the same fusions. Anything else (qgemm=
  // reference, a shape the quantized GEMV does not take): RMSNorm into xn_ (the only normed_out
  // in use), Gemm per segment, then the epilogue. Segments of different kinds (a checkpoint
  // that left some projections dense) run one launch each.
  absl::Status RunGemv(const FusedGemv& g, bool projection = false) {
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
      for (int s = 0; s < g.segments; ++s) {
        FusedGemv one = g;
        one.segments = 1;
        one.seg[0] = g.seg[s];
        one.w[0] = g.w[s];
        one.bias[0] = g.bias[s];
        if (auto st = RunGemv(one, projection); !st.ok()) return st;
      }
      return absl::OkStatus();
    }
    if (k0 == Kind::kBf16) {
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
                      xn_, stream_);
        in = xn_;
      }
      const uint16_t* in_bf16 = PrepareInput(in, static_cast<int64_t>(g.rows) * g.k);
      for (int s = 0; s < g.segments; ++s) {
        const cuda::GemvSegment& seg = g.seg[s];
        if (!g.accumulate && g.scale == 1.f) {
          if (auto st = Gemm(in, in_bf16, g.rows, g.w[s], g.bias[s], seg.y); !st.ok()) return st;
          continue;
        }
        // y_ is free on the GEMV path; accumulating segments (o, down) are [rows, hidden].
        if (auto st = Gemm(in, in_bf16, g.rows, g.w[s], g.bias[s], y_); !st.ok()) return st;
        const int64_t count = static_cast<int64_t>(g.rows) * seg.n;
        if (!g.accumulate)
          CUDA_OR_DIE(cudaMemsetAsync(seg.y, 0, count * sizeof(float), stream_));
        cuda::AddScaled(seg.y, y_, g.scale, count, stream_);
      }
    }
    CHECK_LAUNCH();
    return absl::OkStatus();
  }

  // A GEMV over `rows` rows of x [rows, k], RMS-normalised by `norm` first when it is given.
  static FusedGemv GemvInput(const float* x, int rows, int k, const MatrixRef& norm,
                             float eps = 0.f) {
    FusedGemv a;
    a.x = x;
    a.rows = rows;
    a.k = k;
    a.norm_gain = norm.data;
    a.norm_dtype = norm.dtype;
    a.norm_eps = eps;
    return a;
  }
  static void AddSegment(FusedGemv& a, const MatrixRef& w, const MatrixRef& bias, float* y) {
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

  // x += MLP(RMSNorm(x)) for a dense (non-MoE) layer.
  absl::Status DenseMlp(const LayerWeights& lw, int rows, bool gemv) {
    const int hidden = config_.hidden_size;
    const int64_t elems = static_cast<int64_t>(rows) * hidden;
    if (gemv) {
      const int inter = static_cast<int>(lw.mlp.gate.rows);
      FusedGemv a = GemvInput(x_, rows, hidden, lw.post_attention_norm, config_.rms_norm_eps);
      AddSegment(a, lw.mlp.gate, {}, gate_);
      AddSegment(a, lw.mlp.up, {}, up_);
      if (auto s = RunGemv(a); !s.ok()) return s;
      cuda::SiluMul(gate_, up_, static_cast<int64_t>(rows) * inter, gate_, stream_);
      FusedGemv d = GemvInput(gate_, rows, inter, {});
      AddSegment(d, lw.mlp.down, {}, x_);
      d.accumulate = true;
      if (auto s = RunGemv(d); !s.ok()) return s;
      CHECK_LAUNCH();
      return absl::OkStatus();
    }
    cuda::RmsNorm(x_, rows, hidden, lw.post_attention_norm, config_.rms_norm_eps, xn_, stream_);
    const uint16_t* mb = PrepareInput(xn_, elems);
    if (auto s = Mlp(lw.mlp, xn_, mb, rows, y_); !s.ok()) return s;
    cuda::AddScaled(x_, y_, 1.f, elems, stream_);
    CHECK_LAUNCH();
    return absl::OkStatus();
  }

  // y = down(silu(gate(x)) * up(x)) over `rows` rows of x.

  absl::Status Mlp(const ExpertWeights& e, const float* in, const uint16_t* in_bf16, int rows,
                   float* y) {
    const int inter = static_cast<int>(e.gate.rows);
    if (auto s = Gemm(in, in_bf16, rows, e.gate, {}, gate_); !s.ok()) return s;
    if (auto s = Gemm(in, in_bf16, rows, e.up, {}, up_); !s.ok()) return s;
    cuda::SiluMul(gate_, up_, static_cast<int64_t>(rows) * inter, gate_, stream_);
    const uint16_t* hb = PrepareInput(gate_, static_cast<int64_t>(rows) * inter);
    return Gemm(gate_, hb, rows, e.down, {}, y);
  }

  // Decode steps (n == 1) use the device-indexed kernels when moe=fused (capturable, no host
  // sync); prefill chunks group rows by expert so each expert's weights are read once, not once
  // per token (a 32k-row prefill would otherwise re-read 2.4 TB per layer).
  absl::Status Moe(int l, int rows, int n, bool gemv) {
    const LayerWeights& lw = w_.layers[l];
    const int hidden = config_.hidden_size, k = config_.num_experts_per_tok;
    const int inter = config_.moe_intermediate_size;
    const int64_t elems = static_cast<int64_t>(rows) * hidden;
    const int skip = fault_.kind == FaultInjection::Kind::kZeroExpert
                         ? static_cast<int>(fault_.value)
                         : -1;
    // moe=fused: many rows (batch >= 4 decode, prefill) take the expert-grouped tensor-core
    // kernels, which read each expert once; a few decode rows take the per-pair GEMVs.
    // Quantized experts (w4a16, w8a16) take their per-pair kernels at every decode batch.
    const bool quant_experts = RoutesOnDevice(options_.moe) && view_ && !view_->quant_tables.empty() &&
                               view_->quant_tables[l][0].format != QuantFormat::kNone;
    // A quantized model's view holds its own bf16 tables (dequant_bf16's copies).
    const bool own = view_ && !view_->gate_table.empty();
    // Long prefill chunks (more than kMoeMmaMaxPairsPerExpert pairs per expert on average) of bf16
    // experts go to cuBLAS's grouped GEMMs, with a host sync (prefill is never captured): the MMA
    // kernels re-read an expert's weights for every 64 of its pairs (77 ms a layer at 64 x 512
    // tokens).
    constexpr int kMoeMmaMaxPairsPerExpert = 16;
    const bool many_pairs = rows * k > kMoeMmaMaxPairsPerExpert * config_.num_experts;
    // moe=wgmma configs have no grouped_ runner: its kernels read each expert once per 128
    // pairs, so every chunk stays on the device.
    const bool long_prefill = n > 1 && grouped_ && !quant_experts &&
                              lw.experts[0].gate.dtype == DType::kBF16 &&
                              !lw.experts[0].gate.quantized() && many_pairs;
    const bool grouped_mma = RoutesOnDevice(options_.moe) && !quant_experts && !long_prefill &&
                             rows >= cuda::kMoeGroupedMinRows &&
                             cuda::MoeGroupedSupports(config_.num_experts, hidden, inter);
    // The grouped MMA kernels and the grouped GEMMs' gather read the normalised input in bf16
    // (xn_bf16_): the norm writes it (the GEMV path converts its xn_).
    // qgemm=w4a16|w8a16 prefill chunks: the experts dequantized into bf16 (PrefillExpertCopies)
    // take the grouped MMA kernels.
    const bool quant_prefill = quant_experts && n > 1 && rows >= cuda::kMoeGroupedMinRows &&
                               cuda::MoeGroupedSupports(config_.num_experts, hidden, inter) &&
                               ExpertsQuantizedAlike(l);
    const bool bf16_input = grouped_mma || quant_prefill || options_.moe == Moe::kGrouped || long_prefill;
    if (LaunchRecording())
      RecordMoeFallbacks(l, rows, n, gemv, grouped_mma, quant_prefill, long_prefill, many_pairs);
    // The router runs in fp32 on every config: it is 0.5 MB a layer, and rounding its input to
    // bf16 would flip near-tied routing decisions, a discrete error no bf16 GEMM elsewhere makes.
    if (gemv) {  // RMSNorm + router in one launch; it also leaves the normalised x in xn_
      FusedGemv a = GemvInput(x_, rows, hidden, lw.post_attention_norm, config_.rms_norm_eps);
      a.normed_out = xn_;
      AddSegment(a, lw.router, {}, router_);
      if (auto s = RunGemv(a); !s.ok()) return s;
      if (bf16_input) cuda::ToBf16(xn_, elems, xn_bf16_, stream_);
    } else {
      cuda::RmsNorm(x_, rows, hidden, lw.post_attention_norm, config_.rms_norm_eps, xn_, stream_,
                    bf16_input ? xn_bf16_ : nullptr);
      if (auto s = Router(l, rows); !s.ok()) return s;
    }
    cuda::RouterTopK(router_, rows, config_.num_experts, k, config_.norm_topk_prob, expert_ids_,
                     expert_weights_, stream_);
    if (grouped_mma || quant_prefill) {
      std::array<const uint16_t* const*, 3> tables{};
      if (quant_prefill) {
        auto copies = PrefillExpertCopies(l);
        if (!copies.ok()) return copies.status();
        tables = *copies;
      } else if (own) {
        tables = {view_->gate_table[l], view_->up_table[l], view_->down_table[l]};
      } else {
        tables = {dw_->gate_table[l], dw_->up_table[l], dw_->down_table[l]};
      }
      cuda::MoeGroupedArgs a;
      a.x_bf16 = xn_bf16_;
      a.rows = rows;
      a.k = k;
      a.num_experts = config_.num_experts;
      a.hidden = hidden;
      a.inter = inter;
      a.expert_ids = expert_ids_;
      a.expert_weights = expert_weights_;
      a.skip_expert = skip;
      a.gate = tables[0];
      a.up = tables[1];
      a.down = tables[2];
      a.offsets = expert_offsets_;
      a.sorted_pairs = route_index_;
      a.h = moe_bf16_;
      a.out = moe_out_;
      a.y = x_;
      // moe=wgmma: chunks of more than kMoeMmaMaxPairsPerExpert pairs an expert (prefill). Decode
      // batches keep the mma.sync kernels: at batch 64 (~4 pairs an expert) they measured 22.0
      // ms a step against 23.8 for the second wgmma version, whose smallest N (32) is mostly
      // padding there.
      a.wgmma = options_.moe == Moe::kWgmma && many_pairs;
      cuda::MoeGrouped(a, stream_);
      CHECK_LAUNCH();
    } else if (quant_experts && n == 1) {
      const std::array<cuda::QuantExpertTable, 3>& t = view_->quant_tables[l];
      cuda::MoeGateUpQuant(xn_, rows, k, expert_ids_, t[0], t[1], moe_h_, stream_);
      cuda::MoeDownCombineQuant(moe_h_, rows, k, expert_ids_, expert_weights_, skip, t[2], x_,
                                stream_);
      CHECK_LAUNCH();
    } else if (RoutesOnDevice(options_.moe) && n == 1) {
      cuda::MoeGateUp(xn_, rows, k, expert_ids_, own ? view_->gate_table[l] : dw_->gate_table[l],
                      own ? view_->up_table[l] : dw_->up_table[l], hidden, inter, moe_h_, stream_);
      cuda::MoeDownCombine(moe_h_, rows, k, expert_ids_, expert_weights_, skip,
                           own ? view_->down_table[l] : dw_->down_table[l], hidden, inter, x_,
                           stream_);
      CHECK_LAUNCH();
    } else {
      // Read the routing on the host (a sync), then either one grouped GEMM per projection over
      // every expert, or (the loop) one gather + MLP + scatter per expert.
      const HostRouting routing = RouteOnHost(rows, skip);
      if (options_.moe == Moe::kGrouped || long_prefill) {
        if (auto s = GroupedExperts(lw, rows, routing); !s.ok()) return s;
      } else {
        CUDA_OR_DIE(cudaMemsetAsync(y_, 0, static_cast<size_t>(elems) * sizeof(float), stream_));
        for (int e = 0; e < config_.num_experts; ++e) {
          const auto [first, count] = routing.spans[e];
          if (count == 0) continue;
          cuda::GatherRows(xn_, route_index_ + first, count, hidden, moe_in_, stream_);
          const uint16_t* gb = PrepareInput(moe_in_, static_cast<int64_t>(count) * hidden);
          if (auto s = Mlp(lw.experts[e], moe_in_, gb, count, moe_out_); !s.ok()) return s;
          cuda::ScatterAddRows(moe_out_, route_index_ + first, route_weight_ + first, count,
                               hidden, y_, stream_);
          CHECK_LAUNCH();
        }
        cuda::AddScaled(x_, y_, 1.f, elems, stream_);
      }
      // The routing's host vectors must outlive the async copies from them.
      CUDA_OR_DIE(cudaStreamSynchronize(stream_));
    }
    if (!lw.shared_expert.gate.empty()) {
      const uint16_t* sb = PrepareInput(xn_, static_cast<int64_t>(rows) * hidden);
      if (auto s = Mlp(lw.shared_expert, xn_, sb, rows, o_); !s.ok()) return s;
      // Mlp reused the bf16 staging buffer: convert the input again for the gate.
      sb = PrepareInput(xn_, static_cast<int64_t>(rows) * hidden);
      if (auto s = Gemm(xn_, sb, rows, lw.shared_expert_gate, {}, router_); !s.ok()) return s;
      cuda::AddSigmoidGated(x_, o_, router_, rows, hidden, stream_);
      CHECK_LAUNCH();
    }
    return absl::OkStatus();
  }

  // The launch log's fallbacks of one MoE block (core/launch_log.h): where the experts or the
  // shared expert run on something other than what the moe and gemm values name, from Moe's
  // dispatch decisions (the router's are recorded by Router).
  void RecordMoeFallbacks(int l, int rows, int n, bool gemv, bool grouped_mma, bool quant_prefill,
                          bool long_prefill, bool many_pairs) {
    const char* moe = options_.moe == Moe::kWgmma ? "wgmma" : "fused";
    const std::string chunk = absl::StrCat(n > 1 ? "prefill chunk of " : "decode of ", rows,
                                           " rows (", rows * config_.num_experts_per_tok,
                                           " pairs over ", config_.num_experts, " experts)");
    if (long_prefill && RoutesOnDevice(options_.moe))  // (moe=grouped runs every chunk that way)
      RecordFallback(absl::StrCat("moe=", moe, ": ", chunk,
                                  ", more than 16 pairs an expert: the experts on cuBLAS grouped "
                                  "GEMMs, with a host sync"));
    if (quant_prefill)
      RecordFallback(absl::StrCat("qgemm=", AxisValueName(options_.qgemm), ": ", chunk,
                                  ": the layer's experts dequantized to bf16, then the bf16 "
                                  "grouped mma.sync kernels"));
    // Moe's else branch: the routing read on the host.
    if (RoutesOnDevice(options_.moe) && !grouped_mma && !quant_prefill && n > 1 && !long_prefill)
      RecordFallback(absl::StrCat(
          "moe=", moe, ": ", chunk, ": the per-expert loop with a host sync (moe=loop's path): ",
          rows < cuda::kMoeGroupedMinRows
              ? "fewer rows than the grouped expert kernels take"
              : "the grouped expert kernels do not take these experts (MoeGroupedSupports, or "
                "quantized experts not all alike)"));
    // moe=wgmma runs wgmma on chunks of more than 16 pairs an expert only (Moe's many_pairs).
    if (options_.moe == Moe::kWgmma && grouped_mma && !many_pairs)
      RecordFallback(absl::StrCat("moe=wgmma: ", chunk,
                                  ", 16 or fewer pairs an expert: the mma.sync grouped kernels, "
                                  "not wgmma"));
    if (options_.moe == Moe::kWgmma && !grouped_mma && n == 1)
      RecordFallback(absl::StrCat("moe=wgmma: ", chunk,
                                  ": the per-pair expert GEMVs (moe=fused's), not wgmma"));
    if (gemv && !w_.layers[l].shared_expert.gate.empty())
      RecordFallback(absl::StrCat("gemm=", GemmValue(),
                                  ": the shared expert and its gate unfused (cuBLASLt for bf16 "
                                  "weights), not the fused GEMV"));
  }

  // router_ = xn_ . Wr^T in fp32 (fp32 input, fp32 accumulate) for the non-GEMV paths. From
  // kRouterCublasMinRows rows on, cuBLASLt's fp32 GEMM runs it on fp32 copies of the router
  // weights (MakeRouterCopies): our kernels measured 22 us a layer at batch 64 (warp per expert)
  // and 163 us at prefill 2048 (128 register-tiled blocks).
  static constexpr int kRouterCublasMinRows = 16;
  absl::Status Router(int l, int rows) {
    const MatrixRef& wr = w_.layers[l].router;
    const bool fused = UsesFusedGemv(options_.gemm);
    if (gemm_ && rows >= kRouterCublasMinRows && !router_f32_.empty() && router_f32_[l]) {
      if (fused && LaunchRecording())
        RecordFallback(absl::StrCat("gemm=", GemmValue(), ": router of ", rows,
                                    " rows (>= ", kRouterCublasMinRows,
                                    "): cuBLASLt's fp32 GEMM, not the fused GEMV"));
      return gemm_->RunF32(xn_, rows, router_f32_[l], static_cast<int>(wr.rows),
                           static_cast<int>(wr.cols), router_, stream_);
    }
    if (gemm_ && !fused && LaunchRecording())
      RecordFallback(absl::StrCat("gemm=", GemmValue(), ": router of ", rows, " rows",
                                  rows < kRouterCublasMinRows
                                      ? absl::StrCat(" (< ", kRouterCublasMinRows, ")")
                                      : std::string(" (no fp32 copy of a quantized router)"),
                                  ": our fp32 router kernel, not cuBLASLt"));
    if (gemm_)  // the GPU reference (gemm=reference) keeps the reference GEMM
      cuda::RouterGemm(xn_, rows, wr, router_, stream_);
    else
      cuda::GemmReference(xn_, rows, wr, {}, router_, stream_);
    CHECK_LAUNCH();
    return absl::OkStatus();
  }

  // The routing of `rows` rows read back to the host: pairs (row, slot) grouped by expert, with
  // the row index and routing weight of each uploaded to route_index_ / route_weight_, and the
  // position of every pair in that order uploaded to pair_position_ (-1: left out).
  struct HostRouting {
    std::vector<int> index;
    std::vector<float> index_weight;
    std::vector<int> pair_position;
    std::vector<std::pair<int, int>> spans;  // per expert: first pair, count
  };
  HostRouting RouteOnHost(int rows, int skip) {
    const int k = config_.num_experts_per_tok;
    std::vector<int> ids(static_cast<size_t>(rows) * k);
    std::vector<float> weights(ids.size());
    CUDA_OR_DIE(cudaMemcpyAsync(ids.data(), expert_ids_, ids.size() * sizeof(int), cudaMemcpyDeviceToHost, stream_));
    CUDA_OR_DIE(cudaMemcpyAsync(weights.data(), expert_weights_, ids.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    CUDA_OR_DIE(cudaStreamSynchronize(stream_));
    HostRouting r;
    r.pair_position.assign(ids.size(), -1);
    r.spans.assign(config_.num_experts, {0, 0});
    // Counting sort by expert, pairs in order within an expert: O(pairs + experts). (Scanning
    // every pair once per expert was 2M steps a layer at prefill 2048.)
    for (size_t p = 0; p < ids.size(); ++p)
      if (ids[p] != skip) ++r.spans[ids[p]].second;
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
      if (e == skip) continue;
      const int position = r.spans[e].first + fill[e]++;
      r.pair_position[p] = position;
      r.index[position] = static_cast<int>(p / k);
      r.index_weight[position] = weights[p];
    }
    CUDA_OR_DIE(cudaMemcpyAsync(route_index_, r.index.data(), r.index.size() * sizeof(int), cudaMemcpyHostToDevice, stream_));
    CUDA_OR_DIE(cudaMemcpyAsync(route_weight_, r.index_weight.data(), r.index.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
    if (grouped_)  // only the grouped runner's combine reads it
      CUDA_OR_DIE(cudaMemcpyAsync(pair_position_, r.pair_position.data(), r.pair_position.size() * sizeof(int), cudaMemcpyHostToDevice, stream_));
    return r;
  }

  // moe=grouped: every routed pair's row gathered in expert order, then gate, up and down each as
  // one cuBLAS grouped GEMM over the experts (bf16 in and out), then x += the weighted sum of each
  // row's pairs. bf16 buffers: the gathered input in bf16_, gate | up | h in moe_bf16_, the
  // pairs' outputs after it.
  absl::Status GroupedExperts(const LayerWeights& lw, int rows, const HostRouting& routing) {
    const int hidden = config_.hidden_size, inter = config_.moe_intermediate_size;
    const int pairs = static_cast<int>(routing.index.size());
    if (pairs == 0) return absl::OkStatus();
    // The norm wrote xn_ in bf16 too (Moe): gather those rows, half the bytes of fp32 rows and no
    // conversion after.
    cuda::GatherRowsBf16(xn_bf16_, route_index_, pairs, hidden, bf16_, stream_);
    const uint16_t* xb = bf16_;
    const int64_t h_elems = static_cast<int64_t>(pairs) * inter;
    uint16_t* gate = moe_bf16_;
    uint16_t* up = gate + h_elems;
    uint16_t* out = up + h_elems;  // [pairs, hidden]
    std::vector<cuda::GroupedProblem> gate_problems, up_problems, down_problems;
    for (int e = 0; e < config_.num_experts; ++e) {
      const auto [first, count] = routing.spans[e];
      if (count == 0) continue;
      const ExpertWeights& w = lw.experts[e];
      const int64_t in_row = static_cast<int64_t>(first) * hidden, h_row = static_cast<int64_t>(first) * inter;
      gate_problems.push_back({xb + in_row, static_cast<const uint16_t*>(w.gate.data), gate + h_row, count});
      up_problems.push_back({xb + in_row, static_cast<const uint16_t*>(w.up.data), up + h_row, count});
      // silu(gate) * up is written over gate: the down projection's input.
      down_problems.push_back({gate + h_row, static_cast<const uint16_t*>(w.down.data), out + in_row, count});
    }
    if (auto s = grouped_->Run(gate_problems, inter, hidden, stream_); !s.ok()) return s;
    if (auto s = grouped_->Run(up_problems, inter, hidden, stream_); !s.ok()) return s;
    cuda::SiluMulBf16(gate, up, h_elems, gate, stream_);
    if (auto s = grouped_->Run(down_problems, hidden, inter, stream_); !s.ok()) return s;
    cuda::CombinePairsBf16(out, pair_position_, expert_weights_, rows, config_.num_experts_per_tok,
                           hidden, x_, stream_);
    CHECK_LAUNCH();
    return absl::OkStatus();
  }

  // Activation buffers sized for `rows` rows; grown (never shrunk) on demand.
  // Logits buffers are sized by the rows whose logits are returned (prefill of 64 x 512 tokens
  // returns 64 rows, not 32768).
  absl::Status EnsureScratch(int rows, int out_rows) {
    if (rows <= scratch_rows_ && out_rows <= logit_rows_ && capacity_ <= scratch_capacity_)
      return absl::OkStatus();
    rows = std::max(rows, scratch_rows_);
    out_rows = std::max(out_rows, logit_rows_);
    for (auto& [b, exec] : graphs_) cudaGraphExecDestroy(exec);  // they point at old buffers
    graphs_.clear();
    graph_launches_.clear();
    FreeScratch();
    const size_t r = rows, hidden = config_.hidden_size, k = std::max(1, config_.num_experts_per_tok);
    const size_t inter = std::max({config_.intermediate_size, config_.moe_intermediate_size,
                                   config_.shared_expert_intermediate_size, 1});
    const size_t moe_inter = std::max(config_.moe_intermediate_size, 1);
    const size_t widest = std::max({hidden, static_cast<size_t>(config_.q_dim()), inter});
    struct Want {
      float** ptr;
      size_t count;
    };
    const Want wants[] = {
        {&x_, r * hidden}, {&xn_, r * hidden}, {&q_, r * config_.q_dim()}, {&k_, r * config_.kv_dim()},
        {&qkv_, r * (config_.q_dim() + 2 * config_.kv_dim())},
        {&v_, r * config_.kv_dim()}, {&attn_, r * config_.q_dim()}, {&o_, r * hidden},
        {&y_, r * hidden}, {&gate_, r * inter}, {&up_, r * inter},
        // + 1: graphs=persistent's sum of squares of x, after the logits' sums
        {&router_, r * std::max(config_.num_experts, 1) + 1}, {&expert_weights_, r * k},
        {&moe_h_, r * k * moe_inter}, {&moe_out_, r * k * hidden}, {&moe_in_, r * k * hidden},
        {&route_weight_, r * k},
        // naive: materialised scores; flash: the splits' partial softmaxes
        {&scores_, options_.attention == Attention::kFlash
                       ? static_cast<size_t>(cuda::FlashPartialFloats(rows, config_.num_q_heads,
                                                                      config_.num_kv_heads,
                                                                      config_.head_dim))
                       : r * config_.num_q_heads * static_cast<size_t>(capacity_)},
        {&logits_, static_cast<size_t>(out_rows) * config_.vocab_size}};
    for (const Want& want : wants) {
      auto p = DeviceAlloc<float>(want.count);
      if (!p.ok()) return p.status();
      *want.ptr = *p;
    }
    auto ids = DeviceAlloc<int>(r * k);
    auto index = DeviceAlloc<int>(r * k);
    auto tokens = DeviceAlloc<int32_t>(r);
    auto last = DeviceAlloc<int>(r);
    auto pos = DeviceAlloc<int>(1);
    auto bf16 = DeviceAlloc<uint16_t>(std::max(r * widest, r * k * hidden));
    auto xn_bf16 = DeviceAlloc<uint16_t>(r * hidden);
    if (!xn_bf16.ok()) return xn_bf16.status();
    xn_bf16_ = *xn_bf16;
    auto moe_bf16 = DeviceAlloc<uint16_t>(r * k * (2 * moe_inter + hidden));
    if (!moe_bf16.ok()) return moe_bf16.status();
    moe_bf16_ = *moe_bf16;
    auto pair_position = DeviceAlloc<int>(r * k);
    if (!pair_position.ok()) return pair_position.status();
    pair_position_ = *pair_position;
    auto offsets = DeviceAlloc<int>(std::max(config_.num_experts, 0) + 1);
    if (!offsets.ok()) return offsets.status();
    expert_offsets_ = *offsets;
    for (const auto* s : {&ids.status(), &index.status(), &tokens.status(), &last.status(), &pos.status(), &bf16.status()})
      if (!s->ok()) return *s;
    expert_ids_ = *ids;
    route_index_ = *index;
    d_tokens_ = *tokens;
    d_last_rows_ = *last;
    d_position_ = *pos;
    bf16_ = *bf16;
    CUDA_OR_DIE(cudaMallocHost(&h_tokens_, r * sizeof(int32_t)));
    CUDA_OR_DIE(cudaMallocHost(&h_last_rows_, r * sizeof(int)));
    CUDA_OR_DIE(cudaMallocHost(&h_position_, sizeof(int)));
    CUDA_OR_DIE(cudaMallocHost(&h_logits_, static_cast<size_t>(out_rows) * config_.vocab_size * sizeof(float)));
    CUDA_OR_DIE(cudaMallocHost(&h_next_, static_cast<size_t>(out_rows) * sizeof(int32_t)));
    // The kernels read and write these host buffers through their device mappings.
    for (void* p : {static_cast<void*>(h_tokens_), static_cast<void*>(h_position_),
                    static_cast<void*>(h_next_)}) {
      void* mapped = nullptr;
      CUDA_OR_DIE(cudaHostGetDevicePointer(&mapped, p, 0));
      if (mapped != p)
        return absl::InternalError(
            "pinned host memory is not mapped at its own address (no unified addressing?): the "
            "step kernels cannot read it");
    }
    auto keys = DeviceAlloc<unsigned long long>(out_rows);
    if (!keys.ok()) return keys.status();
    greedy_scratch_.keys = *keys;
    auto tickets = DeviceAlloc<unsigned>(out_rows);
    if (!tickets.ok()) return tickets.status();
    greedy_scratch_.tickets = *tickets;
    CUDA_OR_DIE(cudaMemset(greedy_scratch_.keys, 0, out_rows * sizeof(unsigned long long)));
    CUDA_OR_DIE(cudaMemset(greedy_scratch_.tickets, 0, out_rows * sizeof(unsigned)));
    scratch_rows_ = rows;
    logit_rows_ = out_rows;
    scratch_capacity_ = capacity_;
    return absl::OkStatus();
  }

  void FreeScratch() {
    for (float* p : {x_, xn_, q_, k_, v_, qkv_, attn_, o_, y_, gate_, up_, router_, expert_weights_, moe_h_,
                     moe_out_, moe_in_, route_weight_, scores_, logits_})
      if (p) cudaFree(p);
    for (int* p : {expert_ids_, route_index_, pair_position_, expert_offsets_, d_tokens_, d_last_rows_, d_position_})
      if (p) cudaFree(p);
    if (bf16_) cudaFree(bf16_);
    if (xn_bf16_) cudaFree(xn_bf16_);
    if (moe_bf16_) cudaFree(moe_bf16_);
    for (void* p :
         {static_cast<void*>(greedy_scratch_.keys), static_cast<void*>(greedy_scratch_.tickets)})
      if (p) cudaFree(p);
    greedy_scratch_ = {};
    for (void* p : {static_cast<void*>(h_tokens_), static_cast<void*>(h_last_rows_),
                    static_cast<void*>(h_position_), static_cast<void*>(h_logits_),
                    static_cast<void*>(h_next_)})
      if (p) cudaFreeHost(p);
    x_ = xn_ = q_ = k_ = v_ = qkv_ = attn_ = o_ = y_ = gate_ = up_ = router_ = expert_weights_ = moe_h_ =
        moe_out_ = moe_in_ = route_weight_ = scores_ = logits_ = nullptr;
    expert_ids_ = route_index_ = pair_position_ = expert_offsets_ = d_tokens_ = d_last_rows_ = d_position_ = nullptr;
    bf16_ = moe_bf16_ = xn_bf16_ = nullptr;
    h_tokens_ = nullptr;
    h_last_rows_ = h_position_ = nullptr;
    h_logits_ = nullptr;
    h_next_ = nullptr;
    scratch_rows_ = 0;
    logit_rows_ = 0;
  }

  const ModelConfig config_;
  std::shared_ptr<DeviceWeights> dw_;
  std::unique_ptr<QuantView> view_;  // quantized models only
  const ModelWeights& w_;
  const CudaOptions options_;
  const FaultInjection fault_;  // TEST ONLY
  std::unique_ptr<cuda::CublasLtGemm> gemm_;
  std::unique_ptr<cuda::CublasGroupedGemm> grouped_;  // moe=grouped
  cudaStream_t stream_ = nullptr;
  int batch_ = 0, capacity_ = 0, position_ = 0, scratch_rows_ = 0, scratch_capacity_ = 0,
      logit_rows_ = 0;
  char *k_cache_ = nullptr, *v_cache_ = nullptr;  // fp32, or bf16 with kv_cache=bf16
  float2* rope_ = nullptr;  // [capacity, head_dim / 2] cos/sin
  std::vector<float*> router_f32_;  // per layer (MakeRouterCopies); null for dense layers
  float *x_ = nullptr, *xn_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr,
        *qkv_ = nullptr,  // [rows, q | k | v]: the fused q/k/v GEMM's output
        *attn_ = nullptr,
        *o_ = nullptr, *y_ = nullptr, *gate_ = nullptr, *up_ = nullptr, *router_ = nullptr,
        *expert_weights_ = nullptr, *moe_h_ = nullptr, *moe_out_ = nullptr, *moe_in_ = nullptr,
        *route_weight_ = nullptr, *scores_ = nullptr, *logits_ = nullptr;
  int *expert_ids_ = nullptr, *route_index_ = nullptr, *pair_position_ = nullptr,
      *expert_offsets_ = nullptr, *d_tokens_ = nullptr,
      *d_last_rows_ = nullptr, *d_position_ = nullptr;
  uint16_t* bf16_ = nullptr;
  uint16_t* xn_bf16_ = nullptr;  // the MoE block's normalised input in bf16 (cuBLASLt configs)
  uint16_t* moe_bf16_ = nullptr;  // moe=grouped: gate | up | pair outputs, bf16
  bool prefill_ = false;           // the step being enqueued is a prefill chunk (n > 1)
  uint16_t* prefill_dense_ = nullptr;  // PrefillBf16Copy
  size_t prefill_dense_count_ = 0;
  uint16_t* prefill_experts_ = nullptr;  // PrefillExpertCopies: [gate | up | down][expert]
  const uint16_t** prefill_expert_tables_ = nullptr;
  std::vector<MatrixRef*> prefill_expert_refs_;  // per layer: its experts' refs on the device
  int32_t* h_tokens_ = nullptr;
  int *h_last_rows_ = nullptr, *h_position_ = nullptr;
  float* h_logits_ = nullptr;
  int32_t* h_next_ = nullptr;  // ForwardGreedy's tokens, written by cuda::GreedyTokens
  cuda::GreedyScratch greedy_scratch_{};
  std::map<int, cudaGraphExec_t> graphs_;  // by 2 * batch + (greedy step)
  std::map<int, LaunchRecorder> graph_launches_;  // what each graph's capture launched
  double capture_seconds_ = 0;
  cudaEvent_t step_start_ = nullptr, step_end_ = nullptr;
  std::optional<double> last_step_ms_;
  // graphs=persistent (PreparePersistentDecode): the kernel's arguments that do not change per
  // step (layers null: not in use), and the device buffer behind them.
  cuda::PersistentDecodeArgs persistent_;
  void* persistent_buffer_ = nullptr;
  // The routers transposed, and nvfp4 group scales copied into padded rows.
  std::vector<void*> persistent_copies_;
  std::string persistent_timeline_path_;  // TEST ONLY
};

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> MakeCudaModel(HostModel& host, const CudaOptions& options,
                                                     const FaultInjection& fault) {
  if (const std::string why = CudaModelRefusal(host.config, host.quant_format, options);
      !why.empty())
    return absl::UnimplementedError(why);
  const ModelConfig& c = host.config;
  auto weights = UploadWeights(host);
  if (!weights.ok()) return weights.status();
  std::unique_ptr<cuda::CublasLtGemm> gemm;
  if (UsesCublasLt(options.gemm)) {
    auto made = cuda::CublasLtGemm::Create();
    if (!made.ok()) return made.status();
    gemm = std::move(*made);
  }
  std::unique_ptr<QuantView> view;
  if (host.quant_format != QuantFormat::kNone) {
    auto made = BuildQuantView(host, **weights, options, fault);
    if (!made.ok()) return made.status();
    view = std::move(*made);
  }
  std::unique_ptr<cuda::CublasGroupedGemm> grouped;
  // moe=fused also takes long prefill chunks to the grouped GEMMs (bf16 experts, cuBLAS configs).
  if (c.is_moe() && (options.moe == Moe::kGrouped ||
                     (options.moe == Moe::kFused && UsesCublasLt(options.gemm)))) {
    auto made = cuda::CublasGroupedGemm::Create();
    if (!made.ok()) return made.status();
    grouped = std::move(*made);
  }
  auto model = std::make_unique<CudaModel>(host.config, std::move(*weights), options, fault,
                                           std::move(gemm), std::move(grouped), std::move(view));
  if (IsPersistent(options.graphs))
    if (auto s = model->PreparePersistentDecode(); !s.ok()) return s;
  return std::unique_ptr<Model>(std::move(model));
}

absl::StatusOr<std::vector<uint8_t>> CopyDeviceTensorToHost(HostModel& host, size_t index) {
  auto weights = UploadWeights(host);
  if (!weights.ok()) return weights.status();
  if (index >= host.specs.size()) return absl::OutOfRangeError("tensor index");
  const HostTensor& t = (*weights)->tensors[index];
  std::vector<uint8_t> bytes(static_cast<size_t>(host.specs[index].numel()) * DTypeSize(t.dtype));
  CUDA_OR_DIE(cudaMemcpy(bytes.data(), t.data, bytes.size(), cudaMemcpyDeviceToHost));
  return bytes;
}

}  // namespace infersweep
