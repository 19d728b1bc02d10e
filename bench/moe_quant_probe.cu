// Quantized MoE probe: one MoE layer's experts (cuda::MoeGrouped: bucketing, gate/up + SiLU, down,
// combine) on qwen3-30b-a3b's shapes (128 experts, top 8, hidden 2048, inter 768) for each
// quantized format the grouped kernels take, at decode batches and prefill chunks, under the
// variant the MoE plan picks (MoeGroupedKernelFor) and, from 256 rows, the wgmma one.
//
// Bytes a layer reads: the codes and scales of every expert some row routes to (3 matrices of
// 768 x 2048: NVFP4 0.5625 B a weight, MXFP4 0.53125, FP8 1, plus a scale a row) and the
// activations (small beside them). Roofline: those bytes at --gbps (default 4,460 GB/s, the
// H200 figure docs/PERFORMANCE.md holds every row against; 3,350 on an H100).
// Each point: 8 layers (each its own experts, so that no layer finds its weights in L2) captured
// in one CUDA graph, median of 7 timed replays after 2 warm-ups; routing is uniform at random,
// the same for every layer.
// Usage: moe_quant_probe [--gbps G]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench/probe.h"
#include "core/quant/format.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/limits.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"

namespace {

using infersweep::DType;
using infersweep::QuantFormat;
namespace cuda = infersweep::cuda;
namespace bench = infersweep::bench;

constexpr int kExperts = 128, kTopK = 8, kHidden = 2048, kInter = 768;
constexpr int kLayers = 8, kRepeats = 7;

// Device memory freed together: a format's expert tables, or one point's inputs and scratch.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* d : owned_) CUDA_OR_DIE(cudaFree(d));
  }
  template <typename T>
  T* Allocate(size_t count) {
    T* d = nullptr;
    CUDA_OR_DIE(cudaMalloc(&d, count * sizeof(T)));
    owned_.push_back(d);
    return d;
  }
  template <typename T>
  T* Copy(const T* host, size_t count) {
    T* d = Allocate<T>(count);
    CUDA_OR_DIE(cudaMemcpy(d, host, count * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  template <typename T>
  T* Copy(const std::vector<T>& host) {
    return Copy(host.data(), host.size());
  }

 private:
  std::vector<void*> owned_;
};

// `count` bytes base + (random & mask), from one random pool (every matrix of a kind has the same
// bytes at its own address: timing reads no meaning into them).
const uint8_t* RandomBytes(size_t count, uint8_t mask, uint8_t base) {
  static std::vector<uint8_t> pool;
  static uint8_t pool_mask = 0, pool_base = 0;
  if (pool.size() < count || pool_mask != mask || pool_base != base) {
    pool.resize(std::max(pool.size(), count));
    std::mt19937 rng(mask * 256 + base);
    for (uint8_t& b : pool) b = static_cast<uint8_t>(base + (rng() & mask));
    pool_mask = mask;
    pool_base = base;
  }
  return pool.data();
}

// One matrix kind (gate, up or down) of every expert of a layer: random codes (FP8 without the
// NaN code, exponents 4..11), E4M3 group scales near 1 (NVFP4), E8M0 ones near 2^-3 (MXFP4),
// fp32 channel scales (FP8), one global scale per expert (NVFP4).
cuda::QuantExpertTable Table(DeviceArena& arena, QuantFormat f, int rows, int cols) {
  const bool fp4 = infersweep::IsFp4(f);
  const size_t code_bytes = static_cast<size_t>(rows) * cols / (fp4 ? 2 : 1);
  const size_t groups = static_cast<size_t>(rows) * cols / (f == QuantFormat::kNvfp4 ? 16 : 32);
  std::vector<const void*> codes(kExperts), scales(kExperts), globals(kExperts);
  for (int e = 0; e < kExperts; ++e) {
    codes[e] = fp4 ? arena.Copy(RandomBytes(code_bytes, 0xff, 0), code_bytes)
                   : arena.Copy(RandomBytes(code_bytes, 0x3f, 0x20), code_bytes);
    if (f == QuantFormat::kNvfp4) {
      scales[e] = arena.Copy(RandomBytes(groups, 0x0f, 0x30), groups);
      globals[e] = arena.Copy(std::vector<float>{1.f / 1024});
    } else if (f == QuantFormat::kMxfp4) {
      scales[e] = arena.Copy(RandomBytes(groups, 0x03, 122), groups);
    } else {
      scales[e] = arena.Copy(std::vector<float>(rows, 1.f / 64));
    }
  }
  cuda::QuantExpertTable t;
  t.codes = arena.Copy(codes);
  t.scales = arena.Copy(scales);
  t.global_scales = f == QuantFormat::kNvfp4 ? arena.Copy(globals) : nullptr;
  t.format = f;
  t.scale_dtype = DType::kF32;
  t.rows = rows;
  t.cols = cols;
  return t;
}

// Bytes of one expert's three matrices: codes and scales.
double ExpertBytes(QuantFormat f) {
  const double weights = 3.0 * kHidden * kInter;
  switch (f) {
    case QuantFormat::kNvfp4:
      return weights * (0.5 + 1.0 / 16);
    case QuantFormat::kMxfp4:
      return weights * (0.5 + 1.0 / 32);
    default:
      return weights + 4.0 * (2 * kInter + kHidden);
  }
}

struct Point {
  double us = 0, gbps = 0;
};

// tables: [layer][gate, up, down].
Point TimeLayer(QuantFormat f, const std::vector<cuda::QuantExpertTable>& tables, int rows,
                cuda::MoeGroupedKernel kernel) {
  DeviceArena arena;
  const int pairs = rows * kTopK;
  std::vector<int> ids(pairs);
  std::vector<float> weights(pairs, 1.f / kTopK);
  std::set<int> touched;
  std::mt19937 rng(rows);
  for (int r = 0; r < rows; ++r) {
    std::vector<int> all(kExperts);
    for (int e = 0; e < kExperts; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int s = 0; s < kTopK; ++s) {
      ids[r * kTopK + s] = all[s];
      touched.insert(all[s]);
    }
  }
  std::vector<uint16_t> x_host(static_cast<size_t>(rows) * kHidden);
  for (size_t i = 0; i < x_host.size(); ++i) x_host[i] = 0x3c00 + (i * 37 % 256);  // ~1 in bf16
  cuda::MoeGroupedArgs a;
  a.kernel = kernel;
  a.x_bf16 = arena.Copy(x_host);
  a.rows = rows;
  a.k = kTopK;
  a.num_experts = kExperts;
  a.hidden = kHidden;
  a.inter = kInter;
  a.expert_ids = arena.Copy(ids);
  a.expert_weights = arena.Copy(weights);
  a.expert_begin = 0;
  a.expert_end = kExperts;
  a.offsets = arena.Allocate<int>(kExperts + 1);
  a.sorted_pairs = arena.Allocate<int>(pairs);
  a.h = arena.Allocate<uint16_t>(static_cast<size_t>(pairs) * kInter);
  a.out = arena.Allocate<float>(static_cast<size_t>(pairs) * kHidden);
  a.y = arena.Allocate<float>(static_cast<size_t>(rows) * kHidden);
  CUDA_OR_DIE(cudaMemset(a.y, 0, sizeof(float) * rows * kHidden));

  const double ms = bench::MedianGraphMs(
      [&](cudaStream_t stream) {
        for (int l = 0; l < kLayers; ++l) {
          a.quant = tables.data() + 3 * l;  // read on the host: kernels take the tables by value
          cuda::MoeGrouped(a, stream);
        }
      },
      kRepeats);
  Point p;
  p.us = 1e3 * ms / kLayers;
  p.gbps = touched.size() * ExpertBytes(f) / p.us / 1e3;
  return p;
}

const char* KernelName(cuda::MoeGroupedKernel k) {
  switch (k) {
    case cuda::MoeGroupedKernel::kQuantMma4:
      return "mma x4";
    case cuda::MoeGroupedKernel::kQuantMma8:
      return "mma x8";
    case cuda::MoeGroupedKernel::kQuantWgmma:
      return "wgmma";
    default:
      return "?";
  }
}

}  // namespace

int main(int argc, char** argv) {
  const double gbps = bench::RooflineGbpsFromArgs(argc, argv);
  std::printf("# %s; roofline %.0f GB/s; us a layer, median of %d graphs of %d layers\n",
              bench::DeviceLine().c_str(), gbps, kRepeats, kLayers);
  std::printf("%-12s %6s %-7s %10s %10s %8s\n", "format", "rows", "kernel", "us", "GB/s", "%roof");
  for (QuantFormat f : {QuantFormat::kNvfp4, QuantFormat::kMxfp4, QuantFormat::kFp8Channel}) {
    DeviceArena arena;  // this format's tables
    std::vector<cuda::QuantExpertTable> tables;
    for (int l = 0; l < kLayers; ++l) {
      tables.push_back(Table(arena, f, kInter, kHidden));
      tables.push_back(Table(arena, f, kInter, kHidden));
      tables.push_back(Table(arena, f, kHidden, kInter));
    }
    for (int rows : {1, 4, 16, 64, 256, 2048}) {
      std::vector<cuda::MoeGroupedKernel> kernels = {
          cuda::MoeGroupedKernelFor(true, false, rows * kTopK, kExperts)};
      if (rows >= 256) kernels.push_back(cuda::MoeGroupedKernel::kQuantWgmma);
      for (cuda::MoeGroupedKernel k : kernels) {
        const Point p = TimeLayer(f, tables, rows, k);
        std::printf("%-12s %6d %-7s %10.2f %10.0f %7.1f%%\n",
                    infersweep::QuantFormatName(f).c_str(), rows, KernelName(k), p.us, p.gbps,
                    100.0 * p.gbps / gbps);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
