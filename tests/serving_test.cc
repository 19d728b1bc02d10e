// Serving load on the CPU reference: ragged steps and the KV slot allocator, the load generator
// (closed loop, Poisson arrivals, chunked prefill), its figures, and the verdict that holds
// every served request's greedy tokens to the same request run alone.
#include "harness/serving.h"

#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "api/status_macros.h"
#include "engine/backends.h"
#include "engine/cpu_model.h"
#include "engine/sampler.h"
#include "engine/weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "harness/executor.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<HostModel> LoadPreset(const std::string& name) {
  auto host = LoadHostModel("preset:" + name);
  EXPECT_TRUE(host.ok()) << host.status();
  return host.ok() ? std::move(*host) : nullptr;
}

// The CPU reference's config, normalized (every axis at its default).
const BackendConfig kCpu = *NormalizeBackendConfig({{"device", "cpu"}});

ServeSpec Spec(const std::string& text) {
  auto spec = ParseServeSpec(text);
  EXPECT_TRUE(spec.ok()) << text << ": " << spec.status();
  return spec.ok() ? *spec : ServeSpec{};
}

// Every load point ran to an OK verdict with every request (warm-up included) checked.
void ExpectAllMatch(const ServeTrialResult& trial, const ServeSpec& spec) {
  ASSERT_EQ(trial.status, TrialStatus::kOk) << trial.reason;
  ASSERT_EQ(trial.points.size(), LoadPoints(spec).size());
  for (const LoadPointResult& p : trial.points) {
    SCOPED_TRACE(LoadPointName(p.point));
    EXPECT_EQ(p.verdict, TrialStatus::kOk) << p.mismatch;
    EXPECT_EQ(p.requests_checked, spec.requests + spec.warmup);
    EXPECT_EQ(p.requests_matching, p.requests_checked);
    EXPECT_EQ(p.metrics.completed, spec.requests);
  }
}

// ---------------------------------------------------------------------------------------------
// The engine: ragged steps against lockstep runs, slot bookkeeping, refusal

// Two sequences at different positions share steps (one prefilling in chunks while the other
// decodes); each one's logits equal its lone lockstep run's bit for bit.
TEST(RaggedStep, MixedPositionsMatchLockstepRunsExactly) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  auto served = CreateModel(*host, kCpu);
  auto alone = CreateModel(*host, kCpu);
  ASSERT_TRUE(served.ok() && alone.ok());
  const int vocab = host->config.vocab_size;
  const std::vector<int32_t> a = {5, 17, 300, 42, 7, 9, 11, 100, 3, 64};
  const std::vector<int32_t> b = {400, 2, 77, 91, 13, 250};

  // Lone runs: each prompt in one prefill; the last-token logits.
  auto lone_logits = [&](const std::vector<int32_t>& prompt) {
    std::vector<float> logits;
    EXPECT_TRUE((*alone)->StartBatch(1, 32).ok());
    EXPECT_TRUE((*alone)
                    ->Forward(prompt, static_cast<int>(prompt.size()), LogitsMode::kLast, &logits)
                    .ok());
    return logits;
  };
  const std::vector<float> want_a = lone_logits(a), want_b = lone_logits(b);

  ASSERT_TRUE((*served)->StartServing(3, 32).ok());
  auto slot_a = (*served)->AdmitSequence();
  ASSERT_TRUE(slot_a.ok());
  std::vector<float> logits;
  // a's first 7 tokens alone, then b's prompt in pieces of 4 and 2 beside a's last 3 tokens.
  const std::span<const int32_t> sa(a), sb(b);
  std::vector<RaggedChunk> step = {{*slot_a, sa.subspan(0, 7)}};
  ASSERT_TRUE((*served)->RaggedStep(step, &logits).ok());
  auto slot_b = (*served)->AdmitSequence();
  ASSERT_TRUE(slot_b.ok());
  EXPECT_NE(*slot_a, *slot_b);
  step = {{*slot_b, sb.subspan(0, 4)}, {*slot_a, sa.subspan(7, 1)}};
  ASSERT_TRUE((*served)->RaggedStep(step, &logits).ok());
  step = {{*slot_a, sa.subspan(8, 2)}, {*slot_b, sb.subspan(4, 2)}};
  ASSERT_TRUE((*served)->RaggedStep(step, &logits).ok());
  ASSERT_EQ(logits.size(), 2u * vocab);
  EXPECT_EQ(std::vector<float>(logits.begin(), logits.begin() + vocab), want_a);
  EXPECT_EQ(std::vector<float>(logits.begin() + vocab, logits.end()), want_b);
}

TEST(RaggedStep, SlotsAreAdmittedRetiredAndChecked) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  auto model = CreateModel(*host, kCpu);
  ASSERT_TRUE(model.ok());
  std::vector<float> logits;
  const std::vector<int32_t> tokens = {1, 2, 3};
  EXPECT_EQ((*model)->RaggedStep({}, &logits).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*model)->StartServing(2, 4).ok());
  EXPECT_EQ(*(*model)->AdmitSequence(), 0);
  EXPECT_EQ(*(*model)->AdmitSequence(), 1);
  EXPECT_EQ((*model)->AdmitSequence().status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE((*model)->RetireSequence(0).ok());
  EXPECT_THAT((*model)->RetireSequence(0).message(), HasSubstr("KV slot 0 holds no sequence"));
  std::vector<RaggedChunk> free_slot = {{0, tokens}};
  EXPECT_THAT((*model)->RaggedStep(free_slot, &logits).message(), HasSubstr("KV slot 0"));
  std::vector<RaggedChunk> twice = {{1, std::span(tokens).subspan(0, 1)},
                                    {1, std::span(tokens).subspan(1, 1)}};
  EXPECT_THAT((*model)->RaggedStep(twice, &logits).message(), HasSubstr("appears twice"));
  std::vector<RaggedChunk> fill = {{1, tokens}};
  ASSERT_TRUE((*model)->RaggedStep(fill, &logits).ok());
  std::vector<RaggedChunk> over = {{1, tokens}};
  EXPECT_THAT((*model)->RaggedStep(over, &logits).message(), HasSubstr("exceed its max_tokens 4"));
  // A retired slot's next sequence starts empty: admitted again, it takes the whole room.
  ASSERT_TRUE((*model)->RetireSequence(1).ok());
  EXPECT_EQ(*(*model)->AdmitSequence(), 0);
  EXPECT_EQ(*(*model)->AdmitSequence(), 1);
  EXPECT_TRUE((*model)->RaggedStep(fill, &logits).ok());
  // A lockstep batch after serving, and Forward refused while serving.
  ASSERT_TRUE((*model)->StartServing(1, 4).ok());
  EXPECT_EQ((*model)->Forward(tokens, 3, LogitsMode::kLast, &logits).code(),
            absl::StatusCode::kFailedPrecondition);
}

// An engine that runs lockstep batches only (the CUDA engine's case) is refused with a reason,
// by the model and by the load generator.
class LockstepOnlyModel : public Model {
 public:
  explicit LockstepOnlyModel(Model& inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_.config(); }
  std::string device() const override { return "cuda:0"; }
  absl::Status StartBatch(int batch, int max_tokens) override {
    return inner_.StartBatch(batch, max_tokens);
  }
  absl::Status Forward(std::span<const int32_t> tokens, int n, LogitsMode mode,
                       std::vector<float>* logits) override {
    return inner_.Forward(tokens, n, mode, logits);
  }
  int position() const override { return inner_.position(); }

 private:
  Model& inner_;
};

TEST(RaggedStep, LockstepOnlyEngineIsRefusedWithItsReason) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  auto inner = CreateModel(*host, kCpu);
  ASSERT_TRUE(inner.ok());
  LockstepOnlyModel model(**inner);
  const absl::Status s = model.StartServing(4, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("device=cuda:0: this engine runs lockstep batches only"));
  auto point = RunLoadPoint(model, Spec("concurrency=2,isl=8,osl=4,requests=2"), {false, 2, 0}, {});
  EXPECT_EQ(point.status().code(), absl::StatusCode::kUnimplemented);
}

// ---------------------------------------------------------------------------------------------
// Served tokens against lone runs (the CPU acceptance of continuous batching)

TEST(Serving, TinyMoeAtConcurrency1And4MatchesLoneRuns) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  // Ragged lengths, so sequences sit at different positions and retire at different steps.
  const ServeSpec spec = Spec("concurrency=1:4,isl=8-40,osl=3-12,requests=10,warmup=2");
  const ServeTrialResult trial = RunServeTrial(*host, kCpu, spec, {});
  ExpectAllMatch(trial, spec);
  ASSERT_EQ(trial.points.size(), 2u);
  EXPECT_EQ(trial.points[0].peak_running, 1);
  EXPECT_EQ(trial.points[1].peak_running, 4);  // continuous batching did batch
}

TEST(Serving, ChunkedPrefillBesideDecodeRowsMatchesLoneRuns) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  const ServeSpec spec = Spec("concurrency=4,isl=10-30,osl=4-8,requests=8,chunk=6");
  const ServeTrialResult trial = RunServeTrial(*host, kCpu, spec, {});
  ExpectAllMatch(trial, spec);
}

// A prefill token budget feeds several prompts' chunks in one step (vLLM's
// max_num_batched_tokens): tokens still equal the lone runs', and the prompts are in sooner.
TEST(Serving, PrefillTokenBudgetFeedsSeveralChunksAStep) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  auto model = CreateModel(*host, kCpu);
  ASSERT_TRUE(model.ok()) << model.status();
  const ServeSpec one = Spec("concurrency=4,isl=24,osl=4,requests=4,chunk=6");
  const ServeSpec budget = Spec("concurrency=4,isl=24,osl=4,requests=4,chunk=6,prefill_tokens=24");
  auto one_a_step = RunLoadPoint(**model, one, {false, 4, 0}, {});
  auto four_a_step = RunLoadPoint(**model, budget, {false, 4, 0}, {});
  ASSERT_TRUE(one_a_step.ok() && four_a_step.ok());
  // One chunk a step: 16 prefill steps for four 24-token prompts, then the last one's 3 decodes.
  EXPECT_EQ(one_a_step->steps, 16 + 3);
  // Four chunks a step: 4 steps feed every prompt, then 3 decode steps.
  EXPECT_EQ(four_a_step->steps, 4 + 3);
  const ServeTrialResult trial = RunServeTrial(*host, kCpu, budget, {});
  ExpectAllMatch(trial, budget);
  EXPECT_THAT(ServeWorkloadKey(budget, {}), HasSubstr(",chunk=6,prefill_tokens=24,seed="));
  EXPECT_THAT(ServeWorkloadKey(one, {}), Not(HasSubstr("prefill_tokens")));
  EXPECT_EQ(Spec(ServeSpecString(budget)).prefill_tokens, 24);
}

TEST(Serving, TinyMoeAtPoissonRateMatchesLoneRuns) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  const ServeSpec spec = Spec("rate=100:400,isl=8-32,osl=4-10,requests=10,seed=3");
  const ServeTrialResult trial = RunServeTrial(*host, kCpu, spec, {});
  ExpectAllMatch(trial, spec);
  const ServeSpec capped = Spec("rate=400,max_concurrency=2,isl=8-32,osl=4-10,requests=6,chunk=8");
  const ServeTrialResult capped_trial = RunServeTrial(*host, kCpu, capped, {});
  ExpectAllMatch(capped_trial, capped);
  ASSERT_EQ(capped_trial.points.size(), 1u);
  EXPECT_LE(capped_trial.points[0].peak_running, 2);
}

// The memory plan's decision on a served trial: a refused closed-loop point is UNSUPPORTED with
// its words and never served; an open-loop point runs on the capped slots (fewer in flight) and
// says so; the other points run and match their lone runs.
TEST(Serving, TheMemoryPlanRefusesAndCapsLoadPoints) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  ServingMemoryDecision memory;
  memory.slot_cap = 2;
  memory.does_not_fit["concurrency=4"] = "4 KV slots: needs 9.00 GiB on the device (...)";
  const ServeSpec closed = Spec("concurrency=2:4,isl=8-24,osl=3-8,requests=6");
  const ServeTrialResult trial = RunServeTrial(*host, kCpu, closed, {}, {}, nullptr, &memory);
  ASSERT_EQ(trial.status, TrialStatus::kOk) << trial.reason;
  ASSERT_EQ(trial.points.size(), 2u);
  EXPECT_EQ(trial.points[0].verdict, TrialStatus::kOk);
  EXPECT_EQ(trial.points[0].requests_matching, 6);
  EXPECT_EQ(trial.points[1].verdict, TrialStatus::kUnsupported);
  EXPECT_EQ(trial.points[1].unsupported_reason, memory.does_not_fit.at("concurrency=4"));
  EXPECT_EQ(trial.points[1].steps, 0);  // nothing served
  const ServingPoint refused = ToServingPoint(trial.points[1], {});
  EXPECT_EQ(refused.reason, memory.does_not_fit.at("concurrency=4"));
  EXPECT_THAT(FormatServingPointLine(refused, {}), HasSubstr("UNSUPPORTED 4 KV slots: needs"));

  const ServeSpec open = Spec("rate=400,max_concurrency=6,isl=8-24,osl=3-8,requests=6");
  const ServeTrialResult capped = RunServeTrial(*host, kCpu, open, {}, {}, nullptr, &memory);
  ExpectAllMatch(capped, open);
  EXPECT_LE(capped.points[0].peak_running, 2);
  EXPECT_EQ(capped.points[0].slots_capped_at, 2);
  EXPECT_EQ(ToServingPoint(capped.points[0], {}).slots_capped_at, 2);
  EXPECT_THAT(FormatServingPointLine(ToServingPoint(capped.points[0], {}), {}),
              HasSubstr(" slots_capped_at=2"));

  // A closed loop above a cap is refused by RunLoadPoint itself, never run on fewer slots.
  auto model = CreateModel(*host, kCpu);
  ASSERT_TRUE(model.ok()) << model.status();
  auto above = RunLoadPoint(**model, closed, {false, 4, 0}, {}, nullptr, 2);
  EXPECT_EQ(above.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(above.status().message(), HasSubstr("above the 2 KV slots the memory plan allows"));
}

// Tensor parallelism serves (CPU ranks as threads): every rank admits to the same slot and runs
// the same ragged step on its shard. A hybrid in NVFP4 at tp=2, a MoE at tp=2 with whole experts
// a rank, and Qwen2-MoE in FP8 at tp=4 each serve tokens identical to their lone runs (fp32
// arithmetic on every rank, the partial sums added in rank order).
TEST(Serving, TensorParallelRanksServeWhatTheirLoneRunsGive) {
  struct Case {
    std::string model;
    BackendConfig config;
  };
  const std::vector<Case> cases = {
      {"preset:tiny-hybrid@nvfp4", {{"device", "cpu"}, {"tp", "2"}}},
      {"preset:tiny-moe", {{"device", "cpu"}, {"tp", "2"}, {"ep", "on"}}},
      {"preset:tiny-qwen2-moe@fp8_channel", {{"device", "cpu"}, {"tp", "4"}}},
  };
  const ServeSpec spec = Spec("concurrency=1:3,isl=6-20,osl=3-8,requests=6,chunk=5");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.model);
    auto host = LoadHostModel(c.model);
    ASSERT_TRUE(host.ok()) << host.status();
    const ServeTrialResult trial = RunServeTrial(**host, c.config, spec, {});
    ExpectAllMatch(trial, spec);
    EXPECT_EQ(trial.points.back().peak_running, 3);  // the ranks did batch
  }
}

// Linear-attention layers keep their conv and recurrent state per slot, beside full-attention
// layers of head size 32 and of qwen3-next's 256 (partial RoPE over 64 dims).
TEST(Serving, HybridModelKeepsStatePerSlot) {
  for (const std::string name : {"tiny-hybrid", "tiny-hybrid-hd256"}) {
    auto host = LoadPreset(name);
    ASSERT_NE(host, nullptr);
    for (const std::string text : {"concurrency=3,isl=6-20,osl=3-8,requests=6",
                                   "concurrency=3,isl=6-20,osl=3-8,requests=6,chunk=4"}) {
      SCOPED_TRACE(name + " " + text);
      const ServeSpec spec = Spec(text);
      ExpectAllMatch(RunServeTrial(*host, kCpu, spec, {}), spec);
    }
  }
}

// Served at concurrency 1 and 4 under a slot-swap fault on the CPU: one sequence at a time has
// nothing to swap (OK); four are INCORRECT, the served requests parting from their lone runs.
void ExpectSwapIncorrectAtConcurrencyFour(const std::string& preset, const FaultInjection& fault,
                                          const std::string& chunk) {
  auto host = LoadPreset(preset);
  ASSERT_NE(host, nullptr);
  const ServeSpec spec = Spec("concurrency=1:4,isl=12-24,osl=8,requests=6" + chunk);
  const ServeTrialResult trial = RunServeTrial(*host, kCpu, spec, {}, fault);
  ASSERT_EQ(trial.status, TrialStatus::kOk) << trial.reason;
  ASSERT_EQ(trial.points.size(), 2u);
  EXPECT_EQ(trial.points[0].verdict, TrialStatus::kOk) << trial.points[0].mismatch;
  EXPECT_EQ(trial.points[1].verdict, TrialStatus::kIncorrect);
  EXPECT_LT(trial.points[1].requests_matching, trial.points[1].requests_checked);
  EXPECT_THAT(trial.points[1].mismatch, HasSubstr("served"));
}

// A scheduling bug (a sequence reading another's KV slot) is INCORRECT; with one sequence at a
// time there is nothing to swap.
TEST(Serving, KvSlotSwapIsIncorrect) {
  auto fault = ParseFaultInjection("kv-slot-swap:0");
  ASSERT_TRUE(fault.ok());
  EXPECT_EQ(FaultInjectionString(*fault), "kv-slot-swap:0");
  for (const std::string name : {"tiny-moe", "tiny-hybrid"}) {
    SCOPED_TRACE(name);
    ExpectSwapIncorrectAtConcurrencyFour(name, *fault, "");
  }
}

// A sequence handed another's recurrent state (a Gated DeltaNet layer's, its KV cache kept) is
// INCORRECT; a model without linear-attention layers has no state to swap and is refused.
TEST(Serving, StateSlotSwapIsIncorrect) {
  auto fault = ParseFaultInjection("state-slot-swap:0");
  ASSERT_TRUE(fault.ok()) << fault.status();
  EXPECT_EQ(FaultInjectionString(*fault), "state-slot-swap:0");
  ExpectSwapIncorrectAtConcurrencyFour("tiny-hybrid", *fault, ",chunk=5");

  auto dense = LoadPreset("tiny-moe");
  ASSERT_NE(dense, nullptr);
  auto refused = CreateModel(*dense, kCpu, *fault);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("state-slot-swap needs a model with linear-attention layers"));
}

// The judge of non-fp32 configs (their tokens may leave the lone run's at a near-tie): a sample of
// served requests replayed teacher-forced through ragged steps, its logits against the
// reference's. Correct serving is within every class's KL ceilings (here the model is the
// reference's twin: KL 0, every argmax agrees); a swapped KV slot feeds requests another
// sequence's past, and their distributions move past the bf16 ceiling.
TEST(Serving, NonFp32ClassesAreJudgedByKlToTheReferenceOnServedRequests) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  auto reference = CreateModel(*host, kCpu);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const ServeSpec spec = Spec("concurrency=4,isl=12-24,osl=12,requests=6,warmup=1");
  auto served = CreateModel(*host, kCpu);
  ASSERT_TRUE(served.ok()) << served.status();
  auto clean = RunLoadPoint(**served, spec, {false, 4, 0}, {});
  ASSERT_TRUE(clean.ok()) << clean.status();
  ReferenceLogits cache;
  for (PrecisionClass precision :
       {PrecisionClass::kBf16, PrecisionClass::kFp8, PrecisionClass::kFp4}) {
    ASSERT_TRUE(
        CheckServedAgainstReference(**served, **reference, precision, 4, &*clean, &cache).ok());
    EXPECT_EQ(clean->verdict, TrialStatus::kOk) << clean->mismatch;
    EXPECT_EQ(clean->requests_checked, 4);  // the sample, warm-up left out
    EXPECT_EQ(clean->requests_matching, 4);
    ASSERT_TRUE(clean->reference_kl_mean.has_value());
    EXPECT_LT(*clean->reference_kl_mean, 1e-9);
    EXPECT_EQ(*clean->reference_top1, 1.0);
  }
  EXPECT_EQ(cache.size(), 4u);  // the reference ran each sampled request once

  // The sample stops at the token budget, one request at least: three 1,100-token requests
  // would feed the reference 3,300 tokens.
  auto long_requests =
      RunLoadPoint(**served, Spec("concurrency=2,isl=1096,osl=4,requests=3"), {false, 2, 0}, {});
  ASSERT_TRUE(long_requests.ok()) << long_requests.status();
  ASSERT_TRUE(
      CheckServedAgainstReference(**served, **reference, PrecisionClass::kBf16, 4, &*long_requests)
          .ok());
  EXPECT_EQ(long_requests->requests_checked, 1);
  EXPECT_EQ(long_requests->verdict, TrialStatus::kOk) << long_requests->mismatch;
  auto swapped = CreateModel(*host, kCpu, *ParseFaultInjection("kv-slot-swap:0"));
  ASSERT_TRUE(swapped.ok()) << swapped.status();
  auto bad = RunLoadPoint(**swapped, spec, {false, 4, 0}, {});
  ASSERT_TRUE(bad.ok()) << bad.status();
  ASSERT_TRUE(
      CheckServedAgainstReference(**swapped, **reference, PrecisionClass::kBf16, 4, &*bad).ok());
  EXPECT_EQ(bad->verdict, TrialStatus::kIncorrect);
  EXPECT_LT(bad->requests_matching, bad->requests_checked);
  EXPECT_GT(*bad->reference_kl_mean, 0.01);
  EXPECT_THAT(bad->mismatch, HasSubstr("KL to the reference"));
}

// A model whose own bf16 rounding misses the class's ceilings (a run's verdict widens them to the
// bf16 yardstick's drift) is judged the same way when served: the yardstick runs the sampled
// requests, and a config within twice its drift is OK. Without a yardstick, or against one that
// meets the class's ceilings (nothing to widen), the same served requests stay INCORRECT.
TEST(Serving, ServedRequestsAreJudgedByCeilingsWidenedToTheBf16Yardstick) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  auto reference = CreateModel(*host, kCpu);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const FaultInjection drift = *ParseFaultInjection("bad-scale:1.6");
  auto served = CreateModel(*host, kCpu, drift);
  ASSERT_TRUE(served.ok()) << served.status();
  const ServeSpec spec = Spec("concurrency=4,isl=12-24,osl=12,requests=6,warmup=1");
  auto point = RunLoadPoint(**served, spec, {false, 4, 0}, {});
  ASSERT_TRUE(point.ok()) << point.status();
  ReferenceLogits cache;

  ASSERT_TRUE(
      CheckServedAgainstReference(**served, **reference, PrecisionClass::kBf16, 4, &*point, &cache)
          .ok());
  EXPECT_EQ(point->verdict, TrialStatus::kIncorrect);
  EXPECT_FALSE(point->yardstick_kl_mean.has_value());
  const double kl_mean = *point->reference_kl_mean;

  // A yardstick as far from the reference as the served config: the ceilings widen to twice it.
  std::unique_ptr<Model> drifted_model;
  int made = 0;
  ServedYardstick drifted;
  drifted.model = [&]() -> absl::StatusOr<Model*> {
    ++made;
    ASSIGN_OR_RETURN(drifted_model, CreateModel(*host, kCpu, drift));
    return drifted_model.get();
  };
  ASSERT_TRUE(CheckServedAgainstReference(**served, **reference, PrecisionClass::kBf16, 4, &*point,
                                          &cache, &drifted)
                  .ok());
  EXPECT_EQ(point->verdict, TrialStatus::kOk) << point->mismatch;
  EXPECT_EQ(point->requests_matching, point->requests_checked);
  ASSERT_TRUE(point->yardstick_kl_mean.has_value());
  EXPECT_NEAR(*point->yardstick_kl_mean, kl_mean, 1e-6 * kl_mean);
  EXPECT_EQ(made, 1);
  EXPECT_EQ(drifted.logits.size(), 4u);
  EXPECT_THAT(FormatLoadPointLine(*point, {}), HasSubstr("widened to this model's bf16 drift"));
  auto stored = ServingPointFromJson(ToJson(ToServingPoint(*point, {})), "point");
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->yardstick_kl_mean, point->yardstick_kl_mean);

  // A yardstick within the class's ceilings widens nothing: still INCORRECT.
  std::unique_ptr<Model> clean_model;
  ServedYardstick clean;
  clean.model = [&]() -> absl::StatusOr<Model*> {
    ASSIGN_OR_RETURN(clean_model, CreateModel(*host, kCpu));
    return clean_model.get();
  };
  ASSERT_TRUE(CheckServedAgainstReference(**served, **reference, PrecisionClass::kBf16, 4, &*point,
                                          &cache, &clean)
                  .ok());
  EXPECT_EQ(point->verdict, TrialStatus::kIncorrect);
  EXPECT_FALSE(point->yardstick_kl_mean.has_value());
  EXPECT_THAT(point->mismatch, HasSubstr("bf16 class ceiling"));

  // A yardstick that fails to load is an error, not a verdict.
  ServedYardstick broken;
  broken.model = []() -> absl::StatusOr<Model*> { return absl::InternalError("no device"); };
  EXPECT_EQ(CheckServedAgainstReference(**served, **reference, PrecisionClass::kBf16, 4, &*point,
                                        &cache, &broken)
                .code(),
            absl::StatusCode::kInternal);
}

// Only the CPU reference commits kv-slot-swap: elsewhere the request is refused, not run clean.
TEST(Serving, KvSlotSwapElsewhereThanTheCpuIsRefused) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  auto cuda = NormalizeBackendConfig({{"device", "cuda"}});
  ASSERT_TRUE(cuda.ok());
  auto model = CreateModel(*host, *cuda, *ParseFaultInjection("kv-slot-swap:1"));
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(model.status().message(), HasSubstr("kv-slot-swap is committed by the CPU"));
}

// The same fault in a lockstep trial: the eval's batch of prompts shares the slots it swaps, so
// the trial's own verdict is INCORRECT too.
TEST(Serving, KvSlotSwapInALockstepTrialIsIncorrect) {
  TrialExecutor executor(LocalDevices{});
  TrialRequest request;
  request.trial_id = "t";
  request.model = "preset:tiny-moe";
  request.config = {{"device", "cpu"}};
  request.workload.prompt_len = 8;
  request.workload.output_len = 4;
  request.workload.repeats = 1;
  request.workload.warmup = 0;
  request.inject_fault = "kv-slot-swap:1";
  const TrialResult result = executor.Execute(request);
  EXPECT_EQ(result.status, TrialStatus::kIncorrect) << result.reason;
}

// ---------------------------------------------------------------------------------------------
// Figures

void ExpectOrdered(const Distribution& d, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_GT(d.median, 0);
  EXPECT_LE(d.median, d.p90);
  EXPECT_LE(d.p90, d.p99);
}

TEST(Serving, PercentilesAreOrderedAndCountsMatch) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  const ServeSpec spec =
      Spec("concurrency=3,rate=300,isl=8-40,osl=2-12,requests=12,warmup=2,seed=5");
  Slo slo;
  slo.ttft_ms = 1e6;  // every request meets it: goodput equals the request throughput
  const ServeTrialResult trial = RunServeTrial(*host, kCpu, spec, slo);
  ExpectAllMatch(trial, spec);
  for (const LoadPointResult& p : trial.points) {
    SCOPED_TRACE(LoadPointName(p.point));
    const ServeMetrics& m = p.metrics;
    ExpectOrdered(m.ttft_ms, "ttft");
    ExpectOrdered(m.tpot_ms, "tpot");
    ExpectOrdered(m.itl_ms, "itl");
    ExpectOrdered(m.e2el_ms, "e2el");
    EXPECT_LE(m.ttft_ms.p99, m.e2el_ms.p99);
    int64_t input = 0, output = 0;
    for (int i = spec.warmup; i < spec.warmup + spec.requests; ++i) {
      const ServeRequest r = MakeServeRequest(spec, host->config.vocab_size, i);
      input += static_cast<int64_t>(r.prompt.size());
      output += r.output_len;
    }
    EXPECT_EQ(m.total_input_tokens, input);
    EXPECT_EQ(m.total_output_tokens, output);
    EXPECT_EQ(static_cast<int64_t>(p.served.size()), spec.requests + spec.warmup);
    int timed = 0;
    for (const ServedRequest& s : p.served) {
      timed += !s.warmup;
      EXPECT_EQ(static_cast<int>(s.tokens.size()), s.request.output_len);
      EXPECT_EQ(s.token_times_s.size(), s.tokens.size());
    }
    EXPECT_EQ(timed, spec.requests);
    EXPECT_NEAR(m.request_throughput, spec.requests / m.duration_s, 1e-9);
    EXPECT_NEAR(m.output_throughput, output / m.duration_s, 1e-6);
    EXPECT_NEAR(m.total_token_throughput, (input + output) / m.duration_s, 1e-6);
    ASSERT_TRUE(m.request_goodput.has_value());
    EXPECT_NEAR(*m.request_goodput, m.request_throughput, 1e-9);
    EXPECT_TRUE(MeetsSlo(m, slo));
    EXPECT_FALSE(m.energy_j_per_output_token.has_value());  // no energy counter on the CPU
    EXPECT_EQ(static_cast<int64_t>(m.tpot_values_ms.size()), spec.requests);
  }
}

// The figures from hand-made timings: vLLM's definitions, warm-up requests skipped.
TEST(Serving, MetricsFollowVllmDefinitions) {
  std::vector<ServedRequest> served(3);
  served[0].warmup = true;
  served[0].request.prompt = {1};
  served[0].tokens = {1};
  served[0].token_times_s = {100};
  served[1].request.prompt = {1, 2, 3, 4};
  served[1].tokens = {7, 8, 9};
  served[1].start_s = 0;
  served[1].token_times_s = {0.010, 0.030, 0.050};  // ttft 10, tpot 20, itl 20 20, e2el 50
  served[2].request.prompt = {1, 2};
  served[2].tokens = {5, 6};
  served[2].start_s = 0.020;
  served[2].token_times_s = {0.060, 0.100};  // ttft 40, tpot 40, itl 40, e2el 80
  Slo slo;
  slo.ttft_ms = 20;
  const ServeMetrics m = ComputeServeMetrics(served, 0.1, slo);
  EXPECT_EQ(m.completed, 2);
  EXPECT_EQ(m.total_input_tokens, 6);
  EXPECT_EQ(m.total_output_tokens, 5);
  EXPECT_NEAR(m.ttft_ms.mean, 25, 1e-9);
  EXPECT_NEAR(m.ttft_ms.median, 10, 1e-9);
  EXPECT_NEAR(m.ttft_ms.p99, 40, 1e-9);
  EXPECT_NEAR(m.tpot_ms.mean, 30, 1e-9);
  EXPECT_NEAR(m.itl_ms.mean, (20 + 20 + 40) / 3.0, 1e-9);
  EXPECT_NEAR(m.e2el_ms.p99, 80, 1e-9);
  EXPECT_NEAR(m.request_throughput, 20, 1e-9);
  EXPECT_NEAR(m.output_throughput, 50, 1e-9);
  EXPECT_NEAR(m.total_token_throughput, 110, 1e-9);
  EXPECT_NEAR(m.output_tok_s_per_user, (50 + 25) / 2.0, 1e-9);
  ASSERT_TRUE(m.request_goodput.has_value());
  EXPECT_NEAR(*m.request_goodput, 10, 1e-9);  // one of two meets ttft <= 20 ms
  EXPECT_FALSE(MeetsSlo(m, slo));             // p99 ttft is 40 ms
  slo.percentile = 50;
  EXPECT_TRUE(MeetsSlo(m, slo));
}

// Nearest-rank percentiles over 20 requests whose TTFTs are 1..20 ms.
TEST(Serving, PercentilesAreNearestRank) {
  std::vector<ServedRequest> served(20);
  for (int i = 0; i < 20; ++i) {
    served[i].request.prompt = {1};
    served[i].tokens = {1, 2};
    served[i].start_s = i;
    served[i].token_times_s = {i + (20 - i) * 1e-3, i + 1.0};  // ttft 20 - i ms
  }
  const ServeMetrics m = ComputeServeMetrics(served, 40, {});
  EXPECT_NEAR(m.ttft_ms.median, 10, 1e-6);
  EXPECT_NEAR(m.ttft_ms.p90, 18, 1e-6);
  EXPECT_NEAR(m.ttft_ms.p99, 20, 1e-6);
  EXPECT_NEAR(m.ttft_ms.mean, 10.5, 1e-6);
  EXPECT_FALSE(m.request_goodput.has_value());  // no SLO, no goodput
}

// The search answers with the highest load when every load meets the SLO and with none when
// none does; the answer's tokens are checked, the probes that only steer it are not.
TEST(Serving, SloSearchFindsTheHighestLoadMeetingTheSlo) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  const ServeSpec spec = Spec("concurrency=1:5,isl=8-16,osl=3-6,requests=6");
  Slo generous;
  generous.ttft_ms = 1e6;
  generous.tpot_ms = 1e6;
  ServeTrialResult trial = RunServeTrial(*host, kCpu, spec, generous);
  ASSERT_EQ(trial.status, TrialStatus::kOk) << trial.reason;
  ASSERT_TRUE(trial.slo_search.has_value());
  EXPECT_TRUE(trial.slo_search->found);
  EXPECT_EQ(trial.slo_search->best.point.concurrency, 5);
  EXPECT_EQ(trial.slo_search->best.verdict, TrialStatus::kOk);
  EXPECT_GT(trial.slo_search->best.requests_checked, 0);
  EXPECT_EQ(trial.slo_search->best.requests_matching, trial.slo_search->best.requests_checked);
  ASSERT_EQ(trial.slo_search->probes.size(), 1u);  // the highest load met it
  EXPECT_EQ(trial.slo_search->probes[0].requests_checked, trial.slo_search->best.requests_checked);
  EXPECT_THAT(FormatSloSearchLine(*trial.slo_search, generous),
              HasSubstr("highest load meeting it: concurrency=5"));
  // A fault the judge sees makes the answer INCORRECT.
  trial = RunServeTrial(*host, kCpu, spec, generous, *ParseFaultInjection("kv-slot-swap:0"));
  ASSERT_TRUE(trial.slo_search.has_value() && trial.slo_search->found) << trial.reason;
  EXPECT_EQ(trial.slo_search->best.verdict, TrialStatus::kIncorrect);

  Slo impossible;
  impossible.ttft_ms = 1e-9;
  trial = RunServeTrial(*host, kCpu, spec, impossible);
  ASSERT_TRUE(trial.slo_search.has_value());
  EXPECT_FALSE(trial.slo_search->found);
  ASSERT_EQ(trial.slo_search->probes.size(), 2u);  // the highest load, then the lowest
  EXPECT_EQ(trial.slo_search->probes[0].point.concurrency, 5);
  EXPECT_EQ(trial.slo_search->probes[1].point.concurrency, 1);
  EXPECT_THAT(FormatSloSearchLine(*trial.slo_search, impossible),
              HasSubstr("no probed load meets the SLO"));
}

// The search serves the loads it probes but judges only its answer, and takes a load the trial
// listed (served and judged already) from the listed results.
TEST(Serving, SloSearchJudgesItsAnswerAloneAndReusesListedLoads) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  auto model = CreateModel(*host, kCpu);
  ASSERT_TRUE(model.ok()) << model.status();
  const ServeSpec spec = Spec("concurrency=1:5,isl=8-16,osl=3-6,requests=6");
  int judged = 0;
  const ServedJudge judge = [&](LoadPointResult* r) {
    ++judged;
    r->requests_checked = r->requests_matching = 1;
    return absl::OkStatus();
  };
  Slo generous;
  generous.ttft_ms = generous.tpot_ms = 1e6;
  auto found = SearchSloLoad(**model, spec, generous, judge);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_TRUE(found->found);
  EXPECT_EQ(judged, 1);
  EXPECT_EQ(found->best.requests_checked, 1);
  ASSERT_EQ(found->probes.size(), 1u);
  EXPECT_EQ(found->probes[0].requests_checked, 1);  // the answer, as judged

  Slo impossible;
  impossible.ttft_ms = 1e-9;
  judged = 0;
  auto none = SearchSloLoad(**model, spec, impossible, judge);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->found);
  EXPECT_EQ(judged, 0);
  ASSERT_EQ(none->probes.size(), 2u);
  for (const LoadPointResult& p : none->probes) {
    EXPECT_EQ(p.requests_checked, 0);
    EXPECT_THAT(FormatLoadPointLine(p, impossible), HasSubstr(" unjudged "));
  }

  // Listed loads: marked, so a reused one is told from one served again.
  std::vector<LoadPointResult> listed;
  for (int concurrency : {1, 5}) {
    auto r = RunLoadPoint(**model, spec, {false, concurrency, 0}, generous);
    ASSERT_TRUE(r.ok()) << r.status();
    r->steps = -concurrency;
    r->requests_checked = r->requests_matching = 3;
    listed.push_back(std::move(*r));
  }
  judged = 0;
  auto reused = SearchSloLoad(**model, spec, generous, judge, listed);
  ASSERT_TRUE(reused.ok()) << reused.status();
  ASSERT_EQ(reused->probes.size(), 1u);
  EXPECT_EQ(reused->probes[0].steps, -5);
  EXPECT_EQ(reused->best.requests_checked, 3);
  EXPECT_EQ(judged, 0);  // judged when it was listed
}

// duration=S issues requests for S seconds (closed loop: none starts after S); every one that
// started completes and is counted.
TEST(Serving, DurationBoundsTheIssuedRequests) {
  auto host = LoadPreset("tiny-moe");
  ASSERT_NE(host, nullptr);
  const ServeSpec spec = Spec("concurrency=2,rate=100,isl=8-16,osl=3-6,duration=0.15");
  const ServeTrialResult trial = RunServeTrial(*host, kCpu, spec, {});
  ASSERT_EQ(trial.status, TrialStatus::kOk) << trial.reason;
  for (const LoadPointResult& p : trial.points) {
    SCOPED_TRACE(LoadPointName(p.point));
    EXPECT_EQ(p.verdict, TrialStatus::kOk) << p.mismatch;
    EXPECT_GT(p.metrics.completed, 0);
    EXPECT_EQ(p.metrics.completed, static_cast<int>(p.served.size()));
    EXPECT_EQ(p.requests_matching, p.requests_checked);
    for (const ServedRequest& s : p.served) {
      EXPECT_LT(s.start_s, 0.15);
      EXPECT_EQ(static_cast<int>(s.tokens.size()), s.request.output_len);
    }
  }
}

// The same spec draws the same requests; the seed changes them.
TEST(Serving, RequestsAreSeeded) {
  const ServeSpec spec = Spec("concurrency=1,isl=4-64,osl=2-9,requests=4,seed=9");
  const ServeRequest a = MakeServeRequest(spec, 512, 3), b = MakeServeRequest(spec, 512, 3);
  EXPECT_EQ(a.prompt, b.prompt);
  EXPECT_EQ(a.output_len, b.output_len);
  EXPECT_NE(
      MakeServeRequest(Spec("concurrency=1,isl=4-64,osl=2-9,requests=4,seed=10"), 512, 3).prompt,
      a.prompt);
}

// ---------------------------------------------------------------------------------------------
// The spec and the CLI

TEST(ServeSpec, ParsesLoadPointsAndRanges) {
  const ServeSpec spec = Spec("concurrency=1:4:16,isl=32-64,osl=16,requests=8,warmup=2,chunk=16");
  EXPECT_EQ(spec.concurrency, (std::vector<int>{1, 4, 16}));
  EXPECT_EQ(spec.isl_min, 32);
  EXPECT_EQ(spec.isl_max, 64);
  EXPECT_EQ(spec.osl_min, 16);
  EXPECT_EQ(spec.osl_max, 16);
  EXPECT_EQ(spec.chunk, 16);
  EXPECT_EQ(LoadPoints(Spec("rate=2:8,max_concurrency=4,requests=1")).size(), 2u);
}

TEST(ServeSpec, BadInputNamesTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"concurrency=0,requests=8", "'concurrency'"},
      {"concurrency=1:x,requests=8", "'concurrency'"},
      {"rate=-1,requests=8", "'rate'"},
      {"concurrency=1,isl=abc,requests=8", "'isl'"},
      {"concurrency=1,osl=9-3,requests=8", "'osl'"},
      {"concurrency=1,requests=many", "'requests'"},
      {"concurrency=1", "exactly one of 'requests'"},
      {"concurrency=1,requests=2,duration=5", "exactly one of 'requests'"},
      {"isl=8,requests=2", "needs a load"},
      {"concurrency=1,requests=2,max_concurrency=4", "'max_concurrency'"},
      {"concurrency=1,requests=2,speed=4", "unknown --serve field 'speed'"},
      {"concurrency=1,requests", "field=value"},
      {"concurrency=1,requests=2,chunk=8,prefill_tokens=4", "'prefill_tokens'"},
      {"concurrency=1,requests=2,prefill_tokens=-1", "'prefill_tokens'"},
  };
  for (const auto& [text, want] : cases) {
    auto spec = ParseServeSpec(text);
    EXPECT_FALSE(spec.ok()) << text;
    EXPECT_THAT(spec.status().message(), HasSubstr(want)) << text;
  }
  EXPECT_THAT(ParseSlo("ttft_ms=fast").status().message(), HasSubstr("'ttft_ms'"));
  EXPECT_THAT(ParseSlo("p99=3").status().message(), HasSubstr("unknown --slo field 'p99'"));
}

// A field given twice, and load points that repeat or go down, are typos: refused naming the
// field.
TEST(ServeSpec, RefusesARepeatedFieldAndLoadPointsThatDoNotIncrease) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"concurrency=1,isl=8,isl=16,requests=2", "--serve field 'isl' given twice"},
      {"concurrency=1,requests=2,requests=3", "--serve field 'requests' given twice"},
      {"concurrency=1,concurrency=2,requests=2", "--serve field 'concurrency' given twice"},
      {"concurrency=4:1,requests=2",
       "--serve field 'concurrency': '4:1': load points must increase"},
      {"concurrency=1:4:4,requests=2", "'concurrency': '1:4:4': load points must increase"},
      {"rate=2:1,requests=2", "--serve field 'rate': '2:1': load points must increase"},
  };
  for (const auto& [text, want] : cases) {
    auto spec = ParseServeSpec(text);
    EXPECT_FALSE(spec.ok()) << text;
    EXPECT_THAT(spec.status().message(), HasSubstr(want)) << text;
  }
  EXPECT_THAT(ParseSlo("ttft_ms=5,ttft_ms=9").status().message(),
              HasSubstr("--slo field 'ttft_ms' given twice"));
  EXPECT_THAT(ParseSlo("tpot_ms=5,percentile=90,percentile=99").status().message(),
              HasSubstr("--slo field 'percentile' given twice"));
  EXPECT_TRUE(ParseServeSpec("rate=0.5:2:8,requests=2").ok());
}

TEST(ServeCli, PrintsOneLinePerLoadPointWithItsVerdict) {
  int code = -1;
  const std::string out =
      RunCommand(WorkerBinary() +
                     " run --model preset:tiny-moe --serve concurrency=1:4,isl=16,osl=4,requests=4"
                     " --slo ttft_ms=100000,tpot_ms=100000 2>&1",
                 &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("concurrency=1 "));
  EXPECT_THAT(out, HasSubstr("concurrency=4 "));
  EXPECT_THAT(out, HasSubstr("matching=4/4"));
  EXPECT_THAT(out, HasSubstr("median_tpot_ms="));
  EXPECT_THAT(out, HasSubstr("request_goodput="));
  EXPECT_THAT(out, HasSubstr("# slo search"));

  // --json: the same load points under their vLLM names.
  const std::string dir = MakeTempDir("serving-json");
  ASSERT_FALSE(dir.empty());
  const std::string json_path = dir + "/serve.json";
  const std::string json_run = RunCommand(
      WorkerBinary() + " run --model preset:tiny-moe --serve rate=200,isl=8,osl=3,requests=3" +
          " --json " + json_path + " 2>&1",
      &code);
  EXPECT_EQ(code, 0) << json_run;
  std::ifstream in(json_path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << json_run;
  EXPECT_EQ(j["schema"], "infersweep.serve/1");
  const nlohmann::json& point = j["results"][0]["load_points"][0];
  EXPECT_EQ(point["verdict"], "OK");
  EXPECT_EQ(point["completed"], 3);
  EXPECT_EQ(point["request_rate"], 200);
  EXPECT_TRUE(point.contains("p99_itl_ms"));
  EXPECT_FALSE(point.contains("energy_j_per_output_token"));
  std::filesystem::remove_all(dir);

  const std::string faulty =
      RunCommand(WorkerBinary() +
                     " run --model preset:tiny-moe --serve concurrency=4,isl=16,osl=6,requests=4"
                     " --test-inject-fault kv-slot-swap:2 2>&1",
                 &code);
  EXPECT_EQ(code, 0) << faulty;  // the run ran; its verdict is the line's
  EXPECT_THAT(faulty, HasSubstr("INCORRECT"));

  const std::string bad = RunCommand(
      WorkerBinary() + " run --model preset:tiny-moe --serve concurrency=1,isl=x,requests=2 2>&1",
      &code);
  EXPECT_EQ(code, 2);
  EXPECT_THAT(bad, HasSubstr("--serve field 'isl'"));
}

}  // namespace
}  // namespace infersweep
