// Gated DeltaNet decode probe: the fused decode step (cuda::GatedDeltaDecode) under each state
// layout, on qwen3-next-80b-a3b's head shapes (Hk 16, Hv 32, dk = dv = 128, conv 4 taps), at
// batches 1 to 128: the figures behind GatedDeltaDecodeLayoutFor's choice.
//
// Bytes a launch moves: the recurrent state in and out (2 MiB a sequence each way), the conv
// state in and out (3 x 8192 fp32 = 96 KB each way), the conv input (32 KB), z (16 KB) and a, b
// (256 B): 4.39 MB a sequence; the conv weights (64 KB bf16) are shared and L2-resident.
// Roofline: those bytes at --gbps (default 4,460 GB/s, the H200 figure docs/PERFORMANCE.md
// holds every row against; 3,350 on an H100).
// Each point: 20 launches captured in a CUDA graph, each on its own recurrent and conv states
// (as 20 layers of a step are, so that no launch finds its state in L2), median of 7 timed
// replays after 2 warm-ups.
// Usage: gated_delta_probe [--gbps G]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "bench/probe.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gated_delta.h"

namespace {

using infersweep::DType;
using infersweep::MatrixRef;
namespace cuda = infersweep::cuda;
namespace bench = infersweep::bench;

constexpr int kKeyHeads = 16, kValueHeads = 32, kDim = 128, kTaps = 4;
constexpr int kLaunches = 20, kRepeats = 7;

template <typename T>
T* Device(size_t count, float fill_scale) {
  std::vector<T> host(count);
  unsigned x = 12345;
  for (T& v : host) {
    x = x * 1664525u + 1013904223u;
    const float u = (static_cast<float>(x >> 8) / 16777216.f - 0.5f) * fill_scale;
    if constexpr (sizeof(T) == 2) {
      unsigned bits;
      std::memcpy(&bits, &u, 4);
      v = static_cast<T>(bits >> 16);
    } else {
      v = u;
    }
  }
  T* d = nullptr;
  CUDA_OR_DIE(cudaMalloc(&d, count * sizeof(T)));
  CUDA_OR_DIE(cudaMemcpy(d, host.data(), count * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

MatrixRef Ref(const void* data, DType dtype, int64_t rows, int64_t cols) {
  MatrixRef m;
  m.data = data;
  m.dtype = dtype;
  m.rows = rows;
  m.cols = cols;
  return m;
}

double TimeLayout(int batch, cuda::GatedDeltaDecodeLayout layout) {
  const cuda::GatedDeltaShape s{batch, 1, kKeyHeads, kValueHeads, kDim, kDim, kTaps};
  const int channels = s.conv_channels(), value = kValueHeads * kDim;
  cuda::GatedDeltaDecodeOperands ops;
  ops.projected = Device<float>(static_cast<size_t>(batch) * channels, 2.f);
  ops.z = Device<float>(static_cast<size_t>(batch) * value, 2.f);
  ops.a = Device<float>(static_cast<size_t>(batch) * kValueHeads, 1.f);
  ops.b = Device<float>(static_cast<size_t>(batch) * kValueHeads, 1.f);
  ops.conv = Ref(Device<uint16_t>(static_cast<size_t>(channels) * kTaps, 1.f), DType::kBF16,
                 channels, kTaps);
  ops.a_log = Ref(Device<float>(kValueHeads, 0.5f), DType::kF32, 1, kValueHeads);
  ops.dt_bias = Ref(Device<float>(kValueHeads, 0.5f), DType::kF32, 1, kValueHeads);
  ops.norm = Ref(Device<float>(kDim, 2.f), DType::kF32, 1, kDim);
  ops.eps = 1e-6f;
  // Every launch's states start as the same random ones (copied on the device).
  const size_t conv_count = static_cast<size_t>(batch) * (kTaps - 1) * channels;
  const size_t state_count = static_cast<size_t>(batch) * kValueHeads * kDim * kDim;
  float* conv_first = Device<float>(conv_count, 1.f);
  float* state_first = Device<float>(state_count, 0.2f);
  std::vector<float*> conv_states{conv_first}, states{state_first};
  for (int i = 1; i < kLaunches; ++i) {
    float *conv = nullptr, *state = nullptr;
    CUDA_OR_DIE(cudaMalloc(&conv, conv_count * sizeof(float)));
    CUDA_OR_DIE(cudaMalloc(&state, state_count * sizeof(float)));
    CUDA_OR_DIE(cudaMemcpy(conv, conv_first, conv_count * sizeof(float), cudaMemcpyDeviceToDevice));
    CUDA_OR_DIE(
        cudaMemcpy(state, state_first, state_count * sizeof(float), cudaMemcpyDeviceToDevice));
    conv_states.push_back(conv);
    states.push_back(state);
  }
  CUDA_OR_DIE(cudaMalloc(&ops.key_head_arrivals, sizeof(unsigned) * batch * kKeyHeads));
  CUDA_OR_DIE(cudaMemset(ops.key_head_arrivals, 0, sizeof(unsigned) * batch * kKeyHeads));
  CUDA_OR_DIE(cudaMalloc(&ops.out, sizeof(float) * batch * value));

  const double ms = bench::MedianGraphMs(
      [&](cudaStream_t stream) {
        for (int i = 0; i < kLaunches; ++i) {
          ops.conv_state = conv_states[i];
          ops.state = states[i];
          cuda::GatedDeltaDecode(ops, s, stream, layout);
        }
      },
      kRepeats);
  for (const void* p :
       {static_cast<const void*>(ops.projected), static_cast<const void*>(ops.z),
        static_cast<const void*>(ops.a), static_cast<const void*>(ops.b), ops.conv.data,
        ops.a_log.data, ops.dt_bias.data, ops.norm.data,
        static_cast<const void*>(ops.key_head_arrivals), static_cast<const void*>(ops.out)})
    CUDA_OR_DIE(cudaFree(const_cast<void*>(p)));
  for (int i = 0; i < kLaunches; ++i) {
    CUDA_OR_DIE(cudaFree(conv_states[i]));
    CUDA_OR_DIE(cudaFree(states[i]));
  }
  return 1e3 * ms / kLaunches;  // us a launch
}

}  // namespace

int main(int argc, char** argv) {
  const double gbps = bench::RooflineGbpsFromArgs(argc, argv);
  std::printf("# %s; roofline %.0f GB/s; us a launch, median of %d graphs of %d\n",
              bench::DeviceLine().c_str(), gbps, kRepeats, kLaunches);
  std::printf("%6s %10s %10s %8s %10s %10s %8s  %s\n", "batch", "columns", "GB/s", "%roof", "rows",
              "GB/s", "%roof", "auto");
  const double channels = 2.0 * kKeyHeads * kDim + kValueHeads * kDim;
  const double bytes_per_seq = 2.0 * kValueHeads * kDim * kDim * 4 +
                               2.0 * (kTaps - 1) * channels * 4 + channels * 4 +
                               kValueHeads * kDim * 4.0 * 2 + kValueHeads * 8.0;
  for (int batch : {1, 2, 4, 8, 16, 32, 64, 128}) {
    const double bytes = bytes_per_seq * batch;
    const double cols = TimeLayout(batch, cuda::GatedDeltaDecodeLayout::kColumns);
    const double rows = TimeLayout(batch, cuda::GatedDeltaDecodeLayout::kRows);
    const cuda::GatedDeltaShape s{batch, 1, kKeyHeads, kValueHeads, kDim, kDim, kTaps};
    const bool auto_rows =
        cuda::GatedDeltaDecodeLayoutFor(s) == cuda::GatedDeltaDecodeLayout::kRows;
    std::printf("%6d %10.2f %10.0f %7.1f%% %10.2f %10.0f %7.1f%%  %s\n", batch, cols,
                bytes / cols / 1e3, 100.0 * bytes / cols / 1e3 / gbps, rows, bytes / rows / 1e3,
                100.0 * bytes / rows / 1e3 / gbps, auto_rows ? "rows" : "columns");
  }
  return 0;
}
