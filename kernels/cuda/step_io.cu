// A decode step's way in and way out, as kernels rather than copies.
//
// In: the step's token ids and position are read by the first kernel straight from pinned host
// memory (mapped: the same pointer under unified addressing), which also gathers the embedding
// rows and zeroes the counters the step's kernels count on. It replaces two copy-engine nodes,
// the embedding kernel and a memset node of a captured step.
// Out: the greedy next token of each sequence, picked where the logits are; the host reads one
// int a sequence instead of the vocabulary's floats (608 KB a sequence on qwen3-30b-a3b: ~12 us
// of PCIe at ~50 GB/s a step, 39 MB at batch 64).
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace infersweep::cuda {
namespace {

constexpr int kInputThreads = 256;
constexpr int kGreedyThreads = 256;
constexpr int kGreedyPerThread = 8;
constexpr int kGreedyChunk = kGreedyThreads * kGreedyPerThread;  // logits a block

// One block a row: its token id (and, block 0, the position) from the host, then its
// embedding row upcast to fp32. Block 0 also zeroes `zero_count` counters.
__global__ void StepInputsKernel(const int32_t* host_tokens, const int* host_position,
                                 int32_t* tokens, int* position, const void* table, DType dtype,
                                 int hidden, float* x, unsigned* zero, int zero_count,
                                 const int2* host_ragged, int2* ragged) {
  __shared__ int32_t token;
  if (threadIdx.x == 0) {
    token = *reinterpret_cast<const volatile int32_t*>(host_tokens + blockIdx.x);
    tokens[blockIdx.x] = token;
    if (blockIdx.x == 0) *position = *reinterpret_cast<const volatile int*>(host_position);
    if (ragged) {
      const volatile int* pair = reinterpret_cast<const volatile int*>(host_ragged + blockIdx.x);
      ragged[blockIdx.x] = make_int2(pair[0], pair[1]);
    }
  }
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < zero_count; i += blockDim.x) zero[i] = 0u;
  __syncthreads();
  const int64_t base = static_cast<int64_t>(token) * hidden;
  float* out = x + static_cast<int64_t>(blockIdx.x) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    out[i] = LoadAsFloat(table, dtype, base + i);
}

// A logit's rank as an unsigned key: larger logits larger keys (the sign-magnitude bits made
// monotonic), the lower index winning among equal logits. 0 ranks below every candidate: a row
// with no logit above -inf (all NaN, say) picks token 0, as the host's Greedy does.
__device__ __forceinline__ unsigned long long GreedyKey(float v, int index) {
  if (!(v > -INFINITY)) return 0ull;                          // NaN and -inf never win
  const unsigned bits = __float_as_uint(v == 0.f ? 0.f : v);  // -0 == +0: the lower index wins
  const unsigned ordered = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return (static_cast<unsigned long long>(ordered) << 32) |
         (0xffffffffu - static_cast<unsigned>(index));
}

__device__ __forceinline__ unsigned long long WarpMaxKey(unsigned long long v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// Grid (chunks, rows). Each block ranks its chunk of a row and folds its best into the row's key
// (atomicMax); the row's last block to finish (its ticket) turns the key into the token id,
// writes it to `out` (pinned host memory) and resets the key and the ticket for the next launch.
__global__ void GreedyTokensKernel(const float* logits, int vocab, unsigned long long* keys,
                                   unsigned* tickets, int32_t* out) {
  WaitForPrerequisites();
  __shared__ unsigned long long warp_best[kGreedyThreads / 32];
  const int row = blockIdx.y;
  const float* r = logits + static_cast<int64_t>(row) * vocab;
  const int first = blockIdx.x * kGreedyChunk;
  unsigned long long best = 0ull;
#pragma unroll
  for (int i = 0; i < kGreedyPerThread; ++i) {
    const int index = first + i * kGreedyThreads + threadIdx.x;
    if (index < vocab) {
      const unsigned long long key = GreedyKey(__ldcg(r + index), index);
      best = key > best ? key : best;
    }
  }
  best = WarpMaxKey(best);
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x / 32] = best;
  __syncthreads();
  if (threadIdx.x >= 32) return;
  best = WarpMaxKey(threadIdx.x < kGreedyThreads / 32 ? warp_best[threadIdx.x] : 0ull);
  if (threadIdx.x != 0) return;
  if (best) atomicMax(keys + row, best);
  __threadfence();  // the key before the ticket: the last block reads every block's
  if (atomicAdd(tickets + row, 1u) + 1 != gridDim.x) return;
  const unsigned long long final_key = atomicExch(keys + row, 0ull);
  tickets[row] = 0u;
  *reinterpret_cast<volatile int32_t*>(out + row) =
      final_key ? static_cast<int32_t>(0xffffffffu - static_cast<unsigned>(final_key)) : 0;
}

}  // namespace

void StepInputs(const StepInputArgs& a, cudaStream_t stream) {
  LaunchPlain(StepInputsKernel, a.rows, kInputThreads, 0, stream, a.host_tokens, a.host_position,
              a.tokens, a.position, a.embed.data, a.embed.dtype, static_cast<int>(a.embed.cols),
              a.x, a.zero, a.zero_count, a.host_ragged, a.ragged);
}

void GreedyTokens(const float* logits, int rows, int vocab, const GreedyScratch& scratch,
                  int32_t* out, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(vocab, kGreedyChunk)), static_cast<unsigned>(rows));
  Launch(GreedyTokensKernel, grid, dim3(kGreedyThreads), 0, stream, logits, vocab, scratch.keys,
         scratch.tickets, out);
}

}  // namespace infersweep::cuda
