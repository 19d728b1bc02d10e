// `infersweep logits`, `generate` and `demo`: run the engine once, in process; `backends`: the
// backend registry, as text or as docs/BACKENDS.md.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
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
#include "engine/sampler.h"
#include "engine/weights.h"

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

// --backend picks the device's reference; --config overrides axes (a fast config).
absl::StatusOr<Loaded> Load(const ModelArgs& args) {
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
  // The capability probe, as a trial asks it: before any weights load.
  if (absl::StatusOr<ModelConfig> shapes = DescribeModelShapes(model_description, args.layers);
      shapes.ok())
    if (absl::Status probed = MakeDeviceProbe(devices)->Probe(
            normalized, *shapes, DeclaredWeightFormat(model_description));
        !probed.ok())
      return absl::FailedPreconditionError(
          absl::StrCat(absl::IsUnimplemented(probed) ? "UNSUPPORTED: " : "",
                       BackendConfigString(normalized), ": capability probe: ", probed.message()));
  Loaded loaded;
  ASSIGN_OR_RETURN(auto host, LoadHostModel(model_description, {args.layers, args.seed}));
  for (const std::string& warning : host->warnings)
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
  loaded.host = std::move(host);
  ASSIGN_OR_RETURN(auto model, CreateModel(*loaded.host, normalized));
  loaded.model = std::move(model);
  return loaded;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str());
  return 1;
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

int RunLogits(const ModelArgs& args, const std::string& tokens_text, const std::string& out) {
  auto tokens = ParseTokens(tokens_text);
  if (!tokens.ok()) return Fail(tokens.status());
  auto loaded = Load(args);
  if (!loaded.ok()) return Fail(loaded.status());
  Model& model = *loaded->model;
  const int n = static_cast<int>(tokens->size());
  if (auto s = model.StartBatch(1, n); !s.ok()) return Fail(s);
  std::vector<float> logits;
  const auto start = std::chrono::steady_clock::now();
  if (auto s = model.Forward(*tokens, n, LogitsMode::kAll, &logits); !s.ok()) return Fail(s);
  const double seconds = Seconds(start);
  if (auto s = WriteNpyFloat32(out, {n, model.config().vocab_size}, logits.data()); !s.ok())
    return Fail(s);
  std::fprintf(stderr, "# %s on %s: %d tokens in %.3f s (%.1f tok/s prefill), wrote %s\n",
               loaded->host->source.c_str(), model.device().c_str(), n, seconds, n / seconds,
               out.c_str());
  return 0;
}

// The prompt in every row of a batch (shifted per row), greedy: for profiling batched steps (ncu,
// nsys). Prints the first row's tokens.
int RunGenerateBatch(Model& model, const std::vector<int32_t>& prompt, int batch,
                     int max_new_tokens) {
  const int n = static_cast<int>(prompt.size()), vocab = model.config().vocab_size;
  if (auto s = model.StartBatch(batch, n + max_new_tokens); !s.ok()) return Fail(s);
  std::vector<int32_t> input;
  // Row b's prompt is shifted by b token ids, so rows route to different experts like a real batch.
  for (int b = 0; b < batch; ++b)
    for (int32_t t : prompt) input.push_back((t + 7 * b) % vocab);
  std::vector<float> logits;
  std::vector<int32_t> first_row;
  auto start = std::chrono::steady_clock::now();
  if (auto s = model.Forward(input, n, LogitsMode::kLast, &logits); !s.ok()) return Fail(s);
  const double prefill = Seconds(start);
  start = std::chrono::steady_clock::now();
  for (int step = 0; step < max_new_tokens; ++step) {
    input.assign(batch, 0);
    for (int b = 0; b < batch; ++b)
      input[b] =
          Greedy(std::span<const float>(logits).subspan(static_cast<size_t>(b) * vocab, vocab));
    first_row.push_back(input[0]);
    if (step + 1 < max_new_tokens)
      if (auto s = model.Forward(input, 1, LogitsMode::kLast, &logits); !s.ok()) return Fail(s);
  }
  const double decode = Seconds(start);
  std::printf("{\"tokens\":[%s]}\n", absl::StrJoin(first_row, ",").c_str());
  std::fprintf(
      stderr, "# batch %d: prefill %d tokens a row: %.1f tok/s; decode: %.1f tok/s\n", batch, n,
      static_cast<double>(batch) * n / prefill,
      static_cast<double>(batch) * std::max(1, max_new_tokens - 1) / std::max(decode, 1e-9));
  return 0;
}

int RunGenerate(const ModelArgs& args, const std::string& tokens_text, int max_new_tokens,
                int batch) {
  auto tokens = ParseTokens(tokens_text);
  if (!tokens.ok()) return Fail(tokens.status());
  if (max_new_tokens <= 0) return Fail(absl::InvalidArgumentError("--max-new-tokens must be > 0"));
  if (batch <= 0) return Fail(absl::InvalidArgumentError("--batch must be > 0"));
  auto loaded = Load(args);
  if (!loaded.ok()) return Fail(loaded.status());
  if (batch > 1) return RunGenerateBatch(*loaded->model, *tokens, batch, max_new_tokens);
  auto gen = GenerateGreedy(*loaded->model, *tokens, max_new_tokens);
  if (!gen.ok()) return Fail(gen.status());
  std::string json = "{\"tokens\":[";
  for (size_t i = 0; i < gen->tokens.size(); ++i)
    absl::StrAppend(&json, i ? "," : "", gen->tokens[i]);
  std::printf("%s]}\n", json.c_str());
  std::fprintf(stderr, "# prefill %zu tokens: %.1f tok/s; decode %d tokens: %.1f tok/s\n",
               tokens->size(), tokens->size() / gen->prefill_seconds, max_new_tokens,
               std::max(1, max_new_tokens - 1) / std::max(gen->decode_seconds, 1e-9));
  return 0;
}

// The README's first command: a tiny synthetic model generating tokens on the CPU reference.
int RunDemo(ModelArgs args, int max_new_tokens) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back((i * 37 + 11) % 500);
  auto loaded = Load(args);
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
