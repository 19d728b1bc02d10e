#include "engine/cuda/device_util.h"

#include <execinfo.h>

#include <atomic>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>

namespace infersweep {

bool PoisonsAllocation(const char* v, int64_t number) {
  if (v == nullptr || v[0] == '\0' || std::string_view(v) == "0") return false;
  bool any_range = false;
  for (std::string_view rest(v); !rest.empty();) {
    const size_t comma = rest.find(',');
    const std::string range(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    int64_t a = 0, b = 0;
    if (std::sscanf(range.c_str(), "%" SCNd64 "-%" SCNd64, &a, &b) != 2) continue;
    any_range = true;
    if (number >= a && number < b) return true;
  }
  return !any_range;
}

absl::Status PoisonAllocation(void* p, size_t bytes, bool device, std::string_view label) {
  static std::atomic<int64_t> next_number{0};
  const int64_t number = next_number.fetch_add(1);
  if (!PoisonsAllocation(std::getenv("INFERSWEEP_POISON_DEVICE_MEMORY"), number))
    return absl::OkStatus();
  if (device) {
    // cudaMemset runs on the legacy default stream, which does not order against the engine's
    // non-blocking streams: without the wait, the poison could land after the engine's own
    // cudaMemsetAsync of the buffer (the KV cache's zeros, say) and be read as its contents.
    RETURN_IF_ERROR(CudaStatus(cudaMemset(p, 0xFF, bytes), std::string(label).c_str()));
    RETURN_IF_ERROR(CudaStatus(cudaDeviceSynchronize(), std::string(label).c_str()));
  } else {
    std::memset(p, 0xFF, bytes);
  }
  if (const char* log = std::getenv("INFERSWEEP_POISON_LOG"); log != nullptr && log[0] != '\0') {
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    if (FILE* f = std::fopen(log, "a")) {
      std::fprintf(f, "poisoned #%" PRId64 " %zu bytes (%s): %.*s\n", number, bytes,
                   device ? "device" : "pinned", static_cast<int>(label.size()), label.data());
      void* frames[12];
      const int depth = backtrace(frames, 12);
      std::fflush(f);
      backtrace_symbols_fd(frames, depth, fileno(f));
      std::fclose(f);
    }
  }
  return absl::OkStatus();
}

}  // namespace infersweep
