// Memory as a verdict (harness/memory_verdict.h): which batch sizes run, which get "does not fit",
// and when the whole trial is UNSUPPORTED, from each size's memory plan and the free bytes.
#include "harness/memory_verdict.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "api/backend_config.h"
#include "api/model_config.h"

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
  EXPECT_TRUE(d->does_not_fit.empty());
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

}  // namespace
}  // namespace infersweep
