// Targets: the command-line and config strings. Each parser accepts or names what is wrong, and
// what it accepts survives its own round trip (the string form parses back to the same value).
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "api/backend_config.h"
#include "api/model_description.h"
#include "api/serve_spec.h"
#include "api/trial.h"
#include "engine/fault_injection.h"
#include "tests/fuzz/targets.h"

namespace infersweep::fuzz {
namespace {

Outcome Workloads(std::string_view input) {
  absl::StatusOr<Workload> w = ParseWorkload(input);
  if (!w.ok()) return Rejected(w.status(), "workload");
  if (absl::Status s = ValidateWorkload(*w); !s.ok())
    return Broken(absl::StrCat("accepted, but ValidateWorkload says: ", s.message()));
  absl::StatusOr<Workload> back = WorkloadFromJson(ToJson(*w));
  if (!back.ok())
    return Broken(absl::StrCat("its JSON does not parse back: ", back.status().message()));
  if (WorkloadKey(*back) != WorkloadKey(*w))
    return Broken(absl::StrCat("its JSON parses back as ", WorkloadKey(*back)));
  absl::StatusOr<std::string> key = CanonicalWorkloadKey(input);
  if (!key.ok())
    return Broken(absl::StrCat("CanonicalWorkloadKey refuses it: ", key.status().message()));
  if (*key != WorkloadKey(*w))
    return Broken(absl::StrCat("canonical key ", *key, " != ", WorkloadKey(*w)));
  return Accepted();
}

// The contract of a parser with a string form: what it accepts passes `validate`, and its
// string form parses back to the same string form.
template <typename T, typename Parse, typename Validate, typename Print>
Outcome RoundTrip(std::string_view input, std::string_view must_name, Parse parse,
                  Validate validate, Print print) {
  absl::StatusOr<T> value = parse(input);
  if (!value.ok()) return Rejected(value.status(), must_name);
  if (absl::Status s = validate(*value); !s.ok())
    return Broken(absl::StrCat("accepted, but validation says: ", s.message()));
  const std::string text = print(*value);
  absl::StatusOr<T> back = parse(text);
  if (!back.ok())
    return Broken(absl::StrCat("'", text, "' does not parse back: ", back.status().message()));
  if (print(*back) != text)
    return Broken(absl::StrCat("'", text, "' parses back as '", print(*back), "'"));
  return Accepted();
}

absl::Status Valid(const auto&) { return absl::OkStatus(); }

Outcome ServeSpecs(std::string_view input) {
  Outcome o = RoundTrip<ServeSpec>(
      input, "--serve", ParseServeSpec, [](const ServeSpec& s) { return ValidateServeSpec(s); },
      ServeSpecString);
  if (!o.accepted) return o;
  // The JSON form trial requests carry.
  const ServeSpec spec = *ParseServeSpec(input);
  absl::StatusOr<ServeSpec> from_json = ServeSpecFromJson(ToJson(spec), "serve");
  if (!from_json.ok() || ServeSpecString(*from_json) != ServeSpecString(spec))
    return Broken(absl::StrCat("'", ServeSpecString(spec), "' does not survive its JSON form"));
  return o;
}

Outcome Slos(std::string_view input) {
  return RoundTrip<Slo>(
      input, "--slo", ParseSlo, [](const Slo& s) { return ValidateSlo(s); }, SloString);
}

Outcome BackendConfigs(std::string_view input) {
  Outcome o = RoundTrip<BackendConfig>(input, "", ParseBackendConfig, Valid<BackendConfig>,
                                       BackendConfigString);
  if (!o.accepted) return o;
  // Normalizing (the registry's defaults, unknown axes refused) is idempotent.
  absl::StatusOr<BackendConfig> normalized = NormalizeBackendConfig(*ParseBackendConfig(input));
  if (!normalized.ok()) return Rejected(normalized.status());
  absl::StatusOr<BackendConfig> again = NormalizeBackendConfig(*normalized);
  if (!again.ok() || *again != *normalized)
    return Broken(
        absl::StrCat("normalizing '", BackendConfigString(*normalized), "' again changes it"));
  return o;
}

Outcome FaultInjections(std::string_view input) {
  return RoundTrip<FaultInjection>(input, "--test-inject-fault", ParseFaultInjection,
                                   Valid<FaultInjection>, FaultInjectionString);
}

Outcome ModelDescriptions(std::string_view input) {
  return RoundTrip<ModelDescription>(
      input, "model",
      [](std::string_view text) { return ParseModelDescription(std::string(text)); },
      Valid<ModelDescription>, ModelDescriptionString);
}

}  // namespace

std::vector<FuzzTarget> StringTargets() {
  constexpr size_t kMax = 64 << 10;
  return {
      {"workload",
       Workloads,
       [] {
         return std::vector<std::string>{
             "prompt=128,output=32,batch=1:8:64,repeats=3,warmup=1,timeout=600",
             "prompt=16,output=8", "batch=4", "timeout=1.5,repeats=1", ""};
       },
       {"prompt", "output", "batch", "repeats", "warmup", "timeout", "=", ",", ":", "serve:"},
       kMax},
      {"serve_spec",
       ServeSpecs,
       [] {
         return std::vector<std::string>{
             "concurrency=1:4,isl=64,osl=16,requests=8",
             "rate=2:8,max_concurrency=16,isl=32-64,osl=16,duration=30",
             "concurrency=2,isl=8,osl=4,requests=4,warmup=1,chunk=4,prefill_tokens=16,seed=7"};
       },
       {"concurrency", "rate", "max_concurrency", "isl", "osl", "requests", "duration", "warmup",
        "chunk", "prefill_tokens", "seed", "=", ",", ":", "-"},
       kMax},
      {"slo",
       Slos,
       [] {
         return std::vector<std::string>{"ttft_ms=2000,tpot_ms=50", "tpot_ms=20,percentile=90",
                                         "ttft_ms=0.5"};
       },
       {"ttft_ms", "tpot_ms", "percentile", "=", ","},
       kMax},
      {"backend_config",
       BackendConfigs,
       [] {
         return std::vector<std::string>{"device=cpu,matmul=blocked,threads=2", "device=cpu",
                                         "device=cuda,attention=flash,moe=fused,graphs=on"};
       },
       {"device", "cpu", "cuda", "matmul", "threads", "attention", "moe", "gemm", "graphs",
        "kv_cache", "tp", "=", ","},
       kMax},
      {"fault_injection",
       FaultInjections,
       [] {
         return std::vector<std::string>{
             "nan-layer:1", "bad-quant-scale:16@model.layers.1.mlp.experts.3.down_proj.weight",
             "segv", "delay:0.5", "none"};
       },
       {"nan-layer", "zero-expert", "bad-scale", "bad-quant-scale", "stuck-token", "delay",
        "kv-slot-swap", "rank-kill", ":", "@"},
       kMax},
      {"model_description",
       ModelDescriptions,
       [] {
         return std::vector<std::string>{"preset:qwen3-30b-a3b@nvfp4", "preset:tiny-moe",
                                         "/models/qwen@fp8_block128", "/a@b/c"};
       },
       {"preset:", "@", "nvfp4", "mxfp4", "fp8_channel", "fp8_tensor", "fp8_block128", "bf16"},
       kMax},
  };
}

}  // namespace infersweep::fuzz
