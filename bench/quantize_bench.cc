// Host quantization of a synthetic preset (`--model preset:NAME@FORMAT`): seconds for the load at
// two layer counts, and their difference, the cost of one layer. Prints '#' metadata lines, then
// one row per format. A benchmark, not a test.
//
//   ./build/bench/quantize_bench [--preset qwen3-30b-a3b] [--layers 1,2] [--threads N]
//                                [--formats nvfp4,fp8_block128]
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/weights.h"
#include "kernels/cpu/parallel.h"

namespace {

// The process's peak resident set (VmHWM), in GiB.
double PeakRssGib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / (1024.0 * 1024.0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "qwen3-30b-a3b", layers_arg = "1,2", formats_arg = "nvfp4,fp8_block128";
  int threads = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--preset")
      preset = value;
    else if (flag == "--layers")
      layers_arg = value;
    else if (flag == "--formats")
      formats_arg = value;
    else if (flag == "--threads")
      threads = std::stoi(value);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  infersweep::cpu::SetNumThreads(threads);
  std::vector<int> layers;
  for (absl::string_view l : absl::StrSplit(layers_arg, ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(l, &n) || n <= 0) return 2;
    layers.push_back(n);
  }
  std::printf("# preset %s, %d threads (%u hardware), layers %s\n", preset.c_str(),
              infersweep::cpu::NumThreads(), std::thread::hardware_concurrency(),
              layers_arg.c_str());
  std::printf("# %-13s %8s %12s %14s\n", "format", "layers", "load_s", "peak_rss_GiB");
  for (absl::string_view f : absl::StrSplit(formats_arg, ',')) {
    const std::string model = "preset:" + preset + "@" + std::string(f);
    std::vector<double> seconds;
    for (int n : layers) {
      const auto start = std::chrono::steady_clock::now();
      auto host = infersweep::LoadHostModel(model, {n, 1, true});
      if (!host.ok()) {
        std::fprintf(stderr, "%s: %s\n", model.c_str(), host.status().ToString().c_str());
        return 1;
      }
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      std::printf("  %-13s %8d %12.2f %14.2f\n", std::string(f).c_str(), n, seconds.back(),
                  PeakRssGib());
      std::fflush(stdout);
    }
    if (seconds.size() >= 2)
      std::printf("# %s: %.2f s per layer (layers %d -> %d)\n", std::string(f).c_str(),
                  (seconds.back() - seconds.front()) / (layers.back() - layers.front()),
                  layers.front(), layers.back());
  }
  return 0;
}
