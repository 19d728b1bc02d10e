// Targets: what reaches the coordinator and the agents over the network. A sweep spec the
// coordinator accepts expands within the cap into normalized trials, and its GPU-name pattern
// compiles and matches as the scheduler's does; an agent's result JSON is taken the way the
// coordinator's OnResult takes it and survives the round trip through its stored form; gRPC
// messages are parsed from bytes as the server parses them and then validated the way the
// coordinator validates a Hello.
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "api/trial.h"
#include "api/untrusted_regex.h"
#include "coordinator/agent_sessions.h"
#include "coordinator/sweep_spec.h"
#include "proto/infersweep.pb.h"
#include "tests/fuzz/targets.h"

namespace infersweep::fuzz {
namespace {

namespace fs = std::filesystem;

constexpr char kSpecSource[] = "fuzz.yaml";
constexpr size_t kMaxTrials = 2000;

// ------------------------------------------------------------------------ sweep specs

std::vector<std::string> SweepSpecSeeds() {
  std::vector<std::string> seeds = {
      // Every top-level key, flow style; selector.gpu_name is a regular expression.
      R"(name: moe-backends-h200
model: preset:qwen3-30b-a3b
layers: 4
seed: 1
matrix:
  device: [cuda]
  attention: [naive, flash]
  moe: [loop, fused]
  graphs: ["off", "on"]
include:
  - {device: cuda, attention: flash, moe: fused, graphs: "on"}
exclude:
  - {moe: loop, graphs: "on"}
workload: {prompt: 128, output: 32, batch: [1, 8], repeats: 3, warmup: 1, timeout: 600}
selector: {sm: [90], gpu_name: "H200|H100", min_memory_gb: 80, gpus: 1}
repeats: 1
priority: 0
)",
      // Block style, a top-level device, a plain-scalar regex.
      R"(model: preset:tiny-moe
device: cpu
matrix:
  matmul:
    - naive
    - blocked
  threads: ["1", "2", all]
exclude:
  - matmul: naive
    threads: all
workload:
  prompt: 16
  output: 8
  batch:
    - 1
    - 4
selector:
  gpu_name: NVIDIA H\d+ (SXM|PCIe)
  p2p: false
repeats: 2
priority: -3
)",
      R"(name: "gemm sweep"
model: /models/qwen@fp8_block128
seed: 18446744073709551615
matrix: {device: [cuda], gemm: [reference, cublaslt]}
include: [{device: cuda, gemm: cublaslt, graphs: "on"}]
selector:
  sm: 90
  gpu_name: 'H\d+'
  min_memory_gb: 79.5
)",
  };
  // The shipped sweeps (kept valid by the sweep tests).
  const fs::path sweeps = fs::path(INFERSWEEP_SOURCE_DIR) / "sweeps";
  std::vector<fs::path> paths;
  for (const auto& entry : fs::directory_iterator(sweeps))
    if (entry.path().extension() == ".yaml") paths.push_back(entry.path());
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    seeds.push_back(text.str());
  }
  return seeds;
}

// The coordinator's SubmitSweep, less the store: parse, check the model, expand.
Outcome SubmitSpec(std::string_view yaml, std::string_view source) {
  absl::StatusOr<SweepSpec> spec = ParseSweepSpec(yaml, source);
  if (!spec.ok()) {
    Outcome o = Rejected(spec.status(), source);
    if (o.violation.empty() &&
        !absl::StartsWith(spec.status().message(), absl::string_view(source.data(), source.size())))
      return Broken(
          absl::StrCat("the error does not start with the source: ", spec.status().message()));
    return o;
  }
  absl::StatusOr<std::vector<std::string>> warnings = CheckSweepModel(*spec);
  if (!warnings.ok()) return Rejected(warnings.status(), source);
  absl::StatusOr<std::vector<TrialRecord>> trials = ExpandSweep(*spec, 3, kMaxTrials);
  if (!trials.ok()) return Rejected(trials.status(), source);
  if (trials->empty()) return Broken("accepted a sweep of no trials");
  if (trials->size() > kMaxTrials)
    return Broken(absl::StrCat(trials->size(), " trials, over the cap"));
  if (trials->size() % static_cast<size_t>(spec->repeats) != 0)
    return Broken(
        absl::StrCat(trials->size(), " trials is not a multiple of ", spec->repeats, " repeats"));
  for (const TrialRecord& t : *trials) {
    absl::StatusOr<BackendConfig> normalized = NormalizeBackendConfig(t.config);
    if (!normalized.ok() || *normalized != t.config)
      return Broken(
          absl::StrCat("trial config ", BackendConfigString(t.config), " is not normalized"));
    if (t.selector.device != ConfigDevice(t.config))
      return Broken("selector device != config device");
    if (absl::Status s = ValidateWorkload(t.workload); !s.ok())
      return Broken(absl::StrCat("trial workload invalid: ", s.message()));
  }
  // The scheduler's matching of the selector against each slot's GPU name
  // (coordinator/scheduler.cc): a pattern the parser took must compile there too, or the trials
  // would wait forever.
  if (const std::string& pattern = spec->selector.gpu_name_regex; !pattern.empty()) {
    absl::StatusOr<std::unique_ptr<re2::RE2>> re = CompileUntrustedRegex(pattern);
    if (!re.ok())
      return Broken(absl::StrCat("accepted gpu_name '", pattern.substr(0, 80),
                                 "' that the scheduler cannot compile: ", re.status().message()));
    for (const char* gpu : {"NVIDIA H200", "NVIDIA GeForce RTX 5090", "cpu", ""})
      (void)RegexSearch(**re, gpu);
    (void)RegexSearch(**re, std::string(256, 'H'));
  }
  (void)MakeSweepRecord(*spec);
  return Accepted();
}

Outcome SweepSpecs(std::string_view input) { return SubmitSpec(input, kSpecSource); }

const std::vector<std::string> kYamlTokens = {"name",
                                              "model",
                                              "matrix",
                                              "include",
                                              "exclude",
                                              "workload",
                                              "selector",
                                              "gpu_name",
                                              "sm",
                                              "repeats",
                                              "priority",
                                              "device",
                                              "mode: serving",
                                              "slo",
                                              ": ",
                                              "- ",
                                              "[",
                                              "]",
                                              "{",
                                              "}",
                                              "&a ",
                                              "*a",
                                              "<<: *a",
                                              "!!map ",
                                              "? ",
                                              "|\n",
                                              ">-\n",
                                              "\"\\x00\"",
                                              "'",
                                              "\"",
                                              "#",
                                              "---\n",
                                              "(",
                                              ")",
                                              "((((",
                                              "))))",
                                              "\\d+",
                                              "(?:",
                                              "|"};

// ------------------------------------------------------------------------ result JSON

TrialResult SampleResult(TrialStatus status) {
  TrialResult r;
  r.trial_id = "7-3";
  r.attempt = 2;
  r.status = status;
  r.model = "preset:tiny-moe";
  r.config = {{"device", "cpu"}, {"matmul", "blocked"}, {"threads", "2"}};
  r.device = "cpu";
  r.engine_version = "infersweep v0.1.0";
  r.model_identity = {"preset", "tiny-moe", 2, 1, "bf16", ""};
  r.workload = "prompt=32,output=16,warmup=1";
  r.software = {"580.65.06", "13.0", "13.0", "13.0.0", "13.0.0", "2.27", "9.10"};
  r.load_seconds = 0.25;
  r.peak_memory_bytes = 1 << 20;
  r.verdict.precision_class = "bf16";
  r.verdict.top1_agreement = 1;
  r.verdict.loop_reference_agreement = 0.5;
  r.verdict.failures = {"kl_mean 0.3 > 0.1"};
  BatchFigures b;
  b.batch = 4;
  b.ttft_ms = {1.5, 1.2, 2.0};
  b.itl_ms = {1, 2, 3};
  b.roofline_tok_s = 1000;
  PhaseKernels decode;
  decode.graph = true;
  decode.kernels = {{"gemm_bf16", 12}, {"attention_decode", 2}};
  decode.fallbacks = {"moe=fused -> loop"};
  b.decode_kernels = decode;
  r.batches = {b, b};
  r.started_unix_ms = 1700000000000;
  r.finished_unix_ms = 1700000001000;
  return r;
}

TrialResult SampleServingResult() {
  TrialResult r = SampleResult(TrialStatus::kOk);
  r.batches.clear();
  r.workload = "serve:isl=64,osl=16,requests=8,warmup=0,chunk=0,seed=1";
  ServingPoint p;
  p.point = {false, 4, 0};
  p.requests_checked = p.requests_matching = p.completed = 8;
  p.ttft_ms = {1, 2, 3, 4};
  p.request_goodput = 2.5;
  p.meets_slo = true;
  r.serving = {p};
  ServingSloSearch search;
  search.found = true;
  search.best = p;
  search.probes = {p, p};
  r.slo_search = search;
  return r;
}

std::vector<std::string> ResultSeeds() {
  return {ToJson(SampleResult(TrialStatus::kOk)).dump(),
          ToJson(SampleResult(TrialStatus::kIncorrect)).dump(2),
          ToJson(SampleServingResult()).dump()};
}

// Coordinator side: OnResult's parse, then the stored form (what the results table and `best`
// read back) must parse to the same JSON.
Outcome AgentResults(std::string_view input) {
  absl::StatusOr<TrialResult> result = TrialResultFromJsonText(input, "result_json");
  if (!result.ok()) return Rejected(result.status(), "result_json");
  const std::string stored = ToJson(*result).dump();
  absl::StatusOr<TrialResult> back = TrialResultFromJsonText(stored, "stored result");
  if (!back.ok())
    return Broken(absl::StrCat("its stored form does not parse back: ", back.status().message()));
  if (ToJson(*back).dump() != stored) return Broken("its stored form parses back to other figures");
  return Accepted();
}

std::vector<std::string> RequestSeeds() {
  TrialRequest r;
  r.trial_id = "4-1";
  r.attempt = 1;
  r.model = "preset:tiny-moe@nvfp4";
  r.layers = 2;
  r.config = {{"device", "cpu"}, {"matmul", "naive"}};
  absl::StatusOr<Workload> w = ParseWorkload("prompt=16,output=8,batch=1:4");
  if (w.ok()) r.workload = *w;
  std::vector<std::string> seeds = {ToJson(r).dump()};
  absl::StatusOr<ServeSpec> serve = ParseServeSpec("concurrency=1:4,isl=64,osl=16,requests=8");
  if (serve.ok()) r.workload.serve = *serve;
  r.workload.slo.ttft_ms = 200;
  seeds.push_back(ToJson(r).dump(1));
  return seeds;
}

// Agent side: an Assignment's request_json.
Outcome Assignments(std::string_view input) {
  absl::StatusOr<TrialRequest> request = TrialRequestFromJsonText(input, "request_json");
  if (!request.ok()) return Rejected(request.status(), "request_json");
  if (absl::Status s = ValidateWorkload(request->workload); !s.ok())
    return Broken(absl::StrCat("accepted an invalid workload: ", s.message()));
  return Accepted();
}

const std::vector<std::string> kResultTokens = {"\"status\"",
                                                "\"OK\"",
                                                "\"batches\"",
                                                "\"serving\"",
                                                "\"slo_search\"",
                                                "\"kernels\"",
                                                "\"decode\"",
                                                "\"launches\"",
                                                "\"verdict\"",
                                                "\"config\"",
                                                "\"workload\"",
                                                "\"serve\"",
                                                "\"model_identity\"",
                                                "[",
                                                "]",
                                                "{",
                                                "}",
                                                "null",
                                                "1e400",
                                                "-1",
                                                "18446744073709551616",
                                                "[[[[[[[[",
                                                "{\"a\":{\"a\":"};

// ------------------------------------------------------------------------ gRPC messages

// Protobuf's text format is what the generic mutations edit (so that strings and nesting can
// change without breaking the wire framing); the bytes the target gets are the wire format.
Framing ProtoFraming(const google::protobuf::Message& prototype) {
  Framing f;
  f.unwrap = [&prototype](std::string_view wire) {
    std::unique_ptr<google::protobuf::Message> m(prototype.New());
    std::string text;
    if (m->ParseFromArray(wire.data(), static_cast<int>(wire.size())))
      google::protobuf::TextFormat::PrintToString(*m, &text);
    return text;
  };
  f.rewrap = [&prototype](std::string_view, std::string_view text) {
    std::unique_ptr<google::protobuf::Message> m(prototype.New());
    google::protobuf::TextFormat::Parser parser;
    parser.AllowPartialMessage(true);
    // Text that no longer parses goes to the wire parser as it is: garbage bytes are inputs too.
    if (!parser.ParseFromString(std::string(text), m.get())) return std::string(text);
    return m->SerializeAsString();
  };
  // Wire-level edits: nested unknown groups, long varints, huge length prefixes, truncation.
  f.mutate = [](std::string& wire, Rng& rng) {
    switch (rng.Below(4)) {
      case 0: {  // field 15 as a group nested thousands deep (protobuf's recursion limit is 100)
        const size_t depth = std::size_t{1} << (1 + rng.Below(15));
        wire.insert(rng.Below(wire.size() + 1),
                    std::string(depth, '\x7b') + std::string(depth, '\x7c'));
        break;
      }
      case 1:  // a varint of ten 0xff bytes
        wire.insert(rng.Below(wire.size() + 1), std::string(10, '\xff'));
        break;
      case 2: {  // field 3 (length-delimited) claiming more bytes than follow
        const std::string prefix = "\x1a\xff\xff\xff\xff\x0f";
        wire.insert(rng.Below(wire.size() + 1), prefix);
        break;
      }
      default:
        wire.resize(rng.Below(wire.size() + 1));
        break;
    }
  };
  return f;
}

const v1::AgentMessage& AgentPrototype() {
  static const v1::AgentMessage m;
  return m;
}
const v1::CoordinatorMessage& CoordinatorPrototype() {
  static const v1::CoordinatorMessage m;
  return m;
}
const v1::SubmitSweepRequest& SubmitPrototype() {
  static const v1::SubmitSweepRequest m;
  return m;
}

std::vector<std::string> AgentMessageSeeds() {
  std::vector<std::string> seeds;
  v1::AgentMessage hello;
  v1::Hello* h = hello.mutable_hello();
  h->set_agent_id("gpu-host-1");
  h->set_host("gpu-host-1.example");
  h->set_engine_version("infersweep v0.1.0");
  h->set_protocol_version(rpc::kProtocolVersion);
  h->set_cuda_build(true);
  for (int i = 0; i < 2; ++i) {
    v1::Gpu* g = h->add_gpus();
    g->set_index(i);
    g->set_name("NVIDIA H200");
    g->set_sm(90);
    g->set_memory_bytes(int64_t{141} << 30);
    g->add_p2p_peers(1 - i);
  }
  h->add_backends("moe=fused");
  v1::RunningTrial* running = h->add_running();
  running->set_trial_id("3-1");
  running->set_attempt(1);
  running->add_slots(0);
  seeds.push_back(hello.SerializeAsString());

  v1::AgentMessage cpu;
  cpu.mutable_hello()->set_agent_id("cpu-1");
  cpu.mutable_hello()->set_cpu_only(true);
  cpu.mutable_hello()->set_protocol_version(rpc::kProtocolVersion);
  seeds.push_back(cpu.SerializeAsString());

  v1::AgentMessage result;
  result.mutable_result()->set_trial_id("7-3");
  result.mutable_result()->set_attempt(2);
  result.mutable_result()->set_result_json(ToJson(SampleResult(TrialStatus::kOk)).dump());
  result.mutable_result()->add_slots(0);
  seeds.push_back(result.SerializeAsString());

  v1::AgentMessage heartbeat;
  heartbeat.mutable_heartbeat()->add_running_trial_ids("7-3");
  heartbeat.mutable_heartbeat()->set_free_slots(1);
  seeds.push_back(heartbeat.SerializeAsString());
  return seeds;
}

// The coordinator's reading of an agent's message: Hello validation, a Result's JSON.
Outcome AgentMessages(std::string_view input) {
  v1::AgentMessage m;
  if (!m.ParseFromArray(input.data(), static_cast<int>(input.size()))) return {};
  if (m.has_hello()) {
    absl::Status s = coordinator::ValidateHello(m.hello());
    if (!s.ok()) return Rejected(s, "Hello");
    const v1::Hello& h = m.hello();
    if (h.gpus_size() > 256 || h.agent_id().empty() || h.agent_id().size() > 128)
      return Broken("ValidateHello accepted out-of-range fields");
    for (int i = 0; i < h.gpus_size(); ++i)
      for (int peer : h.gpus(i).p2p_peers())
        if (peer < 0 || peer >= h.gpus_size()) return Broken("accepted a peer outside the GPUs");
    return Accepted();
  }
  if (m.has_result()) return AgentResults(m.result().result_json());
  return Accepted();
}

std::vector<std::string> CoordinatorMessageSeeds() {
  std::vector<std::string> seeds;
  for (const std::string& request : RequestSeeds()) {
    v1::CoordinatorMessage m;
    m.mutable_assignment()->set_trial_id("4-1");
    m.mutable_assignment()->set_attempt(1);
    m.mutable_assignment()->set_request_json(request);
    m.mutable_assignment()->set_lease_expires_ms(1700000000000);
    m.mutable_assignment()->add_slots(0);
    seeds.push_back(m.SerializeAsString());
  }
  v1::CoordinatorMessage error;
  error.mutable_error()->set_message("the coordinator is stopping");
  error.mutable_error()->set_code(14);
  seeds.push_back(error.SerializeAsString());
  return seeds;
}

// The agent's reading of the coordinator's message: an Assignment's request.
Outcome CoordinatorMessages(std::string_view input) {
  v1::CoordinatorMessage m;
  if (!m.ParseFromArray(input.data(), static_cast<int>(input.size()))) return {};
  if (m.has_assignment()) return Assignments(m.assignment().request_json());
  return Accepted();
}

std::vector<std::string> SubmitSeeds() {
  std::vector<std::string> seeds;
  for (const std::string& spec : SweepSpecSeeds()) {
    v1::SubmitSweepRequest r;
    r.set_spec_yaml(spec);
    r.set_source("sweep.yaml");
    seeds.push_back(r.SerializeAsString());
  }
  return seeds;
}

Outcome SubmitRequests(std::string_view input) {
  v1::SubmitSweepRequest r;
  if (!r.ParseFromArray(input.data(), static_cast<int>(input.size()))) return {};
  // The coordinator's own size check and source default (coordinator/user_api.cc).
  if (r.spec_yaml().size() > kMaxSweepSpecBytes) return {};
  const std::string source = r.source().empty() ? "<request>" : r.source().substr(0, 256);
  return SubmitSpec(r.spec_yaml(), source);
}

}  // namespace

std::vector<FuzzTarget> ServiceTargets() {
  constexpr size_t kMessageBytes = 4 << 20;  // rpc::kMaxMessageBytes
  std::vector<FuzzTarget> targets = {
      {"sweep_spec", SweepSpecs, SweepSpecSeeds, kYamlTokens, kMaxSweepSpecBytes + (64 << 10)},
      {"result_json", AgentResults, ResultSeeds, kResultTokens, kMessageBytes},
      {"request_json", Assignments, RequestSeeds, kResultTokens, kMessageBytes},
      {"grpc_agent_message", AgentMessages, AgentMessageSeeds, kResultTokens, kMessageBytes},
      {"grpc_coordinator_message", CoordinatorMessages, CoordinatorMessageSeeds, kResultTokens,
       kMessageBytes},
      {"grpc_submit_sweep", SubmitRequests, SubmitSeeds, kYamlTokens, kMessageBytes},
  };
  targets[3].framing = ProtoFraming(AgentPrototype());
  targets[4].framing = ProtoFraming(CoordinatorPrototype());
  targets[5].framing = ProtoFraming(SubmitPrototype());
  return targets;
}

}  // namespace infersweep::fuzz
