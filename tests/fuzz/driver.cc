#include "tests/fuzz/driver.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

namespace infersweep::fuzz {
namespace {

using Clock = std::chrono::steady_clock;

// The input being run, for the crash and hang reports (which cannot unwind to the loop).
struct Current {
  const char* target = nullptr;
  int64_t index = -1;
  uint64_t seed = 0;
  const std::string* input = nullptr;
  const std::string* how = nullptr;
};
Current g_current;
std::atomic<int64_t> g_started_ns{-1};  // when the current input started; -1: none running
std::atomic<bool> g_reported{false};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

std::string ArtifactPath(const char* target, int64_t index) {
  return absl::StrCat("fuzz-", target, "-", index, ".bin");
}

void WriteFile(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// Says which input died and how to replay it; writes the input next to the test's working
// directory. Runs from a signal handler or a sanitizer's death callback: fixed buffers, write(2).
void ReportDeath(const char* what) {
  if (g_reported.exchange(true) || g_current.target == nullptr) return;
  static char path[512];
  std::snprintf(path, sizeof path, "fuzz-%s-%lld.bin", g_current.target,
                static_cast<long long>(g_current.index));
  static char text[2048];
  const int n = std::snprintf(
      text, sizeof text,
      "\nfuzz: target %s, input %lld %s\n  made by: %.600s\n  input (%zu bytes) written to %s\n"
      "  replay: INFERSWEEP_FUZZ_SEED=%llu INFERSWEEP_FUZZ_REPLAY=%s:%lld fuzz_test "
      "--gtest_filter='*%s*'\n",
      g_current.target, static_cast<long long>(g_current.index), what,
      g_current.how ? g_current.how->c_str() : "?", g_current.input ? g_current.input->size() : 0,
      path, static_cast<unsigned long long>(g_current.seed), g_current.target,
      static_cast<long long>(g_current.index), g_current.target);
  if (n > 0) (void)!::write(2, text, static_cast<size_t>(std::min<int>(n, sizeof text - 1)));
  if (g_current.input != nullptr) WriteFile(path, *g_current.input);
}

#if defined(__SANITIZE_ADDRESS__)
void SanitizerDeath() { ReportDeath("killed the process (the sanitizer's report is above)"); }
#else
void OnFatalSignal(int sig) {
  char what[64];
  std::snprintf(what, sizeof what, "crashed with signal %d (%s)", sig, ::strsignal(sig));
  ReportDeath(what);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}
#endif

void InstallCrashReporting() {
  static bool installed = false;
  if (installed) return;
  installed = true;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_set_death_callback(SanitizerDeath);
#else
  // A stack overflow leaves no stack to report from: the handler runs on its own.
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  ::sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_handler = OnFatalSignal;
  sa.sa_flags = SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) ::sigaction(sig, &sa, nullptr);
#endif
}

// Aborts the process, after the report, when one input runs past the hang limit.
class Watchdog {
 public:
  explicit Watchdog(double seconds) : limit_ns_(static_cast<int64_t>(seconds * 1e9)) {
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const int64_t started = g_started_ns.load();
        if (started >= 0 && NowNs() - started > limit_ns_) {
          ReportDeath(absl::StrCat("hung (over ", limit_ns_ / 1e9, " s)").c_str());
          std::abort();
        }
      }
    });
  }
  ~Watchdog() {
    stop_.store(true);
    thread_.join();
  }

 private:
  int64_t limit_ns_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::string Printable(std::string_view bytes, size_t limit = 300) {
  std::string out;
  for (size_t i = 0; i < bytes.size() && i < limit; ++i) {
    const unsigned char c = static_cast<unsigned char>(bytes[i]);
    if (c >= 32 && c < 127 && c != '\\') {
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  if (bytes.size() > limit) absl::StrAppend(&out, "... (", bytes.size(), " bytes)");
  return out;
}

template <typename T>
T FromEnv(const char* name, T fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  T value{};
  if constexpr (std::is_floating_point_v<T>) {
    if (absl::SimpleAtod(text, &value)) return value;
  } else {
    if (absl::SimpleAtoi(text, &value)) return value;
  }
  std::fprintf(stderr, "fuzz: ignoring %s='%s' (not a number)\n", name, text);
  return fallback;
}

}  // namespace

Outcome Rejected(const absl::Status& status, std::string_view must_name) {
  if (status.ok()) return Broken("Rejected() called with OK");
  if (status.message().empty())
    return Broken(absl::StrCat("rejected with an empty message (", status.ToString(), ")"));
  const absl::string_view name(must_name.data(), must_name.size());
  if (!name.empty() && !absl::StrContains(status.message(), name))
    return Broken(absl::StrCat("the error does not name '", name, "': ", status.message()));
  return {};
}

RunOptions OptionsFromEnvironment() {
  RunOptions o;
  o.seed = FromEnv<uint64_t>("INFERSWEEP_FUZZ_SEED", 0x1f5eedf022ull);
  o.random_inputs = FromEnv<int64_t>("INFERSWEEP_FUZZ_INPUTS", o.random_inputs);
  o.seconds = FromEnv<double>("INFERSWEEP_FUZZ_SECONDS", o.seconds);
  o.hang_seconds = FromEnv<double>("INFERSWEEP_FUZZ_HANG_SECONDS", o.hang_seconds);
  return o;
}

uint64_t TargetSeed(const FuzzTarget& target, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name
  for (char c : target.name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return seed ^ h;
}

RunReport RunTarget(const FuzzTarget& target, const RunOptions& options) {
  InstallCrashReporting();
  Mutator mutator({target.seeds(), target.dictionary, target.max_input_bytes, target.framing});
  const uint64_t seed = TargetSeed(target, options.seed);
  RunReport report;
  report.structural = mutator.structural_count();
  Watchdog watchdog(options.hang_seconds);
  const auto start = Clock::now();

  // Runs input `i`; false once a contract is broken.
  auto run_one = [&](int64_t i) {
    // The watchdog covers making the input too: a slow mutation is a harness bug to see.
    g_current = {target.name.c_str(), i, options.seed, nullptr, nullptr};
    g_started_ns.store(NowNs());
    const FuzzInput in = mutator.Make(seed, i);
    g_current = {target.name.c_str(), i, options.seed, &in.bytes, &in.how};
    const int64_t started = NowNs();
    g_started_ns.store(started);
    Outcome outcome;
    try {
      outcome = target.run(in.bytes);
    } catch (const std::exception& e) {
      outcome = Broken(absl::StrCat("exception escaped: ", e.what()));
    } catch (...) {
      outcome = Broken("unknown exception escaped");
    }
    g_started_ns.store(-1);
    const double seconds = static_cast<double>(NowNs() - started) / 1e9;
    ++report.inputs;
    report.largest_bytes = std::max(report.largest_bytes, in.bytes.size());
    if (seconds > report.slowest_seconds) {
      report.slowest_seconds = seconds;
      report.slowest_input = i;
    }
    if (!outcome.violation.empty()) {
      report.failure = absl::StrCat(
          "input ", i, " (", in.how, "): ", Printable(outcome.violation, 1000),
          "\n  input: ", Printable(in.bytes), "\n  replay: INFERSWEEP_FUZZ_SEED=", options.seed,
          " INFERSWEEP_FUZZ_REPLAY=", target.name, ":", i);
      WriteFile(ArtifactPath(target.name.c_str(), i), in.bytes);
      return false;
    }
    ++(outcome.accepted ? report.accepted : report.rejected);
    return true;
  };

  if (options.only_input >= 0) {
    const FuzzInput in = mutator.Make(seed, options.only_input);
    WriteFile(ArtifactPath(target.name.c_str(), options.only_input), in.bytes);
    std::fprintf(stderr, "fuzz: replaying %s input %lld (%s), written to %s\n", target.name.c_str(),
                 static_cast<long long>(options.only_input), in.how.c_str(),
                 ArtifactPath(target.name.c_str(), options.only_input).c_str());
    run_one(options.only_input);
  } else {
    bool ok = true;
    for (int64_t i = 0; ok && i < report.structural; ++i) ok = run_one(i);
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options.seconds));
    for (int64_t i = report.structural; ok && i < report.structural + options.random_inputs; ++i) {
      if (Clock::now() >= deadline) break;
      ok = run_one(i);
    }
  }
  g_current = {};
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return report;
}

}  // namespace infersweep::fuzz
