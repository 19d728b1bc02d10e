// What ran, per result: the harness records one untimed prefill and decode step per batch size
// through the launch log (core/launch_log.h), stores them in BatchFigures and the JSON, and
// reports them (harness/report.h). The CPU engine's side here; the CUDA engine's in gpu_test.cc
// (GpuProvenance.*).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "core/launch_log.h"
#include "engine/backends.h"
#include "engine/cpu_model.h"
#include "api/model_config.h"
#include "harness/executor.h"
#include "harness/measure.h"
#include "harness/report.h"
#include "api/trial.h"
#include "kernels/cpu/parallel.h"

namespace infersweep {

// Launch counts in test failures as "name x count" (found by argument-dependent lookup).
void PrintTo(const KernelCount& k, std::ostream* os) { *os << k.name << " x" << k.count; }

namespace {

using testing::ElementsAre;
using testing::HasSubstr;

int64_t Count(const PhaseKernels& p, const std::string& name) {
  for (const KernelCount& k : p.kernels)
    if (k.name == name) return k.count;
  return 0;
}

TrialRequest TinyMoeRequest(const std::string& config, int warmup) {
  TrialRequest r;
  r.trial_id = "provenance";
  r.model = "preset:tiny-moe";
  r.layers = 2;
  r.config = *ParseBackendConfig(config);
  r.workload.prompt_len = 8;
  r.workload.output_len = 4;
  r.workload.repeats = 2;
  r.workload.warmup = warmup;
  r.workload.batch_sizes = {1, 3};
  return r;
}

// A CPU trial records, per batch size, the ops of one prefill and one decode step: the selected
// matmul variant (and not the other), each per-layer op once per layer, and the matmuls a layer
// runs (q, k, v, o, router, then gate, up and down per expert with rows routed to it), plus the
// lm_head. With warm-up and without it (the extra untimed step after the timed repeats).
TEST(Provenance, CpuTrialRecordsTheOpsOfTheSelectedVariant) {
  const int layers = 2, top_k = 2, experts = 8;  // tiny-moe at 2 layers: every layer MoE
  TrialExecutor executor(LocalDevices{});
  for (const std::string variant : {"naive", "blocked"}) {
    for (int warmup : {0, 1}) {
      SCOPED_TRACE("matmul=" + variant + ", warmup " + std::to_string(warmup));
      const TrialResult result =
          executor.Execute(TinyMoeRequest("device=cpu,threads=1,matmul=" + variant, warmup));
      ASSERT_EQ(result.status, TrialStatus::kOk) << result.reason;
      ASSERT_EQ(result.batches.size(), 2u);
      const std::string matmul = "matmul_" + variant;
      const std::string other = variant == "naive" ? "matmul_blocked" : "matmul_naive";
      for (const BatchFigures& b : result.batches) {
        SCOPED_TRACE(FormatKernels(b));
        ASSERT_TRUE(b.prefill_kernels.has_value());
        ASSERT_TRUE(b.decode_kernels.has_value());
        for (const PhaseKernels* p : {&*b.prefill_kernels, &*b.decode_kernels}) {
          EXPECT_FALSE(p->graph);
          EXPECT_TRUE(p->fallbacks.empty());
          // First-launch order: the step's input first, the host's pick last.
          ASSERT_FALSE(p->kernels.empty());
          EXPECT_EQ(p->kernels.front(), (KernelCount{"embedding", 1}));
          EXPECT_EQ(p->kernels.back(), (KernelCount{"greedy_pick", 1}));
          EXPECT_EQ(Count(*p, "rmsnorm"), 2 * layers + 1);  // two a layer, the final norm
          EXPECT_EQ(Count(*p, "qk_norm_rope_append"), layers);
          EXPECT_EQ(Count(*p, "attention"), layers);
          EXPECT_EQ(Count(*p, "router_topk"), layers);
          EXPECT_EQ(Count(*p, "moe_experts"), layers);
          EXPECT_EQ(Count(*p, other), 0);
          // One silu_mul per expert run: at least top_k a layer (a row's experts are distinct).
          const int64_t expert_runs = Count(*p, "silu_mul");
          EXPECT_GE(expert_runs, layers * top_k);
          EXPECT_LE(expert_runs, layers * experts);
          EXPECT_EQ(Count(*p, matmul), layers * 5 + 3 * expert_runs + 1);
        }
        // One sequence, one token: exactly its top_k experts a layer.
        if (b.batch == 1) {
          EXPECT_EQ(Count(*b.decode_kernels, "silu_mul"), layers * top_k);
        }
      }
      // The JSON carries it and reads it back.
      auto back = TrialResultFromJson(nlohmann::json::parse(ToJson(result).dump()));
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(ToJson(*back), ToJson(result));
      ASSERT_TRUE(back->batches[1].decode_kernels.has_value());
      EXPECT_EQ(back->batches[1].decode_kernels->kernels,
                result.batches[1].decode_kernels->kernels);
      EXPECT_TRUE(SameKernels(back->batches[1], result.batches[1]));
    }
  }
}

// A model that passes every call on to a CPU model and notes which ForwardGreedy calls ran
// while a launch recording was active; it records a fallback of its own in every step.
class WatchedModel : public Model {
 public:
  explicit WatchedModel(Model& inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_.config(); }
  std::string device() const override { return inner_.device(); }
  absl::Status StartBatch(int batch, int max_tokens) override {
    return inner_.StartBatch(batch, max_tokens);
  }
  absl::Status Forward(std::span<const int32_t> tokens, int n, LogitsMode mode,
                       std::vector<float>* logits) override {
    return inner_.Forward(tokens, n, mode, logits);
  }
  absl::Status ForwardGreedy(std::span<const int32_t> tokens, int n,
                             std::vector<int32_t>* next) override {
    if (LaunchRecording()) recorded_calls.push_back(calls);
    ++calls;
    RecordFallback("test: a fallback in every " + std::string(n > 1 ? "prefill" : "decode") +
                   " step");
    return inner_.ForwardGreedy(tokens, n, next);
  }
  int position() const override { return inner_.position(); }
  int calls = 0;
  std::vector<int> recorded_calls;  // indices of the calls made while recording

 private:
  Model& inner_;
};

std::unique_ptr<HostModel> TinyDenseHost() {
  auto loaded = LoadHostModel("preset:tiny-dense", {2});
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(MaterializeHostWeights(**loaded).ok());
  return std::move(*loaded);
}

// Recording stays out of the timed repeats: it is the last warm-up repeat's prefill and last
// decode step, or without warm-up one more prefill and decode step after the timed repeats. A
// fallback recorded during a step lands in BatchFigures and in the JSON.
TEST(Provenance, StepsAreRecordedOutsideTheTimedRepeatsWithTheirFallbacks) {
  std::unique_ptr<HostModel> host = TinyDenseHost();
  std::unique_ptr<Model> cpu = MakeCpuModel(*host);
  Workload w;
  w.prompt_len = 4;
  w.output_len = 5;
  w.repeats = 2;
  for (int warmup : {0, 2}) {
    SCOPED_TRACE("warmup " + std::to_string(warmup));
    w.warmup = warmup;
    WatchedModel model(*cpu);
    auto figures = MeasureBatch(model, w, 2, MeasureOptions{});
    ASSERT_TRUE(figures.ok()) << figures.status();
    const int timed_calls = (w.warmup + w.repeats) * w.output_len;
    if (warmup > 0) {
      EXPECT_EQ(model.calls, timed_calls);
      // The last warm-up repeat: its prefill and its last decode step.
      const int first = (warmup - 1) * w.output_len;
      EXPECT_THAT(model.recorded_calls, ElementsAre(first, first + w.output_len - 1));
    } else {
      EXPECT_EQ(model.calls, timed_calls + 2);
      EXPECT_THAT(model.recorded_calls, ElementsAre(timed_calls, timed_calls + 1));
    }
    ASSERT_TRUE(figures->prefill_kernels.has_value());
    ASSERT_TRUE(figures->decode_kernels.has_value());
    EXPECT_THAT(figures->prefill_kernels->fallbacks,
                ElementsAre("test: a fallback in every prefill step"));
    EXPECT_THAT(figures->decode_kernels->fallbacks,
                ElementsAre("test: a fallback in every decode step"));
    EXPECT_EQ(Count(*figures->decode_kernels, "greedy_pick"), 1);

    TrialResult result;
    result.status = TrialStatus::kOk;
    result.batches.push_back(*figures);
    const nlohmann::json j = ToJson(result);
    const nlohmann::json& fallbacks =
        j.at("batches").at(0).at("kernels").at("decode").at("fallbacks");
    ASSERT_EQ(fallbacks.size(), 1u) << j.dump();
    EXPECT_EQ(fallbacks.at(0), "test: a fallback in every decode step");
    auto back = TrialResultFromJson(nlohmann::json::parse(j.dump()));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->batches[0].decode_kernels->fallbacks, figures->decode_kernels->fallbacks);
    EXPECT_EQ(back->batches[0].prefill_kernels->kernels, figures->prefill_kernels->kernels);
  }
}

// The CPU engine's one fallback: the process-wide thread pool running another count than the
// model's `threads` (a model built after its StartBatch resized it). Recorded in the step;
// StartBatch gives the model its own count back.
TEST(Provenance, CpuThreadPoolResizedUnderAModelIsAFallback) {
  std::unique_ptr<HostModel> host = TinyDenseHost();
  CpuModelOptions one_thread;
  one_thread.threads = 1;
  std::unique_ptr<Model> model = MakeCpuModel(*host, one_thread);
  ASSERT_TRUE(model->StartBatch(1, 8).ok());
  CpuModelOptions two_threads;
  two_threads.threads = 2;
  std::unique_ptr<Model> other = MakeCpuModel(*host, two_threads);  // resizes the shared pool
  std::vector<int32_t> next;
  LaunchRecorder resized;
  {
    ScopedLaunchRecording record(&resized);
    ASSERT_TRUE(model->ForwardGreedy(std::vector<int32_t>{1, 2, 3}, 3, &next).ok());
  }
  EXPECT_THAT(resized.fallbacks(),
              ElementsAre(HasSubstr("threads=1: ran on 2 threads (1 configured")));
  ASSERT_TRUE(model->StartBatch(1, 8).ok());
  EXPECT_EQ(cpu::NumThreads(), 1);
  LaunchRecorder own;
  {
    ScopedLaunchRecording record(&own);
    ASSERT_TRUE(model->ForwardGreedy(std::vector<int32_t>{1, 2, 3}, 3, &next).ok());
  }
  EXPECT_TRUE(own.fallbacks().empty());
  EXPECT_GT(own.count("matmul_naive"), 0);
}

// Results stored before the launch log existed read without it; a malformed one is refused
// with the field named.
TEST(Provenance, KernelsJsonIsOptionalAndValidated) {
  TrialResult r;
  r.status = TrialStatus::kOk;
  BatchFigures b;
  b.decode_kernels = PhaseKernels{true, {{"GemvKernel<1, 1>", 6}}, {"gemm=fused: x"}};
  r.batches.push_back(b);
  nlohmann::json j = ToJson(r);
  EXPECT_TRUE(j.at("batches")[0].at("kernels").at("prefill").is_null());
  auto back = TrialResultFromJson(j);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->batches[0].prefill_kernels.has_value());
  ASSERT_TRUE(back->batches[0].decode_kernels.has_value());
  EXPECT_TRUE(back->batches[0].decode_kernels->graph);
  EXPECT_THAT(back->batches[0].decode_kernels->kernels,
              ElementsAre(KernelCount{"GemvKernel<1, 1>", 6}));

  // A batch without the key (an old result) has no kernels, and writes none back.
  nlohmann::json old = j;
  old.at("batches")[0].erase("kernels");
  auto old_back = TrialResultFromJson(old);
  ASSERT_TRUE(old_back.ok()) << old_back.status();
  EXPECT_FALSE(old_back->batches[0].decode_kernels.has_value());
  EXPECT_FALSE(ToJson(*old_back).at("batches")[0].contains("kernels"));

  auto refused = [&](auto mutate) {
    nlohmann::json bad = j;
    mutate(bad.at("batches")[0].at("kernels"));
    auto parsed = TrialResultFromJson(bad);
    EXPECT_FALSE(parsed.ok());
    return std::string(parsed.status().message());
  };
  EXPECT_THAT(refused([](nlohmann::json& k) { k = "yes"; }),
              HasSubstr("result.batches[].kernels: not an object"));
  EXPECT_THAT(refused([](nlohmann::json& k) { k["decode"] = 3; }),
              HasSubstr("result.batches[].kernels.decode: not an object"));
  EXPECT_THAT(refused([](nlohmann::json& k) { k["decode"]["graph"] = "true"; }),
              HasSubstr("result.batches[].kernels.decode.graph: wrong type"));
  EXPECT_THAT(refused([](nlohmann::json& k) { k["decode"]["launches"] = "GemvKernel"; }),
              HasSubstr("result.batches[].kernels.decode.launches: not an array"));
  EXPECT_THAT(refused([](nlohmann::json& k) { k["decode"]["launches"][0]["count"] = "6"; }),
              HasSubstr("result.batches[].kernels.decode.launches[].count: wrong type"));
  EXPECT_THAT(refused([](nlohmann::json& k) { k["decode"]["launches"][0]["count"] = 0; }),
              HasSubstr("result.batches[].kernels.decode.launches[].count: 0"));
  EXPECT_THAT(refused([](nlohmann::json& k) { k["decode"]["launches"][0].erase("name"); }),
              HasSubstr("result.batches[].kernels.decode.launches[].name: missing"));
  EXPECT_THAT(refused([](nlohmann::json& k) {
                k["prefill"] = {{"fallbacks", {1, 2}}};
              }),
              HasSubstr("result.batches[].kernels.prefill.fallbacks: wrong type"));
}

BatchFigures Figures(PhaseKernels prefill, PhaseKernels decode) {
  BatchFigures b;
  b.batch = 4;
  b.prefill_kernels = std::move(prefill);
  b.decode_kernels = std::move(decode);
  return b;
}

TEST(Provenance, FormatKernelsListsEachPhase) {
  const BatchFigures b = Figures({false, {{"cublasLt:bf16 gemm", 5}}, {"gemm=fused: prefill"}},
                                 {true, {{"StepInputsKernel", 1}, {"GemvKernel<1, 4>", 6}}, {}});
  EXPECT_EQ(FormatKernels(b),
            "#   prefill at batch 4: one step, 5 launches\n"
            "#          5  cublasLt:bf16 gemm\n"
            "#     fallback: gemm=fused: prefill\n"
            "#   decode at batch 4: one step, a CUDA graph replay, 7 launches\n"
            "#          1  StepInputsKernel\n"
            "#          6  GemvKernel<1, 4>\n");
  BatchFigures old;
  old.batch = 2;
  EXPECT_EQ(FormatKernels(old),
            "#   prefill at batch 2: not recorded\n#   decode at batch 2: not recorded\n");
}

TEST(Provenance, KernelDifferencesNameEachDifference) {
  const PhaseKernels prefill{false, {{"cublasLt:bf16 gemm", 5}}, {}};
  const BatchFigures a =
      Figures(prefill, {true,
                        {{"StepInputsKernel", 1}, {"GemvKernel<1, 4>", 6}, {"MoeGateUpKernel", 2}},
                        {"moe=wgmma: x"}});
  EXPECT_TRUE(KernelDifferences(a, a).empty());
  EXPECT_TRUE(SameKernels(a, a));
  // The same kernels launched in another order are the same.
  BatchFigures reordered = a;
  std::reverse(reordered.decode_kernels->kernels.begin(), reordered.decode_kernels->kernels.end());
  EXPECT_TRUE(SameKernels(a, reordered));

  const BatchFigures b = Figures(
      prefill, {false,
                {{"StepInputsKernel", 1}, {"GemvKernel<1, 4>", 8}, {"cublasLt:bf16 gemm", 2}},
                {"gemm=fused: y"}});
  EXPECT_THAT(KernelDifferences(a, b, "on", "off"),
              ElementsAre("decode: a CUDA graph replay in on only",
                          "decode: only in on: MoeGateUpKernel x2",
                          "decode: only in off: cublasLt:bf16 gemm x2",
                          "decode: GemvKernel<1, 4> x6 in on, x8 in off",
                          "decode: fallback in on only: moe=wgmma: x",
                          "decode: fallback in off only: gemm=fused: y"));
  EXPECT_FALSE(SameKernels(a, b));
  // A side without a launch log (an old result) differs, and is never the same.
  BatchFigures old;
  old.batch = 4;
  EXPECT_THAT(KernelDifferences(a, old),
              ElementsAre("prefill: recorded in A only", "decode: recorded in A only"));
  EXPECT_FALSE(SameKernels(old, old));
}

}  // namespace
}  // namespace infersweep
