// The Prometheus metrics of the coordinator and the agent, read back over HTTP the way Prometheus
// scrapes them: names, types, labels and values, the series cardinality cap, and the agent's GPU
// readings from an injected sampler.
#include "agent/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/metrics_http.h"
#include "testing/http_get.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One sample line of the text exposition format.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses sample lines (label values without escaped quotes, which is all these tests use).
std::vector<Sample> ParseExposition(const std::string& text) {
  std::vector<Sample> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    size_t pos = line.find_first_of("{ ");
    s.name = line.substr(0, pos);
    if (pos != std::string::npos && line[pos] == '{') {
      const size_t end = line.find('}', pos);
      std::string body = line.substr(pos + 1, end - pos - 1);
      size_t i = 0;
      while (i < body.size()) {
        const size_t eq = body.find('=', i);
        const size_t q1 = body.find('"', eq);
        const size_t q2 = body.find('"', q1 + 1);
        s.labels[body.substr(i, eq - i)] = body.substr(q1 + 1, q2 - q1 - 1);
        i = q2 + 1;
        if (i < body.size() && body[i] == ',') ++i;
      }
      pos = end + 1;
    }
    s.value = std::stod(line.substr(line.find_first_not_of(' ', pos)));
    out.push_back(std::move(s));
  }
  return out;
}

// The value of the one sample named `name` whose labels include `labels`.
std::optional<double> Find(const std::vector<Sample>& samples, const std::string& name,
                           const std::map<std::string, std::string>& labels = {}) {
  std::optional<double> found;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      match = match && it != s.labels.end() && it->second == v;
    }
    if (!match) continue;
    EXPECT_FALSE(found.has_value()) << "more than one sample of " << name << " matches";
    found = s.value;
  }
  return found;
}

size_t Count(const std::vector<Sample>& samples, const std::string& name) {
  size_t n = 0;
  for (const Sample& s : samples) n += s.name == name;
  return n;
}

std::vector<Sample> Scrape(int port) {
  std::optional<HttpResponse> r = HttpGet(port, "/metrics");
  EXPECT_TRUE(r.has_value()) << "no HTTP answer on port " << port;
  if (!r) return {};
  EXPECT_THAT(r->status_line, HasSubstr("200"));
  return ParseExposition(r->body);
}

TrialResult Result(TrialStatus status, double tok_s_b1, double ttft_ms, double tpot_ms) {
  TrialResult r;
  r.trial_id = "1-0";
  r.status = status;
  BatchFigures b1;
  b1.batch = 1;
  b1.output_tok_s = {tok_s_b1, tok_s_b1 - 1, tok_s_b1 + 1};
  b1.ttft_ms = {ttft_ms, ttft_ms, ttft_ms};
  b1.tpot_ms = {tpot_ms, tpot_ms, tpot_ms};
  BatchFigures b8 = b1;
  b8.batch = 8;
  b8.output_tok_s.median = 4 * tok_s_b1;
  b1.roofline_fraction = 0.397;  // a GPU with known figures: batch 1 has both rooflines
  b1.prefill_roofline_fraction = 0.39;
  b8.roofline_fraction = 0.55;  // batch 8: the decode one only
  r.batches = {b1, b8};
  return r;
}

TEST(SmArchLabelTest, Names) {
  EXPECT_EQ(SmArchLabel(90), "sm_90");
  EXPECT_EQ(SmArchLabel(120), "sm_120");
  EXPECT_EQ(SmArchLabel(0), "cpu");
}

TEST(CoordinatorMetricsTest, ServesEveryMetricOverHttp) {
  CoordinatorMetrics m;
  absl::StatusOr<int> port = m.Listen("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  ASSERT_GT(*port, 0);
  EXPECT_EQ(m.port(), *port);

  const BackendConfig config = *ParseBackendConfig("device=cuda,graphs=on");
  m.OnResult("preset:tiny-moe", 90, "NVIDIA H200", config, Result(TrialStatus::kOk, 250, 12, 4));
  m.SetAgentsConnected(3);
  m.SetQueueDepth(17);
  m.SetLeasedTrials(2);
  m.ObserveIngestSeconds(0.003);
  m.ObserveIngestSeconds(0.2);

  std::vector<Sample> s = Scrape(*port);
  const std::map<std::string, std::string> b1 = {{"model", "preset:tiny-moe"},
                                                 {"sm_arch", "sm_90"},
                                                 {"gpu", "NVIDIA H200"},
                                                 {"config", "device=cuda,graphs=on"},
                                                 {"batch", "1"}};
  EXPECT_EQ(Find(s, "infersweep_output_tokens_per_second", b1), 250);
  EXPECT_DOUBLE_EQ(*Find(s, "infersweep_ttft_seconds", b1), 0.012);
  EXPECT_DOUBLE_EQ(*Find(s, "infersweep_tpot_seconds", b1), 0.004);
  std::map<std::string, std::string> b8 = b1;
  b8["batch"] = "8";
  EXPECT_EQ(Find(s, "infersweep_output_tokens_per_second", b8), 1000);
  auto roofline = [&](std::map<std::string, std::string> labels, const char* kind) {
    labels["kind"] = kind;
    return Find(s, "infersweep_roofline_ratio", labels);
  };
  EXPECT_EQ(roofline(b1, "decode"), 0.397);
  EXPECT_EQ(roofline(b1, "prefill"), 0.39);
  EXPECT_EQ(roofline(b8, "decode"), 0.55);
  EXPECT_FALSE(roofline(b8, "prefill").has_value()) << "no figure, no series";
  EXPECT_EQ(Find(s, "infersweep_trials_total",
                 {{"status", "OK"}, {"sm_arch", "sm_90"}, {"model", "preset:tiny-moe"}}),
            1);
  const std::map<std::string, std::string> cfg = {
      {"model", "preset:tiny-moe"}, {"sm_arch", "sm_90"}, {"config", "device=cuda,graphs=on"}};
  auto status_of = [&](const std::vector<Sample>& samples, const std::string& status) {
    auto labels = cfg;
    labels["status"] = status;
    return Find(samples, "infersweep_config_status", labels);
  };
  EXPECT_EQ(status_of(s, "OK"), 1);
  for (const char* other : {"INCORRECT", "CRASHED", "UNSUPPORTED", "TIMEOUT", "ERROR"})
    EXPECT_EQ(status_of(s, other), 0) << other;
  EXPECT_EQ(Find(s, "infersweep_agents_connected"), 3);
  EXPECT_EQ(Find(s, "infersweep_queue_depth"), 17);
  EXPECT_EQ(Find(s, "infersweep_leased_trials"), 2);
  EXPECT_EQ(Find(s, "infersweep_ingest_latency_seconds_count"), 2);
  EXPECT_DOUBLE_EQ(*Find(s, "infersweep_ingest_latency_seconds_sum"), 0.203);
  EXPECT_EQ(Find(s, "infersweep_ingest_latency_seconds_bucket", {{"le", "+Inf"}}), 2);
  EXPECT_EQ(Find(s, "infersweep_metrics_series_dropped_total"), 0);
  EXPECT_EQ(Find(s, "infersweep_metrics_config_series"), 2);
  EXPECT_EQ(Find(s, "infersweep_metrics_config_series_limit"), 5000);

  // The config turns INCORRECT: its status flips, the latest figures replace the old ones.
  m.OnResult("preset:tiny-moe", 90, "NVIDIA H200", config,
             Result(TrialStatus::kIncorrect, 300, 10, 3));
  s = Scrape(*port);
  EXPECT_EQ(status_of(s, "OK"), 0);
  EXPECT_EQ(status_of(s, "INCORRECT"), 1);
  EXPECT_EQ(Find(s, "infersweep_output_tokens_per_second", b1), 300);
  EXPECT_EQ(Find(s, "infersweep_trials_total", {{"status", "INCORRECT"}}), 1);
  EXPECT_EQ(Find(s, "infersweep_trials_total", {{"status", "OK"}}), 1);

  // HELP and TYPE lines, with the unit suffixes in the names.
  const std::string text = HttpGet(*port, "/metrics")->body;
  EXPECT_THAT(text, HasSubstr("# TYPE infersweep_ingest_latency_seconds histogram"));
  EXPECT_THAT(text, HasSubstr("# TYPE infersweep_trials_total counter"));
  EXPECT_THAT(text, HasSubstr("# TYPE infersweep_output_tokens_per_second gauge"));
  EXPECT_THAT(text, HasSubstr("# HELP infersweep_config_status "));
  EXPECT_THAT(m.Serialize(), HasSubstr("# TYPE infersweep_trials_total counter"));
}

TEST(CoordinatorMetricsTest, CpuResultsAndUnsupportedResults) {
  CoordinatorMetrics m;
  TrialResult unsupported;
  unsupported.status = TrialStatus::kUnsupported;  // no figures: only status and count
  m.OnResult("preset:tiny-moe", 90, "NVIDIA H200", *ParseBackendConfig("device=cuda"), unsupported);
  m.OnResult("preset:tiny-moe", 0, "cpu", *ParseBackendConfig("device=cpu"),
             Result(TrialStatus::kOk, 50, 20, 5));
  const std::vector<Sample> s = ParseExposition(m.Serialize());
  EXPECT_EQ(Find(s, "infersweep_config_status",
                 {{"sm_arch", "sm_90"}, {"config", "device=cuda"}, {"status", "UNSUPPORTED"}}),
            1);
  EXPECT_EQ(Find(s, "infersweep_output_tokens_per_second",
                 {{"sm_arch", "cpu"}, {"gpu", "cpu"}, {"batch", "1"}}),
            50);
  EXPECT_EQ(Count(s, "infersweep_output_tokens_per_second"), 2u);  // the CPU result's 2 batches
}

// A batch the memory plan refused is a verdict series of its (config, batch, GPU), with no
// figures; a later measured result of that batch sets the verdict back to 0.
TEST(CoordinatorMetricsTest, MemoryVerdictsArePerConfigBatchAndGpu) {
  CoordinatorMetrics m;
  const BackendConfig config = *ParseBackendConfig("device=cuda");
  TrialResult r = Result(TrialStatus::kOk, 50, 20, 5);
  r.batches[1].memory_verdict = BatchMemoryVerdict::kDoesNotFit;
  r.batches[1].memory_reason = "needs 80.00 GiB on the device (...), 70.00 GiB free";
  m.OnResult("preset:tiny-moe", 90, "NVIDIA H200", config, r);
  std::vector<Sample> s = ParseExposition(m.Serialize());
  const std::map<std::string, std::string> batch8 = {
      {"gpu", "NVIDIA H200"}, {"config", "device=cuda"}, {"batch", "8"}};
  auto with = [&](const char* verdict) {
    std::map<std::string, std::string> labels = batch8;
    labels["verdict"] = verdict;
    return labels;
  };
  EXPECT_EQ(Find(s, "infersweep_batch_memory_verdict", with("DOES_NOT_FIT")), 1);
  EXPECT_EQ(Find(s, "infersweep_batch_memory_verdict", with("OUT_OF_MEMORY")), 0);
  EXPECT_EQ(Count(s, "infersweep_batch_memory_verdict"), 2u);      // batch 1 ran: no verdict series
  EXPECT_EQ(Count(s, "infersweep_output_tokens_per_second"), 1u);  // only batch 1 has figures
  m.OnResult("preset:tiny-moe", 90, "NVIDIA H200", config, Result(TrialStatus::kOk, 50, 20, 5));
  s = ParseExposition(m.Serialize());
  EXPECT_EQ(Find(s, "infersweep_batch_memory_verdict", with("DOES_NOT_FIT")), 0);
  EXPECT_EQ(Find(s, "infersweep_output_tokens_per_second", batch8), 200);
}

// Every status of a (model, sm_arch) is exported from 0 before its first result, and from the
// first result on when nothing declared it: increase() then counts the first increment.
TEST(CoordinatorMetricsTest, TrialCountersStartAtZeroForEveryStatus) {
  CoordinatorMetrics m;
  m.DeclareTrialSeries("preset:tiny-moe", 90);
  std::vector<Sample> s = ParseExposition(m.Serialize());
  EXPECT_EQ(Count(s, "infersweep_trials_total"), 6u);
  for (const char* status : {"OK", "INCORRECT", "CRASHED", "UNSUPPORTED", "TIMEOUT", "ERROR"})
    EXPECT_EQ(Find(s, "infersweep_trials_total",
                   {{"model", "preset:tiny-moe"}, {"sm_arch", "sm_90"}, {"status", status}}),
              0)
        << status;
  m.OnResult("preset:tiny-moe", 90, "NVIDIA H200", *ParseBackendConfig("device=cuda"),
             Result(TrialStatus::kOk, 50, 20, 5));
  m.DeclareTrialSeries("preset:tiny-moe", 90);  // declaring again keeps the count
  m.OnResult("preset:other", 0, "cpu", *ParseBackendConfig("device=cpu"),
             Result(TrialStatus::kCrashed, 50, 20, 5));
  s = ParseExposition(m.Serialize());
  EXPECT_EQ(Count(s, "infersweep_trials_total"), 12u);
  EXPECT_EQ(Find(s, "infersweep_trials_total", {{"sm_arch", "sm_90"}, {"status", "OK"}}), 1);
  EXPECT_EQ(Find(s, "infersweep_trials_total", {{"sm_arch", "cpu"}, {"status", "CRASHED"}}), 1);
  EXPECT_EQ(Find(s, "infersweep_trials_total", {{"sm_arch", "cpu"}, {"status", "OK"}}), 0);
}

TEST(CoordinatorMetricsTest, CardinalityCapDropsNewSeriesOnly) {
  CoordinatorMetricsOptions options;
  options.max_config_series = 3;
  CoordinatorMetrics m(options);
  TrialResult r = Result(TrialStatus::kOk, 100, 10, 2);
  r.batches.resize(1);  // batch 1 only: one key per config
  for (int threads = 1; threads <= 5; ++threads)
    m.OnResult("m", 90, "g", *ParseBackendConfig(absl::StrCat("device=cpu,threads=", threads)), r);
  std::vector<Sample> s = ParseExposition(m.Serialize());
  EXPECT_EQ(Count(s, "infersweep_output_tokens_per_second"), 3u);
  EXPECT_EQ(Count(s, "infersweep_config_status"), 3u * 6u);
  EXPECT_EQ(Find(s, "infersweep_metrics_config_series"), 3);
  // Configs 4 and 5: one dropped label set each in the figures and in the status family.
  EXPECT_EQ(Find(s, "infersweep_metrics_series_dropped_total"), 4);
  EXPECT_EQ(m.dropped_series(), 4);
  // Every result is still counted (its (model, sm_arch) key exists).
  EXPECT_EQ(Find(s, "infersweep_trials_total", {{"status", "OK"}}), 5);

  // An existing key keeps updating at the cap.
  r.batches[0].output_tok_s.median = 777;
  m.OnResult("m", 90, "g", *ParseBackendConfig("device=cpu,threads=2"), r);
  s = ParseExposition(m.Serialize());
  EXPECT_EQ(Find(s, "infersweep_output_tokens_per_second", {{"config", "device=cpu,threads=2"}}),
            777);
  EXPECT_EQ(Find(s, "infersweep_metrics_series_dropped_total"), 4);
}

TEST(CoordinatorMetricsTest, ListenErrors) {
  CoordinatorMetrics a;
  absl::StatusOr<int> port = a.Listen("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_FALSE(a.Listen("127.0.0.1:0").ok());  // already listening
  CoordinatorMetrics b;
  absl::StatusOr<int> taken = b.Listen(absl::StrCat("127.0.0.1:", *port));
  EXPECT_FALSE(taken.ok());
  EXPECT_THAT(taken.status().message(), HasSubstr("cannot listen"));
  EXPECT_FALSE(b.Listen("not-an-address:xyz").ok());
  EXPECT_FALSE(b.Listen("127.0.0.1").ok());
  EXPECT_EQ(b.port(), 0);
}

TEST(MetricsHttpServerTest, AnswersOnlyMetricsAndStops) {
  int port = 0;
  {
    MetricsHttpServer server;
    absl::StatusOr<int> bound = server.Start("127.0.0.1:0", [] { return std::string("x 1\n"); });
    ASSERT_TRUE(bound.ok()) << bound.status();
    port = *bound;
    EXPECT_EQ(server.port(), port);
    EXPECT_FALSE(server.Start("127.0.0.1:0", [] { return std::string(); }).ok());
    std::optional<HttpResponse> r = HttpGet(port, "/metrics?x=1");
    ASSERT_TRUE(r.has_value());
    EXPECT_THAT(r->status_line, HasSubstr("200"));
    EXPECT_EQ(r->body, "x 1\n");
    r = HttpGet(port, "/other");
    ASSERT_TRUE(r.has_value());
    EXPECT_THAT(r->status_line, HasSubstr("404"));
    // Serves again after answering (one connection at a time).
    EXPECT_EQ(HttpGet(port, "/metrics")->body, "x 1\n");
  }
  // Stopped: the port is free again.
  MetricsHttpServer again;
  EXPECT_TRUE(again.Start(absl::StrCat("127.0.0.1:", port), [] { return std::string(); }).ok());
}

class FakeSampler final : public GpuSampler {
 public:
  std::vector<GpuSample> Sample() override {
    ++samples;
    GpuSample g0;
    g0.index = 0;
    g0.name = "NVIDIA H200";
    g0.power_watts = 412.5;
    g0.utilization_ratio = 0.97;
    g0.memory_used_bytes = 80e9;
    g0.temperature_celsius = 61;
    GpuSample g1;
    g1.index = 1;
    g1.name = "NVIDIA H200";
    g1.power_watts = 90;  // the other readings unsupported
    return {g0, g1};
  }
  std::string kind() const override { return "fake"; }
  int samples = 0;
};

TEST(AgentMetricsTest, ServesTrialsSpoolAndGpus) {
  auto sampler = std::make_unique<FakeSampler>();
  FakeSampler* fake = sampler.get();
  AgentMetrics m(std::move(sampler));
  absl::StatusOr<int> port = m.Listen("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();

  m.TrialStarted("7-3", "device=cpu,threads=2");
  m.TrialStarted("7-4", "device=cpu,threads=4");
  m.SetSpoolDepth(5);
  std::vector<Sample> s = Scrape(*port);
  EXPECT_GE(fake->samples, 1);  // sampled at scrape time
  EXPECT_EQ(Find(s, "infersweep_agent_up"), 1);
  EXPECT_EQ(Find(s, "infersweep_agent_running_trial",
                 {{"trial_id", "7-3"}, {"config", "device=cpu,threads=2"}}),
            1);
  EXPECT_EQ(Count(s, "infersweep_agent_running_trial"), 2u);
  EXPECT_EQ(Find(s, "infersweep_agent_spool_depth"), 5);
  EXPECT_EQ(Find(s, "infersweep_agent_gpu_power_watts", {{"gpu", "0"}}), 412.5);
  EXPECT_EQ(Find(s, "infersweep_agent_gpu_power_watts", {{"gpu", "1"}}), 90);
  EXPECT_DOUBLE_EQ(*Find(s, "infersweep_agent_gpu_utilization_ratio", {{"gpu", "0"}}), 0.97);
  EXPECT_EQ(Find(s, "infersweep_agent_gpu_memory_used_bytes", {{"gpu", "0"}}), 80e9);
  EXPECT_EQ(Find(s, "infersweep_agent_gpu_temperature_celsius", {{"gpu", "0"}}), 61);
  EXPECT_EQ(Count(s, "infersweep_agent_gpu_temperature_celsius"), 1u);
  EXPECT_EQ(Find(s, "infersweep_agent_gpu_info", {{"gpu", "1"}, {"name", "NVIDIA H200"}}), 1);

  m.TrialFinished("7-3", TrialStatus::kOk);
  m.TrialFinished("7-4", TrialStatus::kCrashed);
  m.TrialStarted("7-5", "device=cpu");
  m.TrialAbandoned("7-5");
  m.TrialAbandoned("never-started");  // harmless
  s = Scrape(*port);
  EXPECT_EQ(Count(s, "infersweep_agent_running_trial"), 0u);
  EXPECT_EQ(Find(s, "infersweep_agent_trials_total", {{"status", "OK"}}), 1);
  EXPECT_EQ(Find(s, "infersweep_agent_trials_total", {{"status", "CRASHED"}}), 1);
  EXPECT_EQ(Count(s, "infersweep_agent_trials_total"), 2u);
}

TEST(AgentMetricsTest, WithoutGpusStillUp) {
  AgentMetrics m(MakeNoGpuSampler());
  absl::StatusOr<int> port = m.Listen("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  const std::vector<Sample> s = Scrape(*port);
  EXPECT_EQ(Find(s, "infersweep_agent_up"), 1);
  EXPECT_EQ(Find(s, "infersweep_agent_gpu_sampler_nvml"), 0);
  EXPECT_EQ(Count(s, "infersweep_agent_gpu_power_watts"), 0u);
  EXPECT_EQ(Find(s, "infersweep_agent_spool_depth"), 0);
  EXPECT_THAT(m.Serialize(), Not(HasSubstr("trial_id=")));
}

// promtool's linter (naming conventions, HELP text, counter suffixes, histogram shape) on both
// expositions, when promtool is installed (Debian's prometheus package).
TEST(MetricsLintTest, PromtoolCheckMetricsIsClean) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "promtool not installed";
  CoordinatorMetrics c;
  c.OnResult("preset:tiny-moe", 90, "NVIDIA H200", *ParseBackendConfig("device=cuda"),
             Result(TrialStatus::kOk, 250, 12, 4));
  c.ObserveIngestSeconds(0.01);
  AgentMetrics a(std::make_unique<FakeSampler>());
  a.TrialStarted("1-0", "device=cpu");
  a.TrialFinished("1-1", TrialStatus::kOk);
  for (const std::string& text : {c.Serialize(), a.Serialize()}) {
    char path[] = "/tmp/metrics_lint.XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
    close(fd);
    const std::string cmd = absl::StrCat("promtool check metrics < ", path, " 2>&1");
    FILE* out = popen(cmd.c_str(), "r");
    ASSERT_NE(out, nullptr);
    std::string report;
    char buf[512];
    for (size_t n; (n = fread(buf, 1, sizeof(buf), out)) > 0;) report.append(buf, n);
    const int rc = pclose(out);
    unlink(path);
    EXPECT_EQ(rc, 0) << report;
    EXPECT_EQ(report, "") << text;
  }
}

}  // namespace
}  // namespace infersweep
