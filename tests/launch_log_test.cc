// The launch log (core/launch_log.h): scopes, counts, graph replays, fallbacks, kernel names.
#include "core/launch_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>
#include <thread>

namespace infersweep {

// Launch counts in test failures as "name x count" (found by argument-dependent lookup).
void PrintTo(const KernelCount& k, std::ostream* os) { *os << k.name << " x" << k.count; }

namespace {

using ::testing::ElementsAre;

TEST(LaunchLog, NothingIsRecordedWithoutAScope) {
  EXPECT_FALSE(LaunchRecording());
  EXPECT_EQ(ActiveLaunchRecorder(), nullptr);
  RecordLaunch("GemvKernel<1, 1>");  // no recorder: a no-op, not a crash
  RecordFallback("gemm=fused: nothing records this");
  LaunchRecorder recorder;
  {
    ScopedLaunchRecording record(&recorder);
    EXPECT_TRUE(LaunchRecording());
    RecordLaunch("StepInputsKernel");
  }
  EXPECT_FALSE(LaunchRecording());
  RecordLaunch("StepInputsKernel");  // after the scope: not recorded
  EXPECT_THAT(recorder.kernels(), ElementsAre(KernelCount{"StepInputsKernel", 1}));
}

TEST(LaunchLog, CountsByNameInFirstLaunchOrder) {
  LaunchRecorder recorder;
  ScopedLaunchRecording record(&recorder);
  RecordLaunch("rmsnorm");
  RecordLaunch("matmul_naive", 3);
  RecordLaunch("rmsnorm");
  RecordLaunch("attention");
  RecordLaunch("matmul_naive");
  EXPECT_THAT(recorder.kernels(),
              ElementsAre(KernelCount{"rmsnorm", 2}, KernelCount{"matmul_naive", 4},
                          KernelCount{"attention", 1}));
  EXPECT_EQ(recorder.count("matmul_naive"), 4);
  EXPECT_EQ(recorder.count("never"), 0);
  EXPECT_EQ(recorder.total_launches(), 7);
  EXPECT_FALSE(recorder.graph_replayed());
}

// An inner scope shadows the outer one and gives it back when it ends.
TEST(LaunchLog, NestedScopesShadowAndRestore) {
  LaunchRecorder outer, inner;
  ScopedLaunchRecording record_outer(&outer);
  RecordLaunch("a");
  {
    ScopedLaunchRecording record_inner(&inner);
    EXPECT_EQ(ActiveLaunchRecorder(), &inner);
    RecordLaunch("b");
    RecordFallback("inner only");
    {
      ScopedLaunchRecording suspended(nullptr);  // a null recorder suspends recording
      EXPECT_FALSE(LaunchRecording());
      RecordLaunch("c");
    }
    RecordLaunch("b");
  }
  EXPECT_EQ(ActiveLaunchRecorder(), &outer);
  RecordLaunch("a");
  EXPECT_THAT(outer.kernels(), ElementsAre(KernelCount{"a", 2}));
  EXPECT_TRUE(outer.fallbacks().empty());
  EXPECT_THAT(inner.kernels(), ElementsAre(KernelCount{"b", 2}));
  EXPECT_THAT(inner.fallbacks(), ElementsAre("inner only"));
}

// A graph's capture is recorded once; every replay adds exactly what it captured, fallbacks too.
TEST(LaunchLog, GraphReplayAddsTheCapturedLaunches) {
  LaunchRecorder captured;
  {
    ScopedLaunchRecording capture(&captured);
    RecordLaunch("StepInputsKernel");
    RecordLaunch("GemvKernel<2, 1>", 2);
    RecordFallback("gemm=fused: something");
  }
  LaunchRecorder step;
  RecordGraphReplay(captured);  // nothing records: no effect
  EXPECT_TRUE(step.empty());
  {
    ScopedLaunchRecording record(&step);
    RecordGraphReplay(captured);
  }
  EXPECT_TRUE(step.graph_replayed());
  EXPECT_THAT(step.kernels(),
              ElementsAre(KernelCount{"StepInputsKernel", 1}, KernelCount{"GemvKernel<2, 1>", 2}));
  EXPECT_THAT(step.fallbacks(), ElementsAre("gemm=fused: something"));
  // Two replays in one recording: twice the launches, the fallback once.
  LaunchRecorder two;
  {
    ScopedLaunchRecording record(&two);
    RecordGraphReplay(captured);
    RecordGraphReplay(captured);
  }
  EXPECT_EQ(two.count("GemvKernel<2, 1>"), 4);
  EXPECT_EQ(two.total_launches(), 6);
  EXPECT_EQ(two.fallbacks().size(), 1u);
  EXPECT_FALSE(captured.graph_replayed());  // the capture itself replayed nothing
}

TEST(LaunchLog, FallbacksAreDeduplicatedInFirstSeenOrder) {
  LaunchRecorder recorder;
  ScopedLaunchRecording record(&recorder);
  for (int layer = 0; layer < 3; ++layer) {
    RecordFallback("moe=fused: B");
    RecordFallback("gemm=fused: A");
  }
  EXPECT_THAT(recorder.fallbacks(), ElementsAre("moe=fused: B", "gemm=fused: A"));
  recorder.Clear();
  EXPECT_TRUE(recorder.empty());
  EXPECT_EQ(recorder.count("anything"), 0);
}

// Recording is per thread: another thread's launches go to its own recorder, or nowhere.
TEST(LaunchLog, RecordersArePerThread) {
  LaunchRecorder mine, theirs;
  ScopedLaunchRecording record(&mine);
  std::thread other([&] {
    EXPECT_FALSE(LaunchRecording());
    RecordLaunch("unrecorded");
    ScopedLaunchRecording record_other(&theirs);
    RecordLaunch("other");
  });
  other.join();
  RecordLaunch("mine");
  EXPECT_THAT(mine.kernels(), ElementsAre(KernelCount{"mine", 1}));
  EXPECT_THAT(theirs.kernels(), ElementsAre(KernelCount{"other", 1}));
}

// Kernel names as the CUDA runtime gives them (mangled; these are symbols of this repo's kernels
// as nvcc emits them), demangled and shortened: template variants stay distinct.
TEST(LaunchLog, KernelNamesAreShortAndKeepTemplateArguments) {
  EXPECT_EQ(SymbolKernelName("_ZN10infersweep4cuda39_GLOBAL__N__9049f1b5_7_gemv_cu_e1db61da10Gemv"
                             "KernelILi1ELi1EEEvNS0_8GemvArgsE"),
            "GemvKernel<1, 1>");
  EXPECT_EQ(SymbolKernelName("_ZN10infersweep4cuda39_GLOBAL__N__9049f1b5_7_gemv_cu_e1db61da10Gemv"
                             "KernelILi2ELi4EEEvNS0_8GemvArgsE"),
            "GemvKernel<2, 4>");
  EXPECT_EQ(SymbolKernelName("_ZN10infersweep4cuda46_GLOBAL__N__1143e02a_13_gemv_quant_cu_4d92882a"
                             "15GemvQuantKernelILNS_11QuantFormatE1ELi4EEEvNS0_8GemvArgsENS0_16Qua"
                             "ntGemvWeightsE"),
            "GemvQuantKernel<(QuantFormat)1, 4>");
  EXPECT_EQ(SymbolKernelName("_ZN10infersweep4cuda53_GLOBAL__N__6c0e2138_20_attention_prefill_cu_e"
                             "1fe98d618FlashPrefillKernelILi32E13__nv_bfloat16EEvPKfPKT0_S8_iiiPKii"
                             "Pf"),
            "FlashPrefillKernel<32, __nv_bfloat16>");
  // Not a template: no return type in the symbol.
  EXPECT_EQ(SymbolKernelName("_ZN10infersweep4cuda47_GLOBAL__N__8701b5d7_14_elementwise_cu_dc206b"
                             "0313RmsNormKernelEPKfiPKvNS_5DTypeEfPfP13__nv_bfloat16"),
            "RmsNormKernel");
  // A C name (extern "C") is kept as it is.
  EXPECT_EQ(SymbolKernelName("my_c_kernel"), "my_c_kernel");
  EXPECT_EQ(ShortKernelName("void ns::(anonymous namespace)::K<ns::T<int>, 2>(ns::Args, int)"),
            "K<T<int>, 2>");
  const std::string long_name = "void K<" + std::string(200, 'x') + ">(int)";
  EXPECT_EQ(ShortKernelName(long_name).size(), 120u);
}

}  // namespace
}  // namespace infersweep
