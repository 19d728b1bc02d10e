// Decode-chain probe: how fast can the weight streaming of one batch-1 decode layer go as a chain
// of kernels, and as one persistent kernel? It answers a design question (is a persistent
// per-step kernel worth building for the batch-1 target?) with measurements, not estimates.
//
// Per layer, qwen3-30b-a3b byte shapes (bf16 weights, fp32 activations), five GEMVs:
//   q/k/v 5120 x 2048 (21.0 MB), o 2048 x 4096 (16.8 MB), router 128 x 2048 (0.5 MB),
//   expert gate/up 12288 x 2048 (8 experts x 2 x 768 rows: 50.3 MB), expert down 2048 x 6144
//   (8 x 768 inputs: 25.2 MB): 113.8 MB a layer, 25.5 us at 4.46 TB/s. Every layer has its own
//   weights (5.5 GB for 48), so nothing is served from L2 across layers.
// Modes (each: 48 layers in a CUDA graph or one launch, median of 5 timed runs after 1 warm-up):
//   empty       9 empty kernels a layer chained with programmatic dependent launch (PDL): what a
//               kernel boundary costs by itself
//   gemv        the 5 GEMVs a layer through the engine's GEMV launcher (cuda::Gemv), PDL, graph
//   persistent  one cooperative kernel: the 5 GEMVs a layer as phases separated by grid-wide
//               barriers; each warp double-buffers 4 KB weight batches in registers and issues the
//               next phase's first batch before it waits at the barrier
//               (1 or 2 blocks of 8 warps an SM, or 1 of 16; a flat or two-level barrier), and the
//               same launch with no rows: what staging the input and a grid barrier cost a phase
// Usage: decode_chain_probe [--layers N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace {

using infersweep::cuda::Dot8Bf16;
using infersweep::cuda::WarpSum;

struct Shape {
  int rows, k;
};
constexpr Shape kPhases[] = {{5120, 2048}, {2048, 4096}, {128, 2048}, {12288, 2048}, {2048, 6144}};
constexpr int kPhasesPerLayer = 5;
constexpr int kBatch = 2048;  // bf16 weights a warp loads at once: 32 lanes x 8 x 16 bytes = 4 KB
constexpr int kMaxK = 6144;

struct Phase {
  const uint16_t* w;
  const float* x;
  float* y;
  int rows, k;
};

__global__ void EmptyKernel() {
  infersweep::cuda::WaitForPrerequisites();
  infersweep::cuda::AllowDependentsToLaunch();
}

// Loads batch b of this warp's share of a phase: the warp's rows are warp, warp + warps, ...;
// each row is k / kBatch batches. Lane l takes 16-byte chunks l + 32 u.
__device__ __forceinline__ void LoadBatch(const Phase& ph, int b, int warp, int warps, int lane,
                                          uint4 (&buf)[8]) {
  const int per_row = ph.k / kBatch;
  const int row = warp + (b / per_row) * warps, part = b % per_row;
  const uint4* p = reinterpret_cast<const uint4*>(ph.w + static_cast<int64_t>(row) * ph.k +
                                                  static_cast<int64_t>(part) * kBatch);
#pragma unroll
  for (int u = 0; u < 8; ++u) buf[u] = __ldcs(p + lane + 32 * u);
}

__device__ __forceinline__ int WarpBatches(const Phase& ph, int warp, int warps) {
  const int rows = ph.rows > warp ? (ph.rows - warp + warps - 1) / warps : 0;
  return rows * (ph.k / kBatch);
}

// Grid-wide barrier number `index` (0, 1, ...) on counters zeroed before the launch. Flat: every
// block adds to counters[0] and polls it. Two-level: blocks add to one of 8 group counters (each
// on its own 128-byte line), the last of a group adds to counters[0], every block polls that:
// 8 atomics on the polled line instead of one per block.
constexpr int kGroups = 8;
constexpr int kCounterWords = 1 + kGroups * 32;
template <bool kTwoLevel>
__device__ __forceinline__ void GridBarrier(unsigned* counters, unsigned index) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned target = (index + 1) * gridDim.x;
    if constexpr (kTwoLevel) {
      const unsigned group = blockIdx.x % kGroups;
      const unsigned group_size = (gridDim.x - group + kGroups - 1) / kGroups;
      if (atomicAdd(&counters[1 + group * 32], 1u) + 1 == (index + 1) * group_size)
        atomicAdd(&counters[0], 1u);
      target = (index + 1) * kGroups;
    } else {
      atomicAdd(&counters[0], 1u);
    }
    while (*reinterpret_cast<volatile unsigned*>(&counters[0]) < target) {
    }
    __threadfence();
  }
  __syncthreads();
}

template <bool kTwoLevel>
__global__ void __launch_bounds__(512) PersistentChain(const Phase* phases, int count,
                                                       unsigned* counter) {
  __shared__ __align__(16) float xs[kMaxK];
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x / 32), warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  uint4 cur[8], nxt[8];
  if (WarpBatches(phases[0], warp, warps) > 0) LoadBatch(phases[0], 0, warp, warps, lane, cur);
  for (int p = 0; p < count; ++p) {
    const Phase ph = phases[p];
    for (int i = threadIdx.x; i < ph.k / 4; i += blockDim.x)
      reinterpret_cast<float4*>(xs)[i] = __ldcg(reinterpret_cast<const float4*>(ph.x) + i);
    __syncthreads();
    const int batches = WarpBatches(ph, warp, warps), per_row = ph.k / kBatch;
    float acc = 0.f;
    for (int b = 0; b < batches; ++b) {
      if (b + 1 < batches) LoadBatch(ph, b + 1, warp, warps, lane, nxt);
      const int part = b % per_row;
#pragma unroll
      for (int u = 0; u < 8; ++u) acc += Dot8Bf16(cur[u], xs + part * kBatch + (lane + 32 * u) * 8);
      if (part == per_row - 1) {  // the row is complete
        acc = WarpSum(acc);
        if (lane == 0) ph.y[warp + (b / per_row) * warps] = acc;
        acc = 0.f;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) cur[u] = nxt[u];
    }
    // The next phase's first weights do not depend on this phase: in flight across the barrier.
    if (p + 1 < count && WarpBatches(phases[p + 1], warp, warps) > 0)
      LoadBatch(phases[p + 1], 0, warp, warps, lane, cur);
    GridBarrier<kTwoLevel>(counter, p);
  }
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 48;
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--layers")) layers = std::atoi(argv[i + 1]);
  cudaDeviceProp prop{};
  CUDA_OR_DIE(cudaGetDeviceProperties(&prop, 0));
  double layer_bytes = 0;
  for (const Shape& s : kPhases) layer_bytes += 2.0 * s.rows * s.k;
  std::printf("# %s, %d SMs; %d layers of %.1f MB of weights (roofline %.1f us a layer at 4.46 TB/s)\n",
              prop.name, prop.multiProcessorCount, layers, layer_bytes / 1e6, layer_bytes / 4.46e6);

  // Weights (distinct per layer), activations: x 2048 / attention out 4096 / h 6144 wide.
  std::vector<Phase> phases;
  float *x = nullptr, *attn = nullptr, *h = nullptr, *scratch = nullptr;
  CUDA_OR_DIE(cudaMalloc(&x, kMaxK * sizeof(float)));
  CUDA_OR_DIE(cudaMalloc(&attn, kMaxK * sizeof(float)));
  CUDA_OR_DIE(cudaMalloc(&h, 12288 * sizeof(float)));
  CUDA_OR_DIE(cudaMalloc(&scratch, 12288 * sizeof(float)));
  CUDA_OR_DIE(cudaMemset(x, 0, kMaxK * sizeof(float)));
  CUDA_OR_DIE(cudaMemset(attn, 0, kMaxK * sizeof(float)));
  CUDA_OR_DIE(cudaMemset(h, 0, 12288 * sizeof(float)));
  std::vector<void*> buffers;
  for (int l = 0; l < layers; ++l)
    for (int p = 0; p < kPhasesPerLayer; ++p) {
      const Shape s = kPhases[p];
      void* w = nullptr;
      CUDA_OR_DIE(cudaMalloc(&w, 2ull * s.rows * s.k));
      CUDA_OR_DIE(cudaMemset(w, 0, 2ull * s.rows * s.k));
      buffers.push_back(w);
      const float* in = p == 1 ? attn : p == 4 ? h : x;
      float* out = p == 3 ? h : scratch;
      phases.push_back({static_cast<const uint16_t*>(w), in, out, s.rows, s.k});
    }
  cudaStream_t stream;
  CUDA_OR_DIE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CUDA_OR_DIE(cudaEventCreate(&start));
  CUDA_OR_DIE(cudaEventCreate(&stop));
  // 1 warm-up and 5 timed runs of `launch` (all layers each), `prepare` before each outside the
  // timed span: the median, in us a layer.
  auto time_runs = [&](auto prepare, auto launch) {
    std::vector<float> ms;
    for (int run = 0; run < 6; ++run) {
      prepare();
      CUDA_OR_DIE(cudaEventRecord(start, stream));
      launch();
      CUDA_OR_DIE(cudaEventRecord(stop, stream));
      CUDA_OR_DIE(cudaEventSynchronize(stop));
      float t = 0;
      CUDA_OR_DIE(cudaEventElapsedTime(&t, start, stop));
      if (run > 0) ms.push_back(t);
    }
    return Median(ms) * 1000.f / layers;
  };
  auto time_graph = [&](auto record) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OR_DIE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    record();
    CUDA_OR_DIE(cudaStreamEndCapture(stream, &graph));
    CUDA_OR_DIE(cudaGraphInstantiate(&exec, graph, 0));
    const float us = time_runs([] {}, [&] { CUDA_OR_DIE(cudaGraphLaunch(exec, stream)); });
    CUDA_OR_DIE(cudaGraphExecDestroy(exec));
    CUDA_OR_DIE(cudaGraphDestroy(graph));
    return us;
  };
  infersweep::cuda::SetProgrammaticLaunch(true);

  const float empty_us = time_graph([&] {
    for (int i = 0; i < 9 * layers; ++i)
      infersweep::cuda::Launch(EmptyKernel, dim3(prop.multiProcessorCount), dim3(256), 0, stream);
  });
  std::printf("empty       %7.2f us a layer (9 empty PDL kernels: %.2f us each)\n", empty_us,
              empty_us / 9);

  const float gemv_us = time_graph([&] {
    for (const Phase& ph : phases) {
      infersweep::cuda::GemvArgs a;
      a.x = ph.x;
      a.rows = 1;
      a.k = ph.k;
      a.seg[0].w = ph.w;
      a.seg[0].y = ph.y;
      a.seg[0].n = ph.rows;
      a.seg[0].ld = ph.rows;
      a.segments = 1;
      infersweep::cuda::Gemv(a, stream);
    }
  });
  std::printf("gemv        %7.2f us a layer (5 GEMV kernels, PDL, graph): %.1f %% of the roofline\n",
              gemv_us, 100.0 * layer_bytes / 4.46e6 / gemv_us);

  Phase* d_phases = nullptr;
  CUDA_OR_DIE(cudaMalloc(&d_phases, phases.size() * sizeof(Phase)));
  unsigned* counters = nullptr;
  CUDA_OR_DIE(cudaMalloc(&counters, kCounterWords * sizeof(unsigned)));
  std::vector<Phase> idle = phases;  // no rows: each phase only stages its input and meets the barrier
  for (Phase& ph : idle) ph.rows = 0;
  auto run_persistent = [&](const std::vector<Phase>& list, bool two_level, int blocks,
                            int threads) {
    CUDA_OR_DIE(
        cudaMemcpy(d_phases, list.data(), list.size() * sizeof(Phase), cudaMemcpyHostToDevice));
    int count = static_cast<int>(list.size());
    void* kernel = two_level ? reinterpret_cast<void*>(PersistentChain<true>)
                             : reinterpret_cast<void*>(PersistentChain<false>);
    void* args[] = {&d_phases, &count, &counters};
    return time_runs(
        [&] {
          CUDA_OR_DIE(cudaMemsetAsync(counters, 0, kCounterWords * sizeof(unsigned), stream));
        },
        [&] {
          CUDA_OR_DIE(
              cudaLaunchCooperativeKernel(kernel, dim3(blocks), dim3(threads), args, 0, stream));
        });
  };
  const int sms = prop.multiProcessorCount;
  struct Shape2 {
    int blocks, threads;
  };
  for (const Shape2 g : {Shape2{sms, 256}, Shape2{2 * sms, 256}, Shape2{sms, 512}})
    for (const bool two_level : {false, true}) {
      const float us = run_persistent(phases, two_level, g.blocks, g.threads);
      const float idle_us = run_persistent(idle, two_level, g.blocks, g.threads);
      std::printf("persistent  %7.2f us a layer (%d blocks of %d warps, %s barrier): %.1f %% of the "
                  "roofline; with no rows %.2f us (%.2f us a phase)\n",
                  us, g.blocks, g.threads / 32, two_level ? "two-level" : "flat",
                  100.0 * layer_bytes / 4.46e6 / us, idle_us, idle_us / kPhasesPerLayer);
    }
  for (void* b : buffers) cudaFree(b);
  return 0;
}
