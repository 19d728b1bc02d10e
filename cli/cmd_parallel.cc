// allreduce-bench: the tensor-parallel all-reduce's nccl-tests-style table
// (harness/allreduce_bench.h).
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "cli/commands.h"
#include "harness/allreduce_bench.h"

namespace infersweep::cli {
namespace {

int RunAllReduceBench(const AllReduceBenchOptions& options) {
  auto rows = RunCpuAllReduceBench(options);
  if (!rows.ok()) {
    std::fprintf(stderr, "allreduce-bench: %s\n", std::string(rows.status().message()).c_str());
    return 2;
  }
  std::cout << FormatAllReduceBench(options, *rows);
  // The benchmark is the test: a wrong element fails the command.
  for (const AllReduceBenchRow& row : *rows)
    if (row.wrong > 0) return 1;
  return std::cout.good() ? 0 : 1;
}

}  // namespace

void AddParallelCommands(CLI::App& app) {
  static AllReduceBenchOptions options;
  CLI::App* bench = app.add_subcommand(
      "allreduce-bench",
      "time the CPU ranks' all-reduce per size (size, time, algbw, busbw, #wrong)");
  bench->add_option("--ranks", options.ranks, "ranks (threads)")->capture_default_str();
  bench->add_option("--min-bytes", options.min_bytes, "smallest message per rank, bytes")
      ->capture_default_str();
  bench->add_option("--max-bytes", options.max_bytes, "largest message per rank, bytes")
      ->capture_default_str();
  bench->add_option("--factor", options.size_factor, "each size is the previous one times this")
      ->capture_default_str();
  bench->add_option("--iters", options.iterations, "timed all-reduces per size")
      ->capture_default_str();
  bench->callback([] { std::exit(RunAllReduceBench(options)); });
}

}  // namespace infersweep::cli
