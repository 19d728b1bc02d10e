#include "bench/allreduce_bench.h"
#include "api/status_macros.h"

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/allreduce.h"
#include "kernels/cpu/parallel.h"

namespace infersweep {
namespace {

// Rank r's element i: a small integer, so every sum over up to 8 ranks is exact in fp32 and the
// known answer does not depend on the order of the additions.
float KnownValue(int rank, int64_t i) { return static_cast<float>((i % 251) + 3 * rank); }
float KnownSum(int ranks, int64_t i) {
  return static_cast<float>(ranks * (i % 251) + 3 * ranks * (ranks - 1) / 2);
}

}  // namespace

absl::Status ValidateAllReduceBenchOptions(const AllReduceBenchOptions& o) {
  if (o.ranks < 1)
    return absl::InvalidArgumentError(absl::StrCat("--ranks: ", o.ranks, " is below 1"));
  if (o.min_bytes < 4 || o.max_bytes < o.min_bytes)
    return absl::InvalidArgumentError(absl::StrCat("--min-bytes ", o.min_bytes, " and --max-bytes ",
                                                   o.max_bytes,
                                                   ": need 4 <= min-bytes <= max-bytes"));
  if (o.size_factor < 2)
    return absl::InvalidArgumentError(absl::StrCat("--factor: ", o.size_factor, " is below 2"));
  if (o.iterations < 1)
    return absl::InvalidArgumentError(absl::StrCat("--iters: ", o.iterations, " is below 1"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AllReduceBenchRow>> RunCpuAllReduceBench(
    const AllReduceBenchOptions& o) {
  RETURN_IF_ERROR(ValidateAllReduceBenchOptions(o));
  std::vector<AllReduceBenchRow> rows;
  for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.size_factor) {
    AllReduceBenchRow row;
    row.count = bytes / 4;
    row.bytes = row.count * 4;
    std::vector<std::vector<float>> buffers(o.ranks, std::vector<float>(row.count));
    cpu::ThreadAllReduce allreduce(o.ranks);
    std::vector<int64_t> wrong(o.ranks, 0);
    double seconds = 0;
    auto rank_body = [&](int r) {
      cpu::ScopedInlineParallelFor own_thread;
      std::vector<float>& data = buffers[r];
      auto fill = [&] {
        for (int64_t i = 0; i < row.count; ++i) data[i] = KnownValue(r, i);
      };
      fill();
      allreduce.Sum(r, data.data(), row.count);  // warm-up
      // The Sum's own barriers line the ranks up: rank 0's clock spans every rank's work.
      const auto start = std::chrono::steady_clock::now();
      for (int it = 0; it < o.iterations; ++it) allreduce.Sum(r, data.data(), row.count);
      if (r == 0)
        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      // The checked run, on fresh known values.
      fill();
      allreduce.Sum(r, data.data(), row.count);
      for (int64_t i = 0; i < row.count; ++i) wrong[r] += data[i] != KnownSum(o.ranks, i);
    };
    {
      std::vector<std::jthread> threads;
      for (int r = 1; r < o.ranks; ++r) threads.emplace_back(rank_body, r);
      rank_body(0);
    }
    row.time_us = seconds / o.iterations * 1e6;
    row.algbw_gb_s = row.bytes / (row.time_us * 1e-6) / 1e9;
    row.busbw_gb_s = row.algbw_gb_s * 2.0 * (o.ranks - 1) / o.ranks;
    for (int64_t w : wrong) row.wrong += w;
    rows.push_back(row);
  }
  return rows;
}

std::string FormatAllReduceBench(const AllReduceBenchOptions& o,
                                 const std::vector<AllReduceBenchRow>& rows) {
  std::string out = absl::StrFormat(
      "# infersweep allreduce-bench: device=cpu allreduce=reference, %d ranks as threads, fp32 "
      "sum, in place\n"
      "# time: mean of %d all-reduces after one warm-up; busbw = algbw * 2(n-1)/n; #wrong: "
      "elements over every rank that differ from the known sum\n"
      "# %12s %12s %6s %10s %12s %12s %8s\n",
      o.ranks, o.iterations, "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
      "#wrong");
  for (const AllReduceBenchRow& r : rows)
    absl::StrAppendFormat(&out, "  %12d %12d %6s %10.2f %12.3f %12.3f %8d\n", r.bytes, r.count,
                          "float", r.time_us, r.algbw_gb_s, r.busbw_gb_s, r.wrong);
  return out;
}

}  // namespace infersweep
