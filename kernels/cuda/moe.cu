#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/routing.cuh"

namespace infersweep::cuda {
namespace {

// One warp per row (WarpTopK, routing.cuh): the logits and their exponentials are read once into
// registers, not once per round of the top-k.
template <int kPerLane>
__global__ void RouterTopKKernel(const float* logits, int rows, int num_experts, int k,
                                 bool renormalize, int* expert_ids, float* expert_weights,
                                 const float* shared_logit) {
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  int id;
  float weight;
  WarpTopK<kPerLane>(logits + static_cast<int64_t>(row) * num_experts, num_experts, k,
                     renormalize, &id, &weight);
  StoreRouting(row, lane, k, num_experts, id, weight, shared_logit, expert_ids, expert_weights);
}

// grid (ceil(inter / 8), pairs), 256 threads: warp w computes output i = blockIdx.x * 8 + w for
// both gate and up. Its first 2 x kUnroll weight loads (all of a 2048-wide row) are issued
// before x is staged in shared memory (16-byte loads, all in flight), so the staging and its
// barrier hide under their DRAM latency. Needs hidden % 8 == 0. A pair of an expert outside
// [expert_begin, expert_end) writes zeros (the down kernel then adds 0 for it) and reads no
// weights: the block's pair is one, so the whole block leaves before any barrier.
__global__ void MoeGateUpKernel(const float* x, int k, const int* expert_ids, int expert_begin,
                                int expert_end, const uint16_t* const* gate,
                                const uint16_t* const* up, int hidden, int inter, float* h) {
  extern __shared__ float xs[];
  constexpr int kUnroll = 8;
  WaitForPrerequisites();  // the expert ids are the previous kernel's output
  AllowDependentsToLaunch();
  const int pair = blockIdx.y, row = pair / k;
  const int out = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x & 31;
  const bool active = out < inter;
  const int chunks = hidden / 8;
  const int e = expert_ids[pair];
  if (e < expert_begin || e >= expert_end) {
    if (active && lane == 0) h[static_cast<int64_t>(pair) * inter + out] = 0.f;
    return;
  }
  const int64_t offset = static_cast<int64_t>(active ? out : 0) * hidden;
  const uint4* g = reinterpret_cast<const uint4*>(gate[e] + offset);
  const uint4* u = reinterpret_cast<const uint4*>(up[e] + offset);
  uint4 gw[kUnroll], uw[kUnroll];
#pragma unroll
  for (int i = 0; i < kUnroll; ++i)
    if (active && lane + 32 * i < chunks) {
      gw[i] = __ldcs(g + lane + 32 * i);
      uw[i] = __ldcs(u + lane + 32 * i);
    }
  StageFloats(x + static_cast<int64_t>(row) * hidden, hidden, xs);
  __syncthreads();
  if (!active) return;
  float ga = 0.f, ua = 0.f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    if (c0 != lane) {
#pragma unroll
      for (int i = 0; i < kUnroll; ++i)
        if (c0 + 32 * i < chunks) {
          gw[i] = __ldcs(g + c0 + 32 * i);
          uw[i] = __ldcs(u + c0 + 32 * i);
        }
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int c = c0 + 32 * i;
      if (c >= chunks) break;
      ga += Dot8Bf16(gw[i], xs + c * 8);
      ua += Dot8Bf16(uw[i], xs + c * 8);
    }
  }
  ga = WarpSum(ga);
  ua = WarpSum(ua);
  if (lane == 0) h[static_cast<int64_t>(pair) * inter + out] = ga / (1.f + expf(-ga)) * ua;
}

// grid (ceil(hidden / 8), rows), 256 threads: warp computes output j of row r over all k slots,
// y[r, j] += sum_slot w[slot] * (Wd[e_slot][j] . h[r, slot]). One launch instead of a down GEMV
// plus a combine; the pair outputs never reach DRAM. The k slots' rows are one flat list of
// (slot, chunk) items so a lane has kUnroll loads in flight across slots: looping slot by slot
// would wait out one DRAM round trip per slot. Each slot's row
// address is computed once by lane `slot` and shuffled to the lanes that need it: resolving
// expert id -> pointer table -> row per item put two dependent loads in front of every weight
// load. h is read through L1 (8 warps share it). Each lane's items and their order are fixed,
// so the sum is deterministic. A slot of an expert outside [expert_begin, expert_end) has no row
// (its weights read as zeros, its h is MoeGateUp's zeros) and weight 0: it adds exactly 0.
// Batch 1, qwen3-30b-a3b: 8 x 2048 x 768 x 2 B = 25 MB -> 5.6 us.
__global__ void MoeDownCombineKernel(const float* h, const int* expert_ids, const float* weights,
                                     int skip_expert, int expert_begin, int expert_end, int k,
                                     const uint16_t* const* down, int hidden, int inter, float* y) {
  constexpr int kUnroll = 12;  // 24 items a lane at qwen3-30b-a3b shapes: two batches
  const int row = blockIdx.y;
  const int out = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (out >= hidden) return;
  const int chunks = inter / 8, items = k * chunks;
  // Lane s < k holds slot s: its row of Wd[e_s] (null for an expert not held here), its routing
  // weight (0 for a skipped expert or one not held here).
  const uint4* my_row = nullptr;
  float my_weight = 0.f;
  if (lane < k) {
    const int e = expert_ids[row * k + lane];
    if (e >= expert_begin && e < expert_end) {
      my_row = reinterpret_cast<const uint4*>(down[e] + static_cast<int64_t>(out) * inter);
      my_weight = e == skip_expert ? 0.f : weights[row * k + lane];
    }
  }
  const float* hr = h + static_cast<int64_t>(row) * k * inter;
  float total = 0.f;
  uint4 w[kUnroll];
  float slot_weight[kUnroll];
  int slot_of[kUnroll];
  // Issues batch `base`'s weight loads (row addresses shuffled from lane `slot`).
  auto load = [&](int base) {
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int item = min(base + lane + 32 * i, items - 1);
      const int slot = item / chunks;
      const auto slot_row = reinterpret_cast<const uint4*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_row), slot));
      slot_weight[i] = __shfl_sync(0xffffffffu, my_weight, slot);
      slot_of[i] = slot;
      if (base + lane + 32 * i < items)
        w[i] = slot_row ? __ldcs(slot_row + (item - slot * chunks)) : make_uint4(0, 0, 0, 0);
    }
  };
  load(0);  // the routing is two kernels back (top-k): readable before the wait
  WaitForPrerequisites();  // h is the previous kernel's output
  AllowDependentsToLaunch();
  // The loop bound is warp-uniform: every lane must reach the shuffles (items < 32 at small
  // shapes left lanes out of the loop, and their shuffles undefined: an illegal address).
  for (int base = 0; base < items; base += 32 * kUnroll) {
    if (base > 0) load(base);
    const int i0 = base + lane;
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int item = i0 + 32 * i;
      if (item >= items) break;
      float hv[8];
      LoadFloat8(hr + static_cast<int64_t>(slot_of[i]) * inter + (item - slot_of[i] * chunks) * 8, hv);
      total += slot_weight[i] * Dot8Bf16(w[i], hv);
    }
  }
  total = WarpSum(total);
  if (lane == 0) y[static_cast<int64_t>(row) * hidden + out] += total;
}

// One block per row; src bf16 [pairs, hidden].
__global__ void CombinePairsKernel(const __nv_bfloat16* src, const int* position,
                                   const float* weights, int k, int hidden, float* y) {
  const int row = blockIdx.x;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
    float acc = 0.f;
    for (int slot = 0; slot < k; ++slot) {
      const int p = position[row * k + slot];
      if (p >= 0)
        acc += weights[row * k + slot] * __bfloat162float(src[static_cast<int64_t>(p) * hidden + j]);
    }
    y[static_cast<int64_t>(row) * hidden + j] += acc;
  }
}

__global__ void SiluMulBf16Kernel(const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t n,
                                  __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(gate[i]);
    out[i] = __float2bfloat16_rn(g / (1.f + expf(-g)) * __bfloat162float(up[i]));
  }
}

__global__ void SigmoidGatedKernel(float* y, const float* shared, const float* gate_logit,
                                   int hidden) {
  const int row = blockIdx.x;
  const float s = 1.f / (1.f + expf(-gate_logit[row]));
  for (int j = threadIdx.x; j < hidden; j += blockDim.x)
    y[static_cast<int64_t>(row) * hidden + j] += s * shared[static_cast<int64_t>(row) * hidden + j];
}

__global__ void GatherRowsKernel(const float* x, const int* index, int hidden, float* out) {
  const int i = blockIdx.x;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x)
    out[static_cast<int64_t>(i) * hidden + j] = x[static_cast<int64_t>(index[i]) * hidden + j];
}

// bf16 rows, 16 bytes per thread (hidden % 8 == 0). Prefill 2048 on qwen3-30b-a3b: 16,384 rows
// of 4 KB, converted as they are gathered (one pass over the rows, not two).
__global__ void GatherRowsBf16Kernel(const uint16_t* x, const int* index, int hidden,
                                     uint16_t* out) {
  const int i = blockIdx.x, chunks = hidden / 8;
  const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(index[i]) * hidden);
  uint4* dst = reinterpret_cast<uint4*>(out + static_cast<int64_t>(i) * hidden);
  for (int j = threadIdx.x; j < chunks; j += blockDim.x) dst[j] = __ldg(src + j);
}

__global__ void ScatterAddRowsKernel(const float* src, const int* index, const float* weights,
                                     int hidden, float* y) {
  const int i = blockIdx.x;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x)
    y[static_cast<int64_t>(index[i]) * hidden + j] += weights[i] * src[static_cast<int64_t>(i) * hidden + j];
}

void ConfigureMoeSharedMemory() {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {
    cudaFuncSetAttribute(MoeGateUpKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMoeMaxSharedBytes);
  });
}

}  // namespace

void RouterTopK(const float* logits, int rows, int num_experts, int k, bool renormalize,
                int* expert_ids, float* expert_weights, cudaStream_t stream,
                const float* shared_logit) {
  const dim3 grid(CeilDiv(rows, 4)), block(128);
  auto launch = [&](auto kernel) {
    Launch(kernel, grid, block, 0, stream, logits, rows, num_experts, k, renormalize, expert_ids,
           expert_weights, shared_logit);
  };
  if (num_experts <= 128)
    launch(RouterTopKKernel<4>);
  else if (num_experts <= 256)
    launch(RouterTopKKernel<8>);
  else if (num_experts <= 512)  // qwen3-next, qwen3.5: half the per-lane rounds of <32>
    launch(RouterTopKKernel<16>);
  else
    launch(RouterTopKKernel<32>);
}

void MoeGateUp(const float* x, int rows, int k, const int* expert_ids, int expert_begin,
               int expert_end, const uint16_t* const* gate, const uint16_t* const* up, int hidden,
               int inter, float* h, cudaStream_t stream) {
  ConfigureMoeSharedMemory();
  Launch(MoeGateUpKernel, dim3(CeilDiv(inter, 8), rows * k), dim3(256), hidden * sizeof(float),
         stream, x, k, expert_ids, expert_begin, expert_end, gate, up, hidden, inter, h);
}

void MoeDownCombine(const float* h, int rows, int k, const int* expert_ids, const float* weights,
                    int skip_expert, int expert_begin, int expert_end, const uint16_t* const* down,
                    int hidden, int inter, float* y, cudaStream_t stream) {
  ConfigureMoeSharedMemory();
  Launch(MoeDownCombineKernel, dim3(CeilDiv(hidden, 8), rows), dim3(256), 0, stream, h, expert_ids,
         weights, skip_expert, expert_begin, expert_end, k, down, hidden, inter, y);
}

void CombinePairsBf16(const uint16_t* src, const int* position, const float* weights, int rows,
                      int k, int hidden, float* y, cudaStream_t stream) {
  LaunchPlain(CombinePairsKernel, rows, 256, 0, stream, reinterpret_cast<const __nv_bfloat16*>(src),
              position, weights, k, hidden, y);
}

void SiluMulBf16(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out,
                 cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(CeilDiv(n, 256), 4096));
  LaunchPlain(SiluMulBf16Kernel, blocks, 256, 0, stream,
              reinterpret_cast<const __nv_bfloat16*>(gate),
              reinterpret_cast<const __nv_bfloat16*>(up), n, reinterpret_cast<__nv_bfloat16*>(out));
}

void AddSigmoidGated(float* y, const float* shared, const float* gate_logit, int rows, int hidden,
                     cudaStream_t stream) {
  LaunchPlain(SigmoidGatedKernel, rows, 256, 0, stream, y, shared, gate_logit, hidden);
}

void GatherRows(const float* x, const int* index, int count, int hidden, float* out,
                cudaStream_t stream) {
  if (count > 0) LaunchPlain(GatherRowsKernel, count, 256, 0, stream, x, index, hidden, out);
}

void GatherRowsBf16(const uint16_t* x, const int* index, int count, int hidden, uint16_t* out,
                    cudaStream_t stream) {
  if (count > 0) LaunchPlain(GatherRowsBf16Kernel, count, 256, 0, stream, x, index, hidden, out);
}

void ScatterAddRows(const float* src, const int* index, const float* weights, int count, int hidden,
                    float* y, cudaStream_t stream) {
  if (count > 0)
    LaunchPlain(ScatterAddRowsKernel, count, 256, 0, stream, src, index, weights, hidden, y);
}

}  // namespace infersweep::cuda
