// SM streaming probe: when every SM of the GPU starts streaming weights at the same instant, does
// each get its first bytes as soon as the others, and its share of the DRAM bandwidth? And what
// do the decode kernel's 4 KB bulk copies reach, against larger copies and plain loads? It asks
// the hardware, with no decode kernel around it, about what the persistent decode kernel's
// timeline shows: at the MLP's start the same SMs get their first expert weights later than the
// others in every layer.
//
// One block an SM (all of its shared memory), one thread keeping `in_flight` bulk copies of
// `unit` bytes (cp.async.bulk with mbarrier completion, as the decode kernel's rings) of the
// block's own slice of one buffer going; every block starts at the same %globaltimer instant.
// Per SM: when its first copy landed, and its bandwidth over its slice. --mode loads reads the
// slices with 16 warps of 16-byte streaming loads instead. Defaults: 48 copies of 4 KB in flight
// an SM (the decode kernel's 16 rings x 3 units: ~26 MB over 132 SMs), 64 MB an SM (8.4 GB in
// all, ~1.9 ms). Median of 5 runs per SM.
// Napkin math, H200: an SM's share of 4.46 TB/s is 33.8 GB/s; the first copy of a burst lands
// after ~1 us unloaded, or up to the whole burst's drain (~5.8 us) for SMs served last.
// Usage: sm_stream_probe [--mode bulk|loads] [--unit BYTES] [--in-flight N] [--mb-per-sm N]
//                        [--runs N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/sm90a/bulk_copy.cuh"

namespace {

constexpr int kMaxInFlight = 48;
constexpr int kMaxIssuers = 8;
constexpr int kFields = 4;  // per block: SM, start skew, first copy landed, slice done (ns)

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__global__ void ReadTimer(unsigned long long* out) { *out = GlobalTimer(); }

// The block's kFields at its end: its SM, when it started after start_at, when its first copy
// landed after that (loads: 0), and when it ended.
__device__ void Record(unsigned long long* out, unsigned long long start_at,
                       unsigned long long started, unsigned long long first_landed) {
  const unsigned long long end = GlobalTimer();
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned long long* o = out + blockIdx.x * kFields;
  o[0] = sm;
  o[1] = started - start_at;
  o[2] = first_landed - started;
  o[3] = end - started;
}

// The block's slice [blockIdx.x * bytes, +bytes) of src, streamed into rings that nothing reads
// (only the arrival times matter): lane 0 of each of the block's `issuers` warps keeps
// `in_flight` / issuers copies of its own part of the slice going.
__global__ void __launch_bounds__(32 * kMaxIssuers, 1)
    StreamKernel(const unsigned char* src, size_t bytes_per_block, int in_flight, int unit,
                 unsigned long long start_at, unsigned long long* out) {
#if defined(__CUDA_ARCH__)  // bulk_copy.cuh's device functions
  using namespace infersweep::cuda;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t all_bars[kMaxInFlight];
  __shared__ unsigned long long first_landed, started;
  const int issuers = blockDim.x / 32, issuer = threadIdx.x / 32, slots = in_flight / issuers;
  const size_t part = bytes_per_block / issuers;
  unsigned char* ring = smem + static_cast<size_t>(issuer) * slots * unit;
  uint64_t* bars = all_bars + issuer * slots;
  if (threadIdx.x % 32 == 0) {
    for (int i = 0; i < slots; ++i) BarrierInit(&bars[i], 1);
    FenceBarrierInit();
    const unsigned char* mine = src + blockIdx.x * bytes_per_block + issuer * part;
    const int units = static_cast<int>(part / unit);
    while (GlobalTimer() < start_at) {
    }
    if (issuer == 0) started = GlobalTimer();
    int issued = 0;
    for (; issued < slots && issued < units; ++issued)
      BulkCopy(ring + issued * unit, mine + static_cast<size_t>(issued) * unit, unit,
               &bars[issued]);
    for (int u = 0; u < units; ++u) {
      const int slot = u % slots;
      BarrierWait(&bars[slot], (u / slots) & 1);
      if (u == 0 && issuer == 0) first_landed = GlobalTimer();
      if (issued < units) {
        BulkCopy(ring + slot * unit, mine + static_cast<size_t>(issued) * unit, unit, &bars[slot]);
        ++issued;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) Record(out, start_at, started, first_landed);
#endif
}

// The same slice read by 16 warps with 16-byte streaming loads (__ldcs), 4 in flight a thread: the
// plain loads' bandwidth, for comparison (the first load's landing is not measured: 0).
__global__ void __launch_bounds__(512, 1)
    LoadKernel(const unsigned char* src, size_t bytes_per_block, unsigned long long start_at,
               unsigned long long* out, float* sink) {
  const float4* mine = reinterpret_cast<const float4*>(src + blockIdx.x * bytes_per_block);
  const size_t n = bytes_per_block / 16;
  while (GlobalTimer() < start_at) {
  }
  const unsigned long long t0 = GlobalTimer();
  float acc = 0.f;
  for (size_t i = threadIdx.x; i < n; i += 4 * blockDim.x) {
    float4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      v[k] = i + k * blockDim.x < n ? __ldcs(mine + i + k * blockDim.x) : float4{};
#pragma unroll
    for (int k = 0; k < 4; ++k) acc += v[k].x + v[k].y + v[k].z + v[k].w;
  }
  __syncthreads();
  if (acc == 1.2345f) *sink = acc;  // keeps the loads
  if (threadIdx.x == 0) Record(out, start_at, t0, t0);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int mb_per_sm = 64, in_flight = kMaxInFlight, runs = 5, unit = 4096, issuers = 1;
  bool loads = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--mb-per-sm"))
      mb_per_sm = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--in-flight"))
      in_flight = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--runs"))
      runs = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--unit"))
      unit = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--issuers"))
      issuers = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--mode"))
      loads = !std::strcmp(argv[i + 1], "loads");
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (in_flight < 1 || in_flight > kMaxInFlight || mb_per_sm < 1 || runs < 1 || unit < 16 ||
      unit % 16 || (1 << 20) % unit || issuers < 1 || issuers > kMaxIssuers ||
      in_flight % issuers) {
    std::fprintf(stderr,
                 "--in-flight 1..%d, --mb-per-sm >= 1, --runs >= 1, --unit a multiple of 16 that "
                 "divides 1 MB, --issuers 1..%d dividing --in-flight\n",
                 kMaxInFlight, kMaxIssuers);
    return 2;
  }
  int device = 0, sms = 0, smem = 0;
  CUDA_OR_DIE(cudaGetDevice(&device));
  CUDA_OR_DIE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUDA_OR_DIE(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  // All of an SM's shared memory, so that no two blocks share one; the ring takes what it needs.
  cudaFuncAttributes attributes{};
  CUDA_OR_DIE(cudaFuncGetAttributes(&attributes, StreamKernel));
  const int dynamic = smem - static_cast<int>(attributes.sharedSizeBytes);
  if (in_flight * unit > dynamic) {
    std::fprintf(stderr, "%d units do not fit in %d bytes of shared memory\n", in_flight, dynamic);
    return 2;
  }
  CUDA_OR_DIE(
      cudaFuncSetAttribute(StreamKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic));
  CUDA_OR_DIE(
      cudaFuncSetAttribute(LoadKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic));
  float* sink = nullptr;
  CUDA_OR_DIE(cudaMalloc(&sink, sizeof(float)));
  const size_t per_block = static_cast<size_t>(mb_per_sm) << 20;
  unsigned char* src = nullptr;
  unsigned long long *out = nullptr, *timer = nullptr;
  CUDA_OR_DIE(cudaMalloc(&src, per_block * sms));
  CUDA_OR_DIE(cudaMemset(src, 1, per_block * sms));
  CUDA_OR_DIE(cudaMalloc(&out, sizeof(unsigned long long) * kFields * sms));
  CUDA_OR_DIE(cudaMalloc(&timer, sizeof(unsigned long long)));
  std::vector<std::vector<double>> first(sms), bandwidth(sms), skew(sms);
  std::vector<int> sm_of(sms, -1);
  std::vector<double> aggregate;  // GB/s, per run
  std::vector<unsigned long long> host(static_cast<size_t>(kFields) * sms);
  for (int run = 0; run <= runs; ++run) {  // run 0 warms up
    unsigned long long now = 0;
    ReadTimer<<<1, 1>>>(timer);
    CUDA_OR_DIE(cudaMemcpy(&now, timer, sizeof(now), cudaMemcpyDeviceToHost));
    // Every block resident and spinning well before the start (a launch takes microseconds).
    if (loads)
      LoadKernel<<<sms, 512, dynamic>>>(src, per_block, now + 5'000'000ull, out, sink);
    else
      StreamKernel<<<sms, 32 * issuers, dynamic>>>(src, per_block, in_flight, unit,
                                                   now + 5'000'000ull, out);
    CUDA_OR_DIE(cudaGetLastError());
    CUDA_OR_DIE(cudaMemcpy(host.data(), out, sizeof(unsigned long long) * host.size(),
                           cudaMemcpyDeviceToHost));
    if (run == 0) continue;
    unsigned long long slowest = 0;  // the whole buffer's time: the last SM's
    for (int b = 0; b < sms; ++b)
      slowest = std::max(slowest, host[static_cast<size_t>(b) * kFields + 1] +
                                      host[static_cast<size_t>(b) * kFields + 3]);
    aggregate.push_back(static_cast<double>(per_block) * sms / slowest);
    for (int b = 0; b < sms; ++b) {
      const unsigned long long* o = &host[static_cast<size_t>(b) * kFields];
      sm_of[b] = static_cast<int>(o[0]);
      skew[b].push_back(o[1] / 1e3);
      first[b].push_back(o[2] / 1e3);
      bandwidth[b].push_back(static_cast<double>(per_block) / o[3]);  // bytes/ns = GB/s
    }
  }
  struct Row {
    int block, sm;
    double skew_us, first_us, gbps;
  };
  std::vector<Row> rows;
  double total_gbps = 0;
  for (int b = 0; b < sms; ++b) {
    rows.push_back({b, sm_of[b], Median(skew[b]), Median(first[b]), Median(bandwidth[b])});
    total_gbps += rows.back().gbps;
  }
  std::sort(rows.begin(), rows.end(),
            [](const Row& a, const Row& b) { return a.first_us < b.first_us; });
  if (loads)
    std::printf(
        "# sm_stream_probe: %d SMs, %d MB an SM, 16-byte loads by 16 warps (4 a thread in "
        "flight), median of %d runs\n",
        sms, mb_per_sm, runs);
  else
    std::printf(
        "# sm_stream_probe: %d SMs, %d MB an SM, %d x %d B copies in flight an SM from %d "
        "issuing thread(s), median of %d runs\n",
        sms, mb_per_sm, in_flight, unit, issuers, runs);
  std::printf(
      "# aggregate (all the bytes over the last SM's time): %.0f GB/s; sum of the SMs' "
      "bandwidths: %.0f GB/s\n",
      Median(aggregate), total_gbps);
  std::vector<double> firsts, rates;
  for (const Row& r : rows) firsts.push_back(r.first_us), rates.push_back(r.gbps);
  std::sort(rates.begin(), rates.end());
  std::printf(
      "# first copy landed (us): min %.2f median %.2f max %.2f; bandwidth (GB/s an SM): min %.1f "
      "median %.1f max %.1f\n",
      firsts.front(), Median(firsts), firsts.back(), rates.front(), Median(rates), rates.back());
  std::printf("# the latest eighth by first copy (block/SM first-us GB/s):");
  for (size_t i = rows.size() - std::max<size_t>(1, rows.size() / 8); i < rows.size(); ++i)
    std::printf(" %d/%d %.2f %.1f", rows[i].block, rows[i].sm, rows[i].first_us, rows[i].gbps);
  std::printf("\n");
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.gbps < b.gbps; });
  std::printf("# the slowest eighth by bandwidth (block/SM first-us GB/s):");
  for (size_t i = 0; i < std::max<size_t>(1, rows.size() / 8); ++i)
    std::printf(" %d/%d %.2f %.1f", rows[i].block, rows[i].sm, rows[i].first_us, rows[i].gbps);
  std::printf("\n");
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.sm < b.sm; });
  std::printf("sm block start_skew_us first_us gbps\n");
  for (const Row& r : rows)
    std::printf("%d %d %.2f %.2f %.1f\n", r.sm, r.block, r.skew_us, r.first_us, r.gbps);
  CUDA_OR_DIE(cudaFree(src));
  CUDA_OR_DIE(cudaFree(out));
  CUDA_OR_DIE(cudaFree(timer));
  CUDA_OR_DIE(cudaFree(sink));
  return 0;
}
