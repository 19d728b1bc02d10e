// Router softmax + top-k of one row, by one warp: shared by the top-k kernel (moe.cu) and the
// router GEMV that finishes with it (gemv.cu).
#pragma once

#include "kernels/cuda/common.cuh"

namespace infersweep::cuda {

// Softmax and top-k of one row of router logits, by one warp (every lane calls it). Lane l holds
// the probabilities of experts l, l+32, ... in registers (kPerLane of them, E <= 32 * kPerLane),
// so softmax is one pass and each of the k rounds is a register scan plus a 5-step shuffle. The first version re-read the logits and recomputed expf
// every round: 9.5 us a layer at batch 1.
template <int kPerLane>
__device__ __forceinline__ void RouterTopKRow(const float* l, int num_experts, int k,
                                              bool renormalize, int* ids, float* weights) {
  const int lane = threadIdx.x & 31;
  float p[kPerLane];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < num_experts ? __ldcg(l + e) : -INFINITY;  // L2: another block may have written it
    m = fmaxf(m, p[i]);
  }
  m = WarpMax(m);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    p[i] = lane + 32 * i < num_experts ? expf(p[i] - m) : 0.f;
    sum += p[i];
  }
  sum = WarpSum(sum);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) p[i] /= sum;
  unsigned chosen = 0;  // bit i: expert lane + 32 i already taken
  float chosen_sum = 0.f;
  int my_id = 0;
  float my_weight = 0.f;
  for (int slot = 0; slot < k; ++slot) {
    float best = -INFINITY;
    int best_id = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e >= num_experts || ((chosen >> i) & 1u)) continue;
      // NaN probabilities never compare greater: take the first free expert so a garbage row
      // still yields valid ids (the verdict, not a crash, must report it).
      if (best_id == 0x7fffffff || p[i] > best) {  // e rises with i: ties keep the lower index
        best = p[i];
        best_id = e;
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
      if (other_id != 0x7fffffff &&
          (best_id == 0x7fffffff || other > best || (other == best && other_id < best_id))) {
        best = other;
        best_id = other_id;
      }
    }
    if (best_id != 0x7fffffff && (best_id & 31) == lane) chosen |= 1u << (best_id >> 5);
    if (lane == slot) {
      my_id = best_id;
      my_weight = best;
    }
    chosen_sum += best;
  }
  if (lane < k) {
    ids[lane] = my_id;
    weights[lane] = renormalize ? my_weight / chosen_sum : my_weight;
  }
}

}  // namespace infersweep::cuda
