// The launch log: which kernels (and host op implementations) the engine ran in a step, and
// every fallback it took, as recorded by the code that launches them. The harness records one
// untimed prefill and one untimed decode step per batch size, so a result says what it measured
// (docs/RESULTS.md, "kernels").
//
// Recording is per thread: a ScopedLaunchRecording installs a LaunchRecorder for the current
// thread, and RecordLaunch / RecordFallback / RecordGraphReplay add to it. With no recorder
// installed (the timed steps) each call costs one thread-local load and a null check; callers
// that build a message first check LaunchRecording().
//
// Header-only and dependency-free (no Abseil, no engine types): CUDA kernels' launchers include
// it. Compiles as C++17 (nvcc builds the .cu files as C++17).
#pragma once

#include <cxxabi.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace infersweep {

// One kernel (or op implementation) and how many times it was launched.
struct KernelCount {
  std::string name;
  int64_t count = 0;
  bool operator==(const KernelCount& other) const {
    return name == other.name && count == other.count;
  }
  bool operator!=(const KernelCount& other) const { return !(*this == other); }
};

// What ran while it was installed: launch counts by name in the order each name was first
// launched (the step's order, readable as a listing), the fallbacks taken (each distinct text
// once, in first-seen order), and whether a captured CUDA graph was replayed.
class LaunchRecorder {
 public:
  void AddLaunch(std::string_view name, int64_t count = 1) {
    if (auto it = index_.find(name); it != index_.end()) {
      kernels_[it->second].count += count;
      return;
    }
    index_.emplace(std::string(name), kernels_.size());
    kernels_.push_back({std::string(name), count});
  }
  void AddFallback(std::string what) {
    for (const std::string& f : fallbacks_)
      if (f == what) return;
    fallbacks_.push_back(std::move(what));
  }
  // A replay of a graph captured while `captured` recorded: the graph launches exactly the
  // captured kernels and takes the captured fallbacks.
  void AddReplay(const LaunchRecorder& captured) {
    for (const KernelCount& k : captured.kernels_) AddLaunch(k.name, k.count);
    for (const std::string& f : captured.fallbacks_) AddFallback(f);
    graph_replayed_ = true;
  }

  const std::vector<KernelCount>& kernels() const { return kernels_; }
  const std::vector<std::string>& fallbacks() const { return fallbacks_; }
  bool graph_replayed() const { return graph_replayed_; }
  // Launches of `name`; 0 when it never ran.
  int64_t count(std::string_view name) const {
    auto it = index_.find(name);
    return it == index_.end() ? 0 : kernels_[it->second].count;
  }
  int64_t total_launches() const {
    int64_t total = 0;
    for (const KernelCount& k : kernels_) total += k.count;
    return total;
  }
  bool empty() const { return kernels_.empty() && fallbacks_.empty() && !graph_replayed_; }
  void Clear() {
    kernels_.clear();
    index_.clear();
    fallbacks_.clear();
    graph_replayed_ = false;
  }

 private:
  std::vector<KernelCount> kernels_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in kernels_
  std::vector<std::string> fallbacks_;
  bool graph_replayed_ = false;
};

namespace launch_log_internal {
inline thread_local LaunchRecorder* active = nullptr;
}  // namespace launch_log_internal

// The current thread's recorder; null when nothing records.
inline LaunchRecorder* ActiveLaunchRecorder() { return launch_log_internal::active; }
inline bool LaunchRecording() { return launch_log_internal::active != nullptr; }

// Installs `recorder` for the current thread until destroyed, then restores the one before.
// Scopes nest and an inner one shadows the outer: what runs inside is recorded in the inner
// recorder only (a graph capture records its kernels for its replays, which the outer scope
// then records as they run). A null recorder suspends recording.
class ScopedLaunchRecording {
 public:
  explicit ScopedLaunchRecording(LaunchRecorder* recorder)
      : previous_(launch_log_internal::active) {
    launch_log_internal::active = recorder;
  }
  ~ScopedLaunchRecording() { launch_log_internal::active = previous_; }
  ScopedLaunchRecording(const ScopedLaunchRecording&) = delete;
  ScopedLaunchRecording& operator=(const ScopedLaunchRecording&) = delete;

 private:
  LaunchRecorder* previous_;
};

inline void RecordLaunch(std::string_view name, int64_t count = 1) {
  if (LaunchRecorder* r = launch_log_internal::active) r->AddLaunch(name, count);
}
// `what` names the axis value and what ran instead, with the shape and the reason:
// "gemm=fused: 64 rows (> 4): dense projections on cuBLASLt".
inline void RecordFallback(std::string what) {
  if (LaunchRecorder* r = launch_log_internal::active) r->AddFallback(std::move(what));
}
inline void RecordGraphReplay(const LaunchRecorder& captured) {
  if (LaunchRecorder* r = launch_log_internal::active) r->AddReplay(captured);
}

// A readable kernel name from a demangled C++ function name: the return type, the parameter
// list and every namespace or class qualifier (in template arguments too) dropped, template
// arguments kept, so variants stay distinct:
//   "void infersweep::cuda::(anonymous namespace)::GemvKernel<2, 1>(infersweep::cuda::GemvArgs)"
//   -> "GemvKernel<2, 1>"
// Names longer than 120 characters are cut there with "...".
inline std::string ShortKernelName(std::string_view demangled) {
  std::string text(demangled);
  for (const std::string_view anonymous : {"(anonymous namespace)::", "{anonymous}::"})
    for (size_t at; (at = text.find(anonymous)) != std::string::npos;)
      text.erase(at, anonymous.size());
  // The parameter list: the first '(' outside template arguments, unless it opens the name
  // itself (a cast inside template arguments is inside them).
  int angle = 0;
  size_t end = text.size();
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '<') ++angle;
    if (c == '>' && angle > 0) --angle;
    if (c == '(' && angle == 0 && i > 0) {
      end = i;
      break;
    }
  }
  text.resize(end);
  // The return type: everything up to the last space outside template arguments.
  angle = 0;
  size_t begin = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '<') ++angle;
    if (c == '>' && angle > 0) --angle;
    if (c == ' ' && angle == 0) begin = i + 1;
  }
  text.erase(0, begin);
  // Qualifiers: each "identifier::" goes.
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ':' && i + 1 < text.size() && text[i + 1] == ':') {
      while (!out.empty()) {
        const char c = out.back();
        const bool identifier =
            (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
        if (!identifier) break;
        out.pop_back();
      }
      ++i;
      continue;
    }
    out.push_back(text[i]);
  }
  constexpr size_t kMaxName = 120;
  if (out.size() > kMaxName) out = out.substr(0, kMaxName - 3) + "...";
  return out.empty() ? std::string(demangled) : out;
}

// ShortKernelName of a symbol as the toolchain spells it: demangled first when it is a mangled
// C++ name (nvcc's anonymous namespaces, "_GLOBAL__N__<hash>", demangle as
// "(anonymous namespace)"), as it is otherwise.
inline std::string SymbolKernelName(const char* symbol) {
  int status = -1;
  char* demangled = abi::__cxa_demangle(symbol, nullptr, nullptr, &status);
  std::string name = ShortKernelName(status == 0 && demangled ? demangled : symbol);
  std::free(demangled);
  return name;
}

}  // namespace infersweep
