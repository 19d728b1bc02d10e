// Tensor and expert parallelism on the CPU reference (engine/tp_model.h): every rank count that
// shards a model gives tp=1's logits (within 1e-5 of max|logit|) and tp=1's greedy tokens, on the
// tiny presets and on the transformers fixtures; the all-reduce adds the ranks in a fixed order,
// bitwise the same on every rank; preflight refuses a rank count that does not divide a
// dimension, naming it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "api/backend_config.h"
#include "bench/allreduce_bench.h"
#include "engine/backends.h"
#include "engine/cpu_model.h"
#include "engine/options.h"
#include "engine/sampler.h"
#include "engine/tp_model.h"
#include "engine/weights.h"
#include "kernels/cpu/allreduce.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using testing::HasSubstr;

// Runs `body(rank)` on `ranks` threads at once.
template <typename Body>
void OnRanks(int ranks, Body body) {
  std::vector<std::jthread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(body, r);
}

// 1e8 + 1 rounds back to 1e8 in fp32, so these partials sum to 1 in rank order 0, 1, 2, 3 and to
// something else in any other order that starts elsewhere.
TEST(ThreadAllReduce, SumsInRankOrderAndIsBitwiseTheSameOnEveryRank) {
  constexpr int kRanks = 4;
  const float order_sensitive[kRanks] = {1e8f, 1.f, -1e8f, 1.f};
  // Lengths below, at and past the rank count, and one the ranks do not divide.
  for (int64_t n : {1, 3, 4, 7, 1000}) {
    SCOPED_TRACE(n);
    std::vector<std::vector<float>> data(kRanks, std::vector<float>(n));
    for (int r = 0; r < kRanks; ++r)
      for (int64_t i = 0; i < n; ++i)
        data[r][i] =
            i % 2 == 0 ? order_sensitive[r] : std::sin(static_cast<float>(r * 131 + i)) * 1e3f;
    // The expected sums, added in rank order.
    std::vector<float> want(n);
    for (int64_t i = 0; i < n; ++i) {
      float acc = data[0][i];
      for (int r = 1; r < kRanks; ++r) acc += data[r][i];
      want[i] = acc;
    }
    ASSERT_EQ(want[0], 1.f);
    cpu::ThreadAllReduce allreduce(kRanks);
    // Twice on the same object: the second Sum must not race the first's copies.
    for (int round = 0; round < 2; ++round) {
      std::vector<std::vector<float>> work = data;
      OnRanks(kRanks, [&](int r) { allreduce.Sum(r, work[r].data(), n); });
      for (int r = 0; r < kRanks; ++r)
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(work[r][i], want[i]) << "rank " << r << " element " << i;
    }
  }
}

TEST(ThreadAllReduce, OneRankKeepsItsData) {
  cpu::ThreadAllReduce allreduce(1);
  std::vector<float> data = {1.5f, -2.f};
  allreduce.Sum(0, data.data(), 2);
  EXPECT_EQ(data, (std::vector<float>{1.5f, -2.f}));
}

// allreduce-bench's rows: every size from min to max by the factor, no wrong element, and
// busbw = algbw * 2(n-1)/n.
TEST(AllReduceBench, ChecksEveryElementAndNormalisesBandwidth) {
  AllReduceBenchOptions options;
  options.ranks = 4;
  options.min_bytes = 4 << 10;
  options.max_bytes = 64 << 10;
  options.iterations = 2;
  auto rows = RunCpuAllReduceBench(options);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 3u);
  for (size_t i = 0; i < rows->size(); ++i) {
    const AllReduceBenchRow& row = (*rows)[i];
    EXPECT_EQ(row.bytes, (int64_t{4} << 10) << (2 * i));
    EXPECT_EQ(row.count, row.bytes / 4);
    EXPECT_EQ(row.wrong, 0);
    EXPECT_GT(row.time_us, 0);
    EXPECT_NEAR(row.busbw_gb_s, row.algbw_gb_s * 1.5, 1e-9 * row.algbw_gb_s);
  }
  const std::string table = FormatAllReduceBench(options, *rows);
  EXPECT_THAT(table, HasSubstr("busbw(GB/s)"));
  EXPECT_THAT(table, HasSubstr("#wrong"));
  options.ranks = 0;
  EXPECT_THAT(RunCpuAllReduceBench(options).status().message(), HasSubstr("--ranks"));
}

// allreduce-bench --device cuda names a bad option or value before it looks for a GPU, and a
// build without CUDA (or a machine with too few GPUs) says so; the table's header says that
// busbw is 0 at one rank. (The timed rows run on the GPU: tests/gpu_allreduce_test.cc.)
TEST(AllReduceBench, CudaRefusesBadOptionsAndSaysWhatIsMissing) {
  AllReduceBenchOptions options;
  options.ranks = 1;
  options.allreduce = {"nccl", "reference"};
  auto bad = RunCudaAllReduceBench(options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--allreduce: unknown value 'reference'"));
  options.allreduce = {"custom"};
  options.min_bytes = 4100;
  EXPECT_THAT(RunCudaAllReduceBench(options).status().message(),
              HasSubstr("--min-bytes: 4100 is not a multiple of 16"));
  options.min_bytes = 4096;
  options.ranks = 64;
  auto missing = RunCudaAllReduceBench(options);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
#ifdef INFERSWEEP_HAVE_CUDA
  EXPECT_THAT(missing.status().message(), HasSubstr("--ranks 64 needs 64 GPUs"));
#else
  EXPECT_THAT(missing.status().message(), HasSubstr("this build has no CUDA"));
#endif
  options.ranks = 1;
  EXPECT_THAT(FormatCudaAllReduceBench(options, {}),
              HasSubstr("0 at one rank, where nothing crosses a link"));
}

// The prompt for a model of `vocab` tokens: `n` ids spread over the vocabulary.
std::vector<int32_t> Prompt(int vocab, int n, int salt) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 37 + salt * 101 + 3) % vocab);
  return ids;
}

// What a run gives: prefill logits of every position, then greedy tokens decoded one at a time.
struct ModelRun {
  std::vector<float> prefill;
  std::vector<int32_t> greedy;
};

ModelRun RunModel(Model& model, int batch, int n, int new_tokens) {
  ModelRun run;
  const int vocab = model.config().vocab_size;
  std::vector<int32_t> tokens;
  for (int b = 0; b < batch; ++b) {
    const std::vector<int32_t> p = Prompt(vocab, n, b);
    tokens.insert(tokens.end(), p.begin(), p.end());
  }
  EXPECT_TRUE(model.StartBatch(batch, n + new_tokens).ok());
  const absl::Status s = model.Forward(tokens, n, LogitsMode::kAll, &run.prefill);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return run;
  std::vector<int32_t> next(batch);
  for (int b = 0; b < batch; ++b) {
    const auto row = run.prefill.begin() + (static_cast<int64_t>(b) * n + n - 1) * vocab;
    next[b] = Greedy(std::span<const float>(&*row, vocab));
  }
  for (int step = 0; step < new_tokens; ++step) {
    run.greedy.insert(run.greedy.end(), next.begin(), next.end());
    std::vector<float> last;
    EXPECT_TRUE(model.Forward(next, 1, LogitsMode::kLast, &last).ok());
    for (int b = 0; b < batch; ++b)
      next[b] =
          Greedy(std::span<const float>(last.data() + static_cast<int64_t>(b) * vocab, vocab));
  }
  return run;
}

// max|a - b| / max|b|.
double RelativeMaxError(const std::vector<float>& a, const std::vector<float>& b) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(b[i])));
  }
  return max_diff / max_ref;
}

const std::string kFixtures = SourceDir() + "/tests/fixtures/hf";

// Presets ("preset:tiny-moe", a quantized one) and transformers' fixture folders.
std::vector<std::string> Models() {
  std::vector<std::string> models = {"preset:tiny-moe", "preset:tiny-dense",
                                     "preset:tiny-qwen2-moe", "preset:tiny-hybrid",
                                     "preset:tiny-moe@nvfp4"};
  for (const std::string& name : FixtureNames(kFixtures)) models.push_back(kFixtures + "/" + name);
  return models;
}

std::string TestName(const std::string& model) {
  std::string name = model.starts_with("preset:")
                         ? model.substr(7)
                         : "hf_" + std::filesystem::path(model).filename().string();
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name;
}

class TensorParallelTest : public testing::TestWithParam<std::string> {};

// Every rank count (2, 4, 8) and ep value the model's shapes allow, through CreateModel as a
// trial builds it, against tp=1; the refused ones are refused with TensorParallelRefusal's reason.
TEST_P(TensorParallelTest, LogitsAndGreedyMatchOneRank) {
  const std::string& source = GetParam();
  auto host = LoadHostModel(source);
  ASSERT_TRUE(host.ok()) << host.status();
  const ModelConfig& config = (*host)->config;
  auto one = CreateModel(**host, *NormalizeBackendConfig({}));
  ASSERT_TRUE(one.ok()) << one.status();
  const int batch = 2, n = 12, new_tokens = 6;
  const ModelRun want = RunModel(**one, batch, n, new_tokens);
  int ran = 0;
  for (int tp : {2, 4, 8}) {
    for (bool ep : {false, true}) {
      const BackendConfig config_text = {{"tp", std::to_string(tp)}, {"ep", ep ? "on" : "off"}};
      auto normalized = NormalizeBackendConfig(config_text);
      ASSERT_TRUE(normalized.ok()) << normalized.status();
      SCOPED_TRACE(BackendConfigString(*normalized));
      const std::string refusal = TensorParallelRefusal(config, tp, ep);
      auto model = CreateModel(**host, *normalized);
      if (!refusal.empty()) {
        ASSERT_FALSE(model.ok());
        EXPECT_EQ(model.status().code(), absl::StatusCode::kUnimplemented);
        EXPECT_EQ(model.status().message(), refusal);
        continue;
      }
      ASSERT_TRUE(model.ok()) << model.status();
      const ModelRun got = RunModel(**model, batch, n, new_tokens);
      ASSERT_EQ(got.prefill.size(), want.prefill.size());
      const double rel = RelativeMaxError(got.prefill, want.prefill);
      std::printf("# %s tp=%d ep=%s: max|tp - tp1| / max|tp1| = %.3g\n", source.c_str(), tp,
                  ep ? "on" : "off", rel);
      EXPECT_LE(rel, 1e-5);
      EXPECT_EQ(got.greedy, want.greedy);
      ++ran;
    }
  }
  // tp=2 shards every model here; ep=on every MoE one.
  EXPECT_GE(ran, config.is_moe() ? 2 : 1);
}

INSTANTIATE_TEST_SUITE_P(PresetsAndFixtures, TensorParallelTest, testing::ValuesIn(Models()),
                         [](const auto& info) { return TestName(info.param); });

// The ranks add their partials in a fixed order: a run repeats bitwise, whichever rank's thread
// gets to each all-reduce first.
TEST(TensorParallel, RunsRepeatBitwise) {
  auto host = LoadHostModel("preset:tiny-moe");
  ASSERT_TRUE(host.ok()) << host.status();
  auto config = NormalizeBackendConfig({{"tp", "4"}, {"ep", "on"}});
  ASSERT_TRUE(config.ok());
  auto first = CreateModel(**host, *config);
  auto second = CreateModel(**host, *config);
  ASSERT_TRUE(first.ok() && second.ok());
  const ModelRun a = RunModel(**first, 2, 9, 4), b = RunModel(**second, 2, 9, 4);
  EXPECT_EQ(a.prefill, b.prefill);
  EXPECT_EQ(a.greedy, b.greedy);
}

// A shard's vocabulary rows: the split is as even as it goes, in rank order, covering it all.
TEST(TensorParallel, ShardsCoverTheVocabularyAndHeads) {
  auto host = LoadHostModel("preset:tiny-moe");
  ASSERT_TRUE(host.ok()) << host.status();
  const ModelConfig& c = (*host)->config;
  int64_t next_row = 0;
  for (int r = 0; r < 4; ++r) {
    auto shard = ShardHostModel(**host, 4, r, false);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ((*shard)->vocab_begin, next_row);
    next_row += (*shard)->host->weights.lm_head.rows;
    const ModelConfig& rc = (*shard)->host->config;
    EXPECT_EQ(rc.num_q_heads, c.num_q_heads / 4);
    EXPECT_EQ(rc.num_kv_heads, 1);  // 2 KV heads over 4 ranks: replicated, one a rank
    const LayerWeights& l0 = (*shard)->host->weights.layers[0];
    EXPECT_EQ(l0.q.rows, c.q_dim() / 4);
    EXPECT_EQ(l0.o.cols, c.q_dim() / 4);
    EXPECT_EQ(l0.experts[0].gate.rows, c.moe_intermediate_size / 4);
    EXPECT_EQ(l0.experts[0].down.cols, c.moe_intermediate_size / 4);
  }
  EXPECT_EQ(next_row, c.vocab_size);
  EXPECT_EQ(ShardHostModel(**host, 4, 4, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  // ep=on: whole experts, experts / tp a rank, the others empty on that rank.
  auto shard = ShardHostModel(**host, 4, 1, true);
  ASSERT_TRUE(shard.ok()) << shard.status();
  const std::vector<ExpertWeights>& experts = (*shard)->host->weights.layers[0].experts;
  for (int e = 0; e < c.num_experts; ++e)
    EXPECT_EQ(experts[e].gate.empty(), e / (c.num_experts / 4) != 1) << "expert " << e;
  EXPECT_EQ(experts[2].gate.rows, c.moe_intermediate_size);
}

// The experts a shard holds, as the CUDA MoE runners read them (HeldExpertRange): every rank's
// run of experts / tp at ep=on, all of them at ep=off and tp=1, none of a dense layer; anything
// but one run of whole experts is refused.
TEST(TensorParallel, HeldExpertsAreTheRanksRun) {
  auto host = LoadHostModel("preset:tiny-qwen2-moe");
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_TRUE(MaterializeHostWeights(**host).ok());
  const ModelConfig& c = (*host)->config;
  ASSERT_EQ(c.num_experts, 8);
  ASSERT_FALSE(c.IsMoeLayer(1));  // the preset's MLP-only layer
  for (int tp : {2, 4})           // its 4 q heads take no more ranks
    for (int rank = 0; rank < tp; ++rank) {
      auto shard = ShardHostModel(**host, tp, rank, /*expert_parallel=*/true);
      ASSERT_TRUE(shard.ok()) << shard.status();
      const ModelWeights& w = (*shard)->host->weights;
      auto held = HeldExpertRange(w.layers[0].experts);
      ASSERT_TRUE(held.ok()) << held.status();
      EXPECT_EQ(held->begin, rank * 8 / tp) << "tp=" << tp << " rank " << rank;
      EXPECT_EQ(held->end, (rank + 1) * 8 / tp) << "tp=" << tp << " rank " << rank;
      EXPECT_TRUE(held->holds(held->begin));
      EXPECT_FALSE(held->holds(held->end));
      auto dense = HeldExpertRange(w.layers[1].experts);
      ASSERT_TRUE(dense.ok()) << dense.status();
      EXPECT_EQ(dense->count(), 0);
    }
  auto sharded = ShardHostModel(**host, 2, 1, /*expert_parallel=*/false);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  auto all = HeldExpertRange((*sharded)->host->weights.layers[0].experts);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->begin, 0);
  EXPECT_EQ(all->end, 8);
  auto whole = HeldExpertRange((*host)->weights.layers[0].experts);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->count(), 8);

  // Rank 1 of 4 holds experts 2 and 3; edits that break its run are refused.
  auto shard = ShardHostModel(**host, 4, 1, /*expert_parallel=*/true);
  ASSERT_TRUE(shard.ok()) << shard.status();
  const std::vector<ExpertWeights> experts = (*shard)->host->weights.layers[0].experts;
  std::vector<ExpertWeights> split = experts;
  split[6] = experts[2];  // a second run
  EXPECT_THAT(HeldExpertRange(split).status().message(),
              HasSubstr("not one run: expert 6 is held outside [2, 4)"));
  std::vector<ExpertWeights> part = experts;
  part[3].down = MatrixRef{};  // gate and up without down
  EXPECT_THAT(HeldExpertRange(part).status().message(), HasSubstr("expert 3 is held in part"));
  std::vector<ExpertWeights> stray = experts;
  stray[0].up = experts[2].up;  // outside the run, up alone
  EXPECT_THAT(HeldExpertRange(stray).status().message(),
              HasSubstr("expert 0 is held outside [2, 4)"));
  const std::vector<ExpertWeights> none(8);
  EXPECT_EQ(HeldExpertRange(none).status().code(), absl::StatusCode::kFailedPrecondition);
}

// ---- Preflight: the registry's tp, ep and allreduce rows and the model's dimensions.

PreflightResult PreflightOn(const std::string& preset, const BackendConfig& config,
                            const std::function<void(ModelConfig&)>& edit = {}) {
  auto model = PresetConfig(preset);
  EXPECT_TRUE(model.ok()) << model.status();
  if (edit) edit(*model);
  auto normalized = NormalizeBackendConfig(config);
  EXPECT_TRUE(normalized.ok()) << normalized.status();
  PreflightTarget target;
  target.weight_format = "bf16";
  target.model = *model;
  return Preflight(*normalized, target);
}

TEST(TensorParallelPreflight, RefusesADimensionTheRanksDoNotDivide) {
  EXPECT_TRUE(PreflightOn("tiny-moe", {{"tp", "4"}}).supported);
  EXPECT_TRUE(PreflightOn("tiny-moe", {{"tp", "4"}, {"ep", "on"}}).supported);
  EXPECT_THAT(PreflightOn("tiny-moe", {{"tp", "8"}}).reason,
              HasSubstr("tp=8 does not divide num_q_heads=4"));
  EXPECT_THAT(PreflightOn("tiny-hybrid", {{"tp", "4"}}).reason,
              HasSubstr("tp=4 does not divide linear_num_key_heads=2"));
  EXPECT_THAT(
      PreflightOn("tiny-moe", {{"tp", "2"}}, [](ModelConfig& c) { c.moe_intermediate_size = 65; })
          .reason,
      HasSubstr("tp=2 does not divide moe_intermediate_size=65"));
  EXPECT_THAT(PreflightOn("tiny-moe", {{"tp", "4"}, {"ep", "on"}},
                          [](ModelConfig& c) { c.num_experts = 6; })
                  .reason,
              HasSubstr("tp=4 does not divide num_experts (ep=on)=6"));
  EXPECT_THAT(
      PreflightOn("tiny-dense", {{"tp", "2"}}, [](ModelConfig& c) { c.intermediate_size = 383; })
          .reason,
      HasSubstr("tp=2 does not divide intermediate_size=383"));
  EXPECT_THAT(PreflightOn("tiny-qwen2-moe", {{"tp", "4"}},
                          [](ModelConfig& c) { c.shared_expert_intermediate_size = 130; })
                  .reason,
              HasSubstr("tp=4 does not divide shared_expert_intermediate_size=130"));
  // KV heads fewer than the ranks are replicated: the ranks must be a multiple of them.
  EXPECT_THAT(PreflightOn("tiny-moe", {{"tp", "8"}},
                          [](ModelConfig& c) {
                            c.num_q_heads = 24;
                            c.num_kv_heads = 3;
                          })
                  .reason,
              HasSubstr("tp=8 is not a multiple of num_kv_heads=3"));
  EXPECT_THAT(PreflightOn("tiny-dense", {{"tp", "2"}, {"ep", "on"}}).reason,
              HasSubstr("ep=on needs a mixture-of-experts model"));
}

TEST(TensorParallelPreflight, RegistryRowsAndDevices) {
  // ep=on with one rank would repeat ep=off's run.
  EXPECT_THAT(PreflightOn("tiny-moe", {{"ep", "on"}}).reason,
              HasSubstr("ep=on cannot be combined with tp=1"));
  // The CPU's all-reduce is its fixed-order sum; NCCL's values are the GPU's.
  auto cpu_nccl = NormalizeBackendConfig({{"allreduce", "nccl"}});
  ASSERT_FALSE(cpu_nccl.ok());
  EXPECT_THAT(cpu_nccl.status().message(),
              HasSubstr("config axis 'allreduce': unknown value 'nccl' (known: reference)"));
  auto bad_tp = NormalizeBackendConfig({{"tp", "3"}});
  ASSERT_FALSE(bad_tp.ok());
  EXPECT_THAT(bad_tp.status().message(), HasSubstr("config axis 'tp'"));
  // The GPU: tp needs that many GPUs of the host; the custom all-reduce runs at one rank, the
  // fused one needs more.
  PreflightTarget gpu;
  gpu.has_cuda_build = true;
  gpu.sm = 90;
  gpu.gpu_count = 1;
  auto cuda_tp = NormalizeBackendConfig({{"device", "cuda"}, {"tp", "2"}});
  ASSERT_TRUE(cuda_tp.ok()) << cuda_tp.status();
  EXPECT_EQ(Preflight(*cuda_tp, gpu).reason, "tp=2 needs 2 GPUs of one host; this host has 1");
  gpu.gpu_count = 2;
  EXPECT_TRUE(Preflight(*cuda_tp, gpu).supported);
  auto custom = NormalizeBackendConfig({{"device", "cuda"}, {"allreduce", "custom"}});
  ASSERT_TRUE(custom.ok()) << custom.status();
  EXPECT_TRUE(Preflight(*custom, gpu).supported) << Preflight(*custom, gpu).reason;
  auto fused = NormalizeBackendConfig({{"device", "cuda"}, {"allreduce", "fused"}});
  ASSERT_TRUE(fused.ok()) << fused.status();
  EXPECT_THAT(Preflight(*fused, gpu).reason,
              HasSubstr("allreduce=fused cannot be combined with tp=1"));
}

// The CUDA default all-reduce is auto, left out of a normalized config (so the default config
// names the same run as before the axis, and launches nothing more at tp=1); a named nccl stays
// in it, so that tp=1 through a single-rank NCCL communicator is its own run.
TEST(TensorParallelPreflight, CudaAllReduceDefaultIsAutoAndNcclIsKept) {
  auto with_auto = NormalizeBackendConfig({{"device", "cuda"}, {"allreduce", "auto"}});
  ASSERT_TRUE(with_auto.ok()) << with_auto.status();
  EXPECT_EQ(with_auto->count("allreduce"), 0u);
  auto options = ParseCudaOptions(*with_auto);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->parallel.allreduce, AllReduce::kAuto);
  EXPECT_FALSE(options->parallel.RunsCollective());
  auto nccl = NormalizeBackendConfig({{"device", "cuda"}, {"allreduce", "nccl"}});
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_EQ(nccl->at("allreduce"), "nccl");
  options = ParseCudaOptions(*nccl);
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->parallel.allreduce, AllReduce::kNccl);
  EXPECT_TRUE(options->parallel.RunsCollective());
  options = ParseCudaOptions(*NormalizeBackendConfig({{"device", "cuda"}, {"tp", "2"}}));
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_TRUE(options->parallel.RunsCollective());
}

TEST(TensorParallel, CreateModelRefusesWhatCannotShard) {
  auto host = LoadHostModel("preset:tiny-dense");
  ASSERT_TRUE(host.ok()) << host.status();
  auto model = CreateModel(**host, *NormalizeBackendConfig({{"tp", "8"}}));
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(model.status().message(), HasSubstr("tp=8 does not divide num_q_heads=4"));
  auto faulty = CreateModel(**host, *NormalizeBackendConfig({{"tp", "2"}}),
                            *ParseFaultInjection("nan-layer:0"));
  ASSERT_FALSE(faulty.ok());
  EXPECT_THAT(faulty.status().message(), HasSubstr("tp=1 models only"));
}

}  // namespace
}  // namespace infersweep
