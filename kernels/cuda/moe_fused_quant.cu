// Quantized experts for moe=fused (qgemm=w4a16 / w8a16): the twins of moe.cu's MoeGateUp and
// MoeDownCombine, reading each routed expert's FP4 or FP8 codes and scales through device
// pointer tables and dequantizing them in registers (quant_decode.cuh). Same structure: a warp
// per output (here two outputs, which share each activation read from shared memory), weight
// loads issued before x is staged, PDL through Launch(), fixed summation order.
//
// Napkin math, qwen3-30b-a3b batch-1 decode, per layer (8 experts, H200 at 4.46 TB/s):
//   gate+up: 8 x 2 x [768, 2048]: nvfp4 14.2 MB -> 3.2 us; fp8 25.2 MB -> 5.6 us; 50 MFLOP.
//   down:    8 x [2048, 768]:     nvfp4  7.1 MB -> 1.6 us; fp8 12.6 MB -> 2.8 us; 25 MFLOP.
//   (bf16: 50 + 25 MB -> 11 + 5.6 us.) These kernels are a few DRAM latencies long, so expect
//   latency, not bandwidth, to set their time.
#include <algorithm>

#include "kernels/cuda/quant.h"
#include "kernels/cuda/quant_decode.cuh"

namespace infersweep::cuda {
namespace {

constexpr int kWarps = 8;        // 256 threads
constexpr int kRowsPerWarp = 2;  // gate/up outputs per warp: they share each activation read
// Down outputs per warp: one, so a lane's share of all k slots' chunks is one round of loads and
// the grid is hidden / 8 blocks (256 at hidden 2048, every SM).
constexpr int kDownRowsPerWarp = 1;

// A MatrixRef of expert e's scales, for the row-factor helpers.
__device__ __forceinline__ MatrixRef ExpertScales(const QuantExpertTable& t, const void* scales,
                                                  const void* global_scale) {
  MatrixRef m;
  m.rows = t.rows;
  m.cols = t.cols;
  m.quant.format = t.format;
  m.quant.scale = scales;
  m.quant.scale_dtype = t.scale_dtype;
  m.quant.global_scale = global_scale;
  return m;
}

// grid (ceil(inter / 16), pairs), 256 threads: warp w computes outputs [2w, 2w + 2) of the
// block's 16 for both gate and up of pair blockIdx.y's expert. Its first weight loads (all of a
// 2048-wide row at qwen3-30b-a3b shapes) are issued before x is staged in shared memory. A pair
// of an expert outside [expert_begin, expert_end) writes zeros and reads no table entry; the
// block's pair is one, so the whole block leaves before any barrier.
template <QuantFormat F>
__global__ void __launch_bounds__(kWarps * 32)
    MoeGateUpQuantKernel(const float* x, int k, const int* expert_ids, int expert_begin,
                         int expert_end, QuantExpertTable gate, QuantExpertTable up, float* h) {
  extern __shared__ float xs[];  // [PaddedFloats(hidden)]
  __shared__ float scratch[32];
  constexpr int kChunk = ChunkElements<F>();
  constexpr int kUnroll = IsFp4(F) ? 2 : 4;     // a 2048-wide row in one pass either way
  constexpr int kRowBytes2 = IsFp4(F) ? 1 : 2;  // bytes of codes per 2 weights
  WaitForPrerequisites();                       // the expert ids are the previous kernel's output
  AllowDependentsToLaunch();
  const int pair = blockIdx.y, row = pair / k;
  const int hidden = gate.cols, inter = gate.rows;
  const int lane = threadIdx.x & 31;
  const int first = (blockIdx.x * kWarps + threadIdx.x / 32) * kRowsPerWarp;
  const bool active = first < inter;
  const int chunks = hidden / kChunk;
  const int e = expert_ids[pair];
  if (e < expert_begin || e >= expert_end) {
    if (lane == 0)
      for (int rr = 0; rr < kRowsPerWarp; ++rr)
        if (first + rr < inter) h[static_cast<int64_t>(pair) * inter + first + rr] = 0.f;
    return;
  }
  const uint8_t* codes[2] = {static_cast<const uint8_t*>(gate.codes[e]),
                             static_cast<const uint8_t*>(up.codes[e])};
  const void* scales[2] = {gate.scales[e], up.scales[e]};
  const void* globals[2] = {nullptr, nullptr};
  const QuantExpertTable* tables[2] = {&gate, &up};
  if constexpr (F == QuantFormat::kNvfp4) {
    globals[0] = gate.global_scales[e];
    globals[1] = up.global_scales[e];
  }
  int out[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) out[rr] = min(first + rr, inter - 1);

  uint4 packed[2][kRowsPerWarp][kUnroll];
  uint32_t scale_bits[2][kRowsPerWarp][kUnroll], row_bits[2][kRowsPerWarp];
  auto load = [&](int c0) {
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (active && c0 + 32 * u < chunks) {
            const uint4* w = reinterpret_cast<const uint4*>(
                codes[p] + static_cast<int64_t>(out[rr]) * hidden * kRowBytes2 / 2);
            packed[p][rr][u] = __ldcs(w + c0 + 32 * u);
            scale_bits[p][rr][u] = LoadChunkScaleBits<F>(scales[p], tables[p]->scale_dtype, out[rr],
                                                         c0 + 32 * u, hidden);
          }
  };
  load(lane);
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr)
      row_bits[p][rr] =
          LoadRowFactorBits<F>(ExpertScales(*tables[p], scales[p], globals[p]), out[rr]);
  float inv[1];
  StagePaddedInput<1>(x + static_cast<int64_t>(row) * hidden, 1, hidden, nullptr, DType::kBF16, 0.f,
                      nullptr, xs, scratch, inv);
  if (!active) return;

  float acc[2][kRowsPerWarp] = {};
  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    if (c0 != lane) load(c0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      const float* xc = xs + PaddedIndex(c * kChunk);
#pragma unroll
      for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int rr = 0; rr < kRowsPerWarp; ++rr)
          ChunkDot<F, 1>(packed[p][rr][u],
                         DecodeChunkScale<F>(scale_bits[p][rr][u], tables[p]->scale_dtype), xc, 0,
                         1, &acc[p][rr]);
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    if (first + rr >= inter) break;
    const float g = WarpSum(acc[0][rr]) * DecodeRowFactor<F>(row_bits[0][rr], gate.scale_dtype);
    const float u = WarpSum(acc[1][rr]) * DecodeRowFactor<F>(row_bits[1][rr], up.scale_dtype);
    if (lane == 0) h[static_cast<int64_t>(pair) * inter + first + rr] = g / (1.f + expf(-g)) * u;
  }
}

// grid (ceil(hidden / 8), rows), 256 threads: warp w computes output j = 8 blockIdx.x + w of
// row r, over all k slots: y[r, j] += sum_slot weight_slot *
// factor(e_slot, j) * (Wd[e_slot][j] . h[r, slot]). As in MoeDownCombine, the k slots' chunks
// are one flat list of (slot, chunk) items so a lane keeps kUnroll loads in flight across
// slots, and each slot's pointers are read once by lane `slot` and shuffled to the lanes that
// need them. h (the previous kernel's output) is staged in padded shared memory after the wait;
// the weights (the routing is two kernels back) are loaded before it. Each lane's items and
// their order are fixed, so the sum is deterministic. A slot of an expert outside
// [expert_begin, expert_end) has no codes (its items read as zero codes and scales, its h is
// MoeGateUpQuant's zeros) and factor 0: it adds exactly 0.
template <QuantFormat F>
__global__ void __launch_bounds__(kWarps * 32)
    MoeDownCombineQuantKernel(const float* h, const int* expert_ids, const float* weights,
                              int skip_expert, int expert_begin, int expert_end, int k,
                              QuantExpertTable down, float* y) {
  extern __shared__ float hs[];  // [k][PaddedFloats(inter)]
  __shared__ float scratch[32];
  constexpr int kChunk = ChunkElements<F>();
  // 12 FP4 or 24 FP8 items a lane at qwen3-30b-a3b, 11 FP8 at qwen3-next: one batch, one
  // round of loads.
  constexpr int kUnroll = 12;
  constexpr int kRowBytes2 = IsFp4(F) ? 1 : 2;
  const int row = blockIdx.y;
  const int hidden = down.rows, inter = down.cols;
  const int lane = threadIdx.x & 31;
  const int first = (blockIdx.x * kWarps + threadIdx.x / 32) * kDownRowsPerWarp;
  const bool active = first < hidden;
  const int chunks = inter / kChunk, items = k * chunks;
  int out[kDownRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kDownRowsPerWarp; ++rr) out[rr] = min(first + rr, hidden - 1);
  // Lane s < k holds slot s: its expert's codes and scales (null for an expert not held here),
  // routing weight (0 for a skipped expert) and row factors.
  const uint8_t* my_codes = nullptr;
  const void* my_scales = nullptr;
  float my_weight = 0.f;
  uint32_t my_row_bits[kDownRowsPerWarp] = {};
  const int e = lane < k ? expert_ids[row * k + lane] : -1;
  if (lane < k && e >= expert_begin && e < expert_end) {
    my_codes = static_cast<const uint8_t*>(down.codes[e]);
    my_scales = down.scales[e];
    const void* global = F == QuantFormat::kNvfp4 ? down.global_scales[e] : nullptr;
    my_weight = e == skip_expert ? 0.f : weights[row * k + lane];
#pragma unroll
    for (int rr = 0; rr < kDownRowsPerWarp; ++rr)
      my_row_bits[rr] = LoadRowFactorBits<F>(ExpertScales(down, my_scales, global), out[rr]);
  }
  uint4 packed[kDownRowsPerWarp][kUnroll];
  uint32_t scale_bits[kDownRowsPerWarp][kUnroll];
  int slot_of[kUnroll];
  // Issues batch `base`'s loads (every lane runs the shuffles: the loop bounds are warp-uniform).
  auto load = [&](int base) {
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int item = min(base + lane + 32 * i, items - 1);
      const int slot = item / chunks, c = item - slot * chunks;
      const auto slot_codes = reinterpret_cast<const uint8_t*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_codes), slot));
      const auto slot_scales = reinterpret_cast<const void*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_scales), slot));
      slot_of[i] = slot;
      if (active && base + lane + 32 * i < items) {
#pragma unroll
        for (int rr = 0; rr < kDownRowsPerWarp; ++rr) {
          packed[rr][i] = make_uint4(0, 0, 0, 0);
          scale_bits[rr][i] = 0;
          if (slot_codes) {
            const uint4* w = reinterpret_cast<const uint4*>(
                slot_codes + static_cast<int64_t>(out[rr]) * inter * kRowBytes2 / 2);
            packed[rr][i] = __ldcs(w + c);
            scale_bits[rr][i] =
                LoadChunkScaleBits<F>(slot_scales, down.scale_dtype, out[rr], c, inter);
          }
        }
      }
    }
  };
  load(0);
  WaitForPrerequisites();  // h is the previous kernel's output
  AllowDependentsToLaunch();
  float inv[1];
  StagePaddedInput<1>(h + static_cast<int64_t>(row) * k * inter, k, inter, nullptr, DType::kBF16,
                      0.f, nullptr, hs, scratch, inv);
  if (!active) return;  // warp-uniform: the shuffles below see every lane

  float my_factor[kDownRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kDownRowsPerWarp; ++rr)
    my_factor[rr] =
        my_codes ? my_weight * DecodeRowFactor<F>(my_row_bits[rr], down.scale_dtype) : 0.f;
  const int ld = PaddedFloats(inter);
  float total[kDownRowsPerWarp] = {};
  for (int base = 0; base < items; base += 32 * kUnroll) {
    if (base > 0) load(base);
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      float factor[kDownRowsPerWarp];
#pragma unroll
      for (int rr = 0; rr < kDownRowsPerWarp; ++rr)
        factor[rr] = __shfl_sync(0xffffffffu, my_factor[rr], slot_of[i]);
      const int item = base + lane + 32 * i;
      if (item >= items) continue;
      const int c = item - slot_of[i] * chunks;
      const float* hc = hs + slot_of[i] * ld + PaddedIndex(c * kChunk);
#pragma unroll
      for (int rr = 0; rr < kDownRowsPerWarp; ++rr) {
        float part = 0.f;
        ChunkDot<F, 1>(packed[rr][i], DecodeChunkScale<F>(scale_bits[rr][i], down.scale_dtype), hc,
                       0, 1, &part);
        total[rr] += factor[rr] * part;
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kDownRowsPerWarp; ++rr) {
    if (first + rr >= hidden) break;
    const float sum = WarpSum(total[rr]);
    if (lane == 0) y[static_cast<int64_t>(row) * hidden + first + rr] += sum;
  }
}

template <QuantFormat F>
void ConfigureShared() {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {
    cudaFuncSetAttribute(MoeGateUpQuantKernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         kMoeMaxSharedBytes);
    cudaFuncSetAttribute(MoeDownCombineQuantKernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         kMoeMaxSharedBytes);
  });
}

template <QuantFormat F>
void LaunchGateUp(const float* x, int rows, int k, const int* expert_ids, int expert_begin,
                  int expert_end, const QuantExpertTable& gate, const QuantExpertTable& up,
                  float* h, cudaStream_t stream) {
  ConfigureShared<F>();
  const dim3 grid(CeilDiv(gate.rows, kWarps * kRowsPerWarp), rows * k);
  Launch(MoeGateUpQuantKernel<F>, grid, dim3(kWarps * 32),
         static_cast<size_t>(PaddedFloats(gate.cols)) * sizeof(float), stream, x, k, expert_ids,
         expert_begin, expert_end, gate, up, h);
}

template <QuantFormat F>
void LaunchDown(const float* h, int rows, int k, const int* expert_ids, const float* weights,
                int skip_expert, int expert_begin, int expert_end, const QuantExpertTable& down,
                float* y, cudaStream_t stream) {
  ConfigureShared<F>();
  const dim3 grid(CeilDiv(down.rows, kWarps * kDownRowsPerWarp), rows);
  Launch(MoeDownCombineQuantKernel<F>, grid, dim3(kWarps * 32),
         static_cast<size_t>(k) * PaddedFloats(down.cols) * sizeof(float), stream, h, expert_ids,
         weights, skip_expert, expert_begin, expert_end, k, down, y);
}

}  // namespace

bool MoeQuantSupports(const QuantExpertTable& t, int slots) {
  if (t.format == QuantFormat::kNone || t.rows <= 0 || t.cols <= 0 || slots <= 0) return false;
  const int chunk = IsFp4(t.format) ? 32 : 16;
  return t.cols % chunk == 0 &&
         static_cast<int64_t>(slots) * PaddedFloats(t.cols) * 4 <= kMoeMaxSharedBytes;
}

void MoeGateUpQuant(const float* x, int rows, int k, const int* expert_ids, int expert_begin,
                    int expert_end, const QuantExpertTable& gate, const QuantExpertTable& up,
                    float* h, cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return;  // an empty grid is a launch error
  auto launch = [&](auto launcher) {
    launcher(x, rows, k, expert_ids, expert_begin, expert_end, gate, up, h, stream);
  };
  switch (gate.format) {
    case QuantFormat::kNvfp4:
      return launch(LaunchGateUp<QuantFormat::kNvfp4>);
    case QuantFormat::kMxfp4:
      return launch(LaunchGateUp<QuantFormat::kMxfp4>);
    case QuantFormat::kFp8Tensor:
      return launch(LaunchGateUp<QuantFormat::kFp8Tensor>);
    case QuantFormat::kFp8Channel:
      return launch(LaunchGateUp<QuantFormat::kFp8Channel>);
    case QuantFormat::kFp8Block128:
      return launch(LaunchGateUp<QuantFormat::kFp8Block128>);
    case QuantFormat::kNone:
      return;
  }
}

void MoeDownCombineQuant(const float* h, int rows, int k, const int* expert_ids,
                         const float* weights, int skip_expert, int expert_begin, int expert_end,
                         const QuantExpertTable& down, float* y, cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return;
  auto launch = [&](auto launcher) {
    launcher(h, rows, k, expert_ids, weights, skip_expert, expert_begin, expert_end, down, y,
             stream);
  };
  switch (down.format) {
    case QuantFormat::kNvfp4:
      return launch(LaunchDown<QuantFormat::kNvfp4>);
    case QuantFormat::kMxfp4:
      return launch(LaunchDown<QuantFormat::kMxfp4>);
    case QuantFormat::kFp8Tensor:
      return launch(LaunchDown<QuantFormat::kFp8Tensor>);
    case QuantFormat::kFp8Channel:
      return launch(LaunchDown<QuantFormat::kFp8Channel>);
    case QuantFormat::kFp8Block128:
      return launch(LaunchDown<QuantFormat::kFp8Block128>);
    case QuantFormat::kNone:
      return;
  }
}

}  // namespace infersweep::cuda
