#include <algorithm>

#include "kernels/cuda/allreduce.h"
#include "kernels/cuda/common.cuh"

namespace infersweep::cuda {
namespace {

constexpr int kThreads = 512;

// The head of every peer buffer. start/mid/end[b][r]: the flag rank r's block b last wrote here
// at that barrier; calls[b]: this rank's block b's call count (its next flag), its own alone.
struct Signals {
  uint32_t start[kAllReduceBlocks][kAllReduceMaxRanks];
  uint32_t mid[kAllReduceBlocks][kAllReduceMaxRanks];
  uint32_t end[kAllReduceBlocks][kAllReduceMaxRanks];
  uint32_t calls[kAllReduceBlocks];
};
constexpr size_t kSignalBytes = (sizeof(Signals) + 4095) / 4096 * 4096;  // staging 4 KB aligned

__device__ __forceinline__ Signals* SignalsOf(void* base) { return static_cast<Signals*>(base); }
__device__ __forceinline__ uint4* StagingOf(void* base) {
  return reinterpret_cast<uint4*>(static_cast<char*>(base) + kSignalBytes);
}

__device__ __forceinline__ void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// This block's flag for this call: its call count, kept in its own signals so that a graph
// replay (same arguments) still counts.
__device__ __forceinline__ uint32_t NextFlag(const PeerBuffers& p) {
  __shared__ uint32_t flag;
  if (threadIdx.x == 0) {
    Signals* own = SignalsOf(p.base[p.rank]);
    flag = own->calls[blockIdx.x] + 1;
    own->calls[blockIdx.x] = flag;
  }
  __syncthreads();
  return flag;
}

enum Phase { kStart, kMid, kEnd };

// Block b of every rank meets here: thread r < ranks writes `flag` into rank r's signals (a
// release store over NVLink or PCIe; no atomics), then waits until rank r's block b has written
// it into ours. The block's writes before the barrier are seen by the peers' reads after it.
__device__ __forceinline__ void Barrier(const PeerBuffers& p, Phase phase, uint32_t flag) {
  __syncthreads();
  if (threadIdx.x < p.ranks) {
    auto slots = [&](void* base) {
      Signals* s = SignalsOf(base);
      return phase == kStart ? s->start : phase == kMid ? s->mid : s->end;
    };
    StoreRelease(&slots(p.base[threadIdx.x])[blockIdx.x][p.rank], flag);
    const uint32_t* mine = &slots(p.base[p.rank])[blockIdx.x][threadIdx.x];
    while (LoadAcquire(mine) != flag) {
    }
  }
  __syncthreads();
}

// 16 bytes of T as fp32 lanes and back (bf16 rounded to nearest even).
template <typename T>
struct Pack;
template <>
struct Pack<float> {
  static constexpr int kLanes = 4;
  __device__ static void Add(uint4 v, float* acc) {
    acc[0] += __uint_as_float(v.x), acc[1] += __uint_as_float(v.y);
    acc[2] += __uint_as_float(v.z), acc[3] += __uint_as_float(v.w);
  }
  __device__ static uint4 From(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};
template <>
struct Pack<__nv_bfloat16> {
  static constexpr int kLanes = 8;
  __device__ static void Add(uint4 v, float* acc) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += __uint_as_float(w[i] << 16);
      acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static uint4 From(const float* f) {
    uint32_t w[4];
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i]))) |
             static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i + 1]))) << 16;
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// Pack i of every rank's staging area summed in rank order.
template <typename T>
__device__ __forceinline__ uint4 SumPeers(const PeerBuffers& p, int64_t i) {
  float acc[Pack<T>::kLanes] = {};
  for (int r = 0; r < p.ranks; ++r) Pack<T>::Add(__ldcg(StagingOf(p.base[r]) + i), acc);
  return Pack<T>::From(acc);
}

// One-shot: every rank reads the whole message from every peer and sums it.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    OneShotKernel(PeerBuffers p, uint4* data, int64_t packs) {
  const uint32_t flag = NextFlag(p);
  uint4* own = StagingOf(p.base[p.rank]);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < packs; i += stride) own[i] = data[i];
  Barrier(p, kStart, flag);
  for (int64_t i = first; i < packs; i += stride) data[i] = SumPeers<T>(p, i);
  Barrier(p, kEnd, flag);
}

// Two-shot: rank r sums part r of the message over the peers into its own staging area (a
// reduce-scatter), then every rank copies each part from its owner (an all-gather). Each block
// walks every part with the same offsets relative to the part's start, so block b of every rank
// touches the same elements in every phase and one flag a (block, rank) orders them.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    TwoShotKernel(PeerBuffers p, uint4* data, int64_t packs) {
  const uint32_t flag = NextFlag(p);
  uint4* own = StagingOf(p.base[p.rank]);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  auto part_begin = [&](int r) { return packs * r / p.ranks; };
  for (int r = 0; r < p.ranks; ++r)
    for (int64_t i = part_begin(r) + first; i < part_begin(r + 1); i += stride) own[i] = data[i];
  Barrier(p, kStart, flag);
  for (int64_t i = part_begin(p.rank) + first; i < part_begin(p.rank + 1); i += stride)
    own[i] = SumPeers<T>(p, i);
  Barrier(p, kMid, flag);
  for (int r = 0; r < p.ranks; ++r) {
    const uint4* owner = StagingOf(p.base[r]);
    for (int64_t i = part_begin(r) + first; i < part_begin(r + 1); i += stride)
      data[i] = __ldcg(owner + i);
  }
  Barrier(p, kEnd, flag);
}

// The fused all-reduce, residual add and RMSNorm: block b takes rows b, b + grid, ...
__global__ void __launch_bounds__(kThreads, 2)
    FusedAddNormKernel(PeerBuffers p, const float* partial, int rows, int n, float* residual,
                       const void* gain, DType gain_dtype, float eps, float* out) {
  __shared__ float scratch[32];
  const uint32_t flag = NextFlag(p);
  uint4* own = StagingOf(p.base[p.rank]);
  const int packs_per_row = n / 4;
  for (int row = blockIdx.x; row < rows; row += gridDim.x)
    for (int i = threadIdx.x; i < packs_per_row; i += blockDim.x) {
      const int64_t k = static_cast<int64_t>(row) * packs_per_row + i;
      own[k] = reinterpret_cast<const uint4*>(partial)[k];
    }
  Barrier(p, kStart, flag);
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    float4* res = reinterpret_cast<float4*>(residual + static_cast<int64_t>(row) * n);
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < packs_per_row; i += blockDim.x) {
      const uint4 s = SumPeers<float>(p, static_cast<int64_t>(row) * packs_per_row + i);
      float4 r = res[i];
      r.x += __uint_as_float(s.x), r.y += __uint_as_float(s.y);
      r.z += __uint_as_float(s.z), r.w += __uint_as_float(s.w);
      res[i] = r;
      sum_sq += r.x * r.x + r.y * r.y + r.z * r.z + r.w * r.w;
    }
    sum_sq = BlockSum(sum_sq, scratch);
    const float inv = rsqrtf(sum_sq / n + eps);
    float* o = out + static_cast<int64_t>(row) * n;
    const float* rr = residual + static_cast<int64_t>(row) * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
      o[i] = rr[i] * inv * LoadAsFloat(gain, gain_dtype, i);
    __syncthreads();  // scratch is reused by the next row's sum
  }
  Barrier(p, kEnd, flag);
}

template <typename T>
void LaunchCustom(const PeerBuffers& peers, void* data, int64_t packs, CustomAlgorithm algorithm,
                  cudaStream_t stream) {
  const int grid =
      static_cast<int>(std::clamp<int64_t>((packs + kThreads - 1) / kThreads, 1, kAllReduceBlocks));
  auto* d = static_cast<uint4*>(data);
  if (algorithm == CustomAlgorithm::kOneShot)
    LaunchPlain(OneShotKernel<T>, grid, kThreads, 0, stream, peers, d, packs);
  else
    LaunchPlain(TwoShotKernel<T>, grid, kThreads, 0, stream, peers, d, packs);
}

}  // namespace

size_t PeerBufferBytes(int64_t staging_bytes) {
  return kSignalBytes + static_cast<size_t>(staging_bytes);
}

void CustomAllReduce(const PeerBuffers& peers, void* data, int64_t count, ReduceDType dtype,
                     CustomAlgorithm algorithm, cudaStream_t stream) {
  const int64_t packs = count * static_cast<int64_t>(ReduceDTypeBytes(dtype)) / 16;
  if (dtype == ReduceDType::kFp32)
    LaunchCustom<float>(peers, data, packs, algorithm, stream);
  else
    LaunchCustom<__nv_bfloat16>(peers, data, packs, algorithm, stream);
}

void FusedAllReduceAddNorm(const PeerBuffers& peers, const float* partial, int rows, int n,
                           float* residual, const MatrixRef& gain, float eps, float* out,
                           cudaStream_t stream) {
  const int grid = std::clamp(rows, 1, kAllReduceBlocks);
  LaunchPlain(FusedAddNormKernel, grid, n >= 2048 ? kThreads : 256, 0, stream, peers, partial, rows,
              n, residual, gain.data, gain.dtype, eps, out);
}

}  // namespace infersweep::cuda
