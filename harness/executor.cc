#include "harness/executor.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/model_description.h"
#include "api/status_macros.h"
#include "core/wall_clock.h"
#include "engine/checkpoint.h"
#include "engine/device_memory.h"
#include "engine/quant/layout.h"
#include "engine/roofline.h"
#include "harness/serving.h"

namespace infersweep {
namespace {

int64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

}  // namespace

QuantFormat DeclaredQuantFormat(const std::string& model) {
  absl::StatusOr<ModelDescription> description = ParseModelDescription(model);
  if (!description.ok()) return QuantFormat::kNone;
  if (description->quantize != QuantFormat::kNone) return description->quantize;
  if (absl::StartsWith(description->model, "preset:")) return QuantFormat::kNone;
  absl::StatusOr<QuantScheme> scheme = ReadCheckpointQuantScheme(description->model);
  if (!scheme.ok() || !scheme->quantized()) return QuantFormat::kNone;
  return scheme->format;
}

TrialExecutor::TrialExecutor(LocalDevices devices, EvalSpec eval,
                             std::shared_ptr<CapabilityProbe> probe)
    : devices_(std::move(devices)), eval_(eval), probe_(std::move(probe)) {
  if (!probe_) probe_ = MakeCachedDeviceProbe(devices_, "");
  software_.cuda_driver = devices_.cuda_driver_version;
  software_.cuda_runtime = devices_.cuda_runtime_version;
  software_.cublas = devices_.cublas_version;
  software_.cublaslt = devices_.cublaslt_version;
  software_.cudnn = devices_.cudnn_version;
  if (devices_.gpu_count > 0) software_.driver = NvidiaDriverVersion();
}

ModelIdentity TrialExecutor::Identity(const TrialRequest& request) {
  const std::string key = ModelKey(request);
  if (auto it = identities_.find(key); it != identities_.end()) return it->second;
  absl::StatusOr<ModelIdentity> described =
      DescribeModel(request.model, {request.layers, request.seed, false});
  if (!described.ok()) {
    // The load fails too and says why; the result carries what the request names.
    ModelIdentity partial;
    const bool preset = absl::StartsWith(request.model, "preset:");
    partial.source = preset ? "preset" : "checkpoint";
    partial.name = preset ? request.model.substr(7) : request.model;
    partial.layers = request.layers;
    partial.seed = preset ? request.seed : 0;
    return partial;
  }
  return identities_[key] = *described;
}

std::string TrialExecutor::ModelKey(const TrialRequest& r) {
  return absl::StrCat(r.model, "|", r.layers, "|", r.seed);
}

absl::Status TrialExecutor::EnsureModel(const TrialRequest& request) {
  const std::string key = ModelKey(request);
  if (host_ && key == model_key_) return absl::OkStatus();
  host_.reset();
  reference_cache_.clear();
  // Synthetic host copies are generated only when a CPU model needs them.
  ASSIGN_OR_RETURN(auto host, LoadHostModel(request.model, {request.layers, request.seed, false}));
  host_ = std::move(host);
  model_key_ = key;
  return absl::OkStatus();
}

absl::Status TrialExecutor::ProbeCapabilities(const TrialRequest& request,
                                              const BackendConfig& config) {
  // A model whose shapes cannot be read fails to load too, and the load says why.
  absl::StatusOr<ModelConfig> shapes = DescribeModelShapes(request.model, request.layers);
  if (!shapes.ok()) return absl::OkStatus();
  absl::Status s = probe_->Probe(config, *shapes, DeclaredWeightFormat(request.model));
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("capability probe: ", s.message()));
}

TrialExecutor::TrialMemory TrialExecutor::DecideTrialMemory(const TrialRequest& request,
                                                            const BackendConfig& config,
                                                            const Progress& progress) {
  TrialMemory memory;
  auto unchecked = [&](absl::string_view why) {
    if (progress) progress(absl::StrCat("memory not checked before loading: ", why));
    memory.decision.reset();
    memory.serving.reset();
    return memory;
  };
  // A model whose shapes cannot be read fails to load too, and the load says why.
  absl::StatusOr<ModelConfig> shapes = DescribeModelShapes(request.model, request.layers);
  if (!shapes.ok()) return unchecked(shapes.status().message());
  const QuantFormat format = DeclaredQuantFormat(request.model);
  const std::string weight_format = format == QuantFormat::kNone ? "" : QuantFormatName(format);
  const Workload& w = request.workload;
  // A plan the engine refuses (the attention plan's Unimplemented) is refused again, with the
  // same words, when the model is built.
  std::vector<BatchMemoryPlan> plans;
  if (!w.serve) {
    for (int batch : w.batch_sizes) {
      MemoryWorkload workload;
      workload.batch = batch;
      workload.prompt_tokens = w.prompt_len;
      workload.generated_tokens = w.output_len;
      absl::StatusOr<MemoryPlan> plan = PlanMemory(config, *shapes, weight_format, workload);
      if (!plan.ok()) return unchecked(plan.status().message());
      memory.plans[batch] = *plan;
      plans.push_back({batch, *std::move(plan)});
    }
  }
  // A serving trial's plan at a slot count: the slots, each a prompt and its output long, and
  // the largest ragged step the scheduler feeds them.
  const auto slots_plan = [&](int slots) {
    MemoryWorkload workload;
    workload.batch = slots;
    workload.prompt_tokens = w.serve ? w.serve->isl_max : 0;
    workload.generated_tokens = w.serve ? w.serve->osl_max : 0;
    workload.serving = true;
    workload.ragged_step_rows = w.serve ? LargestRaggedStepRows(*w.serve, slots) : 0;
    return PlanMemory(config, *shapes, weight_format, workload);
  };
  // The lockstep correctness check (RunEval) before any batch: eval_.prompts sequences, the
  // prefill's every row of logits, then decode steps.
  MemoryWorkload eval;
  eval.batch = std::max(eval_.prompts, 1);
  eval.prompt_tokens = std::max(eval_.prompt_len - eval_.decode_steps, 1);
  eval.generated_tokens = std::max(
      eval_.decode_steps, eval_.free_run_prompt_len + eval_.free_run_len - eval.prompt_tokens);
  eval.all_logits = true;
  absl::StatusOr<MemoryPlan> judging = PlanMemory(config, *shapes, weight_format, eval);
  if (!judging.ok()) return unchecked(judging.status().message());

  // Another model's weights on the device would be dropped by the load anyway: drop them
  // before the free memory is read. This model's, kept from an earlier trial, are the plan's
  // weights pool already in place.
  if (host_ && ModelKey(request) != model_key_) {
    host_.reset();
    reference_cache_.clear();
    model_key_.clear();
  }
  absl::StatusOr<DeviceMemoryInfo> device = CurrentDeviceMemory();
  if (!device.ok()) return unchecked(device.status().message());
  memory.free_bytes = device->free_bytes;
  memory.baseline_used_bytes = device->used_bytes();
  if (host_ && host_->device_weights) {
    const int64_t resident = judging->bytes(MemoryPool::kWeights);
    memory.free_bytes += resident;
    *memory.baseline_used_bytes -= resident;
  }

  if (w.serve) {
    // The served tokens are judged by a second model of the weights (lone runs or the
    // reference), not planned here; the lockstep check is not run.
    absl::StatusOr<ServingMemoryDecision> decision =
        DecideServingMemory(*w.serve, slots_plan, memory.free_bytes);
    if (!decision.ok()) return unchecked(decision.status().message());
    memory.serving = *std::move(decision);
    return memory;
  }
  MemoryDecisionOptions options;
  options.judging = &*judging;
  options.every_batch_or_none = TensorParallelRanks(config) > 1;
  absl::StatusOr<MemoryDecision> decision = DecideMemory(plans, memory.free_bytes, options);
  if (!decision.ok()) return unchecked(decision.status().message());
  memory.decision = *std::move(decision);
  return memory;
}

absl::StatusOr<const EvalOutputs*> TrialExecutor::Reference(const BackendConfig& config,
                                                            Yardstick yardstick) {
  const std::string key = absl::StrCat(BackendConfigString(config), " ", YardstickName(yardstick));
  if (auto it = reference_cache_.find(key); it != reference_cache_.end()) return &it->second;
  ASSIGN_OR_RETURN(auto model, yardstick != Yardstick::kNone
                                   ? CreateYardstick(*host_, config, yardstick)
                                   : CreateModel(*host_, config));
  ASSIGN_OR_RETURN(auto outputs, RunEval(*model, eval_));
  return &(reference_cache_[key] = std::move(outputs));
}

absl::StatusOr<std::vector<std::vector<int32_t>>> TrialExecutor::ReferencePicks(
    const BackendConfig& reference_config, const std::vector<std::vector<int32_t>>& free) {
  ASSIGN_OR_RETURN(auto model, CreateModel(*host_, reference_config));
  return ReferencePicksOnFreeRuns(*model, eval_, free);
}

std::optional<int64_t> TrialExecutor::ExecuteServing(
    const TrialRequest& request, const BackendConfig& config, const FaultInjection& fault,
    const PreflightResult& preflight, const ServingMemoryDecision* memory, TrialResult* result) {
  const ServeSpec& spec = *request.workload.serve;
  const Slo& slo = request.workload.slo;
  if (fault.kind == FaultInjection::Kind::kDelay && fault.value > 0)  // TEST ONLY: a slow trial
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(fault.value * 1e3)));
  if (ConfigDevice(config) == Device::kCuda && !energy_meter_)
    energy_meter_ = OpenGpuEnergyMeter(devices_.gpu_pci_bus_id);
  const ServeTrialResult trial =
      RunServeTrial(*host_, config, spec, slo, fault,
                    ConfigDevice(config) == Device::kCuda ? energy_meter_.get() : nullptr, memory);
  result->verdict.precision_class = std::string(PrecisionClassName(preflight.precision));
  for (const LoadPointResult& point : trial.points)
    result->serving.push_back(ToServingPoint(point, slo));
  if (trial.slo_search) {
    ServingSloSearch search;
    search.found = trial.slo_search->found;
    if (search.found) search.best = ToServingPoint(trial.slo_search->best, slo);
    for (const LoadPointResult& probe : trial.slo_search->probes)
      search.probes.push_back(ToServingPoint(probe, slo));
    result->slo_search = std::move(search);
  }
  if (trial.status != TrialStatus::kOk) {
    result->status = trial.status;
    result->reason = trial.reason;
    return trial.device_memory_used_bytes;
  }
  // The served requests are the verdict: a load point (or SLO probe) whose checked requests
  // fail (fp32: tokens parting from their lone runs; below fp32: a sample's logits beyond the
  // class's ceilings against the reference) makes the trial INCORRECT, its figures kept.
  // A point the memory plan refused was never served: its verdict stands beside the others'.
  auto judge = [&](const ServingPoint& p, absl::string_view role) {
    if (p.verdict == TrialStatus::kOk || p.verdict == TrialStatus::kUnsupported) return;
    result->verdict.failures.push_back(
        absl::StrCat(role, LoadPointName(p.point), ": ", p.requests_matching, " of ",
                     p.requests_checked, " checked served requests pass",
                     p.first_mismatch.empty() ? "" : absl::StrCat(" (", p.first_mismatch, ")")));
  };
  for (const ServingPoint& p : result->serving) judge(p, "");
  if (result->slo_search)
    for (const ServingPoint& p : result->slo_search->probes) judge(p, "slo probe ");
  result->status = result->verdict.failures.empty() ? TrialStatus::kOk : TrialStatus::kIncorrect;
  result->reason = absl::StrJoin(result->verdict.failures, "; ");
  return trial.device_memory_used_bytes;
}

TrialResult StartedResult(const TrialRequest& request) {
  TrialResult result;
  result.trial_id = request.trial_id;
  result.attempt = request.attempt;
  result.model = request.model;
  result.config = request.config;
  result.engine_version = EngineVersion();
  result.started_unix_ms = NowUnixMs();
  result.workload = WorkloadKey(request.workload);
  return result;
}

void NameRequestedModel(const TrialRequest& request, TrialResult* result) {
  if (absl::StatusOr<ModelIdentity> id =
          DescribeModel(request.model, {request.layers, request.seed, false});
      id.ok())
    result->model_identity = *std::move(id);
}

TrialResult TrialExecutor::Execute(const TrialRequest& request, const Progress& progress) {
  TrialResult result = StartedResult(request);
  result.device = devices_.gpu_count > 0 ? devices_.gpu_name : "cpu";
  result.sm = devices_.sm;
  result.model_identity = Identity(request);
  std::optional<int64_t> peak_device_bytes;  // GPU configs, once a model exists
  auto finish = [&](TrialStatus status, std::string reason) {
    result.status = status;
    result.reason = std::move(reason);
    result.finished_unix_ms = NowUnixMs();
    result.peak_memory_bytes = peak_device_bytes ? *peak_device_bytes : PeakRssBytes();
    return result;
  };
  auto say = [&](const std::string& line) {
    if (progress) progress(line);
  };

  auto config = NormalizeBackendConfig(request.config);
  if (!config.ok()) return finish(TrialStatus::kError, std::string(config.status().message()));
  result.config = *config;
  if (ConfigDevice(*config) == Device::kCpu) {
    result.device = "cpu";
  } else {
    result.software = software_;
  }
  auto fault = ParseFaultInjection(request.inject_fault);
  if (!fault.ok()) return finish(TrialStatus::kError, std::string(fault.status().message()));
  if (auto s = ValidateWorkload(request.workload); !s.ok())
    return finish(TrialStatus::kError, std::string(s.message()));

  // Arch, device, conflicts and the declared weight format (a "@<format>" suffix or the
  // checkpoint's quantization declaration) are judged before any weights load; the stored dtype
  // of dense weights after loading.
  PreflightResult preflight = Preflight(*config, MakePreflightTarget(devices_, request.model));
  if (!preflight.supported) return finish(TrialStatus::kUnsupported, preflight.reason);
  // Then the libraries and the driver, asked about this config on this GPU for the model's
  // shapes: a refusal loads nothing and builds no model.
  if (absl::Status probed = ProbeCapabilities(request, *config); !probed.ok())
    return finish(absl::IsUnimplemented(probed) ? TrialStatus::kUnsupported : TrialStatus::kError,
                  std::string(probed.message()));

  // Then device memory, also before any weights load: each batch size's plan, or each load
  // point's KV slots, against the GPU's free memory (harness/memory_verdict.h).
  std::shared_ptr<void> hog;  // TEST ONLY: held until the trial ends
  TrialMemory memory;
  auto planned_of = [&](int batch) -> std::optional<PlannedMemory> {
    auto it = memory.plans.find(batch);
    if (it == memory.plans.end()) return std::nullopt;
    return PlannedMemoryOf(it->second);
  };
  // A batch size the plan refused, or one whose allocation fails as it runs, gets a verdict of
  // its own and no figures; the other sizes keep theirs.
  auto unmeasured = [&](int batch, BatchMemoryVerdict verdict, std::string reason) {
    BatchFigures b;
    b.batch = batch;
    b.memory_verdict = verdict;
    b.memory_reason = std::move(reason);
    b.planned_memory = planned_of(batch);
    say(absl::StrCat("batch ", batch, ": ", std::string(BatchMemoryVerdictName(verdict)), ": ",
                     b.memory_reason));
    result.batches.push_back(std::move(b));
  };
  if (ConfigDevice(*config) == Device::kCuda) {
    if (fault->kind == FaultInjection::Kind::kHogGpuMemory) {
      absl::StatusOr<std::shared_ptr<void>> held = HoldDeviceMemory(fault->value);
      if (!held.ok()) return finish(TrialStatus::kError, std::string(held.status().message()));
      hog = *std::move(held);
    }
    memory = DecideTrialMemory(request, *config, progress);
    if (memory.decision && memory.decision->unsupported) {
      // The result names each batch size that does not fit, as a trial that runs would.
      for (int batch : request.workload.batch_sizes)
        if (auto it = memory.decision->does_not_fit.find(batch);
            it != memory.decision->does_not_fit.end())
          unmeasured(batch, BatchMemoryVerdict::kDoesNotFit, it->second);
      return finish(TrialStatus::kUnsupported, *memory.decision->unsupported);
    }
    if (memory.serving && memory.serving->unsupported)
      return finish(TrialStatus::kUnsupported, *memory.serving->unsupported);
    if (memory.serving && memory.serving->slot_cap > 0)
      say(absl::StrCat("memory plan: at most ", memory.serving->slot_cap,
                       " KV slots fit; open-loop points are capped there"));
  }
  // What this trial holds on the device at a reading of what is in use: that, less what was in
  // use before the trial.
  auto trial_memory_bytes = [&](std::optional<int64_t> used) -> std::optional<int64_t> {
    if (!used || !memory.baseline_used_bytes) return std::nullopt;
    return *used - *memory.baseline_used_bytes;
  };

  say("loading " + request.model);
  if (auto s = EnsureModel(request); !s.ok())
    return finish(TrialStatus::kError, absl::StrCat("load: ", s.message()));
  for (const std::string& warning : host_->warnings) say("warning: " + warning);
  result.load_seconds = host_->load_seconds;
  preflight = Preflight(*config, MakePreflightTarget(devices_, host_.get()));
  if (!preflight.supported) return finish(TrialStatus::kUnsupported, preflight.reason);

  if (request.workload.serve) {
    peak_device_bytes = ExecuteServing(request, *config, *fault, preflight,
                                       memory.serving ? &*memory.serving : nullptr, &result);
    return finish(result.status, result.reason);
  }

  const BackendConfig reference_config = ReferenceConfigFor(*config);
  say("reference " + BackendConfigString(reference_config));
  auto reference = Reference(reference_config);
  // A reference that cannot run this model (Unimplemented: e.g. the GPU reference on a hybrid)
  // leaves nothing to judge against on this device: UNSUPPORTED, with its reason.
  if (!reference.ok())
    return finish(
        absl::IsUnimplemented(reference.status()) ? TrialStatus::kUnsupported : TrialStatus::kError,
        absl::StrCat("reference: ", reference.status().message()));

  say("config under test " + BackendConfigString(*config));
  if (fault->kind == FaultInjection::Kind::kDelay && fault->value > 0)  // TEST ONLY: a slow trial
    std::this_thread::sleep_for(
        std::chrono::milliseconds(static_cast<int64_t>(fault->value * 1e3)));
  auto model = CreateModel(*host_, *config, *fault);
  // Unimplemented: the config cannot run this model's shapes or weights (a backend's model-side
  // requirements, checked as the model is built), not a failure.
  if (!model.ok())
    return finish(
        absl::IsUnimplemented(model.status()) ? TrialStatus::kUnsupported : TrialStatus::kError,
        std::string(model.status().message()));
  // Host load plus the first upload (or on-device generation) of the weights, when there was one.
  result.load_seconds = host_->load_seconds + host_->device_upload_seconds;
  result.model_memory_bytes = trial_memory_bytes((*model)->device_memory_used_bytes());
  auto outputs = RunEval(**model, eval_);
  if (!outputs.ok()) return finish(TrialStatus::kError, std::string(outputs.status().message()));
  const int vocab = host_->config.vocab_size;
  TrialStatus verdict =
      JudgeOutputs(**reference, *outputs, vocab, preflight.precision, &result.verdict);
  // Free runs that loop where the reference's do not: whose loop is it? The reference, fed the
  // config's own runs, tells (a correct config sent off the reference's path by a near-tie
  // walks the model's own loops). Rare, so it costs nothing on the common path.
  std::optional<std::vector<std::vector<int32_t>>> picks;
  if (result.verdict.degenerate) {
    say("reference on the config's free runs");
    auto made = ReferencePicks(reference_config, outputs->free);
    if (!made.ok())
      return finish(TrialStatus::kError,
                    absl::StrCat("reference on the free runs: ", made.status().message()));
    picks = std::move(*made);
    verdict =
        JudgeOutputs(**reference, *outputs, vocab, preflight.precision, &result.verdict, &*picks);
  }
  // A finite config below fp32 that misses its class's ceilings: does its inputs' rounding
  // alone miss them on this model? Its yardstick (the GPU reference with the GEMM inputs rounded
  // as the config rounds them: bf16, or E4M3 rows: YardstickFor) says; where it does, the
  // ceilings widen to its drift (WidenedToYardstick). Only on failure, so it costs nothing on
  // the common path.
  if (verdict == TrialStatus::kIncorrect && preflight.precision != PrecisionClass::kFp32 &&
      result.verdict.non_finite == 0 && ConfigDevice(reference_config) == Device::kCuda) {
    const Yardstick kind = YardstickFor(*config);
    const std::string name = absl::StrCat(YardstickName(kind), " yardstick");
    say(absl::StrCat(name, " of ", BackendConfigString(reference_config)));
    auto yardstick = Reference(reference_config, kind);
    if (!yardstick.ok())
      return finish(TrialStatus::kError, absl::StrCat(name, ": ", yardstick.status().message()));
    VerdictMetrics drift;
    JudgeOutputs(**reference, **yardstick, vocab, PrecisionClass::kBf16, &drift);
    if (const std::optional<Thresholds> wide = WidenedToYardstick(preflight.precision, drift)) {
      verdict = JudgeOutputs(**reference, *outputs, vocab, preflight.precision, &result.verdict,
                             picks ? &*picks : nullptr, &*wide);
      result.verdict.yardstick_kl_mean = drift.kl_mean;
      result.verdict.yardstick = YardstickName(kind);
    }
  }
  if (verdict != TrialStatus::kOk)  // garbage is not worth timing
    return finish(verdict, absl::StrJoin(result.verdict.failures, "; "));

  MeasureOptions measure;
  measure.progress = progress;
  measure.bandwidth_gb_s = KnownReadBandwidthGbs(result.device);
  measure.bf16_tflops = KnownBf16Tflops(result.device);
  measure.bytes_per_weight = WeightFormat(*host_) == "f32" ? 4 : 2;
  if (host_->quant_format != QuantFormat::kNone)
    measure.quantized_bytes_per_weight = QuantBytesPerElement(
        host_->quant_format, host_->config.hidden_size, host_->config.hidden_size);
  measure.bytes_per_kv_element = (*model)->kv_cache_bytes_per_element();
  if (ConfigDevice(*config) == Device::kCuda) {
    if (!energy_meter_) energy_meter_ = OpenGpuEnergyMeter(devices_.gpu_pci_bus_id);
    measure.energy = energy_meter_.get();
  }
  for (int batch : request.workload.batch_sizes) {
    if (memory.decision)
      if (auto it = memory.decision->does_not_fit.find(batch);
          it != memory.decision->does_not_fit.end()) {
        unmeasured(batch, BatchMemoryVerdict::kDoesNotFit, it->second);
        continue;
      }
    auto figures = MeasureBatch(**model, request.workload, batch, measure);
    // cudaErrorMemoryAllocation surfaces as ResourceExhausted naming the allocation
    // (kernels/cuda/check.h).
    if (!figures.ok() && ConfigDevice(*config) == Device::kCuda &&
        absl::IsResourceExhausted(figures.status())) {
      // The allocation that failed, and the plan it ran under: the figures to fix the plan by.
      std::string reason(figures.status().message());
      if (auto it = memory.plans.find(batch); it != memory.plans.end())
        absl::StrAppend(&reason, "; the plan: ", MemoryVerdictText(it->second, memory.free_bytes));
      unmeasured(batch, BatchMemoryVerdict::kOutOfMemory, std::move(reason));
      continue;
    }
    if (!figures.ok()) return finish(TrialStatus::kError, std::string(figures.status().message()));
    figures->planned_memory = planned_of(batch);
    // Nothing is freed during a run, so the reading after the largest batch is the peak.
    const std::optional<int64_t> used = (*model)->device_memory_used_bytes();
    if (used) {
      figures->device_memory_used_bytes = *used;
      peak_device_bytes = std::max(peak_device_bytes.value_or(0), *used);
    }
    figures->measured_memory_bytes = trial_memory_bytes(used);
    result.batches.push_back(*std::move(figures));
  }
  result.graph_capture_seconds = (*model)->graph_capture_seconds();
  // The plan lets the smallest size run, so nothing measured means it ran out of memory (the
  // first entry) and no larger size ran either: the config cannot run this workload here.
  if (std::none_of(result.batches.begin(), result.batches.end(),
                   [](const BatchFigures& b) { return b.measured(); }))
    return finish(
        TrialStatus::kUnsupported,
        absl::StrCat("no batch size ran: batch ", result.batches.front().batch,
                     " ran out of device memory: ", result.batches.front().memory_reason));
  return finish(TrialStatus::kOk, "");
}

}  // namespace infersweep
