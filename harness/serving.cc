#include "harness/serving.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "api/status_macros.h"
#include "engine/backends.h"
#include "engine/sampler.h"
#include "harness/measure.h"
#include "harness/verdict.h"

namespace infersweep {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A deterministic stream of 64-bit draws (splitmix64 of a counter), the same on every platform.
class Draws {
 public:
  explicit Draws(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return SplitMix64(state_++); }
  // Uniform in [lo, hi].
  int Between(int lo, int hi) {
    return lo + static_cast<int>(Next() % static_cast<uint64_t>(hi - lo + 1));
  }
  // Uniform in [0, 1).
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

Distribution Describe(const std::vector<double>& values) {
  Distribution d;
  if (values.empty()) return d;
  double sum = 0;
  for (double v : values) sum += v;
  d.mean = sum / values.size();
  d.median = Percentile(values, 50);
  d.p90 = Percentile(values, 90);
  d.p99 = Percentile(values, 99);
  return d;
}

using Clock = std::chrono::steady_clock;

// One phase of a load point: the warm-up or the timed requests.
struct Phase {
  bool warmup = false;
  bool open_loop = false;
  int limit = 0;        // requests in flight at most (0: none)
  double rate = 0;      // open loop, requests/s
  int first_index = 0;  // request indices first_index, first_index + 1, ...
  int count = -1;       // requests to issue, or -1: issue for duration_s
  double duration_s = 0;
};

struct Running {
  size_t served = 0;  // index into the served list
  int slot = 0;
  int fed = 0;  // prompt tokens fed so far
};

// Serves one phase on a model that has started serving; appends its requests to `served`.
absl::Status RunPhase(Model& model, const ServeSpec& spec, const Phase& phase,
                      std::vector<ServedRequest>* served, int* steps, int* peak_running) {
  const int vocab = model.config().vocab_size;
  const Clock::time_point t0 = Clock::now();
  auto now_s = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  // The arrival schedule is its own seeded stream: the same gaps at every run of the spec.
  Draws arrivals(SplitMix64(spec.seed ^ 0xa771fa15ull) + static_cast<uint64_t>(phase.rate * 1e6));
  auto gap = [&] { return -std::log1p(-arrivals.Unit()) / phase.rate; };
  int issued = 0;
  auto may_issue = [&](double at_s) {
    return phase.count >= 0 ? issued < phase.count : at_s < phase.duration_s;
  };
  auto issue = [&](double start_s) {
    ServedRequest r;
    r.request = MakeServeRequest(spec, vocab, phase.first_index + issued++);
    r.warmup = phase.warmup;
    r.start_s = start_s;
    served->push_back(std::move(r));
    return served->size() - 1;
  };

  std::deque<size_t> waiting;  // arrived, not yet in a slot
  std::vector<Running> running;
  double next_arrival = phase.open_loop ? gap() : 0;
  std::vector<RaggedChunk> chunks;
  std::vector<size_t> owner;  // chunk -> running index
  std::vector<int> prefill;   // chunk -> prompt tokens it feeds (0: a decode row)
  std::vector<int32_t> next;
  while (true) {
    // Rank 0's clock: tensor-parallel rank processes admit the same arrivals at the same step.
    ASSIGN_OR_RETURN(const double now, model.RankZeroValue(now_s()));
    if (phase.open_loop) {
      while (may_issue(next_arrival) && next_arrival <= now) {
        waiting.push_back(issue(next_arrival));
        next_arrival += gap();
      }
    } else {
      while (static_cast<int>(running.size() + waiting.size()) < phase.limit && may_issue(now))
        waiting.push_back(issue(now));
    }
    while (!waiting.empty() &&
           (phase.limit == 0 || static_cast<int>(running.size()) < phase.limit)) {
      absl::StatusOr<int> slot = model.AdmitSequence();
      if (absl::IsResourceExhausted(slot.status())) break;  // waits for a retirement
      if (!slot.ok()) return slot.status();
      running.push_back({waiting.front(), *slot, 0});
      waiting.pop_front();
    }
    if (running.empty()) {
      if (!waiting.empty())
        return absl::InternalError("serving: requests wait while no sequence runs");
      if (phase.open_loop && may_issue(next_arrival)) {
        std::this_thread::sleep_for(std::chrono::duration<double>(next_arrival - now));
        continue;
      }
      return absl::OkStatus();
    }

    // Every decoding sequence gives one row; prefilling sequences, oldest first, take their next
    // `chunk` tokens (their whole prompts with chunk 0) while the step's prompt tokens stay
    // within prefill_tokens (one sequence at least; with prefill_tokens 0, one sequence when
    // chunking, else all). A prompt's pieces start at multiples of the chunk whatever else runs.
    chunks.clear();
    owner.clear();
    prefill.clear();
    int prefilling = 0, prompt_tokens = 0;
    for (size_t i = 0; i < running.size(); ++i) {
      Running& r = running[i];
      ServedRequest& s = (*served)[r.served];
      const int isl = static_cast<int>(s.request.prompt.size());
      if (r.fed < isl) {
        const int take = spec.chunk > 0 ? std::min(spec.chunk, isl - r.fed) : isl;
        const bool room =
            spec.prefill_tokens > 0 ? prompt_tokens + take <= spec.prefill_tokens : spec.chunk == 0;
        if (prefilling > 0 && !room) continue;
        chunks.push_back({r.slot, std::span<const int32_t>(s.request.prompt).subspan(r.fed, take)});
        prefill.push_back(take);
        ++prefilling;
        prompt_tokens += take;
      } else {
        chunks.push_back({r.slot, std::span<const int32_t>(&s.tokens.back(), 1)});
        prefill.push_back(0);
      }
      owner.push_back(i);
    }
    RETURN_IF_ERROR(model.RaggedStepGreedy(chunks, &next));
    const double done = now_s();
    ++*steps;
    *peak_running = std::max(*peak_running, static_cast<int>(chunks.size()));
    for (size_t c = 0; c < chunks.size(); ++c) {
      Running& r = running[owner[c]];
      ServedRequest& s = (*served)[r.served];
      if (prefill[c] > 0) {
        r.fed += prefill[c];
        if (r.fed < static_cast<int>(s.request.prompt.size())) continue;  // more prompt to go
      }
      s.tokens.push_back(next[c]);
      s.token_times_s.push_back(done);
    }
    for (size_t i = 0; i < running.size();) {
      const ServedRequest& s = (*served)[running[i].served];
      if (static_cast<int>(s.tokens.size()) < s.request.output_len) {
        ++i;
        continue;
      }
      RETURN_IF_ERROR(model.RetireSequence(running[i].slot));
      running.erase(running.begin() + i);
    }
  }
}

}  // namespace

ServeRequest MakeServeRequest(const ServeSpec& spec, int vocab, int index) {
  Draws draws(SplitMix64(spec.seed) ^ SplitMix64(static_cast<uint64_t>(index) + 1));
  ServeRequest r;
  r.index = index;
  r.prompt.resize(draws.Between(spec.isl_min, spec.isl_max));
  r.output_len = draws.Between(spec.osl_min, spec.osl_max);
  for (int32_t& t : r.prompt) t = static_cast<int32_t>(draws.Next() % static_cast<uint64_t>(vocab));
  return r;
}

ServeMetrics ComputeServeMetrics(const std::vector<ServedRequest>& served, double duration_s,
                                 const Slo& slo) {
  ServeMetrics m;
  m.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2el, per_user;
  int good = 0;
  for (const ServedRequest& s : served) {
    if (s.warmup || s.tokens.empty()) continue;
    ++m.completed;
    m.total_input_tokens += static_cast<int64_t>(s.request.prompt.size());
    m.total_output_tokens += static_cast<int64_t>(s.tokens.size());
    const double first_ms = (s.token_times_s.front() - s.start_s) * 1e3;
    const double latency_ms = (s.end_s() - s.start_s) * 1e3;
    ttft.push_back(first_ms);
    e2el.push_back(latency_ms);
    std::optional<double> request_tpot;
    if (s.tokens.size() > 1) {
      request_tpot = (latency_ms - first_ms) / static_cast<double>(s.tokens.size() - 1);
      tpot.push_back(*request_tpot);
      if (*request_tpot > 0) per_user.push_back(1e3 / *request_tpot);
    }
    for (size_t i = 1; i < s.token_times_s.size(); ++i)
      itl.push_back((s.token_times_s[i] - s.token_times_s[i - 1]) * 1e3);
    if ((!slo.ttft_ms || first_ms <= *slo.ttft_ms) &&
        (!slo.tpot_ms || !request_tpot || *request_tpot <= *slo.tpot_ms))
      ++good;
  }
  m.ttft_ms = Describe(ttft);
  m.tpot_ms = Describe(tpot);
  m.itl_ms = Describe(itl);
  m.e2el_ms = Describe(e2el);
  m.ttft_values_ms = std::move(ttft);
  m.tpot_values_ms = std::move(tpot);
  if (!per_user.empty()) m.output_tok_s_per_user = Describe(per_user).mean;
  if (duration_s > 0) {
    m.request_throughput = m.completed / duration_s;
    m.output_throughput = m.total_output_tokens / duration_s;
    m.total_token_throughput = (m.total_input_tokens + m.total_output_tokens) / duration_s;
    if (!slo.empty()) m.request_goodput = good / duration_s;
  }
  return m;
}

bool MeetsSlo(const ServeMetrics& metrics, const Slo& slo) {
  if (metrics.completed == 0) return false;
  if (slo.ttft_ms && Percentile(metrics.ttft_values_ms, slo.percentile) > *slo.ttft_ms)
    return false;
  if (slo.tpot_ms && !metrics.tpot_values_ms.empty() &&
      Percentile(metrics.tpot_values_ms, slo.percentile) > *slo.tpot_ms)
    return false;
  return true;
}

absl::StatusOr<LoadPointResult> RunLoadPoint(Model& model, const ServeSpec& spec,
                                             const LoadPoint& point, const Slo& slo,
                                             GpuEnergyMeter* energy, int slot_cap) {
  LoadPointResult result;
  result.point = point;
  int slots = ServingSlots(spec, point);
  if (slot_cap > 0 && slots > slot_cap) {
    // Fewer slots hold an open loop's arrivals back until a sequence retires; a closed loop's
    // concurrency is the load itself.
    if (!point.open_loop)
      return absl::FailedPreconditionError(
          absl::StrCat(LoadPointName(point), ": ", slots, " sequences in flight, above the ",
                       slot_cap, " KV slots the memory plan allows"));
    slots = slot_cap;
    result.slots_capped_at = slot_cap;
  }
  RETURN_IF_ERROR(model.StartServing(slots, spec.isl_max + spec.osl_max));

  if (spec.warmup > 0) {
    Phase warmup;
    warmup.warmup = true;
    warmup.limit = std::min(slots, spec.warmup);
    warmup.count = spec.warmup;
    RETURN_IF_ERROR(
        RunPhase(model, spec, warmup, &result.served, &result.steps, &result.peak_running));
  }
  Phase timed;
  timed.open_loop = point.open_loop;
  timed.limit = point.concurrency;
  timed.rate = point.rate;
  timed.first_index = spec.warmup;
  timed.count = spec.requests > 0 ? spec.requests : -1;
  timed.duration_s = spec.duration_s;
  const size_t first_timed = result.served.size();
  const std::optional<double> joules_before = energy ? energy->ReadJoules() : std::nullopt;
  RETURN_IF_ERROR(
      RunPhase(model, spec, timed, &result.served, &result.steps, &result.peak_running));
  const std::optional<double> joules_after = energy ? energy->ReadJoules() : std::nullopt;
  double duration_s = 0;
  for (size_t i = first_timed; i < result.served.size(); ++i)
    duration_s = std::max(duration_s, result.served[i].end_s());
  result.metrics = ComputeServeMetrics(result.served, duration_s, slo);
  if (joules_before && joules_after && result.metrics.total_output_tokens > 0)
    result.metrics.energy_j_per_output_token =
        (*joules_after - *joules_before) / result.metrics.total_output_tokens;
  return result;
}

absl::StatusOr<std::vector<int32_t>> RunAlone(Model& model, const ServeRequest& request,
                                              int chunk) {
  const int isl = static_cast<int>(request.prompt.size());
  RETURN_IF_ERROR(model.StartBatch(1, isl + request.output_len));
  std::vector<int32_t> next, tokens;
  const int piece = chunk > 0 ? chunk : isl;
  for (int fed = 0; fed < isl; fed += piece) {
    const int take = std::min(piece, isl - fed);
    RETURN_IF_ERROR(model.ForwardGreedy(std::span<const int32_t>(request.prompt).subspan(fed, take),
                                        take, &next));
  }
  tokens.push_back(next[0]);
  while (static_cast<int>(tokens.size()) < request.output_len) {
    RETURN_IF_ERROR(model.ForwardGreedy(std::span<const int32_t>(&tokens.back(), 1), 1, &next));
    tokens.push_back(next[0]);
  }
  return tokens;
}

absl::Status CheckServedTokens(Model& alone, int chunk, LoadPointResult* result,
                               std::map<int, std::vector<int32_t>>* cache) {
  result->requests_checked = result->requests_matching = 0;
  result->mismatch.clear();
  for (const ServedRequest& s : result->served) {
    auto it = cache->find(s.request.index);
    if (it == cache->end()) {
      ASSIGN_OR_RETURN(std::vector<int32_t> tokens, RunAlone(alone, s.request, chunk));
      it = cache->emplace(s.request.index, std::move(tokens)).first;
    }
    ++result->requests_checked;
    if (s.tokens == it->second) {
      ++result->requests_matching;
      continue;
    }
    if (!result->mismatch.empty()) continue;
    size_t at = 0;
    while (at < s.tokens.size() && at < it->second.size() && s.tokens[at] == it->second[at]) ++at;
    result->mismatch =
        absl::StrCat("request ", s.request.index, " (prompt ", s.request.prompt.size(),
                     " tokens): output token ", at, " is ",
                     at < s.tokens.size() ? absl::StrCat(s.tokens[at]) : "missing", " served, ",
                     at < it->second.size() ? absl::StrCat(it->second[at]) : "missing", " alone");
  }
  result->verdict = result->requests_matching == result->requests_checked ? TrialStatus::kOk
                                                                          : TrialStatus::kIncorrect;
  return absl::OkStatus();
}

namespace {

// One output position's distance from the reference: KL(ref || test) and whether the argmaxes
// agree.
struct PositionScore {
  double kl;
  bool agree;
};
PositionScore ScorePosition(const float* ref, const float* test, int vocab) {
  const size_t n = static_cast<size_t>(vocab);
  return {LogitsKl(ref, test, vocab), Greedy({ref, n}) == Greedy({test, n})};
}

// The reference's logits at every output position of a served request: [osl, vocab], the prompt
// a chunk, then the served tokens but the last.
absl::StatusOr<std::vector<float>> ReferenceOutputLogits(Model& reference,
                                                         const ServedRequest& served) {
  const std::vector<int32_t>& prompt = served.request.prompt;
  const int outputs = static_cast<int>(served.tokens.size());
  RETURN_IF_ERROR(
      reference.StartBatch(1, static_cast<int>(prompt.size()) + std::max(outputs - 1, 0)));
  std::vector<float> out, rest;
  RETURN_IF_ERROR(
      reference.Forward(prompt, static_cast<int>(prompt.size()), LogitsMode::kLast, &out));
  if (outputs > 1) {
    const std::span<const int32_t> fed(served.tokens.data(), outputs - 1);
    RETURN_IF_ERROR(reference.Forward(fed, outputs - 1, LogitsMode::kAll, &rest));
    out.insert(out.end(), rest.begin(), rest.end());
  }
  return out;
}

}  // namespace

absl::Status CheckServedAgainstReference(Model& model, Model& reference, PrecisionClass precision,
                                         int sample, LoadPointResult* result,
                                         ReferenceLogits* cache, ServedYardstick* yardstick) {
  const int vocab = reference.config().vocab_size;
  std::vector<const ServedRequest*> picked;
  int longest = 0;
  int64_t fed = 0;
  for (const ServedRequest& s : result->served) {
    if (s.warmup || s.tokens.empty()) continue;
    const int64_t length = static_cast<int64_t>(s.request.prompt.size() + s.tokens.size());
    if (static_cast<int>(picked.size()) == sample ||
        (!picked.empty() && fed + length > kServedReferenceTokens))
      break;
    picked.push_back(&s);
    fed += length;
    longest = std::max(longest, static_cast<int>(length));
  }
  result->requests_checked = result->requests_matching = 0;
  result->mismatch.clear();
  if (picked.empty()) {
    result->verdict = TrialStatus::kIncorrect;
    result->mismatch = "no timed request produced a token to judge";
    return absl::OkStatus();
  }
  ReferenceLogits own;
  if (!cache) cache = &own;
  // A model's logits at the sampled requests' output positions, kept in `logits` by fed sequence.
  auto outputs_of =
      [&](Model& m,
          ReferenceLogits* logits) -> absl::StatusOr<std::vector<const std::vector<float>*>> {
    std::vector<const std::vector<float>*> all;
    for (const ServedRequest* s : picked) {
      std::vector<int32_t> key = s->request.prompt;
      key.insert(key.end(), s->tokens.begin(), s->tokens.end());
      auto it = logits->find(key);
      if (it == logits->end()) {
        ASSIGN_OR_RETURN(std::vector<float> out, ReferenceOutputLogits(m, *s));
        it = logits->emplace(std::move(key), std::move(out)).first;
      }
      all.push_back(&it->second);
    }
    return all;
  };
  ASSIGN_OR_RETURN(const std::vector<const std::vector<float>*> expected,
                   outputs_of(reference, cache));

  // The replay: request k joins at step k with its prompt; each step then feeds every joined
  // request its next served token until its outputs are all judged.
  const int n = static_cast<int>(picked.size());
  RETURN_IF_ERROR(model.StartServing(n, longest));
  std::vector<int> slot(n, -1), judged(n, 0);
  std::vector<double> kl_sum(n, 0), kl_worst(n, 0);
  int64_t agree = 0, positions = 0;
  std::vector<float> logits;
  for (int step = 0;; ++step) {
    std::vector<RaggedChunk> chunks;
    std::vector<int> whose;
    for (int k = 0; k < n; ++k) {
      const ServedRequest& s = *picked[k];
      if (k == step) {
        ASSIGN_OR_RETURN(slot[k], model.AdmitSequence());
        chunks.push_back({slot[k], s.request.prompt});
      } else if (slot[k] >= 0 && judged[k] < static_cast<int>(s.tokens.size())) {
        chunks.push_back({slot[k], std::span<const int32_t>(&s.tokens[judged[k] - 1], 1)});
      } else {
        continue;
      }
      whose.push_back(k);
    }
    if (chunks.empty()) break;
    RETURN_IF_ERROR(model.RaggedStep(chunks, &logits));
    for (size_t c = 0; c < whose.size(); ++c) {
      const int k = whose[c];
      const float* test = logits.data() + c * vocab;
      const float* ref = expected[k]->data() + static_cast<size_t>(judged[k]) * vocab;
      const PositionScore score = ScorePosition(ref, test, vocab);
      kl_sum[k] += score.kl;
      kl_worst[k] = std::max(kl_worst[k], score.kl);
      agree += score.agree;
      ++positions;
      if (++judged[k] == static_cast<int>(picked[k]->tokens.size())) {
        RETURN_IF_ERROR(model.RetireSequence(slot[k]));
      }
    }
  }
  double total = 0, worst = 0;
  for (int k = 0; k < n; ++k) {
    total += kl_sum[k];
    worst = std::max(worst, kl_worst[k]);
  }
  result->reference_kl_mean = total / positions;
  result->reference_top1 = static_cast<double>(agree) / positions;
  result->yardstick_kl_mean.reset();
  result->yardstick.clear();
  // Sets the verdict under `th`: `ceilings` names them in the mismatch.
  auto judge = [&](const Thresholds& th, std::string_view ceilings) {
    result->requests_checked = result->requests_matching = 0;
    result->mismatch.clear();
    for (int k = 0; k < n; ++k) {
      const int outputs = static_cast<int>(picked[k]->tokens.size());
      const double mean = kl_sum[k] / outputs;
      ++result->requests_checked;
      // A request's few positions are judged as a forward pass is: by the class's pass ceiling.
      if (mean <= th.pass_max_kl_mean && kl_worst[k] <= th.max_kl) {
        ++result->requests_matching;
      } else if (result->mismatch.empty()) {
        result->mismatch = absl::StrFormat(
            "request %d (prompt %d tokens), teacher-forced through ragged steps: KL to the "
            "reference mean %.3g (%s for a request %.3g), worst %.3g (ceiling %.3g) "
            "over its %d outputs",
            picked[k]->request.index, picked[k]->request.prompt.size(), mean, ceilings,
            th.pass_max_kl_mean, kl_worst[k], th.max_kl, outputs);
      }
    }
    const bool ok = *result->reference_kl_mean <= th.max_kl_mean && worst <= th.max_kl &&
                    result->requests_matching == result->requests_checked;
    if (!ok && result->mismatch.empty())
      result->mismatch = absl::StrFormat(
          "the sample's KL to the reference, teacher-forced through ragged steps: mean %.3g "
          "(%s %.3g), worst %.3g (ceiling %.3g)",
          *result->reference_kl_mean, ceilings, th.max_kl_mean, worst, th.max_kl);
    result->verdict = ok ? TrialStatus::kOk : TrialStatus::kIncorrect;
  };
  judge(ThresholdsFor(precision), std::string(PrecisionClassName(precision)) + " class ceiling");
  // Missed, but finite: does the config's input rounding alone miss the ceilings on this model?
  // Its yardstick's drift on the same requests says; where it does, they widen to it, as a run's
  // verdict does (WidenedToYardstick).
  if (result->verdict != TrialStatus::kIncorrect || !yardstick || !yardstick->model ||
      !std::isfinite(total) || precision == PrecisionClass::kFp32)
    return absl::OkStatus();
  ASSIGN_OR_RETURN(Model * rounded, yardstick->model());
  ASSIGN_OR_RETURN(const std::vector<const std::vector<float>*> drifted,
                   outputs_of(*rounded, &yardstick->logits));
  VerdictMetrics drift;
  double drift_total = 0;
  int64_t drift_agree = 0;
  for (int k = 0; k < n; ++k)
    for (size_t at = 0; at < picked[k]->tokens.size(); ++at) {
      const PositionScore score =
          ScorePosition(expected[k]->data() + at * vocab, drifted[k]->data() + at * vocab, vocab);
      if (!std::isfinite(score.kl)) ++drift.non_finite;
      drift_total += score.kl;
      drift.kl_max = std::max(drift.kl_max, score.kl);
      drift_agree += score.agree;
    }
  drift.kl_mean = drift_total / positions;
  drift.top1_agreement = static_cast<double>(drift_agree) / positions;
  if (const std::optional<Thresholds> wide = WidenedToYardstick(precision, drift)) {
    result->yardstick = YardstickName(yardstick->kind);
    judge(*wide, absl::StrCat("ceiling widened to the ", result->yardstick, " yardstick's drift"));
    result->yardstick_kl_mean = drift.kl_mean;
  }
  return absl::OkStatus();
}

absl::StatusOr<SloSearch> SearchSloLoad(Model& model, const ServeSpec& spec, const Slo& slo,
                                        const ServedJudge& judge,
                                        std::span<const LoadPointResult> served, int rate_probes,
                                        int slot_cap) {
  SloSearch search;
  const bool open_loop = spec.concurrency.empty();
  // Serves one load and says whether it meets the SLO.
  size_t best_probe = 0;
  auto probe = [&](LoadPoint point) -> absl::StatusOr<bool> {
    LoadPointResult result;
    auto same = [&](const LoadPointResult& r) {
      return LoadPointName(r.point) == LoadPointName(point);
    };
    if (auto it = std::find_if(served.begin(), served.end(), same); it != served.end()) {
      result = *it;  // a listed load point, served and judged already
    } else {
      ASSIGN_OR_RETURN(result, RunLoadPoint(model, spec, point, slo, nullptr, slot_cap));
      result.requests_checked = result.requests_matching = 0;  // not judged (yet)
    }
    // Each rank measures its own percentiles; rank 0's verdict steers every rank's bisection.
    ASSIGN_OR_RETURN(const double rank_zero_meets,
                     model.RankZeroValue(MeetsSlo(result.metrics, slo) ? 1 : 0));
    const bool meets = rank_zero_meets != 0;
    if (meets &&
        (!search.found || (open_loop ? point.rate > search.best.point.rate
                                     : point.concurrency > search.best.point.concurrency))) {
      search.found = true;
      search.best = result;
      best_probe = search.probes.size();
    }
    search.probes.push_back(std::move(result));
    return meets;
  };
  // The answer is judged once the bisection ends; the probes it passed through only steer it.
  auto judged = [&]() -> absl::StatusOr<SloSearch> {
    if (!search.found) return search;
    if (search.best.requests_checked == 0) RETURN_IF_ERROR(judge(&search.best));
    search.probes[best_probe] = search.best;
    return search;
  };
  if (!open_loop) {
    int lo = *std::min_element(spec.concurrency.begin(), spec.concurrency.end());
    int hi = *std::max_element(spec.concurrency.begin(), spec.concurrency.end());
    if (slot_cap > 0) {  // no load above the slots that fit is probed
      if (lo > slot_cap) return judged();
      hi = std::min(hi, slot_cap);
    }
    ASSIGN_OR_RETURN(const bool top, probe({false, hi, 0}));
    if (top || lo == hi) return judged();
    ASSIGN_OR_RETURN(const bool bottom, probe({false, lo, 0}));
    if (!bottom) return judged();
    while (hi - lo > 1) {  // lo meets the SLO, hi does not
      const int mid = lo + (hi - lo) / 2;
      ASSIGN_OR_RETURN(const bool meets, probe({false, mid, 0}));
      (meets ? lo : hi) = mid;
    }
    return judged();
  }
  double lo = *std::min_element(spec.rate.begin(), spec.rate.end());
  double hi = *std::max_element(spec.rate.begin(), spec.rate.end());
  ASSIGN_OR_RETURN(const bool top, probe({true, spec.max_concurrency, hi}));
  if (top || lo == hi) return judged();
  ASSIGN_OR_RETURN(const bool bottom, probe({true, spec.max_concurrency, lo}));
  if (!bottom) return judged();
  for (int i = 0; i < rate_probes; ++i) {
    const double mid = std::sqrt(lo * hi);
    ASSIGN_OR_RETURN(const bool meets, probe({true, spec.max_concurrency, mid}));
    (meets ? lo : hi) = mid;
  }
  return judged();
}

ServeTrialResult RunServeTrial(HostModel& host, const BackendConfig& config, const ServeSpec& spec,
                               const Slo& slo, const FaultInjection& fault, GpuEnergyMeter* energy,
                               const ServingMemoryDecision* memory) {
  ServeTrialResult trial;
  auto fail = [&](TrialStatus status, std::string reason) {
    trial.status = status;
    trial.reason = std::move(reason);
    return trial;
  };
  auto normalized = NormalizeBackendConfig(config);
  if (!normalized.ok())
    return fail(TrialStatus::kError, std::string(normalized.status().message()));
  const PreflightResult preflight =
      Preflight(*normalized, MakePreflightTarget(ProbeLocalDevices(), &host));
  if (!preflight.supported) return fail(TrialStatus::kUnsupported, preflight.reason);
  auto model = CreateModel(host, *normalized, fault);
  if (!model.ok())
    return fail(
        absl::IsUnimplemented(model.status()) ? TrialStatus::kUnsupported : TrialStatus::kError,
        std::string(model.status().message()));
  // The judge: fp32 configs against their own lone runs, token for token (only fp32 arithmetic
  // promises equal tokens whatever the batch); other classes against the reference's picks on a
  // sample of served requests. Either model shares the weights on the device.
  const bool exact = preflight.precision == PrecisionClass::kFp32;
  auto judge_model = CreateModel(host, exact ? *normalized : ReferenceConfigFor(*normalized));
  if (!judge_model.ok())
    return fail(TrialStatus::kError, std::string(judge_model.status().message()));
  std::map<int, std::vector<int32_t>> lone_runs;
  ReferenceLogits reference_logits;
  // The config's yardstick of a GPU reference (YardstickFor), made only when a load point misses
  // the class's ceilings (it holds a third model on the device).
  std::unique_ptr<Model> yardstick_model;
  ServedYardstick yardstick;
  yardstick.kind = YardstickFor(*normalized);
  if (ConfigDevice(ReferenceConfigFor(*normalized)) == Device::kCuda)
    yardstick.model = [&]() -> absl::StatusOr<Model*> {
      if (!yardstick_model) {
        ASSIGN_OR_RETURN(yardstick_model,
                         CreateYardstick(host, ReferenceConfigFor(*normalized), yardstick.kind));
      }
      return yardstick_model.get();
    };
  const ServedJudge judge = [&](LoadPointResult* result) {
    return exact ? CheckServedTokens(**judge_model, spec.chunk, result, &lone_runs)
                 : CheckServedAgainstReference(**model, **judge_model, preflight.precision,
                                               kServedReferenceSample, result, &reference_logits,
                                               &yardstick);
  };
  const int slot_cap = memory ? memory->slot_cap : 0;
  for (const LoadPoint& point : LoadPoints(spec)) {
    if (memory)
      if (auto it = memory->does_not_fit.find(LoadPointName(point));
          it != memory->does_not_fit.end()) {
        LoadPointResult refused;
        refused.point = point;
        refused.verdict = TrialStatus::kUnsupported;
        refused.unsupported_reason = it->second;
        trial.points.push_back(std::move(refused));
        continue;
      }
    auto result = RunLoadPoint(**model, spec, point, slo, energy, slot_cap);
    if (!result.ok())
      return fail(
          absl::IsUnimplemented(result.status()) ? TrialStatus::kUnsupported : TrialStatus::kError,
          absl::StrCat(LoadPointName(point), ": ", result.status().message()));
    if (auto s = judge(&*result); !s.ok())
      return fail(TrialStatus::kError, absl::StrCat("judging served tokens: ", s.message()));
    trial.points.push_back(std::move(*result));
  }
  if (!slo.empty()) {
    auto search = SearchSloLoad(**model, spec, slo, judge, trial.points, 5, slot_cap);
    if (!search.ok())
      return fail(TrialStatus::kError, absl::StrCat("slo search: ", search.status().message()));
    trial.slo_search = std::move(*search);
  }
  trial.device_memory_used_bytes = (*model)->device_memory_used_bytes();
  return trial;
}

namespace {

nlohmann::json LoadPointJson(const LoadPointResult& r) { return ToJson(ToServingPoint(r, Slo{})); }

}  // namespace

ServingPoint ToServingPoint(const LoadPointResult& r, const Slo& slo) {
  const ServeMetrics& m = r.metrics;
  ServingPoint p;
  p.point = r.point;
  p.verdict = r.verdict;
  p.requests_checked = r.requests_checked;
  p.requests_matching = r.requests_matching;
  p.first_mismatch = r.mismatch;
  p.reason = r.unsupported_reason;
  p.slots_capped_at = r.slots_capped_at;
  p.steps = r.steps;
  p.peak_running = r.peak_running;
  p.completed = m.completed;
  p.total_input_tokens = m.total_input_tokens;
  p.total_output_tokens = m.total_output_tokens;
  p.duration_s = m.duration_s;
  p.request_throughput = m.request_throughput;
  p.output_throughput = m.output_throughput;
  p.total_token_throughput = m.total_token_throughput;
  p.output_tok_s_per_user = m.output_tok_s_per_user;
  auto copy = [](const Distribution& d) {
    return ServingDistribution{d.mean, d.median, d.p90, d.p99};
  };
  p.ttft_ms = copy(m.ttft_ms);
  p.tpot_ms = copy(m.tpot_ms);
  p.itl_ms = copy(m.itl_ms);
  p.e2el_ms = copy(m.e2el_ms);
  p.request_goodput = m.request_goodput;
  if (!slo.empty()) {
    p.meets_slo = MeetsSlo(m, slo);
    p.ttft_ms_at_slo_percentile = Percentile(m.ttft_values_ms, slo.percentile);
    p.tpot_ms_at_slo_percentile = Percentile(m.tpot_values_ms, slo.percentile);
  }
  p.energy_j_per_output_token = m.energy_j_per_output_token;
  p.reference_kl_mean = r.reference_kl_mean;
  p.reference_top1 = r.reference_top1;
  p.yardstick_kl_mean = r.yardstick_kl_mean;
  p.yardstick = r.yardstick;
  return p;
}

nlohmann::json ToJson(const ServeTrialResult& trial) {
  nlohmann::json j = {{"status", std::string(TrialStatusName(trial.status))},
                      {"reason", trial.reason},
                      {"load_points", nlohmann::json::array()}};
  for (const LoadPointResult& p : trial.points) j["load_points"].push_back(LoadPointJson(p));
  if (trial.slo_search) {
    nlohmann::json search = {{"found", trial.slo_search->found},
                             {"probes", nlohmann::json::array()}};
    for (const LoadPointResult& p : trial.slo_search->probes)
      search["probes"].push_back(LoadPointJson(p));
    if (trial.slo_search->found) search["best"] = LoadPointJson(trial.slo_search->best);
    j["slo_search"] = std::move(search);
  }
  return j;
}

std::string FormatLoadPointLine(const LoadPointResult& r, const Slo& slo) {
  return FormatServingPointLine(ToServingPoint(r, slo), slo);
}

std::string FormatServingPointLine(const ServingPoint& p, const Slo& slo) {
  if (p.verdict == TrialStatus::kUnsupported)  // the memory plan refused it: nothing served
    return absl::StrFormat("%-28s %-9s %s\n", LoadPointName(p.point), "UNSUPPORTED", p.reason);
  std::string line = absl::StrFormat(
      "%-28s %-9s completed=%d matching=%d/%d steps=%d peak_running=%d duration_s=%.3f",
      LoadPointName(p.point),
      p.requests_checked == 0 && p.verdict == TrialStatus::kOk ? std::string_view("unjudged")
                                                               : TrialStatusName(p.verdict),
      p.completed, p.requests_matching, p.requests_checked, p.steps, p.peak_running, p.duration_s);
  auto add = [&](const char* name, const ServingDistribution& d) {
    absl::StrAppendFormat(&line, " mean_%s=%.3f median_%s=%.3f p90_%s=%.3f p99_%s=%.3f", name,
                          d.mean, name, d.median, name, d.p90, name, d.p99);
  };
  add("ttft_ms", p.ttft_ms);
  add("tpot_ms", p.tpot_ms);
  add("itl_ms", p.itl_ms);
  add("e2el_ms", p.e2el_ms);
  absl::StrAppendFormat(&line,
                        " request_throughput=%.3f output_throughput=%.1f "
                        "total_token_throughput=%.1f output_tok_s_per_user=%.1f",
                        p.request_throughput, p.output_throughput, p.total_token_throughput,
                        p.output_tok_s_per_user);
  if (p.request_goodput) {
    absl::StrAppendFormat(&line, " request_goodput=%.3f meets_slo_p%g=%s", *p.request_goodput,
                          slo.percentile, p.meets_slo.value_or(false) ? "yes" : "no");
  }
  if (p.energy_j_per_output_token)
    absl::StrAppendFormat(&line, " energy_j_per_output_token=%.4f", *p.energy_j_per_output_token);
  if (p.slots_capped_at) absl::StrAppendFormat(&line, " slots_capped_at=%d", *p.slots_capped_at);
  if (p.reference_kl_mean)
    absl::StrAppend(
        &line,
        absl::StrFormat("\n#   judged against the reference on %d sampled requests "
                        "through ragged steps: kl_mean %.3g, top1 %.3f",
                        p.requests_checked, *p.reference_kl_mean, p.reference_top1.value_or(0)));
  if (p.yardstick_kl_mean)
    absl::StrAppendFormat(&line,
                          "\n#   judged by ceilings widened to this model's %s drift: the %s "
                          "yardstick's kl_mean %.3g on the same requests",
                          p.yardstick, p.yardstick, *p.yardstick_kl_mean);
  if (!p.first_mismatch.empty()) absl::StrAppend(&line, "\n#   first mismatch: ", p.first_mismatch);
  return line + "\n";
}

std::string FormatSloSearchLine(const SloSearch& search, const Slo& slo) {
  ServingSloSearch s;
  s.found = search.found;
  if (search.found) s.best = ToServingPoint(search.best, slo);
  for (const LoadPointResult& probe : search.probes) s.probes.push_back(ToServingPoint(probe, slo));
  return FormatServingSloLine(s, slo);
}

std::string FormatServingSloLine(const ServingSloSearch& search, const Slo& slo) {
  std::string bounds;
  if (slo.ttft_ms) absl::StrAppend(&bounds, " ttft_ms<=", *slo.ttft_ms);
  if (slo.tpot_ms) absl::StrAppend(&bounds, " tpot_ms<=", *slo.tpot_ms);
  std::string line =
      absl::StrCat("# slo search (p", slo.percentile, bounds, ", ", search.probes.size(),
                   search.probes.size() == 1 ? " probe): " : " probes): ");
  if (!search.best) return line + "no probed load meets the SLO\n";
  const ServingPoint& best = *search.best;
  absl::StrAppendFormat(&line,
                        "highest load meeting it: %s, request_goodput=%.3f, "
                        "output_throughput=%.1f, p%g_ttft_ms=%.3f, p%g_tpot_ms=%.3f, verdict %s\n",
                        LoadPointName(best.point), best.request_goodput.value_or(0),
                        best.output_throughput, slo.percentile,
                        best.ttft_ms_at_slo_percentile.value_or(0), slo.percentile,
                        best.tpot_ms_at_slo_percentile.value_or(0), TrialStatusName(best.verdict));
  return line;
}

}  // namespace infersweep
