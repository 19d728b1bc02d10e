// allreduce-bench: the tensor-parallel all-reduce's nccl-tests-style table
// (bench/allreduce_bench.h).
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "api/backend_config.h"
#include "bench/allreduce_bench.h"
#include "cli/commands.h"

namespace infersweep::cli {
namespace {

int RunAllReduceBench(const AllReduceBenchOptions& options, Device device) {
  const bool cuda = device == Device::kCuda;
  auto rows = cuda ? RunCudaAllReduceBench(options) : RunCpuAllReduceBench(options);
  if (!rows.ok()) {
    std::fprintf(stderr, "allreduce-bench: %s\n", std::string(rows.status().message()).c_str());
    return 2;
  }
  std::cout << (cuda ? FormatCudaAllReduceBench(options, *rows)
                     : FormatAllReduceBench(options, *rows));
  // The benchmark is the test: a wrong element fails the command.
  for (const AllReduceBenchRow& row : *rows)
    if (row.wrong > 0) return 1;
  return std::cout.good() ? 0 : 1;
}

}  // namespace

void AddParallelCommands(CLI::App& app) {
  static AllReduceBenchOptions options;
  static std::string device = "cpu";
  static std::vector<std::string> values;
  CLI::App* bench = app.add_subcommand(
      "allreduce-bench",
      "time the tensor-parallel all-reduce per size (size, time, algbw, busbw, #wrong): the CPU "
      "ranks' as threads, or (--device cuda) each CUDA allreduce value, eager and graph");
  bench->add_option("--device", device, "cpu (ranks as threads) or cuda (one rank a GPU)")
      ->capture_default_str();
  bench->add_option("--ranks", options.ranks,
                    "ranks: threads on the CPU, GPUs 0..ranks-1 on CUDA (default there: 1)");
  bench
      ->add_option("--allreduce", values,
                   "cuda: the values to time, comma-separated (default nccl,custom,fused)")
      ->delimiter(',');
  bench
      ->add_option("--fused-row", options.fused_row,
                   "cuda: the fused kernel's row width (its message is rows of it)")
      ->capture_default_str();
  bench->add_option("--min-bytes", options.min_bytes, "smallest message per rank, bytes")
      ->capture_default_str();
  CLI::Option* max_bytes =
      bench->add_option("--max-bytes", options.max_bytes,
                        "largest message per rank, bytes (default 64 MB on the CPU, 256 MB on "
                        "CUDA)");
  bench->add_option("--factor", options.size_factor, "each size is the previous one times this")
      ->capture_default_str();
  bench->add_option("--iters", options.iterations, "timed all-reduces per size")
      ->capture_default_str();
  CLI::Option* ranks = bench->get_option("--ranks");
  bench->callback([max_bytes, ranks] {
    const absl::StatusOr<Device> parsed = ParseDevice(device, "--device");
    if (!parsed.ok()) {
      std::fprintf(stderr, "allreduce-bench: %s\n", std::string(parsed.status().message()).c_str());
      std::exit(2);
    }
    if (*parsed == Device::kCuda) {
      if (max_bytes->count() == 0) options.max_bytes = int64_t{256} << 20;
      if (ranks->count() == 0) options.ranks = 1;
      if (!values.empty()) options.allreduce = values;
    }
    std::exit(RunAllReduceBench(options, *parsed));
  });
}

}  // namespace infersweep::cli
