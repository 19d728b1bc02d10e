// `infersweep logits`, `generate` and `demo`: run the engine once, in process (a CUDA config with
// tp > 1: in rank processes of this binary); `backends`: the backend registry, as text or as
// docs/BACKENDS.md.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "api/status_macros.h"
#include "cli/backends_markdown.h"
#include "cli/commands.h"
#include "engine/backends.h"
#include "engine/capability_probe.h"
#include "engine/npy.h"
#include "engine/rank_context.h"
#include "engine/sampler.h"
#include "engine/weights.h"
#include "harness/rank_supervisor.h"

namespace infersweep::cli {
namespace {

struct ModelArgs {
  std::string model = "preset:tiny-moe";
  std::string backend = "cpu";
  int layers = 0;
  uint64_t seed = 1;
  int threads = 0;
  std::string config;
  std::string quantize;
  // Set by the parent of a CUDA tp > 1 run on each of its rank processes (RunAsRanks): this
  // process is a rank, and rank 0 writes what the command prints there.
  std::string rank_output;
};

void AddModelOptions(CLI::App* cmd, ModelArgs& args) {
  cmd->add_option("--model", args.model, "checkpoint folder or preset:NAME")->capture_default_str();
  cmd->add_option("--backend", args.backend, "cpu (CPU reference) or cuda (GPU reference)")
      ->capture_default_str();
  cmd->add_option("--layers", args.layers, "presets: override the layer count");
  cmd->add_option("--seed", args.seed, "presets: synthetic weight seed")->capture_default_str();
  cmd->add_option("--threads", args.threads, "CPU threads (0: all cores)");
  cmd->add_option("--config", args.config, "axis=value,... overrides on the backend's defaults");
  cmd->add_option("--quantize", args.quantize,
                  "quantize the linear layers on load: fp8_tensor, fp8_channel, fp8_block128, "
                  "nvfp4, mxfp4 (docs/QUANTIZATION.md)");
  cmd->add_option("--rank-output", args.rank_output)->group("");  // RunAsRanks's rank processes
}

absl::StatusOr<std::vector<int32_t>> ParseTokens(const std::string& text) {
  std::vector<int32_t> tokens;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id))
      return absl::InvalidArgumentError(absl::StrCat("--tokens: '", part, "' is not an integer"));
    tokens.push_back(id);
  }
  if (tokens.empty()) return absl::InvalidArgumentError("--tokens: no token ids given");
  return tokens;
}

struct Loaded {
  std::unique_ptr<HostModel> host;
  std::unique_ptr<Model> model;
};

// --backend picks the device's reference; --config overrides axes (a fast config). The config
// is judged as a trial judges it (preflight, then the capability probe) before anything loads.
absl::StatusOr<BackendConfig> CheckedConfig(const ModelArgs& args) {
  const absl::StatusOr<Device> device = ParseDevice(args.backend, "--backend");
  if (!device.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("--backend ", args.backend, ": expected cpu or cuda"));
  ASSIGN_OR_RETURN(auto overrides, ParseBackendConfig(args.config));
  BackendConfig config = DefaultAxes(*device);
  if (args.threads > 0) config["threads"] = absl::StrCat(args.threads);
  for (const auto& [axis, value] : overrides) config[axis] = value;
  ASSIGN_OR_RETURN(auto normalized, NormalizeBackendConfig(config));
  ASSIGN_OR_RETURN(auto model_description, WithQuantization(args.model, args.quantize));
  const LocalDevices devices = ProbeLocalDevices();
  PreflightResult preflight =
      Preflight(normalized, MakePreflightTarget(devices, model_description));
  if (!preflight.supported)
    return absl::FailedPreconditionError(
        absl::StrCat("UNSUPPORTED: ", BackendConfigString(normalized), ": ", preflight.reason));
  if (absl::StatusOr<ModelConfig> shapes = DescribeModelShapes(model_description, args.layers);
      shapes.ok())
    if (absl::Status probed = MakeDeviceProbe(devices)->Probe(
            normalized, *shapes, DeclaredWeightFormat(model_description));
        !probed.ok())
      return absl::FailedPreconditionError(
          absl::StrCat(absl::IsUnimplemented(probed) ? "UNSUPPORTED: " : "",
                       BackendConfigString(normalized), ": capability probe: ", probed.message()));
  return normalized;
}

absl::StatusOr<Loaded> Load(const ModelArgs& args, const BackendConfig& normalized) {
  ASSIGN_OR_RETURN(auto model_description, WithQuantization(args.model, args.quantize));
  Loaded loaded;
  ASSIGN_OR_RETURN(auto host, LoadHostModel(model_description, {args.layers, args.seed}));
  for (const std::string& warning : host->warnings)
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
  loaded.host = std::move(host);
  ASSIGN_OR_RETURN(auto model, CreateModel(*loaded.host, normalized));
  loaded.model = std::move(model);
  return loaded;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str());
  return 1;
}

// ---- tp > 1 on CUDA: the command in rank processes.
// The engine runs a CUDA tp > 1 model as one process a rank (engine/rank_context.h), so `logits`
// and `generate` start tp processes of this binary under the rank supervisor, as a trial does:
// each builds its shard and joins the ranks' collective; every rank runs the same steps; rank 0
// writes what the command prints into a file, which the parent then prints. A rank that dies or
// hangs fails the command naming it, and no rank is left running.

// The parent: `command` (the subcommand and its own options) in `ranks` processes.
int RunAsRanks(const ModelArgs& args, const BackendConfig& config, int ranks,
               const std::vector<std::string>& command) {
  char path[] = "/tmp/infersweep-rank-output-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return Fail(absl::InternalError("mkstemp for the rank output failed"));
  close(fd);
  RankSupervisorOptions options;
  options.rank_argv = {"/proc/self/exe"};
  options.rank_argv.insert(options.rank_argv.end(), command.begin(), command.end());
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"--model", args.model},
                                                        {"--backend", args.backend},
                                                        {"--layers", absl::StrCat(args.layers)},
                                                        {"--seed", absl::StrCat(args.seed)},
                                                        {"--config", args.config},
                                                        {"--quantize", args.quantize},
                                                        {"--rank-output", path}})
    if (!value.empty()) options.rank_argv.insert(options.rank_argv.end(), {flag, value});
  TrialRequest request;
  request.trial_id = command.front();
  request.model = args.model;
  request.config = config;
  request.workload.timeout_s = 3600;
  const SupervisedTrial ran = RunRankTrial(request, ranks, "", options);
  if (!ran.ranks.empty() && !ran.ranks[0].stderr_tail.empty())
    std::fprintf(stderr, "%s\n", ran.ranks[0].stderr_tail.c_str());
  int rc = 0;
  if (ran.result.status != TrialStatus::kOk) {
    std::fprintf(stderr, "error: %s over %d rank processes: %s\n",
                 std::string(TrialStatusName(ran.result.status)).c_str(), ranks,
                 ran.result.reason.c_str());
    rc = 1;
  } else if (std::ifstream in(path); in) {
    std::cout << in.rdbuf();
    std::cout.flush();
  }
  unlink(path);
  return rc;
}

// A rank process (--rank-output): joins the ranks as a trial's rank worker does, and answers
// the supervisor once the command is done.
class RankChild {
 public:
  explicit RankChild(const ModelArgs& args) : path_(args.rank_output) {}
  bool active() const { return !path_.empty(); }

  // Reads the assignment, takes the rank's GPU and the exchange through the parent.
  absl::Status Join() {
    std::string line;
    if (!std::getline(std::cin, line))
      return absl::UnavailableError("rank process: no assignment on stdin");
    auto parsed = nlohmann::json::parse(line, nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object() || !parsed.contains("rank") ||
        !parsed.contains("ranks"))
      return absl::InvalidArgumentError("rank assignment: not a JSON object with rank and ranks");
    rank_ = parsed["rank"].get<int>();
    const int ranks = parsed["ranks"].get<int>();
    SetProcessRank(rank_);
    RETURN_IF_ERROR(UseRankDevice(rank_, ranks));
    SetRankContext({rank_, ranks, [ranks](const std::string& mine) {
                      return ExchangeThroughParent(std::cin, std::cout, ranks, mine);
                    }});
    return absl::OkStatus();
  }
  bool writes_output() const { return !active() || rank_ == 0; }
  // Where the command prints: stdout, or rank 0's file (the other ranks print nothing).
  std::FILE* Output() {
    if (!active()) return stdout;
    if (!file_) file_ = std::fopen(rank_ == 0 ? path_.c_str() : "/dev/null", "w");
    return file_;
  }
  // The answer the supervisor reads, then the wait for it to close stdin; the exit code.
  int Answer(const absl::Status& status) {
    if (file_) std::fclose(file_);
    file_ = nullptr;
    nlohmann::json answer = {{"status", status.ok() ? "OK" : "ERROR"}};
    if (!status.ok()) answer["reason"] = std::string(status.message());
    std::cout << answer.dump() << std::endl;
    std::string line;
    while (std::getline(std::cin, line)) {
    }
    return status.ok() ? 0 : 1;
  }

 private:
  std::string path_;
  int rank_ = 0;
  std::FILE* file_ = nullptr;
};

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

struct Generation {
  std::vector<int32_t> tokens;
  std::vector<float> prompt_last_logits;
  double prefill_seconds = 0, decode_seconds = 0;
};

// Greedy generation for one sequence.
absl::StatusOr<Generation> GenerateGreedy(Model& model, const std::vector<int32_t>& prompt,
                                          int max_new_tokens) {
  Generation gen;
  RETURN_IF_ERROR(model.StartBatch(1, static_cast<int>(prompt.size()) + max_new_tokens));
  std::vector<float> logits;
  auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(
      model.Forward(prompt, static_cast<int>(prompt.size()), LogitsMode::kLast, &logits));
  gen.prefill_seconds = Seconds(start);
  gen.prompt_last_logits = logits;
  start = std::chrono::steady_clock::now();
  // The decode steps need only the tokens: picked on the device where the engine has one.
  std::vector<int32_t> next = {Greedy(logits)};
  for (int step = 0; step < max_new_tokens; ++step) {
    gen.tokens.push_back(next[0]);
    if (step + 1 == max_new_tokens) break;
    RETURN_IF_ERROR(model.ForwardGreedy(next, 1, &next));
  }
  gen.decode_seconds = Seconds(start);
  return gen;
}

// Runs `command` here, or (a CUDA config with tp > 1) in rank processes, each running it as
// rank (RankChild); the exit code.
int RunEngineCommand(const ModelArgs& args, const std::vector<std::string>& argv,
                     const std::function<absl::Status(const BackendConfig&, RankChild&)>& command) {
  RankChild child(args);
  if (child.active()) {
    if (absl::Status joined = child.Join(); !joined.ok()) return child.Answer(joined);
    absl::StatusOr<BackendConfig> config = CheckedConfig(args);
    return child.Answer(config.ok() ? command(*config, child) : config.status());
  }
  absl::StatusOr<BackendConfig> config = CheckedConfig(args);
  if (!config.ok()) return Fail(config.status());
  // A CUDA config's tensor-parallel ranks run one process each (the CPU's run as threads here).
  if (const int ranks = TensorParallelRanks(*config);
      ConfigDevice(*config) == Device::kCuda && ranks > 1)
    return RunAsRanks(args, *config, ranks, argv);
  const absl::Status done = command(*config, child);
  return done.ok() ? 0 : Fail(done);
}

int RunLogits(const ModelArgs& args, const std::string& tokens_text, const std::string& out) {
  auto tokens = ParseTokens(tokens_text);
  if (!tokens.ok()) return Fail(tokens.status());
  return RunEngineCommand(
      args, {"logits", "--tokens", tokens_text, "--out", out},
      [&](const BackendConfig& config, RankChild& rank) -> absl::Status {
        ASSIGN_OR_RETURN(Loaded loaded, Load(args, config));
        Model& model = *loaded.model;
        const int n = static_cast<int>(tokens->size());
        RETURN_IF_ERROR(model.StartBatch(1, n));
        std::vector<float> logits;
        const auto start = std::chrono::steady_clock::now();
        RETURN_IF_ERROR(model.Forward(*tokens, n, LogitsMode::kAll, &logits));
        const double seconds = Seconds(start);
        if (!rank.writes_output()) return absl::OkStatus();
        RETURN_IF_ERROR(WriteNpyFloat32(out, {n, model.config().vocab_size}, logits.data()));
        std::fprintf(stderr, "# %s on %s: %d tokens in %.3f s (%.1f tok/s prefill), wrote %s\n",
                     loaded.host->source.c_str(), model.device().c_str(), n, seconds, n / seconds,
                     out.c_str());
        return absl::OkStatus();
      });
}

// The prompt in every row of a batch (shifted per row), greedy: for profiling batched steps (ncu,
// nsys). Prints the first row's tokens to `out`.
absl::Status GenerateBatch(Model& model, const std::vector<int32_t>& prompt, int batch,
                           int max_new_tokens, std::FILE* out) {
  const int n = static_cast<int>(prompt.size()), vocab = model.config().vocab_size;
  RETURN_IF_ERROR(model.StartBatch(batch, n + max_new_tokens));
  std::vector<int32_t> input;
  // Row b's prompt is shifted by b token ids, so rows route to different experts like a real batch.
  for (int b = 0; b < batch; ++b)
    for (int32_t t : prompt) input.push_back((t + 7 * b) % vocab);
  std::vector<float> logits;
  std::vector<int32_t> first_row;
  auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(model.Forward(input, n, LogitsMode::kLast, &logits));
  const double prefill = Seconds(start);
  start = std::chrono::steady_clock::now();
  for (int step = 0; step < max_new_tokens; ++step) {
    input.assign(batch, 0);
    for (int b = 0; b < batch; ++b)
      input[b] =
          Greedy(std::span<const float>(logits).subspan(static_cast<size_t>(b) * vocab, vocab));
    first_row.push_back(input[0]);
    if (step + 1 < max_new_tokens)
      RETURN_IF_ERROR(model.Forward(input, 1, LogitsMode::kLast, &logits));
  }
  const double decode = Seconds(start);
  std::fprintf(out, "{\"tokens\":[%s]}\n", absl::StrJoin(first_row, ",").c_str());
  std::fprintf(
      stderr, "# batch %d: prefill %d tokens a row: %.1f tok/s; decode: %.1f tok/s\n", batch, n,
      static_cast<double>(batch) * n / prefill,
      static_cast<double>(batch) * std::max(1, max_new_tokens - 1) / std::max(decode, 1e-9));
  return absl::OkStatus();
}

int RunGenerate(const ModelArgs& args, const std::string& tokens_text, int max_new_tokens,
                int batch) {
  auto tokens = ParseTokens(tokens_text);
  if (!tokens.ok()) return Fail(tokens.status());
  if (max_new_tokens <= 0) return Fail(absl::InvalidArgumentError("--max-new-tokens must be > 0"));
  if (batch <= 0) return Fail(absl::InvalidArgumentError("--batch must be > 0"));
  return RunEngineCommand(
      args,
      {"generate", "--tokens", tokens_text, "--max-new-tokens", absl::StrCat(max_new_tokens),
       "--batch", absl::StrCat(batch)},
      [&](const BackendConfig& config, RankChild& rank) -> absl::Status {
        ASSIGN_OR_RETURN(Loaded loaded, Load(args, config));
        if (batch > 1)
          return GenerateBatch(*loaded.model, *tokens, batch, max_new_tokens, rank.Output());
        ASSIGN_OR_RETURN(Generation gen, GenerateGreedy(*loaded.model, *tokens, max_new_tokens));
        std::fprintf(rank.Output(), "{\"tokens\":[%s]}\n", absl::StrJoin(gen.tokens, ",").c_str());
        std::fprintf(stderr, "# prefill %zu tokens: %.1f tok/s; decode %d tokens: %.1f tok/s\n",
                     tokens->size(), tokens->size() / gen.prefill_seconds, max_new_tokens,
                     std::max(1, max_new_tokens - 1) / std::max(gen.decode_seconds, 1e-9));
        return absl::OkStatus();
      });
}

// The README's first command: a tiny synthetic model generating tokens on the CPU reference.
int RunDemo(ModelArgs args, int max_new_tokens) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back((i * 37 + 11) % 500);
  auto config = CheckedConfig(args);
  if (!config.ok()) return Fail(config.status());
  auto loaded = Load(args, *config);
  if (!loaded.ok()) return Fail(loaded.status());
  const ModelConfig& c = loaded->host->config;
  std::printf("# model %s (%s): %d layers, hidden %d, %d experts top-%d, vocab %d, %.2fM params\n",
              loaded->host->source.c_str(), std::string(ModelArchName(c.arch)).c_str(),
              c.num_layers, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.vocab_size,
              c.TotalParams() / 1e6);
  std::printf("# backend %s, weights generated in %.3f s\n", loaded->model->device().c_str(),
              loaded->host->load_seconds);
  auto gen = GenerateGreedy(*loaded->model, prompt, max_new_tokens);
  if (!gen.ok()) return Fail(gen.status());
  const std::vector<float>& l = gen->prompt_last_logits;
  double sum = 0, sum_sq = 0;
  float lo = INFINITY, hi = -INFINITY;
  int non_finite = 0;
  for (float v : l) {
    if (!std::isfinite(v)) {
      ++non_finite;
      continue;
    }
    sum += v;
    sum_sq += static_cast<double>(v) * v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const double mean = sum / l.size();
  std::printf("# last-prompt-position logits: mean %.4f std %.4f min %.4f max %.4f non-finite %d\n",
              mean, std::sqrt(std::max(0.0, sum_sq / l.size() - mean * mean)), lo, hi, non_finite);
  std::printf("# prompt %zu tokens, generated:", prompt.size());
  for (int32_t t : gen->tokens) std::printf(" %d", t);
  std::printf("\n# prefill %.1f tok/s, decode %.1f tok/s (batch 1, %s)\n",
              prompt.size() / gen->prefill_seconds,
              std::max(1, max_new_tokens - 1) / std::max(gen->decode_seconds, 1e-9),
              loaded->model->device().c_str());
  return 0;
}

}  // namespace

void AddEngineCommands(CLI::App& app) {
  static ModelArgs args;
  static std::string tokens, out;
  static int max_new_tokens = 16;
  static int batch = 1;

  CLI::App* logits = app.add_subcommand("logits", "write float32 [T, vocab] logits to a .npy");
  AddModelOptions(logits, args);
  logits->add_option("--tokens", tokens, "comma-separated prompt token ids")->required();
  logits->add_option("--out", out, "output .npy file")->required();
  logits->callback([] { std::exit(RunLogits(args, tokens, out)); });

  CLI::App* generate =
      app.add_subcommand("generate", "greedy generation; prints {\"tokens\":[...]}");
  AddModelOptions(generate, args);
  generate->add_option("--tokens", tokens, "comma-separated prompt token ids")->required();
  generate->add_option("--max-new-tokens", max_new_tokens, "tokens to generate")
      ->capture_default_str();
  generate->add_option("--batch", batch, "rows, each the same prompt (for profiling batched steps)")
      ->capture_default_str();
  generate->callback([] { std::exit(RunGenerate(args, tokens, max_new_tokens, batch)); });

  CLI::App* demo = app.add_subcommand("demo", "tiny synthetic model: generate, summarise, time");
  AddModelOptions(demo, args);
  demo->add_option("--max-new-tokens", max_new_tokens, "tokens to generate")->capture_default_str();
  demo->callback([] { std::exit(RunDemo(args, max_new_tokens)); });

  static bool markdown = false;
  CLI::App* backends =
      app.add_subcommand("backends", "list the backend registry: every axis=value");
  backends->add_flag("--markdown", markdown, "print docs/BACKENDS.md, generated from the registry");
  backends->callback([] {
    std::cout << (markdown ? BackendsMarkdown() : BackendsText());
    std::exit(std::cout.good() ? 0 : 1);
  });
}

}  // namespace infersweep::cli
