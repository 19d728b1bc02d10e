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

Outcome ServeSpecs(std::string_view input) {
  absl::StatusOr<ServeSpec> spec = ParseServeSpec(input);
  if (!spec.ok()) return Rejected(spec.status(), "--serve");
  if (absl::Status s = ValidateServeSpec(*spec); !s.ok())
    return Broken(absl::StrCat("accepted, but ValidateServeSpec says: ", s.message()));
  const std::string text = ServeSpecString(*spec);
  absl::StatusOr<ServeSpec> back = ParseServeSpec(text);
  if (!back.ok())
    return Broken(absl::StrCat("'", text, "' does not parse back: ", back.status().message()));
  if (ServeSpecString(*back) != text)
    return Broken(absl::StrCat("'", text, "' parses back as '", ServeSpecString(*back), "'"));
  absl::StatusOr<ServeSpec> from_json = ServeSpecFromJson(ToJson(*spec), "serve");
  if (!from_json.ok() || ServeSpecString(*from_json) != text)
    return Broken(absl::StrCat("'", text, "' does not survive its JSON form"));
  return Accepted();
}

Outcome Slos(std::string_view input) {
  absl::StatusOr<Slo> slo = ParseSlo(input);
  if (!slo.ok()) return Rejected(slo.status(), "--slo");
  if (absl::Status s = ValidateSlo(*slo); !s.ok())
    return Broken(absl::StrCat("accepted, but ValidateSlo says: ", s.message()));
  const std::string text = SloString(*slo);
  absl::StatusOr<Slo> back = ParseSlo(text);
  if (!back.ok() || SloString(*back) != text)
    return Broken(absl::StrCat("'", text, "' does not parse back to itself"));
  return Accepted();
}

Outcome BackendConfigs(std::string_view input) {
  absl::StatusOr<BackendConfig> config = ParseBackendConfig(input);
  if (!config.ok()) return Rejected(config.status());
  const std::string text = BackendConfigString(*config);
  absl::StatusOr<BackendConfig> back = ParseBackendConfig(text);
  if (!back.ok())
    return Broken(absl::StrCat("'", text, "' does not parse back: ", back.status().message()));
  if (*back != *config)
    return Broken(absl::StrCat("'", text, "' parses back as '", BackendConfigString(*back), "'"));
  absl::StatusOr<BackendConfig> normalized = NormalizeBackendConfig(*config);
  if (!normalized.ok()) return Rejected(normalized.status());
  absl::StatusOr<BackendConfig> again = NormalizeBackendConfig(*normalized);
  if (!again.ok() || *again != *normalized)
    return Broken(
        absl::StrCat("normalizing '", BackendConfigString(*normalized), "' again changes it"));
  return Accepted();
}

Outcome FaultInjections(std::string_view input) {
  absl::StatusOr<FaultInjection> fault = ParseFaultInjection(input);
  if (!fault.ok()) return Rejected(fault.status(), "--test-inject-fault");
  const std::string text = FaultInjectionString(*fault);
  absl::StatusOr<FaultInjection> back = ParseFaultInjection(text);
  if (!back.ok())
    return Broken(absl::StrCat("'", text, "' does not parse back: ", back.status().message()));
  if (back->kind != fault->kind || back->target != fault->target)
    return Broken(absl::StrCat("'", text, "' parses back as '", FaultInjectionString(*back), "'"));
  return Accepted();
}

Outcome ModelDescriptions(std::string_view input) {
  absl::StatusOr<ModelDescription> d = ParseModelDescription(std::string(input));
  if (!d.ok()) return Rejected(d.status(), "model");
  const std::string text = ModelDescriptionString(*d);
  absl::StatusOr<ModelDescription> back = ParseModelDescription(text);
  if (!back.ok() || back->model != d->model || back->quantize != d->quantize)
    return Broken(absl::StrCat("'", text, "' does not parse back to the same description"));
  return Accepted();
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
