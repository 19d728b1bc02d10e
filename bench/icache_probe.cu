// How much straight-line code an SM runs from its instruction caches: a loop over a body of N
// independent FMAs (N x 16 bytes of SASS), timed by clock64 per warp. While the body fits a cache
// level, a warp per SM sub-partition issues ~1 FMA a cycle; past it, each pass refetches the body
// from the next level (L2 at the end), and cycles per FMA rise. The persistent decode kernel's
// per-layer path is ~4,700 SASS instructions (~75 KB, cuobjdump): whether that fits is what this
// measures.
//   icache_probe [blocks] [warps_per_block]   (defaults 1, 4; the kernel's shape is 132, 18)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/check.h"

namespace {

constexpr int kPasses = 64;

template <int kFmas>
__global__ void StraightLine(float* sink, long long* cycles) {
  float a0 = threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, a4 = a0 + 4, a5 = a0 + 5,
        a6 = a0 + 6, a7 = a0 + 7;
  const float m = 0.999f, c = 0.5f;
  long long start = 0;
  for (int pass = 0; pass <= kPasses; ++pass) {
    if (pass == 1) start = clock64();  // pass 0 warms what fits
#pragma unroll
    for (int i = 0; i < kFmas / 8; ++i)
      asm volatile(
          "fma.rn.f32 %0, %0, %8, %9;\n fma.rn.f32 %1, %1, %8, %9;\n fma.rn.f32 %2, %2, %8, %9;\n"
          " fma.rn.f32 %3, %3, %8, %9;\n fma.rn.f32 %4, %4, %8, %9;\n fma.rn.f32 %5, %5, %8, %9;\n"
          " fma.rn.f32 %6, %6, %8, %9;\n fma.rn.f32 %7, %7, %8, %9;"
          : "+f"(a0), "+f"(a1), "+f"(a2), "+f"(a3), "+f"(a4), "+f"(a5), "+f"(a6), "+f"(a7)
          : "f"(m), "f"(c));
  }
  const long long elapsed = clock64() - start;
  if ((threadIdx.x & 31) == 0) cycles[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = elapsed;
  sink[blockIdx.x * blockDim.x + threadIdx.x] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

template <int kFmas>
void Measure(int blocks, int warps) {
  const int threads = warps * 32;
  float* sink = nullptr;
  long long* cycles = nullptr;
  cudaMalloc(&sink, sizeof(float) * blocks * threads);
  cudaMalloc(&cycles, sizeof(long long) * blocks * warps);
  StraightLine<kFmas><<<blocks, threads>>>(sink, cycles);  // cold launch: the code reaches L2
  StraightLine<kFmas><<<blocks, threads>>>(sink, cycles);
  std::vector<long long> host(blocks * warps);
  cudaMemcpy(host.data(), cycles, sizeof(long long) * host.size(), cudaMemcpyDeviceToHost);
  CUDA_OR_DIE(cudaGetLastError());
  double mean = 0;
  for (long long c : host) mean += static_cast<double>(c);
  mean /= host.size();
  // Warps share a sub-partition's issue slot when there are more than 4 a block.
  const double per_fma = mean / kPasses / kFmas;
  std::printf(
      "body %6d FMAs = %4d KB of SASS: %.3f cycles per FMA per warp (%d blocks x %d warps)\n",
      kFmas, kFmas * 16 / 1024, per_fma, blocks, warps);
  cudaFree(sink);
  cudaFree(cycles);
}

}  // namespace

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 1;
  const int warps = argc > 2 ? std::atoi(argv[2]) : 4;
  Measure<512>(blocks, warps);
  Measure<1024>(blocks, warps);
  Measure<2048>(blocks, warps);
  Measure<3072>(blocks, warps);
  Measure<4096>(blocks, warps);
  Measure<5120>(blocks, warps);
  Measure<6144>(blocks, warps);
  Measure<7168>(blocks, warps);
  Measure<8192>(blocks, warps);
  Measure<12288>(blocks, warps);
  return 0;
}
