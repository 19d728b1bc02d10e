#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

// One warp per row. Each lane keeps its share of the E probabilities in registers-free form:
// we recompute from logits (E <= 1024, so 32 values per lane at most, read from L1).
__global__ void RouterTopKKernel(const float* logits, int rows, int num_experts, int k,
                                 bool renormalize, int* expert_ids, float* expert_weights) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* l = logits + static_cast<int64_t>(row) * num_experts;
  float m = -INFINITY;
  for (int e = lane; e < num_experts; e += 32) m = fmaxf(m, l[e]);
  m = WarpMax(m);
  float sum = 0.f;
  for (int e = lane; e < num_experts; e += 32) sum += expf(l[e] - m);
  sum = WarpSum(sum);
  // k rounds of arg-max over the not-yet-chosen experts (ties: lower index).
  unsigned long long chosen_mask[16] = {};  // up to 1024 experts
  float chosen_sum = 0.f;
  float weights[32];
  int ids[32];
  for (int slot = 0; slot < k; ++slot) {
    float best = -INFINITY;
    int best_id = 0x7fffffff;
    for (int e = lane; e < num_experts; e += 32) {
      if ((chosen_mask[e >> 6] >> (e & 63)) & 1ull) continue;
      const float p = expf(l[e] - m) / sum;
      // NaN probabilities never compare greater: take the first free expert so a garbage row
      // still yields valid ids (the verdict, not a crash, must report it).
      if (best_id == 0x7fffffff || p > best || (p == best && e < best_id)) {
        best = p;
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
    chosen_mask[best_id >> 6] |= 1ull << (best_id & 63);
    ids[slot] = best_id;
    weights[slot] = best;
    chosen_sum += best;
  }
  if (lane == 0) {
    for (int slot = 0; slot < k; ++slot) {
      expert_ids[static_cast<int64_t>(row) * k + slot] = ids[slot];
      expert_weights[static_cast<int64_t>(row) * k + slot] =
          renormalize ? weights[slot] / chosen_sum : weights[slot];
    }
  }
}

// 16-byte loads of 8 bf16 weights; x (fp32) from shared memory.
__device__ __forceinline__ float Dot8(const uint4 packed, const float* x) {
  const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(&packed);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(w[i]);
    acc += f.x * x[2 * i] + f.y * x[2 * i + 1];
  }
  return acc;
}

// grid (ceil(inter / 8), pairs), 256 threads: warp w computes output i = blockIdx.x * 8 + w for
// both gate and up. Requires hidden % 256 == 0 (8 bf16 per lane per step).
__global__ void MoeGateUpKernel(const float* x, int k, const int* expert_ids,
                                const uint16_t* const* gate, const uint16_t* const* up, int hidden,
                                int inter, float* h) {
  extern __shared__ float xs[];
  const int pair = blockIdx.y, row = pair / k;
  const int e = expert_ids[pair];
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) xs[i] = x[static_cast<int64_t>(row) * hidden + i];
  __syncthreads();
  const int out = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (out >= inter) return;
  const uint4* g = reinterpret_cast<const uint4*>(gate[e] + static_cast<int64_t>(out) * hidden);
  const uint4* u = reinterpret_cast<const uint4*>(up[e] + static_cast<int64_t>(out) * hidden);
  float ga = 0.f, ua = 0.f;
  for (int c = lane; c < hidden / 8; c += 32) {
    const uint4 gw = g[c], uw = u[c];
    ga += Dot8(gw, xs + c * 8);
    ua += Dot8(uw, xs + c * 8);
  }
  ga = WarpSum(ga);
  ua = WarpSum(ua);
  if (lane == 0) h[static_cast<int64_t>(pair) * inter + out] = ga / (1.f + expf(-ga)) * ua;
}

// grid (ceil(hidden / 8), pairs): warp computes output j of Wd[e] [hidden, inter] . h[pair].
__global__ void MoeDownKernel(const float* h, const int* expert_ids, const uint16_t* const* down,
                              int hidden, int inter, float* out_pair) {
  extern __shared__ float hs[];
  const int pair = blockIdx.y;
  const int e = expert_ids[pair];
  for (int i = threadIdx.x; i < inter; i += blockDim.x) hs[i] = h[static_cast<int64_t>(pair) * inter + i];
  __syncthreads();
  const int out = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (out >= hidden) return;
  const uint4* d = reinterpret_cast<const uint4*>(down[e] + static_cast<int64_t>(out) * inter);
  float acc = 0.f;
  for (int c = lane; c < inter / 8; c += 32) acc += Dot8(d[c], hs + c * 8);
  acc = WarpSum(acc);
  if (lane == 0) out_pair[static_cast<int64_t>(pair) * hidden + out] = acc;
}

__global__ void MoeCombineKernel(const float* out_pair, const float* weights,
                                 const int* expert_ids, int skip_expert, int k, int hidden,
                                 float* y) {
  const int row = blockIdx.x;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < k; ++s)
      if (expert_ids[row * k + s] != skip_expert)
        acc += weights[row * k + s] * out_pair[(static_cast<int64_t>(row) * k + s) * hidden + j];
    y[static_cast<int64_t>(row) * hidden + j] += acc;
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

__global__ void ScatterAddRowsKernel(const float* src, const int* index, const float* weights,
                                     int hidden, float* y) {
  const int i = blockIdx.x;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x)
    y[static_cast<int64_t>(index[i]) * hidden + j] += weights[i] * src[static_cast<int64_t>(i) * hidden + j];
}

}  // namespace

void RouterTopK(const float* logits, int rows, int num_experts, int k, bool renormalize,
                int* expert_ids, float* expert_weights, cudaStream_t stream) {
  RouterTopKKernel<<<CeilDiv(rows, 4), 128, 0, stream>>>(logits, rows, num_experts, k, renormalize,
                                                         expert_ids, expert_weights);
}

void MoeGateUp(const float* x, int rows, int k, const int* expert_ids, const uint16_t* const* gate,
               const uint16_t* const* up, int hidden, int inter, float* h, cudaStream_t stream) {
  MoeGateUpKernel<<<dim3(CeilDiv(inter, 8), rows * k), 256, hidden * sizeof(float), stream>>>(
      x, k, expert_ids, gate, up, hidden, inter, h);
}

void MoeDown(const float* h, int pairs, const int* expert_ids, int k, const uint16_t* const* down,
             int hidden, int inter, float* out_pair, cudaStream_t stream) {
  MoeDownKernel<<<dim3(CeilDiv(hidden, 8), pairs), 256, inter * sizeof(float), stream>>>(
      h, expert_ids, down, hidden, inter, out_pair);
}

void MoeCombine(const float* out_pair, const float* weights, const int* expert_ids, int skip_expert,
                int rows, int k, int hidden, float* y, cudaStream_t stream) {
  MoeCombineKernel<<<rows, 256, 0, stream>>>(out_pair, weights, expert_ids, skip_expert, k, hidden, y);
}

void AddSigmoidGated(float* y, const float* shared, const float* gate_logit, int rows, int hidden,
                     cudaStream_t stream) {
  SigmoidGatedKernel<<<rows, 256, 0, stream>>>(y, shared, gate_logit, hidden);
}

void GatherRows(const float* x, const int* index, int count, int hidden, float* out,
                cudaStream_t stream) {
  if (count > 0) GatherRowsKernel<<<count, 256, 0, stream>>>(x, index, hidden, out);
}

void ScatterAddRows(const float* src, const int* index, const float* weights, int count, int hidden,
                    float* y, cudaStream_t stream) {
  if (count > 0) ScatterAddRowsKernel<<<count, 256, 0, stream>>>(src, index, weights, hidden, y);
}

}  // namespace infersweep::cuda
