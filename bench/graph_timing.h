// The probes' timer: what `enqueue` launches on a stream, captured once into a CUDA graph and
// replayed, the median of `repeats` timed replays after `warmups` untimed ones, in ms a replay.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/check.h"

namespace infersweep::bench {

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
