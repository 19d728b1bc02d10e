// What the GPU probes (bench/*_probe.cu) share: their one flag, the device line they print first,
// and their timer.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/check.h"

namespace infersweep::bench {

// `--gbps G`, the bandwidth the probe's rows are held against (default 4,460 GB/s, the H200
// figure docs/PERFORMANCE.md holds every row against; 3,350 on an H100); anything else prints the
// usage and exits.
inline double RooflineGbpsFromArgs(int argc, char** argv) {
  double gbps = 4460.0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--gbps") == 0 && i + 1 < argc) {
      gbps = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--gbps G]\n", argv[0]);
      std::exit(2);
    }
  }
  return gbps;
}

// "<device name>, <SMs> SMs" of device 0.
inline std::string DeviceLine() {
  cudaDeviceProp prop;
  CUDA_OR_DIE(cudaGetDeviceProperties(&prop, 0));
  return std::string(prop.name) + ", " + std::to_string(prop.multiProcessorCount) + " SMs";
}

// What `enqueue` launches on a stream, captured once into a CUDA graph and replayed: the median
// of `repeats` timed replays after `warmups` untimed ones, in ms a replay.
template <typename Enqueue>
double MedianGraphMs(Enqueue enqueue, int repeats, int warmups = 2) {
  cudaStream_t stream;
  CUDA_OR_DIE(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OR_DIE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue(stream);
  CUDA_OR_DIE(cudaStreamEndCapture(stream, &graph));
  CUDA_OR_DIE(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CUDA_OR_DIE(cudaEventCreate(&start));
  CUDA_OR_DIE(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int r = 0; r < repeats + warmups; ++r) {
    CUDA_OR_DIE(cudaEventRecord(start, stream));
    CUDA_OR_DIE(cudaGraphLaunch(exec, stream));
    CUDA_OR_DIE(cudaEventRecord(stop, stream));
    CUDA_OR_DIE(cudaEventSynchronize(stop));
    float t = 0.f;
    CUDA_OR_DIE(cudaEventElapsedTime(&t, start, stop));
    if (r >= warmups) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CUDA_OR_DIE(cudaEventDestroy(start));
  CUDA_OR_DIE(cudaEventDestroy(stop));
  CUDA_OR_DIE(cudaGraphExecDestroy(exec));
  CUDA_OR_DIE(cudaGraphDestroy(graph));
  CUDA_OR_DIE(cudaStreamDestroy(stream));
  return ms[ms.size() / 2];
}

}  // namespace infersweep::bench
