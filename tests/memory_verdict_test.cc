// Memory as a verdict (harness/memory_verdict.h): which batch sizes run, which get "does not fit",
// and when the whole trial is UNSUPPORTED, from each size's memory plan and the free bytes.
#include "harness/memory_verdict.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "api/backend_config.h"
#include "api/model_config.h"
#include "api/serve_spec.h"

namespace infersweep {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int64_t kGiB = int64_t{1} << 30;

// A plan of `weights` GiB of weights and `kv` GiB of KV cache.
MemoryPlan PlanOf(double weights, double kv) {
  MemoryPlan plan;
  plan.items.push_back(
      {MemoryPool::kWeights, "dense tensors (bf16)", static_cast<int64_t>(weights * kGiB), false});
  plan.items.push_back({MemoryPool::kKvCache, "K and V", static_cast<int64_t>(kv * kGiB), false});
  return plan;
}

// Batch sizes 1, 8 and 64 of a 10 GiB model whose KV cache is 0.25 GiB a sequence.
std::vector<BatchMemoryPlan> ThreeBatches() {
  std::vector<BatchMemoryPlan> plans;
  for (int batch : {1, 8, 64}) plans.push_back({batch, PlanOf(10, 0.25 * batch)});
  return plans;
}

TEST(MemoryVerdict, EveryBatchThatFitsRuns) {
  absl::StatusOr<MemoryDecision> d = DecideMemory(ThreeBatches(), 40 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->unsupported.has_value());
  EXPECT_THAT(d->run, ElementsAre(1, 8, 64));  // 64: 10 + 16 GiB
  EXPECT_TRUE(d->does_not_fit.empty());
}

TEST(MemoryVerdict, ALargerBatchThatDoesNotFitGetsItsOwnVerdictAndTheOthersRun) {
  absl::StatusOr<MemoryDecision> d = DecideMemory(ThreeBatches(), 20 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->unsupported.has_value());
  EXPECT_THAT(d->run, ElementsAre(1, 8));
  ASSERT_EQ(d->does_not_fit.size(), 1u);
  ASSERT_TRUE(d->does_not_fit.count(64));
  EXPECT_EQ(d->does_not_fit.at(64),
            "needs 26.00 GiB on the device (weights 10.00 GiB, copies 0 B, KV 16.00 GiB, "
            "recurrent state 0 B, scratch 0 B, workspaces 0 B, graph pools 0 B), 20.00 GiB free");
}

TEST(MemoryVerdict, TheSmallestBatchNotFittingMakesTheTrialUnsupported) {
  absl::StatusOr<MemoryDecision> d = DecideMemory(ThreeBatches(), 10 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->unsupported.has_value());
  EXPECT_EQ(*d->unsupported,
            "batch 1: needs 10.25 GiB on the device (weights 10.00 GiB, copies 0 B, KV 256.0 MiB, "
            "recurrent state 0 B, scratch 0 B, workspaces 0 B, graph pools 0 B), 10.00 GiB free");
  EXPECT_TRUE(d->run.empty());
  // Every size that does not fit keeps its words for the result's per-batch verdicts.
  EXPECT_EQ(d->does_not_fit.size(), 3u);
  EXPECT_THAT(d->does_not_fit.at(64), StartsWith("needs 26.00 GiB on the device"));
}

TEST(MemoryVerdict, ThePlanFitsExactlyTheFreeBytes) {
  EXPECT_THAT(DecideMemory(ThreeBatches(), 12 * kGiB)->run, ElementsAre(1, 8));  // 8: 12 GiB
  EXPECT_THAT(DecideMemory(ThreeBatches(), 12 * kGiB - 1)->run, ElementsAre(1));
}

TEST(MemoryVerdict, TheSmallestIsFoundWhateverTheOrder) {
  std::vector<BatchMemoryPlan> plans = ThreeBatches();
  std::swap(plans.front(), plans.back());  // 64, 8, 1
  absl::StatusOr<MemoryDecision> d = DecideMemory(plans, 11 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->unsupported.has_value());
  EXPECT_THAT(d->run, ElementsAre(1));
  EXPECT_EQ(d->does_not_fit.size(), 2u);
}

TEST(MemoryVerdict, RanksRunEveryBatchOrNone) {
  MemoryDecisionOptions options;
  options.every_batch_or_none = true;
  absl::StatusOr<MemoryDecision> d = DecideMemory(ThreeBatches(), 20 * kGiB, options);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->unsupported.has_value());
  EXPECT_THAT(*d->unsupported, StartsWith("batch 64: needs 26.00 GiB on the device"));
  EXPECT_TRUE(d->run.empty());
  EXPECT_THAT(d->does_not_fit, ::testing::ElementsAre(::testing::Key(64)));
  EXPECT_THAT(DecideMemory(ThreeBatches(), 40 * kGiB, options)->run, ElementsAre(1, 8, 64));
}

TEST(MemoryVerdict, TheCorrectnessCheckMustFit) {
  const MemoryPlan judging = PlanOf(10, 4);
  MemoryDecisionOptions options;
  options.judging = &judging;
  absl::StatusOr<MemoryDecision> d = DecideMemory(ThreeBatches(), 12 * kGiB, options);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->unsupported.has_value());
  EXPECT_THAT(*d->unsupported, StartsWith("correctness check: needs 14.00 GiB on the device"));
  EXPECT_FALSE(DecideMemory(ThreeBatches(), 14 * kGiB, options)->unsupported.has_value());
}

TEST(MemoryVerdict, BadInputIsRefusedByName) {
  EXPECT_THAT(std::string(DecideMemory({}, kGiB).status().message()), HasSubstr("no batch sizes"));
  std::vector<BatchMemoryPlan> twice = ThreeBatches();
  twice.push_back(twice.front());
  EXPECT_THAT(std::string(DecideMemory(twice, kGiB).status().message()),
              HasSubstr("batch size 1 given twice"));
  std::vector<BatchMemoryPlan> zero = {{0, PlanOf(1, 1)}};
  EXPECT_EQ(DecideMemory(zero, kGiB).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(DecideMemory(ThreeBatches(), -1).status().message()),
              HasSubstr("free bytes -1 < 0"));
}

TEST(MemoryVerdict, PlannedMemoryCarriesTheTotalAndEveryPool) {
  const PlannedMemory planned = PlannedMemoryOf(PlanOf(10, 2));
  EXPECT_EQ(planned.total_bytes, 12 * kGiB);
  EXPECT_EQ(planned.pool_bytes.size(), std::size(kMemoryPools));
  EXPECT_EQ(planned.pool_bytes.at("weights"), 10 * kGiB);
  EXPECT_EQ(planned.pool_bytes.at("KV"), 2 * kGiB);
  EXPECT_EQ(planned.pool_bytes.at("scratch"), 0);
}

// The executor's inputs end to end on the host: qwen3-30b-a3b in bf16 (57 GiB of weights) under
// the harness's normalized config, 1024 + 1024 tokens a sequence. On an H200 with ~139 GiB free,
// batch 1024 does not fit (its KV cache alone is hundreds of GiB); with 90 % of the GPU taken by
// another tenant, batch 1 does not either.
TEST(MemoryVerdict, Qwen3MoeOnAnH200) {
  absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(*ParseBackendConfig("device=cuda"));
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<ModelConfig> model = PresetConfig("qwen3-30b-a3b", 0);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<BatchMemoryPlan> plans;
  for (int batch : {1, 64, 1024}) {
    MemoryWorkload w;
    w.batch = batch;
    w.prompt_tokens = 1024;
    w.generated_tokens = 1024;
    absl::StatusOr<MemoryPlan> plan = PlanMemory(*config, *model, "", w);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plans.push_back({batch, *plan});
  }
  const int64_t h200_free = 139 * kGiB;
  absl::StatusOr<MemoryDecision> d = DecideMemory(plans, h200_free);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->unsupported.has_value());
  EXPECT_THAT(d->run, ElementsAre(1, 64));
  ASSERT_TRUE(d->does_not_fit.count(1024));
  EXPECT_THAT(d->does_not_fit.at(1024), HasSubstr("139.00 GiB free"));

  d = DecideMemory(plans, h200_free / 10);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->unsupported.has_value());
  EXPECT_THAT(*d->unsupported, StartsWith("batch 1: needs 5"));
  EXPECT_THAT(*d->unsupported, HasSubstr("(weights 56.87 GiB, "));
  EXPECT_THAT(*d->unsupported, HasSubstr("13.90 GiB free"));
}

// A serving model of 10 GiB of weights whose KV slot takes 1 GiB: the planner the executor
// passes, counting the slots it was asked for.
SlotMemoryPlanner SlotsOf(std::vector<int>* asked = nullptr) {
  return [asked](int slots) -> absl::StatusOr<MemoryPlan> {
    if (asked) asked->push_back(slots);
    return PlanOf(10, slots);
  };
}

ServeSpec SpecOf(const std::string& text) {
  absl::StatusOr<ServeSpec> spec = ParseServeSpec(text);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.value_or(ServeSpec{});
}

TEST(ServingMemory, EveryPointThatFitsRunsUncapped) {
  absl::StatusOr<ServingMemoryDecision> d =
      DecideServingMemory(SpecOf("concurrency=1:8,requests=8"), SlotsOf(), 18 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->unsupported.has_value());
  EXPECT_EQ(d->slot_cap, 0);
  EXPECT_TRUE(d->does_not_fit.empty());
}

// 20 GiB free hold 10 slots: concurrency 16 and 64 do not fit (each with its breakdown), 1
// and 8 run, and the cap is 10.
TEST(ServingMemory, ClosedLoopPointsAboveTheCapDoNotFit) {
  std::vector<int> asked;
  absl::StatusOr<ServingMemoryDecision> d =
      DecideServingMemory(SpecOf("concurrency=1:8:16:64,requests=8"), SlotsOf(&asked), 20 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->unsupported.has_value());
  EXPECT_EQ(d->slot_cap, 10);
  ASSERT_EQ(d->does_not_fit.size(), 2u);
  EXPECT_EQ(d->does_not_fit.at("concurrency=16"),
            "16 KV slots: needs 26.00 GiB on the device (weights 10.00 GiB, copies 0 B, KV 16.00 "
            "GiB, recurrent state 0 B, scratch 0 B, workspaces 0 B, graph pools 0 B), 20.00 GiB "
            "free");
  EXPECT_THAT(d->does_not_fit.at("concurrency=64"), StartsWith("64 KV slots: needs 74.00 GiB"));
  // The bisection asks for few plans: log2(64) and the refused points', not every count.
  EXPECT_LE(asked.size(), 12u);
}

// An open loop's slots (its cap, or its requests) are capped, never refused, while one fits.
TEST(ServingMemory, OpenLoopPointsAreCapped) {
  absl::StatusOr<ServingMemoryDecision> d =
      DecideServingMemory(SpecOf("rate=1:4,max_concurrency=32,requests=16"), SlotsOf(), 20 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->unsupported.has_value());
  EXPECT_EQ(d->slot_cap, 10);
  EXPECT_TRUE(d->does_not_fit.empty());
  // No cap: the warm-up and timed requests are its slots (here 16).
  d = DecideServingMemory(SpecOf("rate=2,requests=12,warmup=4"), SlotsOf(), 26 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->slot_cap, 0);
  d = DecideServingMemory(SpecOf("rate=2,requests=12,warmup=4"), SlotsOf(), 25 * kGiB);
  EXPECT_EQ(d->slot_cap, 15);
}

TEST(ServingMemory, NothingFittingIsUnsupported) {
  absl::StatusOr<ServingMemoryDecision> d =
      DecideServingMemory(SpecOf("rate=2,requests=4"), SlotsOf(), 10 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->unsupported.has_value());
  EXPECT_THAT(*d->unsupported, StartsWith("1 KV slot: needs 11.00 GiB on the device"));
  // Every point a refused closed loop: the smallest's words.
  d = DecideServingMemory(SpecOf("concurrency=16:32,requests=4"), SlotsOf(), 20 * kGiB);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->unsupported.has_value());
  EXPECT_THAT(*d->unsupported, StartsWith("concurrency=16: 16 KV slots: needs 26.00 GiB"));
  // The correctness check's plan is refused first.
  const MemoryPlan judging = PlanOf(30, 0);
  d = DecideServingMemory(SpecOf("concurrency=1,requests=4"), SlotsOf(), 20 * kGiB, &judging);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_THAT(d->unsupported.value_or(""), StartsWith("correctness check: needs 30.00 GiB"));
}

TEST(ServingMemory, APlannerErrorIsPassedOn) {
  const SlotMemoryPlanner broken = [](int) -> absl::StatusOr<MemoryPlan> {
    return absl::UnimplementedError("attention plan: no");
  };
  EXPECT_THAT(
      std::string(
          DecideServingMemory(SpecOf("concurrency=2,requests=2"), broken, kGiB).status().message()),
      HasSubstr("attention plan: no"));
}

// The scheduler's largest step: whole prompts of every slot, one chunk, or the token budget.
TEST(ServingMemory, LargestRaggedStepRowsFollowTheScheduler) {
  EXPECT_EQ(LargestRaggedStepRows(SpecOf("concurrency=8,isl=100,requests=8"), 8), 800);
  EXPECT_EQ(LargestRaggedStepRows(SpecOf("concurrency=8,isl=100,chunk=32,requests=8"), 8), 40);
  EXPECT_EQ(LargestRaggedStepRows(
                SpecOf("concurrency=8,isl=100,chunk=32,prefill_tokens=96,requests=8"), 8),
            104);
  EXPECT_EQ(ServingSlots(SpecOf("rate=2,requests=300"), {true, 0, 2}), kUncappedServingSlots);
  EXPECT_EQ(ServingSlots(SpecOf("rate=2,max_concurrency=4,requests=300"), {true, 4, 2}), 4);
  EXPECT_EQ(ServingSlots(SpecOf("concurrency=3,requests=3"), {false, 3, 0}), 3);
}

// A ragged step's rows size the serving plan's scratch, not the lockstep prefill's.
TEST(ServingMemory, TheServingPlanSizesScratchByTheRaggedStep) {
  absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(*ParseBackendConfig("device=cuda"));
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<ModelConfig> model = PresetConfig("qwen3-30b-a3b", 2);
  ASSERT_TRUE(model.ok()) << model.status();
  MemoryWorkload w;
  w.batch = 8;
  w.prompt_tokens = 1024;
  w.generated_tokens = 64;
  w.serving = true;
  w.ragged_step_rows = 40;
  absl::StatusOr<MemoryPlan> chunked = PlanMemory(*config, *model, "", w);
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  EXPECT_EQ(chunked->step_rows, 40);
  EXPECT_EQ(chunked->kv_sequences, 9);  // the slots and one spare
  w.ragged_step_rows = 8 * 1024;
  absl::StatusOr<MemoryPlan> whole = PlanMemory(*config, *model, "", w);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->step_rows, 8192);
  EXPECT_GT(whole->bytes(MemoryPool::kScratch), chunked->bytes(MemoryPool::kScratch));
}

}  // namespace
}  // namespace infersweep
