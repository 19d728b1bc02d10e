#include "api/trial.h"

#include <cstdint>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "api/status_macros.h"
#include "api/untrusted_json.h"

namespace infersweep {
namespace {

using nlohmann::json;

constexpr std::string_view kStatusNames[] = {"OK",          "INCORRECT", "CRASHED",
                                             "UNSUPPORTED", "TIMEOUT",   "ERROR"};

// Reads an optional field of type T; a present field of the wrong type is an error naming it.
template <typename T>
absl::Status Read(const json& j, const char* key, T* out, absl::string_view where) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  try {
    *out = it->get<T>();
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", key, ": wrong type (", it->type_name(), ")"));
  }
  return absl::OkStatus();
}

json SpreadJson(const Spread& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }
json OptJson(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

absl::Status ReadSpread(const json& j, const char* key, Spread* s, absl::string_view where) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  const std::string w = absl::StrCat(where, ".", key);
  RETURN_IF_ERROR(Read(*it, "median", &s->median, w));
  RETURN_IF_ERROR(Read(*it, "min", &s->min, w));
  return Read(*it, "max", &s->max, w);
}

absl::Status ReadOpt(const json& j, const char* key, std::optional<double>* v,
                     absl::string_view where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number())
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, ": not a number"));
  *v = it->get<double>();
  return absl::OkStatus();
}

// "planned_memory": {"total_bytes": N, "pools": {"weights": N, "copies": N, ...}}.
json PlannedMemoryJson(const PlannedMemory& m) {
  json pools = json::object();
  for (const auto& [pool, bytes] : m.pool_bytes) pools[pool] = bytes;
  return {{"total_bytes", m.total_bytes}, {"pools", pools}};
}

absl::StatusOr<PlannedMemory> PlannedMemoryFromJson(const json& j, absl::string_view where) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  auto byte_count = [&](const json& v, absl::string_view name) -> absl::StatusOr<int64_t> {
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      return absl::InvalidArgumentError(absl::StrCat(where, ".", name, ": not a byte count"));
    return v.get<int64_t>();
  };
  PlannedMemory m;
  auto total = j.find("total_bytes");
  if (total == j.end())
    return absl::InvalidArgumentError(absl::StrCat(where, ".total_bytes: missing"));
  ASSIGN_OR_RETURN(m.total_bytes, byte_count(*total, "total_bytes"));
  if (auto pools = j.find("pools"); pools != j.end() && !pools->is_null()) {
    if (!pools->is_object())
      return absl::InvalidArgumentError(absl::StrCat(where, ".pools: not an object"));
    for (const auto& [pool, bytes] : pools->items()) {
      ASSIGN_OR_RETURN(int64_t n, byte_count(bytes, absl::StrCat("pools.", pool)));
      m.pool_bytes[pool] = n;
    }
  }
  return m;
}

json PhaseJson(const std::optional<PhaseKernels>& p) {
  if (!p) return nullptr;
  json launches = json::array();
  for (const KernelCount& k : p->kernels)
    launches.push_back({{"name", k.name}, {"count", k.count}});
  return {{"graph", p->graph}, {"launches", launches}, {"fallbacks", p->fallbacks}};
}

// "kernels": {"prefill": PHASE, "decode": PHASE}, each optional or null.
absl::Status ReadPhase(const json& kernels, const char* phase, std::optional<PhaseKernels>* out,
                       absl::string_view where) {
  auto it = kernels.find(phase);
  if (it == kernels.end() || it->is_null()) return absl::OkStatus();
  const std::string w = absl::StrCat(where, ".", phase);
  if (!it->is_object()) return absl::InvalidArgumentError(absl::StrCat(w, ": not an object"));
  PhaseKernels p;
  RETURN_IF_ERROR(Read(*it, "graph", &p.graph, w));
  if (auto launches = it->find("launches"); launches != it->end() && !launches->is_null()) {
    if (!launches->is_array())
      return absl::InvalidArgumentError(absl::StrCat(w, ".launches: not an array"));
    const std::string lw = absl::StrCat(w, ".launches[]");
    for (const json& entry : *launches) {
      KernelCount k;
      RETURN_IF_ERROR(Read(entry, "name", &k.name, lw));
      RETURN_IF_ERROR(Read(entry, "count", &k.count, lw));
      if (k.name.empty()) return absl::InvalidArgumentError(absl::StrCat(lw, ".name: missing"));
      if (k.count < 1)
        return absl::InvalidArgumentError(
            absl::StrCat(lw, ".count: ", k.count, " for '", k.name, "' (a launch count is >= 1)"));
      p.kernels.push_back(std::move(k));
    }
  }
  RETURN_IF_ERROR(Read(*it, "fallbacks", &p.fallbacks, w));
  *out = std::move(p);
  return absl::OkStatus();
}

}  // namespace

std::string_view TrialStatusName(TrialStatus s) { return kStatusNames[static_cast<int>(s)]; }

std::optional<TrialStatus> TrialStatusFromName(std::string_view name) {
  for (int i = 0; i < 6; ++i)
    if (kStatusNames[i] == name) return static_cast<TrialStatus>(i);
  return std::nullopt;
}

std::string_view BatchMemoryVerdictName(BatchMemoryVerdict v) {
  switch (v) {
    case BatchMemoryVerdict::kDoesNotFit:
      return "DOES_NOT_FIT";
    case BatchMemoryVerdict::kOutOfMemory:
      return "OUT_OF_MEMORY";
  }
  return "DOES_NOT_FIT";
}

std::optional<BatchMemoryVerdict> BatchMemoryVerdictFromName(std::string_view name) {
  for (BatchMemoryVerdict v : {BatchMemoryVerdict::kDoesNotFit, BatchMemoryVerdict::kOutOfMemory})
    if (BatchMemoryVerdictName(v) == name) return v;
  return std::nullopt;
}

absl::Status ValidateWorkload(const Workload& w) {
  auto bad = [](absl::string_view field, auto value, absl::string_view range) {
    return absl::InvalidArgumentError(
        absl::StrCat("workload field '", field, "': ", value, " is outside ", range));
  };
  if (w.prompt_len < 1 || w.prompt_len > 65536) return bad("prompt", w.prompt_len, "[1, 65536]");
  if (w.output_len < 2 || w.output_len > 65536) return bad("output", w.output_len, "[2, 65536]");
  if (w.batch_sizes.empty() || w.batch_sizes.size() > 16)
    return bad("batch", w.batch_sizes.size(), "1..16 batch sizes");
  for (int b : w.batch_sizes)
    if (b < 1 || b > kMaxBatchSize)
      return bad("batch", b, absl::StrCat("[1, ", kMaxBatchSize, "]"));
  if (w.repeats < 1 || w.repeats > 100) return bad("repeats", w.repeats, "[1, 100]");
  if (w.warmup < 0 || w.warmup > 100) return bad("warmup", w.warmup, "[0, 100]");
  if (!(w.timeout_s >= 1 && w.timeout_s <= 86400))
    return bad("timeout", w.timeout_s, "[1, 86400] s");
  if (w.serve) RETURN_IF_ERROR(ValidateServeSpec(*w.serve, "workload"));
  if (!w.slo.empty() && !w.serve)
    return absl::InvalidArgumentError("workload field 'slo': an SLO applies to serving workloads");
  return ValidateSlo(w.slo, "workload slo");
}

absl::StatusOr<Workload> ParseWorkload(std::string_view text) {
  Workload w;
  std::set<std::string, std::less<>> seen;
  for (absl::string_view item :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (!seen.emplace(kv.first).second)
      return absl::InvalidArgumentError(
          absl::StrCat("workload field '", kv.first, "' given twice"));
    auto as_int = [&](int* out) -> absl::Status {
      if (!absl::SimpleAtoi(kv.second, out))
        return absl::InvalidArgumentError(
            absl::StrCat("workload field '", kv.first, "': '", kv.second, "' is not an integer"));
      return absl::OkStatus();
    };
    if (kv.first == "prompt") {
      RETURN_IF_ERROR(as_int(&w.prompt_len));
    } else if (kv.first == "output") {
      RETURN_IF_ERROR(as_int(&w.output_len));
    } else if (kv.first == "repeats") {
      RETURN_IF_ERROR(as_int(&w.repeats));
    } else if (kv.first == "warmup") {
      RETURN_IF_ERROR(as_int(&w.warmup));
    } else if (kv.first == "timeout") {
      if (!absl::SimpleAtod(kv.second, &w.timeout_s))
        return absl::InvalidArgumentError(
            absl::StrCat("workload field 'timeout': '", kv.second, "' is not a number"));
    } else if (kv.first == "batch") {
      w.batch_sizes.clear();
      for (absl::string_view b : absl::StrSplit(kv.second, ':')) {
        int size;
        if (!absl::SimpleAtoi(b, &size))
          return absl::InvalidArgumentError(
              absl::StrCat("workload field 'batch': '", b, "' is not an integer"));
        // Each size is timed once, in order: a repeated or descending list is a typo.
        if (!w.batch_sizes.empty() && size <= w.batch_sizes.back())
          return absl::InvalidArgumentError(
              absl::StrCat("workload field 'batch': '", kv.second,
                           "': batch sizes must increase (e.g. batch=1:4:16)"));
        w.batch_sizes.push_back(size);
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown workload field '", kv.first,
                       "' (known: prompt, output, batch, repeats, warmup, timeout)"));
    }
  }
  RETURN_IF_ERROR(ValidateWorkload(w));
  return w;
}

std::string WorkloadString(const Workload& w) {
  // The shortest text that reads back to the same timeout.
  std::string timeout = absl::StrFormat("%.17g", w.timeout_s);
  for (int digits = 6; digits < 17; ++digits) {
    std::string s = absl::StrFormat("%.*g", digits, w.timeout_s);
    double back = 0;
    if (absl::SimpleAtod(s, &back) && back == w.timeout_s) {
      timeout = s;
      break;
    }
  }
  return absl::StrCat("prompt=", w.prompt_len, ",output=", w.output_len,
                      ",batch=", absl::StrJoin(w.batch_sizes, ":"), ",repeats=", w.repeats,
                      ",warmup=", w.warmup, ",timeout=", timeout);
}

std::string WorkloadKey(const Workload& w) {
  if (w.serve) return ServeWorkloadKey(*w.serve, w.slo);
  return absl::StrCat("prompt=", w.prompt_len, ",output=", w.output_len, ",warmup=", w.warmup);
}

absl::StatusOr<std::string> CanonicalWorkloadKey(std::string_view text) {
  if (absl::StartsWith(absl::string_view(text.data(), text.size()), kServeWorkloadKeyPrefix))
    return CanonicalServeWorkloadKey(text);
  ASSIGN_OR_RETURN(Workload w, ParseWorkload(text));
  return WorkloadKey(w);
}

json KernelsJson(const BatchFigures& b) {
  return {{"prefill", PhaseJson(b.prefill_kernels)}, {"decode", PhaseJson(b.decode_kernels)}};
}

json ToJson(const Workload& w) {
  json j = {{"prompt_len", w.prompt_len},   {"output_len", w.output_len},
            {"batch_sizes", w.batch_sizes}, {"repeats", w.repeats},
            {"warmup", w.warmup},           {"timeout_s", w.timeout_s}};
  if (w.serve) j["serve"] = ToJson(*w.serve);
  if (!w.slo.empty()) j["slo"] = ToJson(w.slo);
  return j;
}

absl::StatusOr<Workload> WorkloadFromJson(const json& j) {
  Workload w;
  RETURN_IF_ERROR(Read(j, "prompt_len", &w.prompt_len, "workload"));
  RETURN_IF_ERROR(Read(j, "output_len", &w.output_len, "workload"));
  RETURN_IF_ERROR(Read(j, "batch_sizes", &w.batch_sizes, "workload"));
  RETURN_IF_ERROR(Read(j, "repeats", &w.repeats, "workload"));
  RETURN_IF_ERROR(Read(j, "warmup", &w.warmup, "workload"));
  RETURN_IF_ERROR(Read(j, "timeout_s", &w.timeout_s, "workload"));
  if (auto it = j.find("serve"); it != j.end() && !it->is_null()) {
    ASSIGN_OR_RETURN(ServeSpec spec, ServeSpecFromJson(*it, "workload.serve"));
    w.serve = std::move(spec);
  }
  if (auto it = j.find("slo"); it != j.end() && !it->is_null()) {
    ASSIGN_OR_RETURN(w.slo, SloFromJson(*it, "workload.slo"));
  }
  RETURN_IF_ERROR(ValidateWorkload(w));
  return w;
}

json ToJson(const TrialRequest& r) {
  return {{"trial_id", r.trial_id},
          {"attempt", r.attempt},
          {"model", r.model},
          {"layers", r.layers},
          {"seed", r.seed},
          {"config", r.config},
          {"workload", ToJson(r.workload)},
          {"inject_fault", r.inject_fault}};
}

absl::StatusOr<TrialRequest> TrialRequestFromJson(const json& j) {
  TrialRequest r;
  RETURN_IF_ERROR(Read(j, "trial_id", &r.trial_id, "request"));
  RETURN_IF_ERROR(Read(j, "attempt", &r.attempt, "request"));
  RETURN_IF_ERROR(Read(j, "model", &r.model, "request"));
  RETURN_IF_ERROR(Read(j, "layers", &r.layers, "request"));
  RETURN_IF_ERROR(Read(j, "seed", &r.seed, "request"));
  RETURN_IF_ERROR(Read(j, "config", &r.config, "request"));
  RETURN_IF_ERROR(Read(j, "inject_fault", &r.inject_fault, "request"));
  if (r.model.empty()) return absl::InvalidArgumentError("request.model: missing");
  if (j.contains("workload")) {
    ASSIGN_OR_RETURN(auto w, WorkloadFromJson(j["workload"]));
    r.workload = w;
  }
  return r;
}

json ToJson(const TrialResult& r) {
  json batches = json::array();
  for (const BatchFigures& b : r.batches) {
    batches.push_back(
        {{"batch", b.batch},
         {"ttft_ms", SpreadJson(b.ttft_ms)},
         {"tpot_ms", SpreadJson(b.tpot_ms)},
         {"latency_ms", SpreadJson(b.latency_ms)},
         {"prefill_tok_s", SpreadJson(b.prefill_tok_s)},
         {"output_tok_s", SpreadJson(b.output_tok_s)},
         {"output_tok_s_per_seq", SpreadJson(b.output_tok_s_per_seq)},
         {"itl_ms", {{"p50", b.itl_ms.p50}, {"p90", b.itl_ms.p90}, {"p99", b.itl_ms.p99}}},
         {"decode_bytes_per_step", b.decode_bytes_per_step},
         {"achieved_gb_s", b.achieved_gb_s},
         {"roofline_tok_s", OptJson(b.roofline_tok_s)},
         {"roofline_fraction", OptJson(b.roofline_fraction)},
         {"prefill_flops", b.prefill_flops},
         {"prefill_roofline_tok_s", OptJson(b.prefill_roofline_tok_s)},
         {"prefill_roofline_fraction", OptJson(b.prefill_roofline_fraction)},
         {"avg_power_w", OptJson(b.avg_power_w)},
         {"joules_per_output_token", OptJson(b.joules_per_output_token)},
         {"timer", b.timer},
         {"wall_ttft_ms", b.wall_ttft_ms ? SpreadJson(*b.wall_ttft_ms) : json(nullptr)},
         {"wall_tpot_ms", b.wall_tpot_ms ? SpreadJson(*b.wall_tpot_ms) : json(nullptr)}});
    if (b.prefill_kernels || b.decode_kernels) batches.back()["kernels"] = KernelsJson(b);
    if (b.memory_verdict) {
      batches.back()["memory_verdict"] = BatchMemoryVerdictName(*b.memory_verdict);
      batches.back()["memory_reason"] = b.memory_reason;
    }
    if (b.planned_memory) batches.back()["planned_memory"] = PlannedMemoryJson(*b.planned_memory);
    if (b.device_memory_used_bytes)
      batches.back()["device_memory_used_bytes"] = *b.device_memory_used_bytes;
    if (b.measured_memory_bytes) batches.back()["measured_memory_bytes"] = *b.measured_memory_bytes;
  }
  const VerdictMetrics& v = r.verdict;
  json out = {{"trial_id", r.trial_id},
              {"attempt", r.attempt},
              {"status", TrialStatusName(r.status)},
              {"reason", r.reason},
              {"stderr_tail", r.stderr_tail},
              {"model", r.model},
              {"config", r.config},
              {"device", r.device},
              {"sm", r.sm},
              {"engine_version", r.engine_version},
              {"model_identity",
               {{"source", r.model_identity.source},
                {"name", r.model_identity.name},
                {"layers", r.model_identity.layers},
                {"seed", r.model_identity.seed},
                {"weights", r.model_identity.weights},
                {"fingerprint", r.model_identity.fingerprint},
                {"key", ModelIdentityKey(r.model_identity)}}},
              {"workload", r.workload},
              {"software",
               {{"driver", r.software.driver},
                {"cuda_driver", r.software.cuda_driver},
                {"cuda_runtime", r.software.cuda_runtime},
                {"cublas", r.software.cublas},
                {"cublaslt", r.software.cublaslt},
                {"nccl", r.software.nccl},
                {"cudnn", r.software.cudnn}}},
              {"load_seconds", r.load_seconds},
              {"graph_capture_seconds", r.graph_capture_seconds},
              {"peak_memory_bytes", r.peak_memory_bytes},
              {"verdict",
               {{"precision_class", v.precision_class},
                {"max_rel_error", v.max_rel_error},
                {"top1_agreement", v.top1_agreement},
                {"kl_mean", v.kl_mean},
                {"kl_max", v.kl_max},
                {"non_finite", v.non_finite},
                {"degenerate", v.degenerate},
                {"reference_degenerate", v.reference_degenerate},
                {"free_run_agreement", v.free_run_agreement},
                {"loop_reference_agreement", OptJson(v.loop_reference_agreement)},
                {"yardstick_kl_mean", OptJson(v.yardstick_kl_mean)},
                {"yardstick", v.yardstick},
                {"worst_pass", v.worst_pass},
                {"worst_pass_kl_mean", v.worst_pass_kl_mean},
                {"failures", v.failures}}},
              {"batches", batches},
              {"started_unix_ms", r.started_unix_ms},
              {"finished_unix_ms", r.finished_unix_ms}};
  if (r.model_memory_bytes) out["model_memory_bytes"] = *r.model_memory_bytes;
  // Lockstep results carry neither key, so their JSON reads as it did before serving existed.
  if (!r.serving.empty()) {
    json points = json::array();
    for (const ServingPoint& p : r.serving) points.push_back(ToJson(p));
    out["serving"] = std::move(points);
  }
  if (r.slo_search) {
    json search = {{"found", r.slo_search->found}, {"probes", json::array()}};
    for (const ServingPoint& p : r.slo_search->probes) search["probes"].push_back(ToJson(p));
    if (r.slo_search->best) search["best"] = ToJson(*r.slo_search->best);
    out["slo_search"] = std::move(search);
  }
  return out;
}

absl::StatusOr<TrialResult> TrialResultFromJson(const json& j) {
  TrialResult r;
  std::string status;
  RETURN_IF_ERROR(Read(j, "status", &status, "result"));
  auto parsed = TrialStatusFromName(status);
  if (!parsed)
    return absl::InvalidArgumentError(absl::StrCat("result.status: unknown '", status, "'"));
  r.status = *parsed;
  RETURN_IF_ERROR(Read(j, "trial_id", &r.trial_id, "result"));
  RETURN_IF_ERROR(Read(j, "attempt", &r.attempt, "result"));
  RETURN_IF_ERROR(Read(j, "reason", &r.reason, "result"));
  RETURN_IF_ERROR(Read(j, "stderr_tail", &r.stderr_tail, "result"));
  RETURN_IF_ERROR(Read(j, "model", &r.model, "result"));
  RETURN_IF_ERROR(Read(j, "config", &r.config, "result"));
  RETURN_IF_ERROR(Read(j, "device", &r.device, "result"));
  RETURN_IF_ERROR(Read(j, "sm", &r.sm, "result"));
  RETURN_IF_ERROR(Read(j, "engine_version", &r.engine_version, "result"));
  // Results stored before identities existed have none of these three.
  if (auto it = j.find("model_identity"); it != j.end() && !it->is_null()) {
    ModelIdentity& m = r.model_identity;
    const char* w = "result.model_identity";
    RETURN_IF_ERROR(Read(*it, "source", &m.source, w));
    RETURN_IF_ERROR(Read(*it, "name", &m.name, w));
    RETURN_IF_ERROR(Read(*it, "layers", &m.layers, w));
    RETURN_IF_ERROR(Read(*it, "seed", &m.seed, w));
    RETURN_IF_ERROR(Read(*it, "weights", &m.weights, w));
    RETURN_IF_ERROR(Read(*it, "fingerprint", &m.fingerprint, w));
    if (!m.source.empty() && m.source != "preset" && m.source != "checkpoint")
      return absl::InvalidArgumentError(
          absl::StrCat(w, ".source: unknown '", m.source, "' (known: preset, checkpoint)"));
    if (m.layers < 0) return absl::InvalidArgumentError(absl::StrCat(w, ".layers: negative"));
  }
  RETURN_IF_ERROR(Read(j, "workload", &r.workload, "result"));
  if (auto it = j.find("software"); it != j.end() && !it->is_null()) {
    SoftwareStack& s = r.software;
    const char* w = "result.software";
    RETURN_IF_ERROR(Read(*it, "driver", &s.driver, w));
    RETURN_IF_ERROR(Read(*it, "cuda_driver", &s.cuda_driver, w));
    RETURN_IF_ERROR(Read(*it, "cuda_runtime", &s.cuda_runtime, w));
    RETURN_IF_ERROR(Read(*it, "cublas", &s.cublas, w));
    RETURN_IF_ERROR(Read(*it, "cublaslt", &s.cublaslt, w));
    RETURN_IF_ERROR(Read(*it, "nccl", &s.nccl, w));
    RETURN_IF_ERROR(Read(*it, "cudnn", &s.cudnn, w));
  }
  RETURN_IF_ERROR(Read(j, "load_seconds", &r.load_seconds, "result"));
  RETURN_IF_ERROR(Read(j, "graph_capture_seconds", &r.graph_capture_seconds, "result"));
  RETURN_IF_ERROR(Read(j, "peak_memory_bytes", &r.peak_memory_bytes, "result"));
  if (auto held = j.find("model_memory_bytes"); held != j.end() && !held->is_null()) {
    if (!held->is_number_integer())
      return absl::InvalidArgumentError("result.model_memory_bytes: not a whole number of bytes");
    r.model_memory_bytes = held->get<int64_t>();
  }
  RETURN_IF_ERROR(Read(j, "started_unix_ms", &r.started_unix_ms, "result"));
  RETURN_IF_ERROR(Read(j, "finished_unix_ms", &r.finished_unix_ms, "result"));
  if (auto it = j.find("verdict"); it != j.end()) {
    VerdictMetrics& v = r.verdict;
    RETURN_IF_ERROR(Read(*it, "precision_class", &v.precision_class, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "max_rel_error", &v.max_rel_error, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "top1_agreement", &v.top1_agreement, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "kl_mean", &v.kl_mean, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "kl_max", &v.kl_max, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "non_finite", &v.non_finite, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "degenerate", &v.degenerate, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "reference_degenerate", &v.reference_degenerate, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "free_run_agreement", &v.free_run_agreement, "result.verdict"));
    RETURN_IF_ERROR(
        ReadOpt(*it, "loop_reference_agreement", &v.loop_reference_agreement, "result.verdict"));
    RETURN_IF_ERROR(ReadOpt(*it, "yardstick_kl_mean", &v.yardstick_kl_mean, "result.verdict"));
    if (v.yardstick_kl_mean) v.yardstick = "bf16";  // a result without the field: the bf16 one
    RETURN_IF_ERROR(Read(*it, "yardstick", &v.yardstick, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "worst_pass", &v.worst_pass, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "worst_pass_kl_mean", &v.worst_pass_kl_mean, "result.verdict"));
    RETURN_IF_ERROR(Read(*it, "failures", &v.failures, "result.verdict"));
  }
  if (auto it = j.find("batches"); it != j.end()) {
    if (!it->is_array()) return absl::InvalidArgumentError("result.batches: not an array");
    for (const json& bj : *it) {
      BatchFigures b;
      const std::string w = "result.batches[]";
      RETURN_IF_ERROR(Read(bj, "batch", &b.batch, w));
      RETURN_IF_ERROR(ReadSpread(bj, "ttft_ms", &b.ttft_ms, w));
      RETURN_IF_ERROR(ReadSpread(bj, "tpot_ms", &b.tpot_ms, w));
      RETURN_IF_ERROR(ReadSpread(bj, "latency_ms", &b.latency_ms, w));
      RETURN_IF_ERROR(ReadSpread(bj, "prefill_tok_s", &b.prefill_tok_s, w));
      RETURN_IF_ERROR(ReadSpread(bj, "output_tok_s", &b.output_tok_s, w));
      RETURN_IF_ERROR(ReadSpread(bj, "output_tok_s_per_seq", &b.output_tok_s_per_seq, w));
      if (auto itl = bj.find("itl_ms"); itl != bj.end()) {
        RETURN_IF_ERROR(Read(*itl, "p50", &b.itl_ms.p50, w));
        RETURN_IF_ERROR(Read(*itl, "p90", &b.itl_ms.p90, w));
        RETURN_IF_ERROR(Read(*itl, "p99", &b.itl_ms.p99, w));
      }
      RETURN_IF_ERROR(Read(bj, "decode_bytes_per_step", &b.decode_bytes_per_step, w));
      RETURN_IF_ERROR(Read(bj, "achieved_gb_s", &b.achieved_gb_s, w));
      RETURN_IF_ERROR(ReadOpt(bj, "roofline_tok_s", &b.roofline_tok_s, w));
      RETURN_IF_ERROR(ReadOpt(bj, "roofline_fraction", &b.roofline_fraction, w));
      // Results stored before the prefill roofline existed have none of these three.
      RETURN_IF_ERROR(Read(bj, "prefill_flops", &b.prefill_flops, w));
      RETURN_IF_ERROR(ReadOpt(bj, "prefill_roofline_tok_s", &b.prefill_roofline_tok_s, w));
      RETURN_IF_ERROR(ReadOpt(bj, "prefill_roofline_fraction", &b.prefill_roofline_fraction, w));
      RETURN_IF_ERROR(ReadOpt(bj, "avg_power_w", &b.avg_power_w, w));
      RETURN_IF_ERROR(ReadOpt(bj, "joules_per_output_token", &b.joules_per_output_token, w));
      // Results stored before these fields existed lack them: wall clock, no comparison.
      if (bj.contains("timer")) RETURN_IF_ERROR(Read(bj, "timer", &b.timer, w));
      for (auto [name, field] : {std::pair{"wall_ttft_ms", &b.wall_ttft_ms},
                                 std::pair{"wall_tpot_ms", &b.wall_tpot_ms}}) {
        if (!bj.contains(name) || bj[name].is_null()) continue;
        Spread spread;
        RETURN_IF_ERROR(ReadSpread(bj, name, &spread, w));
        *field = spread;
      }
      // What ran (the launch log); results written before it existed have none.
      if (auto kernels = bj.find("kernels"); kernels != bj.end() && !kernels->is_null()) {
        const std::string kw = w + ".kernels";
        if (!kernels->is_object())
          return absl::InvalidArgumentError(absl::StrCat(kw, ": not an object"));
        RETURN_IF_ERROR(ReadPhase(*kernels, "prefill", &b.prefill_kernels, kw));
        RETURN_IF_ERROR(ReadPhase(*kernels, "decode", &b.decode_kernels, kw));
      }
      // Results written before the memory verdicts existed have none of these.
      if (auto v = bj.find("memory_verdict"); v != bj.end() && !v->is_null()) {
        const std::optional<BatchMemoryVerdict> verdict =
            v->is_string() ? BatchMemoryVerdictFromName(v->get<std::string>()) : std::nullopt;
        if (!verdict)
          return absl::InvalidArgumentError(absl::StrCat(
              w, ".memory_verdict: not DOES_NOT_FIT or OUT_OF_MEMORY (", v->dump(), ")"));
        b.memory_verdict = verdict;
        RETURN_IF_ERROR(Read(bj, "memory_reason", &b.memory_reason, w));
      }
      if (auto planned = bj.find("planned_memory"); planned != bj.end() && !planned->is_null()) {
        ASSIGN_OR_RETURN(PlannedMemory memory,
                         PlannedMemoryFromJson(*planned, w + ".planned_memory"));
        b.planned_memory = std::move(memory);
      }
      if (auto used = bj.find("device_memory_used_bytes"); used != bj.end() && !used->is_null()) {
        if (!used->is_number_integer() || used->get<int64_t>() < 0)
          return absl::InvalidArgumentError(
              absl::StrCat(w, ".device_memory_used_bytes: not a byte count"));
        b.device_memory_used_bytes = used->get<int64_t>();
      }
      // Signed: another process freeing memory during the trial can leave it below zero.
      if (auto held = bj.find("measured_memory_bytes"); held != bj.end() && !held->is_null()) {
        if (!held->is_number_integer())
          return absl::InvalidArgumentError(
              absl::StrCat(w, ".measured_memory_bytes: not a whole number of bytes"));
        b.measured_memory_bytes = held->get<int64_t>();
      }
      r.batches.push_back(b);
    }
  }
  if (auto it = j.find("serving"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return absl::InvalidArgumentError("result.serving: not an array");
    for (const json& pj : *it) {
      ASSIGN_OR_RETURN(ServingPoint p, ServingPointFromJson(pj, "result.serving[]"));
      r.serving.push_back(std::move(p));
    }
  }
  if (auto it = j.find("slo_search"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return absl::InvalidArgumentError("result.slo_search: not an object");
    ServingSloSearch search;
    RETURN_IF_ERROR(Read(*it, "found", &search.found, "result.slo_search"));
    if (auto probes = it->find("probes"); probes != it->end() && !probes->is_null()) {
      if (!probes->is_array())
        return absl::InvalidArgumentError("result.slo_search.probes: not an array");
      for (const json& pj : *probes) {
        ASSIGN_OR_RETURN(ServingPoint p, ServingPointFromJson(pj, "result.slo_search.probes[]"));
        search.probes.push_back(std::move(p));
      }
    }
    if (auto best = it->find("best"); best != it->end() && !best->is_null()) {
      ASSIGN_OR_RETURN(ServingPoint p, ServingPointFromJson(*best, "result.slo_search.best"));
      search.best = std::move(p);
    }
    if (search.found != search.best.has_value())
      return absl::InvalidArgumentError(
          "result.slo_search: 'found' and 'best' disagree (a found load has its best point)");
    r.slo_search = std::move(search);
  }
  return r;
}

json ToJson(const ServingPoint& p) {
  json j = {
      {"load_point", LoadPointName(p.point)},
      {"mode", p.point.open_loop ? "poisson" : "closed_loop"},
      {"verdict", std::string(TrialStatusName(p.verdict))},
      {"requests_checked", p.requests_checked},
      {"requests_matching", p.requests_matching},
      {"steps", p.steps},
      {"peak_running", p.peak_running},
      {"completed", p.completed},
      {"total_input_tokens", p.total_input_tokens},
      {"total_output_tokens", p.total_output_tokens},
      {"duration_s", p.duration_s},
      {"request_throughput", p.request_throughput},
      {"output_throughput", p.output_throughput},
      {"total_token_throughput", p.total_token_throughput},
      {"output_tok_s_per_user", p.output_tok_s_per_user},
  };
  if (p.point.open_loop) {
    j["request_rate"] = p.point.rate;
    if (p.point.concurrency > 0) j["max_concurrency"] = p.point.concurrency;
  } else {
    j["max_concurrency"] = p.point.concurrency;
  }
  auto add = [&](const std::string& name, const ServingDistribution& d) {
    j["mean_" + name] = d.mean;
    j["median_" + name] = d.median;
    j["p90_" + name] = d.p90;
    j["p99_" + name] = d.p99;
  };
  add("ttft_ms", p.ttft_ms);
  add("tpot_ms", p.tpot_ms);
  add("itl_ms", p.itl_ms);
  add("e2el_ms", p.e2el_ms);
  if (p.request_goodput) j["request_goodput"] = *p.request_goodput;
  if (p.meets_slo) j["meets_slo"] = *p.meets_slo;
  if (p.reference_kl_mean) j["reference_kl_mean"] = *p.reference_kl_mean;
  if (p.reference_top1) j["reference_top1"] = *p.reference_top1;
  if (p.yardstick_kl_mean) {
    j["yardstick_kl_mean"] = *p.yardstick_kl_mean;
    j["yardstick"] = p.yardstick;
  }
  if (p.ttft_ms_at_slo_percentile) j["ttft_ms_at_slo_percentile"] = *p.ttft_ms_at_slo_percentile;
  if (p.tpot_ms_at_slo_percentile) j["tpot_ms_at_slo_percentile"] = *p.tpot_ms_at_slo_percentile;
  if (p.energy_j_per_output_token) j["energy_j_per_output_token"] = *p.energy_j_per_output_token;
  if (!p.first_mismatch.empty()) j["first_mismatch"] = p.first_mismatch;
  if (!p.reason.empty()) j["reason"] = p.reason;
  if (p.slots_capped_at) j["slots_capped_at"] = *p.slots_capped_at;
  return j;
}

absl::StatusOr<ServingPoint> ServingPointFromJson(const json& j, std::string_view where_view) {
  const std::string where(where_view);
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  ServingPoint p;
  std::string mode, verdict;
  RETURN_IF_ERROR(Read(j, "mode", &mode, where));
  if (mode != "closed_loop" && mode != "poisson")
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".mode: unknown '", mode, "' (known: closed_loop, poisson)"));
  p.point.open_loop = mode == "poisson";
  RETURN_IF_ERROR(Read(j, "max_concurrency", &p.point.concurrency, where));
  RETURN_IF_ERROR(Read(j, "request_rate", &p.point.rate, where));
  if (p.point.open_loop ? !(p.point.rate > 0) : p.point.concurrency < 1)
    return absl::InvalidArgumentError(
        absl::StrCat(where, p.point.open_loop ? ".request_rate: missing or not positive"
                                              : ".max_concurrency: missing or below 1"));
  RETURN_IF_ERROR(Read(j, "verdict", &verdict, where));
  const std::optional<TrialStatus> status = TrialStatusFromName(verdict);
  if (!status)
    return absl::InvalidArgumentError(absl::StrCat(where, ".verdict: unknown '", verdict, "'"));
  p.verdict = *status;
  RETURN_IF_ERROR(Read(j, "requests_checked", &p.requests_checked, where));
  RETURN_IF_ERROR(Read(j, "requests_matching", &p.requests_matching, where));
  RETURN_IF_ERROR(Read(j, "first_mismatch", &p.first_mismatch, where));
  RETURN_IF_ERROR(Read(j, "reason", &p.reason, where));
  if (auto cap = j.find("slots_capped_at"); cap != j.end() && !cap->is_null()) {
    if (!cap->is_number_integer() || cap->get<int64_t>() < 1 || cap->get<int64_t>() > INT32_MAX)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".slots_capped_at: not a positive slot count"));
    p.slots_capped_at = cap->get<int>();
  }
  RETURN_IF_ERROR(Read(j, "steps", &p.steps, where));
  RETURN_IF_ERROR(Read(j, "peak_running", &p.peak_running, where));
  RETURN_IF_ERROR(Read(j, "completed", &p.completed, where));
  RETURN_IF_ERROR(Read(j, "total_input_tokens", &p.total_input_tokens, where));
  RETURN_IF_ERROR(Read(j, "total_output_tokens", &p.total_output_tokens, where));
  RETURN_IF_ERROR(Read(j, "duration_s", &p.duration_s, where));
  RETURN_IF_ERROR(Read(j, "request_throughput", &p.request_throughput, where));
  RETURN_IF_ERROR(Read(j, "output_throughput", &p.output_throughput, where));
  RETURN_IF_ERROR(Read(j, "total_token_throughput", &p.total_token_throughput, where));
  RETURN_IF_ERROR(Read(j, "output_tok_s_per_user", &p.output_tok_s_per_user, where));
  for (auto [name, d] : {std::pair{"ttft_ms", &p.ttft_ms}, std::pair{"tpot_ms", &p.tpot_ms},
                         std::pair{"itl_ms", &p.itl_ms}, std::pair{"e2el_ms", &p.e2el_ms}}) {
    RETURN_IF_ERROR(Read(j, absl::StrCat("mean_", name).c_str(), &d->mean, where));
    RETURN_IF_ERROR(Read(j, absl::StrCat("median_", name).c_str(), &d->median, where));
    RETURN_IF_ERROR(Read(j, absl::StrCat("p90_", name).c_str(), &d->p90, where));
    RETURN_IF_ERROR(Read(j, absl::StrCat("p99_", name).c_str(), &d->p99, where));
  }
  RETURN_IF_ERROR(ReadOpt(j, "request_goodput", &p.request_goodput, where));
  if (auto it = j.find("meets_slo"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean())
      return absl::InvalidArgumentError(absl::StrCat(where, ".meets_slo: not true or false"));
    p.meets_slo = it->get<bool>();
  }
  RETURN_IF_ERROR(ReadOpt(j, "energy_j_per_output_token", &p.energy_j_per_output_token, where));
  RETURN_IF_ERROR(ReadOpt(j, "reference_kl_mean", &p.reference_kl_mean, where));
  RETURN_IF_ERROR(ReadOpt(j, "reference_top1", &p.reference_top1, where));
  RETURN_IF_ERROR(ReadOpt(j, "yardstick_kl_mean", &p.yardstick_kl_mean, where));
  RETURN_IF_ERROR(Read(j, "yardstick", &p.yardstick, where));
  RETURN_IF_ERROR(ReadOpt(j, "ttft_ms_at_slo_percentile", &p.ttft_ms_at_slo_percentile, where));
  RETURN_IF_ERROR(ReadOpt(j, "tpot_ms_at_slo_percentile", &p.tpot_ms_at_slo_percentile, where));
  return p;
}

namespace {

// Parses with the nesting bound, then `from_json`; errors start with `what`.
template <typename T>
absl::StatusOr<T> FromJsonText(std::string_view text, std::string_view what,
                               absl::StatusOr<T> (*from_json)(const json&)) {
  ASSIGN_OR_RETURN(const json j, ParseUntrustedJson(text, what));
  absl::StatusOr<T> value = from_json(j);
  if (!value.ok())
    return absl::Status(
        value.status().code(),
        absl::StrCat(absl::string_view(what.data(), what.size()), ": ", value.status().message()));
  return value;
}

}  // namespace

absl::StatusOr<TrialRequest> TrialRequestFromJsonText(std::string_view text,
                                                      std::string_view what) {
  return FromJsonText<TrialRequest>(text, what, TrialRequestFromJson);
}

absl::StatusOr<TrialResult> TrialResultFromJsonText(std::string_view text, std::string_view what) {
  return FromJsonText<TrialResult>(text, what, TrialResultFromJson);
}

}  // namespace infersweep
