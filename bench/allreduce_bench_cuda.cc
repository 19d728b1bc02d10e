// allreduce-bench --device cuda: the collective seam's values timed per message size, eagerly
// and as CUDA graph replays, one rank a GPU driven by its own thread.
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "api/status_macros.h"
#include "bench/allreduce_bench.h"
#ifdef INFERSWEEP_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/dtype.h"
#include "engine/cuda/communicator.h"
#include "kernels/cuda/check.h"
#endif

namespace infersweep {
namespace {

// NVLink 4's bandwidth a direction a GPU (H100/H200): the busbw column's peak.
constexpr double kNvlinkGbPerS = 450.0;

absl::Status ValidateCuda(const AllReduceBenchOptions& o) {
  RETURN_IF_ERROR(ValidateAllReduceBenchOptions(o));
  if (o.allreduce.empty()) return absl::InvalidArgumentError("--allreduce: no value given");
  for (const std::string& v : o.allreduce)
    if (v != "nccl" && v != "custom" && v != "fused")
      return absl::InvalidArgumentError(absl::StrCat("--allreduce: unknown value '", v,
                                                     "' on device cuda (known: nccl, custom, "
                                                     "fused)"));
  if (o.min_bytes % 16 != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--min-bytes: ", o.min_bytes,
                     " is not a multiple of 16 (the custom kernels move 16-byte packs)"));
  if (o.fused_row < 4 || o.fused_row % 4 != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--fused-row: ", o.fused_row, " is not a positive multiple of 4"));
  return absl::OkStatus();
}

#ifdef INFERSWEEP_HAVE_CUDA

// Rank r's element i: a small integer, so the sum over up to 8 ranks is exact in fp32 whatever
// the order of the additions.
float KnownValue(int rank, int64_t i) { return static_cast<float>((i % 251) + 3 * rank); }
float KnownSum(int ranks, int64_t i) {
  return static_cast<float>(ranks * (i % 251) + 3 * ranks * (ranks - 1) / 2);
}

// One rank's buffers on its GPU.
struct RankBuffers {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, end = nullptr;
  float *data = nullptr, *residual = nullptr, *out = nullptr;
  uint16_t* gain = nullptr;  // fused: bf16 ones
  ~RankBuffers() {
    cudaSetDevice(device);
    for (void* p : {static_cast<void*>(data), static_cast<void*>(residual), static_cast<void*>(out),
                    static_cast<void*>(gain)})
      if (p) cudaFree(p);
    if (start) cudaEventDestroy(start);
    if (end) cudaEventDestroy(end);
    if (stream) cudaStreamDestroy(stream);
  }
  absl::Status Allocate(int64_t max_bytes, int row) {
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device));
    RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    RETURN_IF_CUDA_ERROR(cudaEventCreate(&start));
    RETURN_IF_CUDA_ERROR(cudaEventCreate(&end));
    RETURN_IF_CUDA_ERROR(cudaMalloc(&data, max_bytes));
    RETURN_IF_CUDA_ERROR(cudaMalloc(&residual, max_bytes));
    RETURN_IF_CUDA_ERROR(cudaMalloc(&out, max_bytes));
    RETURN_IF_CUDA_ERROR(cudaMalloc(&gain, row * sizeof(uint16_t)));
    const std::vector<uint16_t> ones(row, FloatToBf16(1.f));
    RETURN_IF_CUDA_ERROR(
        cudaMemcpy(gain, ones.data(), row * sizeof(uint16_t), cudaMemcpyHostToDevice));
    RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
    return absl::OkStatus();
  }
};

// Rank `rank`'s part of one row: fill, warm up, time `iterations` all-reduces (eager or one
// captured graph), then check one all-reduce of fresh known values. `ranks_done` lines the
// ranks' threads up between the phases.
absl::Status RankRow(Communicator& comm, RankBuffers& b, AllReduce kind, int64_t count, bool graph,
                     const AllReduceBenchOptions& o, std::barrier<>& ranks_done, double* ms,
                     int64_t* wrong) {
  RETURN_IF_CUDA_ERROR(cudaSetDevice(b.device));
  const int ranks = comm.ranks(), rank = comm.rank();
  const int n = static_cast<int>(std::min<int64_t>(o.fused_row, count));
  const int rows = static_cast<int>(count / n);
  MatrixRef gain;
  gain.data = b.gain;
  gain.dtype = DType::kBF16;
  gain.rows = 1;
  gain.cols = n;
  auto op = [&]() -> absl::Status {
    if (kind == AllReduce::kFused)
      return comm.SumAddNorm(b.data, rows, n, b.residual, gain, 1e-6f, b.out, b.stream);
    return comm.Sum(b.data, count, cuda::ReduceDType::kFp32, b.stream);
  };
  std::vector<float> host(count);
  auto fill = [&]() -> absl::Status {
    for (int64_t i = 0; i < count; ++i) host[i] = KnownValue(rank, i);
    // On the rank's own stream: a plain cudaMemcpy from pageable memory may return before its
    // last bytes land, and the legacy stream does not order a non-blocking stream's kernels.
    RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(b.data, host.data(), count * sizeof(float),
                                         cudaMemcpyHostToDevice, b.stream));
    RETURN_IF_CUDA_ERROR(cudaMemsetAsync(b.residual, 0, count * sizeof(float), b.stream));
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(b.stream));
    return absl::OkStatus();
  };
  absl::Status status = fill();
  if (status.ok()) status = op();  // warm-up
  if (status.ok()) status = CudaStatus(cudaStreamSynchronize(b.stream), "warm-up");
  ranks_done.arrive_and_wait();
  cudaGraphExec_t exec = nullptr;
  if (status.ok() && graph) {
    cudaGraph_t g = nullptr;
    status = CudaStatus(cudaStreamBeginCapture(b.stream, cudaStreamCaptureModeThreadLocal),
                        "cudaStreamBeginCapture");
    for (int it = 0; status.ok() && it < o.iterations; ++it) status = op();
    const cudaError_t ended = cudaStreamEndCapture(b.stream, &g);
    if (status.ok()) status = CudaStatus(ended, "cudaStreamEndCapture");
    if (status.ok()) status = CudaStatus(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
    if (g) cudaGraphDestroy(g);
  }
  ranks_done.arrive_and_wait();
  if (status.ok()) {
    cudaEventRecord(b.start, b.stream);
    if (graph)
      status = CudaStatus(cudaGraphLaunch(exec, b.stream), "cudaGraphLaunch");
    else
      for (int it = 0; status.ok() && it < o.iterations; ++it) status = op();
    cudaEventRecord(b.end, b.stream);
  }
  if (status.ok()) status = CudaStatus(cudaStreamSynchronize(b.stream), "timed all-reduces");
  float elapsed = 0;
  if (status.ok())
    status = CudaStatus(cudaEventElapsedTime(&elapsed, b.start, b.end), "cudaEventElapsedTime");
  *ms = elapsed;
  if (exec) cudaGraphExecDestroy(exec);
  ranks_done.arrive_and_wait();
  // The checked all-reduce: every element against the known sum (fused: the residual, which
  // starts at zero and takes the sum).
  if (status.ok()) status = fill();
  ranks_done.arrive_and_wait();
  if (status.ok()) status = op();
  if (status.ok()) status = CudaStatus(cudaStreamSynchronize(b.stream), "checked all-reduce");
  if (status.ok())
    status = CudaStatus(cudaMemcpy(host.data(), kind == AllReduce::kFused ? b.residual : b.data,
                                   count * sizeof(float), cudaMemcpyDeviceToHost),
                        "copy back");
  *wrong = 0;
  if (status.ok())
    for (int64_t i = 0; i < count; ++i) *wrong += host[i] != KnownSum(ranks, i);
  ranks_done.arrive_and_wait();
  return status;
}

#endif  // INFERSWEEP_HAVE_CUDA

}  // namespace

absl::StatusOr<std::vector<AllReduceBenchRow>> RunCudaAllReduceBench(
    const AllReduceBenchOptions& o) {
  RETURN_IF_ERROR(ValidateCuda(o));
#ifndef INFERSWEEP_HAVE_CUDA
  return absl::FailedPreconditionError(
      "allreduce-bench --device cuda: this build has no CUDA (configure with INFERSWEEP_CUDA=ON)");
#else
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) {
    cudaGetLastError();
    gpus = 0;
  }
  if (gpus < o.ranks)
    return absl::FailedPreconditionError(absl::StrCat("allreduce-bench --device cuda: --ranks ",
                                                      o.ranks, " needs ", o.ranks,
                                                      " GPUs; this machine has ", gpus));
  std::vector<int> devices;
  for (int r = 0; r < o.ranks; ++r) devices.push_back(r);
  std::vector<RankBuffers> buffers(o.ranks);
  for (int r = 0; r < o.ranks; ++r) {
    buffers[r].device = r;
    RETURN_IF_ERROR(buffers[r].Allocate(o.max_bytes, o.fused_row));
  }
  std::vector<AllReduceBenchRow> rows;
  for (const std::string& value : o.allreduce) {
    const AllReduce kind = value == "nccl"     ? AllReduce::kNccl
                           : value == "custom" ? AllReduce::kCustom
                                               : AllReduce::kFused;
    ASSIGN_OR_RETURN(auto comms, MakeLocalCommunicators(kind, devices, o.max_bytes));
    for (bool graph : {false, true})
      for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.size_factor) {
        AllReduceBenchRow row;
        row.allreduce = value;
        row.graph = graph;
        row.count = bytes / 4;
        row.bytes = row.count * 4;
        std::vector<double> ms(o.ranks, 0);
        std::vector<int64_t> wrong(o.ranks, 0);
        std::vector<absl::Status> status(o.ranks);
        std::barrier<> ranks_done(o.ranks);
        {
          std::vector<std::jthread> threads;
          for (int r = 0; r < o.ranks; ++r)
            threads.emplace_back([&, r] {
              status[r] = RankRow(*comms[r], buffers[r], kind, row.count, graph, o, ranks_done,
                                  &ms[r], &wrong[r]);
            });
        }
        for (int r = 0; r < o.ranks; ++r)
          if (!status[r].ok())
            return absl::Status(status[r].code(),
                                absl::StrCat("allreduce=", value, " rank ", r, " at ", row.bytes,
                                             " bytes: ", status[r].message()));
        double slowest = 0;
        for (int r = 0; r < o.ranks; ++r) {
          slowest = std::max(slowest, ms[r]);
          row.wrong += wrong[r];
        }
        row.time_us = slowest * 1e3 / o.iterations;
        row.algbw_gb_s = row.bytes / (row.time_us * 1e-6) / 1e9;
        row.busbw_gb_s = row.algbw_gb_s * 2.0 * (o.ranks - 1) / o.ranks;
        rows.push_back(row);
      }
  }
  return rows;
#endif
}

std::string FormatCudaAllReduceBench(const AllReduceBenchOptions& o,
                                     const std::vector<AllReduceBenchRow>& rows) {
  std::string out = absl::StrFormat(
      "# infersweep allreduce-bench: device=cuda allreduce=%s, %d rank(s), one a GPU (0..%d), "
      "each driven by its own thread; fp32 sum, in place\n"
      "# time: mean of %d all-reduces after one warm-up, launched eagerly or captured in one "
      "CUDA graph and replayed; the slowest rank's\n"
      "# busbw = algbw * 2(n-1)/n: 0 at one rank, where nothing crosses a link; %%peak = busbw / "
      "%.0f GB/s (NVLink 4, a direction a GPU)\n"
      "# fused: all-reduce + residual add + RMSNorm over rows of %d (#wrong checks the "
      "residual); #wrong: elements over every rank that differ from the known sum\n"
      "# %9s %6s %12s %12s %6s %10s %12s %12s %6s %8s\n",
      absl::StrJoin(o.allreduce, "|"), o.ranks, o.ranks - 1, o.iterations, kNvlinkGbPerS,
      o.fused_row, "allreduce", "mode", "size(B)", "count", "type", "time(us)", "algbw(GB/s)",
      "busbw(GB/s)", "%peak", "#wrong");
  for (const AllReduceBenchRow& r : rows)
    absl::StrAppendFormat(&out, "  %9s %6s %12d %12d %6s %10.2f %12.3f %12.3f %6.1f %8d\n",
                          r.allreduce, r.graph ? "graph" : "eager", r.bytes, r.count, "float",
                          r.time_us, r.algbw_gb_s, r.busbw_gb_s,
                          100.0 * r.busbw_gb_s / kNvlinkGbPerS, r.wrong);
  return out;
}

}  // namespace infersweep
