// Executes trials in this process (the worker side): load weights once per model, preflight,
// judge against the reference, measure. Keeps the weights and the reference outputs cached
// across trials of the same model.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "api/trial.h"
#include "api/version.h"
#include "engine/backends.h"
#include "engine/capability_probe.h"
#include "engine/fault_injection.h"
#include "engine/weights.h"
#include "harness/gpu_sampler.h"
#include "harness/measure.h"
#include "harness/memory_verdict.h"
#include "harness/verdict.h"

namespace infersweep {

// A result of `request` before it runs: its trial, attempt, model, config and workload named,
// the engine version, the start time. The executor, the worker runner and the rank supervisor
// each start from it.
TrialResult StartedResult(const TrialRequest& request);
// Sets result->model_identity to the identity the request names (DescribeModel), where it can
// be described: what a parent reports for a trial its worker did not answer.
void NameRequestedModel(const TrialRequest& request, TrialResult* result);

// The stored format of a model's quantized linears, known without loading: a "@<format>" suffix
// or the checkpoint's declaration; kNone for dense weights and where it takes loading to know.
// The memory plan needs the format itself (fp8_channel, not the family "fp8"): their scales
// differ in size.
QuantFormat DeclaredQuantFormat(const std::string& model);

class TrialExecutor {
 public:
  using Progress = std::function<void(const std::string&)>;
  // `probe` asks the driver and the libraries about each config before its weights load
  // (engine/capability_probe.h); null: this build's device probe, cached in memory.
  explicit TrialExecutor(LocalDevices devices = ProbeLocalDevices(), EvalSpec eval = {},
                         std::shared_ptr<CapabilityProbe> probe = nullptr);

  // Always returns a result; status ERROR carries what went wrong (bad request, load failure).
  TrialResult Execute(const TrialRequest& request, const Progress& progress = {});

  // "model|layers|seed": trials with the same key share loaded weights.
  static std::string ModelKey(const TrialRequest& request);

 private:
  absl::Status EnsureModel(const TrialRequest& request);
  // The capability probe's answer for a config that passed the static preflight: OK,
  // Unimplemented (UNSUPPORTED, "capability probe: " and the library's words) or another error.
  absl::Status ProbeCapabilities(const TrialRequest& request, const BackendConfig& config);
  // A serving workload on the loaded model: each load point served (RunServeTrial, with the
  // GPU's energy meter on GPU configs), its figures and verdict put into `result`, whose status
  // and reason it sets.
  // Returns the device memory in use after serving (GPU configs).
  // `memory`: the memory plan's decision (CUDA configs; null where none was made).
  std::optional<int64_t> ExecuteServing(const TrialRequest& request, const BackendConfig& config,
                                        const FaultInjection& fault,
                                        const PreflightResult& preflight,
                                        const ServingMemoryDecision* memory, TrialResult* result);
  // The memory verdict of a CUDA trial before its weights load (harness/memory_verdict.h):
  // each batch size's plan and the correctness check's (lockstep), or each load point's KV slots
  // (serving), against the GPU's free memory, with this worker's resident weights of the same model
  // counted as free and another model's dropped first. decision is nullopt where it cannot be
  // decided (shapes unknown before loading, a plan the engine refuses, no free-memory figure), said
  // through `progress`: the load or the model's build then say why.
  struct TrialMemory {
    std::optional<MemoryDecision> decision;        // lockstep trials
    std::optional<ServingMemoryDecision> serving;  // serving trials
    std::map<int, MemoryPlan> plans;               // each batch size's
    int64_t free_bytes = 0;                        // free for this trial when it was decided
    // Device memory in use before the trial, resident weights of this model excluded (at the
    // plan's figure): a batch's measured memory is what is in use after it, less this.
    std::optional<int64_t> baseline_used_bytes;
  };
  TrialMemory DecideTrialMemory(const TrialRequest& request, const BackendConfig& config,
                                const Progress& progress);
  // The model's identity (DescribeModel), cached per ModelKey.
  ModelIdentity Identity(const TrialRequest& request);
  // The eval outputs of the reference (or of its `yardstick`, CreateYardstick), cached per model.
  absl::StatusOr<const EvalOutputs*> Reference(const BackendConfig& reference_config,
                                               Yardstick yardstick = Yardstick::kNone);
  // The reference's picks on a test config's free runs (ReferencePicksOnFreeRuns).
  absl::StatusOr<std::vector<std::vector<int32_t>>> ReferencePicks(
      const BackendConfig& reference_config, const std::vector<std::vector<int32_t>>& free);

  LocalDevices devices_;
  EvalSpec eval_;
  std::shared_ptr<CapabilityProbe> probe_;
  std::string model_key_;
  std::unique_ptr<HostModel> host_;
  std::map<std::string, EvalOutputs> reference_cache_;  // by reference config string
  std::unique_ptr<GpuEnergyMeter> energy_meter_;        // opened by the first GPU trial
  std::map<std::string, ModelIdentity> identities_;     // by ModelKey
  SoftwareStack software_;                              // what GPU trials run on
};

}  // namespace infersweep
