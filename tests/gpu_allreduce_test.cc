// The CUDA collective seam (engine/cuda/communicator.h, kernels/cuda/allreduce.h) against host
// sums: the custom one-shot and two-shot kernels and the fused all-reduce + add + norm with ranks
// as streams of one GPU (every rank bitwise the same, summed in rank order), eagerly and as CUDA
// graph replays; NCCL's single-rank communicator; the seam's refusals. Skipped (not failed) on
// machines without a GPU: CI compiles it, the GPU machine runs it (scripts/gpu.sh stage tp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "api/backend_config.h"
#include "bench/allreduce_bench.h"
#include "core/dtype.h"
#include "engine/backends.h"
#include "engine/weights.h"
#include "harness/executor.h"
#include "tests/gpu_trial.h"
#ifdef INFERSWEEP_HAVE_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/communicator.h"
#endif

namespace infersweep {
namespace {

#ifdef INFERSWEEP_HAVE_CUDA

class GpuAllReduce : public testing::Test {
 public:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no GPU on this machine";
    }
  }
};

// Rank r's element i: small integers and fractions whose fp32 sums depend on the order.
float Value(int rank, int64_t i) {
  return static_cast<float>((i * 7 + rank * 13) % 97) * 0.0137f - 0.5f + 1e-3f * rank;
}

struct Ranks {
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<cudaStream_t> streams;
  std::vector<void*> data;
  ~Ranks() {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
    for (void* p : data) cudaFree(p);
  }
};

std::unique_ptr<Ranks> MakeRanks(AllReduce kind, int ranks, int64_t max_bytes) {
  auto out = std::make_unique<Ranks>();
  auto comms = MakeLocalCommunicators(kind, std::vector<int>(ranks, 0), max_bytes);
  EXPECT_TRUE(comms.ok()) << comms.status();
  if (!comms.ok()) return nullptr;
  out->comms = std::move(*comms);
  for (int r = 0; r < ranks; ++r) {
    cudaStream_t s;
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    out->streams.push_back(s);
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, max_bytes), cudaSuccess);
    out->data.push_back(p);
  }
  return out;
}

// Uploads every rank's values, runs `count` elements through the seam (eagerly, or as a graph
// captured on each rank's stream and replayed `replays` times with fresh inputs), and checks
// every element of every rank bitwise against the host's rank-order sum.
void CheckSum(AllReduce kind, int ranks, int64_t count, cuda::ReduceDType dtype, bool graph) {
  SCOPED_TRACE(testing::Message() << AxisValueName(kind) << " ranks " << ranks << " count " << count
                                  << (dtype == cuda::ReduceDType::kBf16 ? " bf16" : " fp32")
                                  << (graph ? " graph" : " eager"));
  const size_t elem = cuda::ReduceDTypeBytes(dtype);
  const int64_t bytes = count * static_cast<int64_t>(elem);
  auto r = MakeRanks(kind, ranks, bytes);
  ASSERT_NE(r, nullptr);
  std::vector<float> expected(count, 0.f);
  std::vector<std::vector<uint8_t>> inputs(ranks, std::vector<uint8_t>(bytes));
  for (int k = 0; k < ranks; ++k)
    for (int64_t i = 0; i < count; ++i) {
      const float v = Value(k, i);
      if (dtype == cuda::ReduceDType::kFp32) {
        std::memcpy(&inputs[k][i * 4], &v, 4);
        expected[i] += v;
      } else {
        const uint16_t b = FloatToBf16(v);
        std::memcpy(&inputs[k][i * 2], &b, 2);
        expected[i] += Bf16ToFloat(b);
      }
    }
  std::vector<cudaGraphExec_t> execs(ranks, nullptr);
  if (graph)
    for (int k = 0; k < ranks; ++k) {
      cudaGraph_t g;
      ASSERT_EQ(cudaStreamBeginCapture(r->streams[k], cudaStreamCaptureModeThreadLocal),
                cudaSuccess);
      ASSERT_TRUE(r->comms[k]->Sum(r->data[k], count, dtype, r->streams[k]).ok());
      ASSERT_EQ(cudaStreamEndCapture(r->streams[k], &g), cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&execs[k], g, 0), cudaSuccess);
      cudaGraphDestroy(g);
    }
  for (int call = 0; call < 3; ++call) {  // the flags count calls: repeat
    for (int k = 0; k < ranks; ++k)
      ASSERT_EQ(cudaMemcpy(r->data[k], inputs[k].data(), bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
    // A copy from pageable memory may return before its last bytes land, and the ranks' streams
    // are not ordered after the legacy stream's copies.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int k = 0; k < ranks; ++k) {
      if (graph) {
        ASSERT_EQ(cudaGraphLaunch(execs[k], r->streams[k]), cudaSuccess);
      } else {
        auto s = r->comms[k]->Sum(r->data[k], count, dtype, r->streams[k]);
        ASSERT_TRUE(s.ok()) << s;
      }
    }
    for (int k = 0; k < ranks; ++k) ASSERT_EQ(cudaStreamSynchronize(r->streams[k]), cudaSuccess);
    int64_t wrong = 0;
    for (int k = 0; k < ranks; ++k) {
      std::vector<uint8_t> out(bytes);
      ASSERT_EQ(cudaMemcpy(out.data(), r->data[k], bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      for (int64_t i = 0; i < count; ++i) {
        float got;
        if (dtype == cuda::ReduceDType::kFp32) {
          std::memcpy(&got, &out[i * 4], 4);
          wrong += std::memcmp(&got, &expected[i], 4) != 0;
        } else {
          uint16_t b;
          std::memcpy(&b, &out[i * 2], 2);
          wrong += b != FloatToBf16(expected[i]);
        }
      }
    }
    EXPECT_EQ(wrong, 0) << "call " << call;
  }
  for (cudaGraphExec_t e : execs)
    if (e) cudaGraphExecDestroy(e);
}

TEST_F(GpuAllReduce, CustomOneShotAndTwoShotSumInRankOrderOnEveryRank) {
  // 4 KB and 64 KB take the one-shot kernel, 2 MB (and an uneven part split) the two-shot one at
  // 4 ranks.
  for (int ranks : {1, 2, 4})
    for (int64_t count : {int64_t{1024}, int64_t{16384}, int64_t{(1 << 19) + 12}})
      for (auto dtype : {cuda::ReduceDType::kFp32, cuda::ReduceDType::kBf16}) {
        if (dtype == cuda::ReduceDType::kBf16 && count % 8 != 0) continue;
        CheckSum(AllReduce::kCustom, ranks, count, dtype, /*graph=*/false);
      }
  EXPECT_EQ(cuda::PickCustomAlgorithm(4, 2 << 20), cuda::CustomAlgorithm::kTwoShot);
  EXPECT_EQ(cuda::PickCustomAlgorithm(4, 4 << 10), cuda::CustomAlgorithm::kOneShot);
}

TEST_F(GpuAllReduce, CustomReplaysAsACudaGraph) {
  CheckSum(AllReduce::kCustom, 2, 4096, cuda::ReduceDType::kFp32, /*graph=*/true);
  CheckSum(AllReduce::kCustom, 4, (1 << 19) + 12, cuda::ReduceDType::kFp32, /*graph=*/true);
}

TEST_F(GpuAllReduce, NcclSingleRankCommunicatorLeavesTheBufferAsItIs) {
  auto id = MakeNcclId();
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_NE(std::getenv("NCCL_NVLS_ENABLE"), nullptr);
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  auto comm = MakeNcclCommunicator(*id, 1, 0);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->ranks(), 1);
  const int64_t count = 3000;
  std::vector<float> host(count);
  for (int64_t i = 0; i < count; ++i) host[i] = Value(0, i);
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, count * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d, host.data(), count * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE((*comm)->Sum(d, count, cuda::ReduceDType::kFp32, s).ok());
  cudaGraph_t g;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_TRUE((*comm)->Sum(d, count, cuda::ReduceDType::kFp32, s).ok());
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  std::vector<float> out(count);
  ASSERT_EQ(cudaMemcpy(out.data(), d, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(out.data(), host.data(), count * 4), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  cudaFree(d);
}

// residual += the ranks' sum of partial, then out = RMSNorm(residual) * gain: the fused kernel
// (one launch) and nccl's unfused path agree with the host.
TEST_F(GpuAllReduce, FusedAddNormMatchesTheHost) {
  const int ranks = 2, rows = 5, n = 256;
  const int64_t count = int64_t{rows} * n;
  auto r = MakeRanks(AllReduce::kFused, ranks, count * 4);
  ASSERT_NE(r, nullptr);
  std::vector<uint16_t> gain(n);
  for (int i = 0; i < n; ++i) gain[i] = FloatToBf16(0.5f + (i % 11) * 0.1f);
  std::vector<float> residual(count), expected_res(count), expected_out(count);
  for (int64_t i = 0; i < count; ++i) residual[i] = Value(7, i) * 3.f;
  for (int64_t i = 0; i < count; ++i) {
    float s = 0.f;
    for (int k = 0; k < ranks; ++k) s += Value(k, i);
    expected_res[i] = residual[i] + s;
  }
  for (int row = 0; row < rows; ++row) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += double(expected_res[row * n + i]) * expected_res[row * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-6);
    for (int i = 0; i < n; ++i)
      expected_out[row * n + i] =
          static_cast<float>(expected_res[row * n + i] * inv * Bf16ToFloat(gain[i]));
  }
  uint16_t* d_gain = nullptr;
  ASSERT_EQ(cudaMalloc(&d_gain, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_gain, gain.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  MatrixRef g;
  g.data = d_gain;
  g.dtype = DType::kBF16;
  g.rows = 1;
  g.cols = n;
  std::vector<float*> res(ranks), out(ranks);
  for (int k = 0; k < ranks; ++k) {
    std::vector<float> partial(count);
    for (int64_t i = 0; i < count; ++i) partial[i] = Value(k, i);
    ASSERT_EQ(cudaMemcpy(r->data[k], partial.data(), count * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMalloc(&res[k], count * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&out[k], count * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(res[k], residual.data(), count * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the uploads land before the ranks' streams
  for (int k = 0; k < ranks; ++k) {
    auto s = r->comms[k]->SumAddNorm(static_cast<float*>(r->data[k]), rows, n, res[k], g, 1e-6f,
                                     out[k], r->streams[k]);
    ASSERT_TRUE(s.ok()) << s;
  }
  for (int k = 0; k < ranks; ++k) ASSERT_EQ(cudaStreamSynchronize(r->streams[k]), cudaSuccess);
  for (int k = 0; k < ranks; ++k) {
    std::vector<float> got_res(count), got_out(count);
    ASSERT_EQ(cudaMemcpy(got_res.data(), res[k], count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_out.data(), out[k], count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(got_res.data(), expected_res.data(), count * 4), 0) << "rank " << k;
    for (int64_t i = 0; i < count; ++i)
      ASSERT_NEAR(got_out[i], expected_out[i], 1e-5f * (1.f + std::fabs(expected_out[i])))
          << "rank " << k << " element " << i;
  }
  for (int k = 0; k < ranks; ++k) {
    cudaFree(res[k]);
    cudaFree(out[k]);
  }
  cudaFree(d_gain);
}

TEST_F(GpuAllReduce, RefusesWhatTheSeamCannotTake) {
  auto r = MakeRanks(AllReduce::kCustom, 1, 4096);
  ASSERT_NE(r, nullptr);
  auto odd = r->comms[0]->Sum(r->data[0], 3, cuda::ReduceDType::kFp32, r->streams[0]);
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(odd.message()).find("multiple of 16 bytes"), std::string::npos) << odd;
  auto big = r->comms[0]->Sum(r->data[0], 2048, cuda::ReduceDType::kFp32, r->streams[0]);
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(big.message()).find("exceeds the peer buffers' 4096 bytes"),
            std::string::npos)
      << big;
  auto twice = MakeLocalCommunicators(AllReduce::kNccl, {0, 0}, 4096);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  auto nine = MakeLocalCommunicators(AllReduce::kCustom, std::vector<int>(9, 0), 4096);
  EXPECT_EQ(nine.status().code(), absl::StatusCode::kInvalidArgument);
  auto reference = MakeLocalCommunicators(AllReduce::kReference, {0}, 4096);
  EXPECT_EQ(reference.status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- The CUDA engine at tp=1 through the seam.

int64_t LaunchesNamed(const PhaseKernels& p, const std::string& prefix) {
  int64_t total = 0;
  for (const KernelCount& k : p.kernels)
    if (k.name.rfind(prefix, 0) == 0) total += k.count;
  return total;
}

// allreduce=nccl (a single-rank NCCL communicator) and custom (the kernels over one peer buffer)
// take the o projection's and the MLP/MoE's outputs through the seam before the residual add:
// the harness judges them OK, their logits are the default's (a one-rank sum is exact), their
// steps launch the seam once a block, and the default (auto) launches no part of it.
TEST_F(GpuAllReduce, EngineAtTp1ThroughTheSeamIsOk) {
  const std::vector<std::string> bases = {
      "device=cuda", "device=cuda,gemm=cublaslt,attention=flash,moe=grouped",
      "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=on"};
  const LocalDevices devices = ProbeLocalDevices();
  TrialExecutor executor(devices);
  const std::vector<int32_t> prompt = {1, 17, 33, 5, 9, 101, 7, 3};
  for (const char* preset : {"preset:tiny-moe", "preset:tiny-dense", "preset:tiny-qwen2-moe"}) {
    auto host = LoadHostModel(preset, LoadOptions{2, 1, false});
    ASSERT_TRUE(host.ok()) << host.status();
    for (const std::string& base : bases) {
      const std::vector<float> by_default = AllLogits(**host, *ParseBackendConfig(base), prompt);
      for (const char* value : {"auto", "nccl", "custom"}) {
        const std::string text = base + ",allreduce=" + value;
        SCOPED_TRACE(std::string(preset) + " " + text);
        const TrialResult r = executor.Execute(GpuRequest(preset, text));
        EXPECT_EQ(r.status, TrialStatus::kOk) << r.reason;
        std::printf("# %s %-80s %-11s top1 %.3f kl_mean %.2g max_rel %.2g\n", preset, text.c_str(),
                    std::string(TrialStatusName(r.status)).c_str(), r.verdict.top1_agreement,
                    r.verdict.kl_mean, r.verdict.max_rel_error);
        const std::vector<float> logits = AllLogits(**host, *ParseBackendConfig(text), prompt);
        ASSERT_EQ(logits.size(), by_default.size());
        double worst = 0;
        for (size_t i = 0; i < logits.size(); ++i)
          worst = std::max(worst, std::fabs(static_cast<double>(logits[i]) - by_default[i]));
        EXPECT_LE(worst, 1e-5) << "logits differ from the default's";
        std::printf("#   max |logit - default's| %.3g%s\n", worst,
                    worst == 0 ? " (bitwise the same)" : "");
        for (const BatchFigures& b : r.batches) {
          ASSERT_TRUE(b.decode_kernels.has_value());
          const int64_t nccl = LaunchesNamed(*b.decode_kernels, "nccl:all-reduce");
          int64_t custom = 0;
          for (const KernelCount& k : b.decode_kernels->kernels)
            custom += k.name.find("OneShotKernel") != std::string::npos ? k.count : 0;
          const int64_t blocks = 2 * 2;  // 2 layers, attention and MLP/MoE blocks
          EXPECT_EQ(nccl, std::string(value) == "nccl" ? blocks : 0);
          EXPECT_EQ(custom, std::string(value) == "custom" ? blocks : 0);
        }
      }
    }
  }
  // graphs=persistent has no seam between its blocks: refused with the reason.
  const TrialResult persistent = executor.Execute(
      GpuRequest("preset:tiny-moe",
                 "device=cuda,gemm=fused,attention=flash,kv_cache=bf16,moe=fused,graphs=persistent,"
                 "allreduce=nccl"));
  EXPECT_EQ(persistent.status, TrialStatus::kUnsupported) << persistent.reason;
  EXPECT_NE(persistent.reason.find("no seam"), std::string::npos) << persistent.reason;
}

// allreduce-bench --device cuda at one rank: every value's table, eager and graph, no wrong
// element, busbw 0.
TEST_F(GpuAllReduce, BenchAtOneRankChecksEveryElement) {
  AllReduceBenchOptions o;
  o.ranks = 1;
  o.min_bytes = 4 << 10;
  o.max_bytes = 1 << 20;
  o.size_factor = 16;
  o.iterations = 3;
  auto rows = RunCudaAllReduceBench(o);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 3u * 2 * 3);  // 3 values x eager|graph x 4 KB, 64 KB, 1 MB
  for (const AllReduceBenchRow& r : *rows) {
    EXPECT_EQ(r.wrong, 0) << r.allreduce << " " << r.bytes;
    EXPECT_EQ(r.busbw_gb_s, 0.0);
    EXPECT_GT(r.time_us, 0.0);
  }
  std::printf("%s", FormatCudaAllReduceBench(o, *rows).c_str());
}

#endif  // INFERSWEEP_HAVE_CUDA

}  // namespace
}  // namespace infersweep
