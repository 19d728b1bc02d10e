// MoE routing math on the device, shared by the top-k kernel (moe.cu) and the persistent decode
// kernel (sm90a/decode_persistent.cu), so both pick the same experts with the same weights.
#pragma once

#include "kernels/cuda/common.cuh"

namespace infersweep::cuda {

// A top-k selection key (a probability, or -1 for NaN) as an unsigned that orders as the key
// does: the bits of keys >= 0 order as they do, the others (complemented) below them; every
// key maps above 0, which stands for "no candidate".
__device__ __forceinline__ unsigned OrderedTopKKey(float key) {
  const unsigned bits = __float_as_uint(key);
  return key >= 0.f ? bits | 0x80000000u : ~bits;
}
__device__ __forceinline__ float KeyOfOrderedTopKKey(unsigned ordered) {
  return __uint_as_float(ordered & 0x80000000u ? ordered & 0x7fffffffu : ~ordered);
}

// Softmax over one row of router logits, then the k largest probabilities, for one warp: lane l
// holds experts l, l + 32, ... in registers (kPerLane of them, num_experts <= 32 * kPerLane), so
// the softmax is one pass and each of the k rounds a register pass (a scan, or a tournament
// from 8 a lane) plus two warp reductions.
// Lane s < k ends with slot s: *my_id and *my_weight (renormalised over the k when asked).
// Ties keep the lower expert index. NaN probabilities (a NaN upstream) rank below every number,
// so the k rounds always pick k distinct experts below num_experts; their weights stay NaN.
// The logits are read through L2 (__ldcg): the persistent kernel reads them in the launch that
// wrote them, from another SM.
// `scale` multiplies every logit as it is read (the persistent kernel's logits are sums of the
// unnormalised input; its 1 / rms comes after).
template <int kPerLane>
__device__ __forceinline__ void WarpTopK(const float* logits, int num_experts, int k,
                                         bool renormalize, int* my_id, float* my_weight,
                                         float scale = 1.f) {
  const int lane = threadIdx.x & 31;
  float p[kPerLane];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < num_experts ? __ldcg(logits + e) * scale : -INFINITY;
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
  // Selection keys: the probabilities, NaN below every one of them. (Comparing NaN directly left
  // lanes disagreeing on each round's winner: repeated ids, or 0x7fffffff past E.)
  float key[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    p[i] /= sum;
    key[i] = p[i] == p[i] ? p[i] : -1.f;
  }
  float chosen_sum = 0.f;
  int id = 0;
  float weight_of_slot = 0.f;
#if __CUDA_ARCH__ >= 800
  constexpr bool kTournament = kPerLane > 4;
#else
  constexpr bool kTournament = false;  // redux.sync is sm_80+
#endif
  if constexpr (kTournament) {
    // Many experts a lane (qwen3-next's 512: 16): the lane's candidates as ordered keys (0: none
    // or taken), its best each round a tournament of adjacent pairs, log2 kPerLane compare-selects
    // deep, where a scan is a chain of kPerLane; the round's latency is the step's.
    unsigned ordered[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      ordered[i] = lane + 32 * i < num_experts ? OrderedTopKKey(key[i]) : 0u;
    for (int slot = 0; slot < k; ++slot) {
      unsigned value[kPerLane / 2];
      int at[kPerLane / 2];
#pragma unroll
      for (int i = 0; i < kPerLane / 2; ++i) {  // ties keep the left, lower index
        const bool right = ordered[2 * i + 1] > ordered[2 * i];
        value[i] = right ? ordered[2 * i + 1] : ordered[2 * i];
        at[i] = right ? 2 * i + 1 : 2 * i;
      }
#pragma unroll
      for (int n = kPerLane / 4; n >= 1; n /= 2)
#pragma unroll
        for (int i = 0; i < n; ++i) {
          const bool right = value[2 * i + 1] > value[2 * i];
          value[i] = right ? value[2 * i + 1] : value[2 * i];
          at[i] = right ? at[2 * i + 1] : at[2 * i];
        }
      const unsigned top = __reduce_max_sync(0xffffffffu, value[0]);
      const int best_id = static_cast<int>(__reduce_min_sync(
          0xffffffffu,
          value[0] == top && top != 0u ? static_cast<unsigned>(lane + 32 * at[0]) : 0x7fffffffu));
      if (best_id != 0x7fffffff && (best_id & 31) == lane) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i)
          if (i == (best_id >> 5)) ordered[i] = 0u;
      }
      const float best = KeyOfOrderedTopKKey(top);
      const float weight = best < 0.f ? NAN : best;  // a NaN probability keeps its NaN weight
      if (lane == slot) {
        id = best_id;
        weight_of_slot = weight;
      }
      chosen_sum += weight;
    }
  } else {
    unsigned chosen = 0;  // bit i: expert lane + 32 i already taken
    for (int slot = 0; slot < k; ++slot) {
      float best = -INFINITY;
      int best_id = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e >= num_experts || ((chosen >> i) & 1u)) continue;
      if (best_id == 0x7fffffff || key[i] > best) {  // e rises with i: ties keep the lower index
        best = key[i];
        best_id = e;
      }
    }
#if __CUDA_ARCH__ >= 800
    // Two warp reductions (redux.sync) in place of five shuffle rounds: the largest key as an
    // ordered integer (OrderedTopKKey), then the lowest expert index among the lanes holding it.
    // In the persistent decode, top-k and x's staging sit between the o barrier and the
    // experts' streaming, so every reduction round is on the step's critical path.
    {
      const unsigned ordered = best_id == 0x7fffffff ? 0u : OrderedTopKKey(best);
      const unsigned top = __reduce_max_sync(0xffffffffu, ordered);
      best_id = static_cast<int>(__reduce_min_sync(
          0xffffffffu, ordered == top && top != 0u ? static_cast<unsigned>(best_id) : 0x7fffffffu));
      best = KeyOfOrderedTopKKey(top);
    }
#else
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
      if (other_id != 0x7fffffff &&
          (best_id == 0x7fffffff || other > best || (other == best && other_id < best_id))) {
        best = other;
        best_id = other_id;
      }
    }
#endif
    if (best_id != 0x7fffffff && (best_id & 31) == lane) chosen |= 1u << (best_id >> 5);
    const float weight = best < 0.f ? NAN : best;  // a NaN probability keeps its NaN weight
    if (lane == slot) {
      id = best_id;
      weight_of_slot = weight;
    }
    chosen_sum += weight;
  }
  }
  *my_id = id;
  *my_weight = renormalize ? weight_of_slot / chosen_sum : weight_of_slot;
}

// Stores one row's routing from WarpTopK's lanes: lane s < k its slot s; with shared_logit (a
// shared expert folded in as one more pair), lane k the shared slot, expert num_experts with
// the shared gate's weight sigmoid(logit). Rows then have k + 1 slots (k <= 31). The logit is
// read through L2: the fused router GEMV's other blocks wrote it in the same launch.
__device__ __forceinline__ void StoreRouting(int row, int lane, int k, int num_experts, int id,
                                             float weight, const float* shared_logit,
                                             int* expert_ids, float* expert_weights) {
  const int64_t base = static_cast<int64_t>(row) * (k + (shared_logit ? 1 : 0));
  if (lane < k) {
    expert_ids[base + lane] = id;
    expert_weights[base + lane] = weight;
  } else if (shared_logit && lane == k) {
    expert_ids[base + k] = num_experts;
    expert_weights[base + k] = 1.f / (1.f + expf(-__ldcg(shared_logit + row)));
  }
}

}  // namespace infersweep::cuda
