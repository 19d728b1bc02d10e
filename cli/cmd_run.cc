// `infersweep run`: trials of one model under one or more backend configs, each in an isolated
// worker process; and `infersweep worker`, that process.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "api/model_config.h"
#include "api/model_description.h"
#include "api/status_macros.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "engine/backends.h"
#include "engine/fault_injection.h"
#include "engine/plan/memory_plan.h"
#include "harness/executor.h"
#include "harness/rank_supervisor.h"
#include "harness/report.h"
#include "harness/runner.h"
#include "harness/serving.h"

namespace infersweep::cli {
namespace {

// "matmul=naive|blocked,threads=1|2" -> the product of the alternatives.
absl::StatusOr<std::vector<BackendConfig>> ExpandConfigArg(const std::string& text) {
  std::map<std::string, std::vector<std::string>> axes;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.first.empty() || kv.second.empty())
      return absl::InvalidArgumentError(
          absl::StrCat("--config item '", item, "' is not of the form axis=value[|value...]"));
    if (axes.count(kv.first))
      return absl::InvalidArgumentError(absl::StrCat("--config axis '", kv.first, "' given twice"));
    std::vector<std::string>& values = axes[kv.first];
    for (absl::string_view value : absl::StrSplit(kv.second, '|')) {
      if (value.empty())
        return absl::InvalidArgumentError(
            absl::StrCat("--config axis '", kv.first, "': '", kv.second,
                         "' has an empty alternative (values separated by single '|')"));
      if (std::find(values.begin(), values.end(), value) != values.end())
        return absl::InvalidArgumentError(
            absl::StrCat("--config axis '", kv.first, "': value '", value, "' given twice"));
      values.emplace_back(value);
    }
  }
  std::vector<BackendConfig> configs;
  for (const BackendConfig& c : ExpandMatrix(axes)) {
    ASSIGN_OR_RETURN(auto normalized, NormalizeBackendConfig(c));
    configs.push_back(normalized);
  }
  return configs;
}

struct RunArgs {
  std::string model = "preset:tiny-moe";
  int layers = 0;
  uint64_t seed = 1;
  std::vector<std::string> configs;
  std::string workload = WorkloadString(Workload{});
  std::string json_out;
  std::string inject_fault;
  std::string quantize;
  bool show_kernels = false;
  std::string serve;  // a ServeSpec: serve load points instead of timing lockstep batches
  std::string slo;    // with serve: the SLO each load point's goodput and verdict use
};

// The configs of --config (device=cpu without one), expanded; prints the error and returns
// nullopt on a bad one.
std::optional<std::vector<BackendConfig>> ExpandConfigArgs(const RunArgs& args) {
  std::vector<BackendConfig> configs;
  for (const std::string& text :
       args.configs.empty() ? std::vector<std::string>{"device=cpu"} : args.configs) {
    auto expanded = ExpandConfigArg(text);
    if (!expanded.ok()) {
      std::fprintf(stderr, "error: --config %s: %s\n", text.c_str(),
                   std::string(expanded.status().message()).c_str());
      return std::nullopt;
    }
    configs.insert(configs.end(), expanded->begin(), expanded->end());
  }
  return configs;
}

// The model and --layers, as far as they are known without loading weights: a preset must exist
// and take the layer count; a checkpoint folder must exist, and the layer count must lie within
// its config.json's when that reads. Workers report everything else about the model.
absl::Status CheckModelArgs(const std::string& model, int layers) {
  ASSIGN_OR_RETURN(const ModelDescription description, ParseModelDescription(model));
  absl::string_view preset = description.model;
  const std::vector<std::string> known = PresetNames();
  int model_layers = 0;
  if (absl::ConsumePrefix(&preset, "preset:")) {
    if (std::find(known.begin(), known.end(), preset) == known.end())
      return absl::InvalidArgumentError(
          absl::StrCat("--model '", model, "': unknown preset '", preset,
                       "' (known presets: ", absl::StrJoin(known, ", "), ")"));
    ASSIGN_OR_RETURN(const ModelConfig config, PresetConfig(std::string(preset)));
    model_layers = config.num_layers;
  } else {
    std::error_code ec;
    if (!std::filesystem::is_directory(description.model, ec))
      return absl::InvalidArgumentError(absl::StrCat(
          "--model '", model, "': no such checkpoint folder (or preset:NAME; known presets: ",
          absl::StrJoin(known, ", "), ")"));
    absl::StatusOr<ModelConfig> config = LoadModelConfig(description.model);
    if (!config.ok()) return absl::OkStatus();  // the worker names the file and the field
    model_layers = config->num_layers;
  }
  if (layers < 0 || layers > model_layers)
    return absl::InvalidArgumentError(absl::StrCat(
        "--layers ", layers, ": must lie in [1, ", model_layers, "], the layer count of ",
        description.model, " (leave it out for all ", model_layers, ")"));
  if (layers > 0 && absl::StartsWith(description.model, "preset:")) {
    if (absl::StatusOr<ModelConfig> shaped = PresetConfig(std::string(preset), layers);
        !shaped.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("--layers ", layers, ": ", shaped.status().message()));
  }
  return absl::OkStatus();
}

// Writes `doc` to `path`, indented; false (and the error on stderr) when it cannot.
bool WriteJson(const std::string& path, const nlohmann::json& doc) {
  std::ofstream out(path);
  out << doc.dump(1) << "\n";
  if (!out) std::fprintf(stderr, "error: cannot write %s\n", path.c_str());
  return static_cast<bool>(out);
}

// `run --serve`: each config serves every load point in an isolated worker process, as a sweep's
// serving trial does (a crash is CRASHED, a hang past --workload's timeout TIMEOUT), judged
// request by request against lone runs; one line per load point. Exits 0 when every config ran,
// whatever its verdicts, as `run` does.
// A trial of `config` on the command's model, seed and fault, for the local runner.
TrialRequest LocalTrialRequest(const RunArgs& args, const std::string& model,
                               const BackendConfig& config, std::string trial_id) {
  TrialRequest request;
  request.trial_id = std::move(trial_id);
  request.model = model;
  request.layers = args.layers;
  request.seed = args.seed;
  request.config = config;
  request.inject_fault = args.inject_fault;
  return request;
}

int RunServing(const RunArgs& args) {
  auto fail = [](const std::string& what, const absl::Status& s) {
    std::fprintf(stderr, "error: %s%s\n", what.c_str(), std::string(s.message()).c_str());
    return 2;
  };
  auto spec = ParseServeSpec(args.serve);
  if (!spec.ok()) return fail("", spec.status());
  Slo slo;
  if (!args.slo.empty()) {
    auto parsed = ParseSlo(args.slo);
    if (!parsed.ok()) return fail("", parsed.status());
    slo = *parsed;
  }
  auto model = WithQuantization(args.model, args.quantize);
  if (!model.ok()) return fail("", model.status());
  if (absl::Status s = CheckModelArgs(*model, args.layers); !s.ok()) return fail("", s);
  auto fault = ParseFaultInjection(args.inject_fault);
  if (!fault.ok()) return fail("", fault.status());
  // Only its timeout applies: the serve spec replaces the lockstep fields.
  auto workload = ParseWorkload(args.workload);
  if (!workload.ok()) return fail("--workload: ", workload.status());
  const std::optional<std::vector<BackendConfig>> configs = ExpandConfigArgs(args);
  if (!configs) return 2;

  auto length = [](int lo, int hi) {
    return lo == hi ? absl::StrCat(lo) : absl::StrCat(lo, "-", hi, " (uniform)");
  };
  std::vector<std::string> header = {
      absl::StrCat("infersweep run --serve: model ", *model,
                   args.layers ? absl::StrCat(" (layers ", args.layers, ")") : "", ", ",
                   configs->size(), " config(s), each in a worker process (timeout ",
                   workload->timeout_s, " s)"),
      absl::StrCat("load: ",
                   spec->requests > 0 ? absl::StrCat(spec->requests, " timed requests")
                                      : absl::StrCat(spec->duration_s, " s of arrivals"),
                   " per load point after ", spec->warmup, " warm-up, isl ",
                   length(spec->isl_min, spec->isl_max), ", osl ",
                   length(spec->osl_min, spec->osl_max), ", prefill chunk ",
                   spec->chunk > 0 ? absl::StrCat(spec->chunk, " tokens") : "whole prompts",
                   spec->prefill_tokens > 0
                       ? absl::StrCat(", up to ", spec->prefill_tokens, " prompt tokens a step")
                       : "",
                   ", seed ", spec->seed),
      absl::StrCat("verdict: fp32 configs: every served request's greedy tokens against the same "
                   "request run alone; others: the verdict's KL/top-1 ceilings on teacher-forced "
                   "logits of served requests (under ",
                   kServedReferenceTokens,
                   " tokens) against the reference; times are wall clock, ms"),
  };
  if (!slo.empty())
    header.push_back(absl::StrCat(
        "slo: ", slo.ttft_ms ? absl::StrCat("ttft_ms <= ", *slo.ttft_ms, " ") : "",
        slo.tpot_ms ? absl::StrCat("tpot_ms <= ", *slo.tpot_ms, " ") : "",
        "(goodput: requests meeting each; a load point meets it at p", slo.percentile, ")"));
  if (!args.inject_fault.empty())
    header.push_back("TEST-ONLY fault injected into every config under test: " + args.inject_fault);
  std::fputs(FormatReportHeader(header).c_str(), stdout);
  TrialRunner runner;
  nlohmann::json all = nlohmann::json::array();
  int index = 0;
  for (const BackendConfig& config : *configs) {
    std::printf("# config %s\n", BackendConfigString(config).c_str());
    std::fflush(stdout);
    TrialRequest request =
        LocalTrialRequest(args, *model, config, absl::StrCat("local-serve-", index++));
    request.workload.serve = *spec;
    request.workload.slo = slo;
    request.workload.timeout_s = workload->timeout_s;
    const TrialResult result = runner.Run(request);
    if (result.serving.empty() && result.status != TrialStatus::kOk) {
      std::printf("%-28s %-9s %s\n", "-", std::string(TrialStatusName(result.status)).c_str(),
                  result.reason.c_str());
    }
    for (const ServingPoint& point : result.serving)
      std::fputs(FormatServingPointLine(point, slo).c_str(), stdout);
    nlohmann::json search = nullptr;
    if (result.slo_search) {
      search = {{"found", result.slo_search->found}, {"probes", nlohmann::json::array()}};
      for (const ServingPoint& probe : result.slo_search->probes) {
        std::fputs(absl::StrCat("# probe ", FormatServingPointLine(probe, slo)).c_str(), stdout);
        search["probes"].push_back(ToJson(probe));
      }
      if (result.slo_search->best) search["best"] = ToJson(*result.slo_search->best);
      std::fputs(FormatServingSloLine(*result.slo_search, slo).c_str(), stdout);
    }
    if (!result.stderr_tail.empty() && result.status != TrialStatus::kOk &&
        result.status != TrialStatus::kIncorrect) {
      std::string tail = result.stderr_tail;
      if (tail.size() > 600) tail = "..." + tail.substr(tail.size() - 600);
      for (absl::string_view line : absl::StrSplit(tail, '\n'))
        std::printf("#   stderr: %s\n", std::string(line).c_str());
    }
    std::fflush(stdout);
    nlohmann::json points = nlohmann::json::array();
    for (const ServingPoint& point : result.serving) points.push_back(ToJson(point));
    nlohmann::json entry = {{"config", BackendConfigString(config)},
                            {"status", std::string(TrialStatusName(result.status))},
                            {"reason", result.reason},
                            {"load_points", std::move(points)}};
    if (!search.is_null()) entry["slo_search"] = std::move(search);
    all.push_back(std::move(entry));
  }
  if (!args.json_out.empty()) {
    if (!WriteJson(args.json_out, {{"schema", "infersweep.serve/1"},
                                   {"model", *model},
                                   {"serve", args.serve},
                                   {"slo", args.slo},
                                   {"results", all}}))
      return 1;
  }
  return 0;
}

int RunTrials(const RunArgs& args) {
  if (!args.serve.empty()) return RunServing(args);
  if (!args.slo.empty()) {
    std::fprintf(stderr, "error: --slo applies to serving load points: it needs --serve\n");
    return 2;
  }
  // Trials carry the model description: "--quantize nvfp4" is "<model>@nvfp4" from here on.
  auto model = WithQuantization(args.model, args.quantize);
  if (!model.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(model.status().message()).c_str());
    return 2;
  }
  if (absl::Status s = CheckModelArgs(*model, args.layers); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  auto workload = ParseWorkload(args.workload);
  if (!workload.ok()) {
    std::fprintf(stderr, "error: --workload: %s\n",
                 std::string(workload.status().message()).c_str());
    return 2;
  }
  if (auto fault = ParseFaultInjection(args.inject_fault); !fault.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(fault.status().message()).c_str());
    return 2;
  }
  const std::optional<std::vector<BackendConfig>> expanded = ExpandConfigArgs(args);
  if (!expanded) return 2;
  const std::vector<BackendConfig>& configs = *expanded;
  const LocalDevices devices = ProbeLocalDevices();
  std::vector<std::string> header = {
      absl::StrCat("infersweep run: model ", *model,
                   args.layers ? absl::StrCat(" (layers ", args.layers, ")") : "", ", ",
                   configs.size(), " config(s)"),
      absl::StrCat(
          "devices: cpu",
          devices.gpu_count ? absl::StrCat(", ", devices.gpu_name, " sm_", devices.sm) : "",
          devices.has_cuda_build ? " (CUDA build)" : " (no CUDA in this build)"),
      absl::StrCat("workload: prompt ", workload->prompt_len, " tokens, output ",
                   workload->output_len, " tokens, repeats ", workload->repeats,
                   " (median; spread on # lines), warmup ", workload->warmup, ", timeout ",
                   workload->timeout_s, " s"),
      "verdict: teacher-forced logits + free-running greedy vs the reference on the same weights",
  };
  if (!args.inject_fault.empty())
    header.push_back("TEST-ONLY fault injected into every config under test: " + args.inject_fault);
  std::fputs(FormatReportHeader(header).c_str(), stdout);
  std::fputs(FormatColumnHeader().c_str(), stdout);
  std::fflush(stdout);

  TrialRunner runner;
  nlohmann::json all = nlohmann::json::array();
  int index = 0;
  for (const BackendConfig& config : configs) {
    TrialRequest request = LocalTrialRequest(args, *model, config, absl::StrCat("local-", index++));
    request.workload = *workload;
    const TrialResult result = runner.Run(request);
    std::fputs(FormatResultRows(result).c_str(), stdout);
    if (args.show_kernels)
      for (const BatchFigures& b : result.batches) std::fputs(FormatKernels(b).c_str(), stdout);
    if (!result.stderr_tail.empty() && result.status != TrialStatus::kOk) {
      std::string tail = result.stderr_tail;
      if (tail.size() > 600) tail = "..." + tail.substr(tail.size() - 600);
      for (absl::string_view line : absl::StrSplit(tail, '\n'))
        std::printf("#   stderr: %s\n", std::string(line).c_str());
    }
    std::fflush(stdout);
    all.push_back(ToJson(result));
  }
  if (!args.json_out.empty()) {
    if (!WriteJson(args.json_out, {{"schema", "infersweep.run/1"},
                                   {"model", *model},
                                   {"workload", ToJson(*workload)},
                                   {"results", all}}))
      return 1;
  }
  return 0;
}

// `memory-plan`: each CUDA config's memory plan at each batch size of the workload, pool by pool,
// computed on the host as a trial computes it before loading (docs/MEMORY.md); against
// `free_gib` when given, with the verdict a trial would reach. Needs no GPU.
int PlanTrialMemory(const RunArgs& args, double free_gib) {
  auto model = WithQuantization(args.model, args.quantize);
  if (!model.ok()) return Fail(model.status());
  if (auto s = CheckModelArgs(*model, args.layers); !s.ok()) return Fail(s);
  auto configs = ExpandConfigArgs(args);
  if (!configs) return kUsageError;
  auto workload = ParseWorkload(args.workload);
  if (!workload.ok()) return Fail(workload.status());
  if (free_gib < 0) return Usage("--free-gib: must be >= 0");
  absl::StatusOr<ModelConfig> shapes = DescribeModelShapes(*model, args.layers);
  if (!shapes.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(shapes.status().message()).c_str());
    return 1;
  }
  const QuantFormat format = DeclaredQuantFormat(*model);
  const std::string weight_format = format == QuantFormat::kNone ? "" : QuantFormatName(format);
  const int64_t free_bytes = static_cast<int64_t>(free_gib * static_cast<double>(int64_t{1} << 30));
  std::printf("# memory plan: %s%s, prompt %d + output %d tokens a sequence%s\n", model->c_str(),
              args.layers > 0 ? absl::StrCat(", ", args.layers, " layers").c_str() : "",
              workload->prompt_len, workload->output_len,
              free_gib > 0 ? absl::StrFormat(", %.2f GiB free", free_gib).c_str() : "");
  int failures = 0;
  for (const BackendConfig& config : *configs) {
    absl::StatusOr<BackendConfig> normalized = NormalizeBackendConfig(config);
    const std::string name = BackendConfigString(normalized.ok() ? *normalized : config);
    if (!normalized.ok() || ConfigDevice(*normalized) != Device::kCuda) {
      std::printf("%s: %s\n", name.c_str(),
                  normalized.ok() ? "not a CUDA config: nothing to plan"
                                  : std::string(normalized.status().message()).c_str());
      continue;
    }
    for (int batch : workload->batch_sizes) {
      MemoryWorkload w;
      w.batch = batch;
      w.prompt_tokens = workload->prompt_len;
      w.generated_tokens = workload->output_len;
      absl::StatusOr<MemoryPlan> plan = PlanMemory(*normalized, *shapes, weight_format, w);
      if (!plan.ok()) {
        ++failures;
        std::printf("%s batch %d: %s\n", name.c_str(), batch,
                    std::string(plan.status().message()).c_str());
        continue;
      }
      if (free_gib > 0) {
        std::printf("%s batch %d: %s: %s\n", name.c_str(), batch,
                    Fits(*plan, free_bytes) ? "fits" : "does not fit",
                    MemoryVerdictText(*plan, free_bytes).c_str());
      } else {
        std::printf("%s batch %d: %s\n", name.c_str(), batch, MemoryNeedsText(*plan).c_str());
      }
    }
  }
  return failures > 0 ? 1 : 0;
}

}  // namespace

void AddRunCommands(CLI::App& app) {
  static RunArgs args;
  CLI::App* run =
      app.add_subcommand("run", "run backend configs in isolated workers; judge and time them");
  run->add_option("--model", args.model, "checkpoint folder or preset:NAME")->capture_default_str();
  run->add_option("--layers", args.layers,
                  "presets: run the first N of the model's layers (1 to its layer count)");
  run->add_option("--seed", args.seed, "presets: synthetic weight seed")->capture_default_str();
  run->add_option("--quantize", args.quantize,
                  "quantize the linear layers on load (fp8_tensor, fp8_channel, fp8_block128, "
                  "nvfp4, mxfp4); the same as --model <model>@<format>");
  run->add_option("--config", args.configs,
                  "axis=value[|value...],... (repeatable; '|' alternatives expand to a matrix)");
  run->add_option("--workload", args.workload,
                  "prompt=N,output=N,batch=B1:B2:...,repeats=N,warmup=N,timeout=S: each key at "
                  "most once, batch sizes increasing; a key left out keeps the default")
      ->capture_default_str();
  run->add_option("--json", args.json_out, "write results as JSON (docs/RESULTS.md)");
  run->add_option("--serve", args.serve,
                  "serve load points instead of lockstep batches: concurrency=1:4|rate=R1:R2 "
                  "[,max_concurrency=N],isl=N|A-B,osl=N|A-B,requests=N|duration=S[,warmup=N]"
                  "[,chunk=N][,seed=N]");
  run->add_option(
      "--slo", args.slo,
      "with --serve: ttft_ms=...,tpot_ms=...[,percentile=99]: goodput per load point, and the "
      "highest load meeting the SLO (bisection between the lowest and highest load)");
  run->add_flag("--show-kernels", args.show_kernels,
                "after each result, the kernels (CPU: ops) one prefill and one decode step ran at "
                "each batch size, and the fallbacks taken");
  run->add_option("--test-inject-fault", args.inject_fault,
                  "TEST ONLY: nan-layer:L, zero-expert:E, bad-scale:F, bad-quant-scale:F[@WEIGHT], "
                  "stuck-token:T, segv, abort, hang, delay:S, bad-state:F, kv-slot-swap:S, "
                  "state-slot-swap:S");
  run->callback([] { std::exit(RunTrials(args)); });

  static RunArgs plan_args;
  static double free_gib = 0;
  CLI::App* plan = app.add_subcommand(
      "memory-plan", "the device memory each CUDA config needs, pool by pool, before any load");
  plan->add_option("--model", plan_args.model, "checkpoint folder or preset:NAME")
      ->capture_default_str();
  plan->add_option("--layers", plan_args.layers, "presets: the first N of the model's layers");
  plan->add_option("--quantize", plan_args.quantize, "the weight format, as run's");
  plan->add_option("--config", plan_args.configs, "axis=value[|value...],... (repeatable)");
  plan->add_option("--workload", plan_args.workload, "prompt=N,output=N,batch=B1:B2:...")
      ->capture_default_str();
  plan->add_option("--free-gib", free_gib,
                   "hold each plan against this much free device memory (GiB): fits or not");
  plan->callback([] { std::exit(PlanTrialMemory(plan_args, free_gib)); });

  CLI::App* worker = app.add_subcommand("worker", "internal: serve trial requests on stdin");
  worker->group("");  // hidden from --help
  static std::string probe_cache;
  worker->add_option("--probe-cache", probe_cache,
                     "file caching the capability probe's answers (the agent's state folder)");
  worker->callback([] { std::exit(WorkerMain(probe_cache)); });
  CLI::App* rank_worker = app.add_subcommand(
      "rank-worker", "internal: run one rank of a supervised trial (harness/rank_supervisor.h)");
  rank_worker->group("");  // hidden from --help
  rank_worker->callback([] { std::exit(RankWorkerMain()); });
}

}  // namespace infersweep::cli
