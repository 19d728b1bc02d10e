// The plans (engine/plan/): one decision per op family that the launch, the scratch, the model
// refusal and the capability probe read. The registry walk fails when a registered value lacks
// a description, a plan case or a probe entry; the rest checks what the plans decide.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>

#include "api/backend_config.h"
#include "api/model_config.h"
#include "engine/options.h"
#include "engine/plan/attention_plan.h"
#include "engine/plan/collective_plan.h"
#include "engine/plan/linear_attention_plan.h"
#include "engine/plan/linear_plan.h"
#include "engine/plan/model_limits.h"
#include "engine/plan/moe_plan.h"
#include "engine/plan/probe_plan.h"
#include "engine/plan/step_plan.h"
#include "kernels/cuda/limits.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;

CudaOptions OptionsWith(const std::string& axis, const std::string& value) {
  absl::StatusOr<BackendConfig> config =
      NormalizeBackendConfig({{"device", "cuda"}, {axis, value}});
  EXPECT_TRUE(config.ok()) << axis << "=" << value << ": " << config.status();
  absl::StatusOr<CudaOptions> o =
      ParseCudaOptions(config.value_or(BackendConfig{{"device", "cuda"}}));
  EXPECT_TRUE(o.ok()) << axis << "=" << value << ": " << o.status();
  return o.value_or(CudaOptions{});
}

const char* PathName(AttentionPath p) {
  switch (p) {
    case AttentionPath::kNaive:
      return "naive";
    case AttentionPath::kFlash:
      return "flash";
    case AttentionPath::kCudnn:
      return "cudnn";
  }
  return "?";
}

// Per axis: what the value's plan must say about it on a small MoE model (qwen3-style heads,
// bf16 experts), or "" when it is right. An axis without an entry has no plan check: the walk
// fails on it until one is written.
using PlanCheck = std::function<std::string(const std::string& value, const CudaOptions&)>;

std::map<std::string, PlanCheck> PlanChecks() {
  const AttentionHeads heads{16, 4, 128};
  const MoeShape moe{128, 8, 2048, 768};
  MoeLayerFacts bf16;
  bf16.experts_bf16 = true;
  bf16.router_f32_copy = true;
  auto moe_on = [moe, bf16](const CudaOptions& o, int rows, int n) {
    return PlanMoe(o, moe, bf16, {rows, n, false});
  };
  return {
      {"gemm",
       [](const std::string& v, const CudaOptions& o) -> std::string {
         // A bf16 linear under the runner the value builds, and a batch-1 decode step.
         const LinearPath linear = PlanLinear(o, {DType::kBF16, QuantFormat::kNone, 4096, 2048},
                                              {UsesCublasLt(o.gemm), 1, false, true})
                                       .path;
         const bool gemv = PlanStep(o, {1, 1, false, 2048, 768, false, true}).fused_gemv;
         if (linear != (v == "reference" ? LinearPath::kReference : LinearPath::kCublasLt))
           return absl::StrCat("planned linear path ", static_cast<int>(linear));
         if (gemv != (v == "fused" || v == "tma")) return absl::StrCat("planned gemv=", gemv);
         return "";
       }},
      {"allreduce",
       [](const std::string& v, const CudaOptions& o) -> std::string {
         // tp=1: a named all-reduce runs over one rank, auto runs none; a rank process (tp > 1)
         // always runs one, auto's being NCCL's.
         absl::StatusOr<CollectivePlan> one = PlanCollective(o.parallel, false, 4096);
         ParallelOptions ranks = o.parallel;
         ranks.tp = 2;
         absl::StatusOr<CollectivePlan> two = PlanCollective(ranks, true, 4096);
         if (!one.ok() || !two.ok()) return "refused";
         const std::map<std::string, std::pair<CollectiveTransport, int64_t>> expect = {
             {"auto", {CollectiveTransport::kNone, 0}},
             {"nccl", {CollectiveTransport::kNccl, 0}},
             {"custom", {CollectiveTransport::kPeerBuffers, 4096}},
             {"fused", {CollectiveTransport::kPeerBuffers, 4096}}};
         auto it = expect.find(v);
         if (it == expect.end()) return "no expected plan for this value";
         if (one->transport != it->second.first || one->max_message_bytes != it->second.second)
           return absl::StrCat("tp=1: planned transport ", static_cast<int>(one->transport));
         const bool peers = v == "custom" || v == "fused";
         if (two->transport !=
                 (peers ? CollectiveTransport::kPeerBuffers : CollectiveTransport::kNccl) ||
             two->max_message_bytes != (peers ? kRankMessageBytes : 0) ||
             AxisValueName(two->kind) != (v == "auto" ? std::string("nccl") : v))
           return absl::StrCat("tp=2: planned ", AxisValueName(two->kind));
         return "";
       }},
      {"graphs",
       [](const std::string& v, const CudaOptions& o) -> std::string {
         // A batch-1 decode step with the persistent kernel built when the value builds it.
         const StepPlan p = PlanStep(o, {1, 1, false, 2048, 768, IsPersistent(o.graphs)});
         const bool captured = CapturesStep(o, 1, true);
         const bool persistent = p.layers == StepLayers::kPersistent;
         if (captured != (v != "off") || persistent != (v == "persistent"))
           return absl::StrCat("planned captured=", captured, ", persistent=", persistent);
         return CapturesStep(o, 16, true) ? "a prefill chunk captured" : "";
       }},
      {"linear_attn",
       [](const std::string& v, const CudaOptions& o) -> std::string {
         const LinearAttentionPlan p = PlanLinearAttention(o);
         const bool fused = p.delta_rule == DeltaRulePath::kFused;
         const bool chunked = p.delta_rule == DeltaRulePath::kChunked;
         if (v == "reference" && !fused && !chunked && !p.silu_in_conv && !p.decode_fused)
           return "";
         if (v == "fused" && fused && p.silu_in_conv && !p.decode_fused) return "";
         if (v == "fused_decode" && fused && p.silu_in_conv && p.decode_fused) return "";
         if (v == "chunked" && chunked && p.silu_in_conv && p.decode_fused) return "";
         return absl::StrCat("planned fused=", fused, ", chunked=", chunked,
                             ", silu in conv=", p.silu_in_conv, ", decode fused=", p.decode_fused);
       }},
      {"qgemm",
       [](const std::string& v, const CudaOptions& o) -> std::string {
         // q_proj of qwen3-30b-a3b at one decode row, in the format the value takes; under
         // dequant_bf16 the linear finds the bf16 copy the load made.
         LinearWeightFacts w{DType::kBF16, QuantFormat::kNvfp4, 4096, 2048};
         if (v == "w8a16" || v == "fp8_cublaslt" || v == "w8a8")
           w.format = QuantFormat::kFp8Channel;
         if (v == "dequant_bf16") w.format = QuantFormat::kNone;
         const LinearPlan p = PlanLinear(o, w, {true, 1, false, true});
         const std::map<std::string, LinearPath> expect = {
             {"reference", LinearPath::kQuantReference}, {"dequant_bf16", LinearPath::kCublasLt},
             {"w4a16", LinearPath::kQuantGemvFp4},       {"w8a16", LinearPath::kQuantGemvFp8},
             {"fp8_cublaslt", LinearPath::kScaledGemm},  {"cudnn", LinearPath::kScaledGemm},
             {"native_fp4", LinearPath::kScaledGemm},    {"w8a8", LinearPath::kQuantGemvFp8}};
         auto it = expect.find(v);
         if (it == expect.end()) return "no expected plan for this value";
         return p.path == it->second ? "" : absl::StrCat("planned path ", static_cast<int>(p.path));
       }},
      {"attention",
       [heads](const std::string& v, const CudaOptions& o) -> std::string {
         absl::StatusOr<AttentionPlan> p = PlanAttention(o, heads);
         if (!p.ok()) return std::string(p.status().message());
         return PathName(p->path) == v ? "" : absl::StrCat("planned ", PathName(p->path));
       }},
      {"kv_cache",
       [heads](const std::string& v, const CudaOptions& o) -> std::string {
         absl::StatusOr<AttentionPlan> p = PlanAttention(o, heads);
         if (!p.ok()) return std::string(p.status().message());
         const int bytes = v == "fp32" ? 4 : v == "bf16" ? 2 : v == "fp8" ? 1 : 0;
         if (AxisValueName(p->kv) != v || p->kv_bytes_per_element != bytes)
           return absl::StrCat("planned ", AxisValueName(p->kv), ", ", p->kv_bytes_per_element,
                               " bytes an element");
         return "";
       }},
      {"moe",
       [moe_on](const std::string& v, const CudaOptions& o) -> std::string {
         // Decode at batch 64 and a 2048-token prefill chunk.
         const MoePlan decode = moe_on(o, 64, 1), prefill = moe_on(o, 2048, 2048);
         const std::map<std::string, std::pair<MoeExperts, MoeExperts>> expect = {
             {"loop", {MoeExperts::kLoop, MoeExperts::kLoop}},
             {"grouped", {MoeExperts::kCublasGrouped, MoeExperts::kCublasGrouped}},
             {"fused", {MoeExperts::kGrouped, MoeExperts::kGrouped}},
             {"wgmma", {MoeExperts::kGrouped, MoeExperts::kGrouped}}};
         auto it = expect.find(v);
         if (it == expect.end()) return "no expected plan for this value";
         if (decode.experts != it->second.first || prefill.experts != it->second.second)
           return absl::StrCat("planned experts ", static_cast<int>(decode.experts), " / ",
                               static_cast<int>(prefill.experts));
         if (v == "wgmma" && prefill.grouped != cuda::MoeGroupedKernel::kWgmma)
           return "a wgmma prefill chunk not on the wgmma kernels";
         return "";
       }},
  };
}

TEST(PlanRegistryWalk, EveryCudaValueHasADescriptionAPlanCaseAndAProbeEntry) {
  ModelConfig model = *PresetConfig("tiny-moe");
  const std::map<std::string, PlanCheck> checks = PlanChecks();
  // The axes whose values choose kernels through a plan.
  const std::set<std::string> planned = {"allreduce", "attention",   "gemm", "graphs",
                                         "kv_cache",  "linear_attn", "moe",  "qgemm"};
  int walked = 0;
  for (const BackendDescriptor& d : BackendRegistry()) {
    SCOPED_TRACE(absl::StrCat(DeviceName(d.device), ": ", d.axis, "=", d.value));
    EXPECT_FALSE(d.description.empty());
    if (d.device != Device::kCuda || d.axis == "device") continue;
    const CudaOptions o = OptionsWith(d.axis, d.value);
    absl::StatusOr<std::vector<ProbeEntry>> probe = ProbeEntriesOf(d.axis, o, model, false);
    EXPECT_TRUE(probe.ok()) << probe.status();
    if (planned.count(d.axis)) {
      auto check = checks.find(d.axis);
      ASSERT_NE(check, checks.end()) << "no plan check for axis " << d.axis;
      EXPECT_EQ(check->second(d.value, o), "");
    } else {
      // Rank counts and the TEST ONLY kernel choose processes and a probe entry, no kernel path.
      EXPECT_TRUE(d.axis == "tp" || d.axis == "ep" || d.axis == "test_kernel")
          << "axis " << d.axis << " has no plan: add its plan and a check above";
    }
    ++walked;
  }
  EXPECT_GT(walked, 30);
}

TEST(PlanRegistryWalk, EnumNamesAreTheRegistrysValuesInOrder) {
  for (const char* axis :
       {"gemm", "attention", "kv_cache", "moe", "graphs", "qgemm", "linear_attn"}) {
    const std::vector<std::string> values = RegisteredValues(Device::kCuda, axis);
    ASSERT_FALSE(values.empty()) << axis;
    for (const std::string& v : values) {
      const CudaOptions o = OptionsWith(axis, v);
      const std::string name = std::string(axis) == "gemm"        ? AxisValueName(o.gemm)
                               : std::string(axis) == "attention" ? AxisValueName(o.attention)
                               : std::string(axis) == "kv_cache"  ? AxisValueName(o.kv_cache)
                               : std::string(axis) == "moe"       ? AxisValueName(o.moe)
                               : std::string(axis) == "graphs"    ? AxisValueName(o.graphs)
                               : std::string(axis) == "qgemm"     ? AxisValueName(o.qgemm)
                                                                  : AxisValueName(o.linear_attn);
      EXPECT_EQ(name, v) << axis;
    }
  }
}

TEST(LinearPlan, QuantizedLinearsTakeTheirKernelByRowsFormatAndShape) {
  const CudaOptions w4a16 = OptionsWith("qgemm", "w4a16");
  const LinearWeightFacts nvfp4{DType::kBF16, QuantFormat::kNvfp4, 4096, 2048};
  const LinearWeightFacts fp8{DType::kBF16, QuantFormat::kFp8Channel, 4096, 2048};
  // Decode rows: the GEMV, then (8+ rows FP4, 16+ FP8, up to 32) the register-decoding MMA, then
  // (33+ rows or a prefill chunk) tensor cores on a bf16 copy, which the launch log names.
  EXPECT_EQ(PlanLinear(w4a16, nvfp4, {true, 4, false, true}).path, LinearPath::kQuantGemvFp4);
  EXPECT_EQ(PlanLinear(w4a16, nvfp4, {true, 8, false, true}).path, LinearPath::kQuantMma);
  EXPECT_EQ(PlanLinear(w4a16, fp8, {true, 8, false, true}).path, LinearPath::kQuantGemvFp8);
  for (int rows : {16, 32}) {
    EXPECT_EQ(PlanLinear(w4a16, nvfp4, {true, rows, false, true}).path, LinearPath::kQuantMma);
    EXPECT_EQ(PlanLinear(w4a16, fp8, {true, rows, false, true}).path, LinearPath::kQuantMma);
  }
  const LinearWeightFacts block128{DType::kBF16, QuantFormat::kFp8Block128, 4096, 2048};
  EXPECT_EQ(PlanLinear(w4a16, block128, {true, 16, false, true}).path, LinearPath::kQuantBf16Copy);
  const LinearStep batch33{true, 33, false, true};
  const LinearPlan copy = PlanLinear(w4a16, nvfp4, batch33);
  EXPECT_EQ(copy.path, LinearPath::kQuantBf16Copy);
  EXPECT_THAT(LinearFallback(w4a16, copy, nvfp4, batch33),
              HasSubstr("decode batch of 33 rows: quantized linears dequantized to bf16"));
  EXPECT_EQ(PlanLinear(w4a16, nvfp4, {true, 2, true, true}).path, LinearPath::kQuantBf16Copy);
  // Without cuBLASLt a batch stays on the codes.
  EXPECT_EQ(PlanLinear(w4a16, nvfp4, {false, 64, false, true}).path, LinearPath::kQuantMma);
  // A K no kernel takes is refused with the shape, never run on another kernel.
  const LinearPlan odd =
      PlanLinear(w4a16, {DType::kBF16, QuantFormat::kNvfp4, 64, 48}, {true, 1, false, true});
  EXPECT_EQ(odd.path, LinearPath::kRefused);
  EXPECT_THAT(odd.refusal, HasSubstr("needs K % 32 == 0 (FP4) or % 16 == 0 (FP8) (64 x 48)"));
  LinearWeightFacts misaligned = nvfp4;
  misaligned.codes_aligned = false;
  EXPECT_EQ(PlanLinear(w4a16, misaligned, {true, 1, false, true}).path, LinearPath::kRefused);
  // Codes under dequant_bf16 mean the load went wrong: refused, not run.
  const LinearPlan dequant =
      PlanLinear(OptionsWith("qgemm", "dequant_bf16"), nvfp4, {true, 1, false, true});
  EXPECT_EQ(dequant.path, LinearPath::kRefused);
  EXPECT_THAT(dequant.refusal, HasSubstr("replaces the codes at load"));
  // Dense weights: cuBLASLt takes bf16; anything else is the reference GEMM, named in the log.
  const CudaOptions cublaslt = OptionsWith("gemm", "cublaslt");
  const LinearWeightFacts f32{DType::kF32, QuantFormat::kNone, 64, 64};
  const LinearStep one{true, 1, false, true};
  const LinearPlan dense = PlanLinear(cublaslt, f32, one);
  EXPECT_EQ(dense.path, LinearPath::kReference);
  EXPECT_THAT(LinearFallback(cublaslt, dense, f32, one),
              HasSubstr("F32 weight [64, 64]: the reference GEMM (cuBLASLt takes bf16 weights)"));
  EXPECT_EQ(LinearFallback(cublaslt, dense, f32, {false, 1, false, false}), "");
}

TEST(CollectivePlan, TheCpusAllReduceIsRefusedOnACudaModel) {
  ParallelOptions p;
  p.allreduce = AllReduce::kReference;
  absl::StatusOr<CollectivePlan> plan = PlanCollective(p, false, 4096);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("allreduce=reference: the CPU's all-reduce"));
}

TEST(StepPlan, FusedGemvAndPersistentLayersFallBackByRowsAndSayWhy) {
  CudaOptions o = OptionsWith("gemm", "fused");
  o.graphs = Graphs::kPersistent;
  // Batch 1 decode: the persistent kernel; batch 4: the chain with the fused GEMV, logged.
  EXPECT_EQ(PlanStep(o, {1, 1, false, 2048, 768, true, true}).layers, StepLayers::kPersistent);
  const StepPlan four = PlanStep(o, {4, 1, false, 2048, 768, true, true});
  EXPECT_EQ(four.layers, StepLayers::kChain);
  EXPECT_TRUE(four.fused_gemv);
  ASSERT_EQ(four.fallbacks.size(), 1u);
  EXPECT_THAT(four.fallbacks[0], HasSubstr("graphs=persistent: decode of 4 rows"));
  // A ragged batch-1 step is not the persistent kernel's either.
  EXPECT_EQ(PlanStep(o, {1, 1, true, 2048, 768, true, true}).layers, StepLayers::kChain);
  // 64 rows: past the GEMV's rows, both fallbacks named; a prefill chunk names only the GEMV's.
  const StepPlan wide = PlanStep(o, {64, 1, false, 2048, 768, true, true});
  // Unrecorded steps (every step but the launch log's) format no fallback text.
  EXPECT_TRUE(PlanStep(o, {64, 1, false, 2048, 768, true}).fallbacks.empty());
  EXPECT_FALSE(wide.fused_gemv);
  ASSERT_EQ(wide.fallbacks.size(), 2u);
  EXPECT_THAT(wide.fallbacks[0], HasSubstr("gemm=fused: decode, 64 rows (> 4)"));
  const StepPlan chunk = PlanStep(o, {256, 256, false, 2048, 768, true, true});
  ASSERT_EQ(chunk.fallbacks.size(), 1u);
  EXPECT_THAT(chunk.fallbacks[0], HasSubstr("prefill chunk"));
  // K the GEMV cannot stage: refused by shape, named with the widest K.
  const StepPlan odd = PlanStep(o, {2, 1, false, 2052, 768, false, true});
  EXPECT_FALSE(odd.fused_gemv);
  EXPECT_THAT(odd.fallbacks.at(0), HasSubstr("2 rows of K up to 2052"));
  // Graph capture: decode steps with last-row logits only.
  EXPECT_TRUE(CapturesStep(o, 1, true));
  EXPECT_FALSE(CapturesStep(o, 1, false));
  o.graphs = Graphs::kOff;
  EXPECT_FALSE(CapturesStep(o, 1, true));
}

TEST(AttentionPlan, ScratchIsSizedForEveryPathAndRefusalsNameEveryReason) {
  CudaOptions o = OptionsWith("attention", "flash");
  o.kv_cache = KvCache::kFp8;
  // Past the flash kernels' head sizes: both refusals.
  const AttentionHeads wide{16, 2, 512};
  const std::vector<std::string> why = AttentionRefusals(o, wide);
  ASSERT_EQ(why.size(), 2u);
  EXPECT_THAT(why[0], HasSubstr("attention=flash supports head_dim <= 256"));
  EXPECT_THAT(why[1], HasSubstr("kv_cache=fp8 is read by the tensor-core flash kernels only"));
  EXPECT_THAT(why[1], HasSubstr("must be 32, 64, 128 or 256"));
  EXPECT_FALSE(PlanAttention(o, wide).ok());
  // A head size the CUDA-core kernel takes and the tensor-core ones do not: flash, not fp8.
  const AttentionHeads odd{16, 2, 192};
  EXPECT_TRUE(AttentionRefusals(OptionsWith("attention", "flash"), odd).empty());
  ASSERT_EQ(AttentionRefusals(o, odd).size(), 1u);
  EXPECT_THAT(AttentionRefusals(o, odd)[0], HasSubstr("head_dim 192 must be 32, 64, 128 or 256"));
  // The hybrids' gated attention (qwen3-next: 16 q and 2 kv heads of 256; qwen3.5: 32 and 2, a
  // GQA group of 16): flash on every cache, the fp8 one with its scales, and the partials sized
  // for any split count.
  for (const AttentionHeads& hybrid : {AttentionHeads{16, 2, 256}, AttentionHeads{32, 2, 256}}) {
    for (const KvCache kv : {KvCache::kFp32, KvCache::kBf16, KvCache::kFp8}) {
      CudaOptions flash = OptionsWith("attention", "flash");
      flash.kv_cache = kv;
      absl::StatusOr<AttentionPlan> p = PlanAttention(flash, hybrid);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->path, AttentionPath::kFlash);
      EXPECT_EQ(p->kv_scales, kv == KvCache::kFp8);
      EXPECT_EQ(p->kv_bytes_per_element, kv == KvCache::kFp8 ? 1 : kv == KvCache::kBf16 ? 2 : 4);
      // (rows + 1056 / kv_heads + 1) x q_heads x (head_dim + 2): 64 rows, 64 + 528 + 1 slots.
      EXPECT_EQ(AttentionScoreFloats(*p, hybrid, 64, 4096),
                int64_t{64 + 528 + 1} * hybrid.q_heads * 258);
      EXPECT_GE(AttentionScoreFloats(*p, hybrid, 1, 4096),
                int64_t{1} * hybrid.q_heads * cuda::kMaxFlashSplits * 258);
    }
  }
  const AttentionHeads heads{16, 4, 128};
  for (const char* v : {"naive", "flash", "cudnn"}) {
    absl::StatusOr<AttentionPlan> p = PlanAttention(OptionsWith("attention", v), heads);
    ASSERT_TRUE(p.ok()) << v;
    const int64_t floats = AttentionScoreFloats(*p, heads, 64, 4096);
    if (std::string(v) == "cudnn") {
      EXPECT_EQ(floats, 0);  // its scores stay inside its kernel
      EXPECT_TRUE(p->zero_cache);
    } else {
      EXPECT_GT(floats, 0) << v;
      EXPECT_FALSE(p->zero_cache);
    }
  }
}

// qgemm=w8a8: FP8 tensor and channel linears take the E4M3 x E4M3 MMA from 8 rows and on every
// prefill chunk, ahead of the bf16 copy (E4M3 wgmma where the device runs sm_90a code); fewer
// decode rows keep the w8a16 GEMV; a K off the 64-element units takes w8a16's paths, and so does a
// block-128 K off the 128-element blocks. Grouped FP8 experts take the E4M3 kernels (64-pair passes
// when wide); under moe=wgmma, long chunks take E4M3 wgmma where hidden and inter are whole
// 128-element chunks, else the mma.sync kernels, which the log says; block-128 experts take the
// mma.sync ones where their K are whole blocks.
TEST(LinearPlan, W8a8TakesE4m3TensorCoresOnBatchesOfFp8Rows) {
  const CudaOptions w8a8 = OptionsWith("qgemm", "w8a8");
  const LinearWeightFacts channel{DType::kBF16, QuantFormat::kFp8Channel, 4096, 2048};
  const LinearWeightFacts tensor{DType::kBF16, QuantFormat::kFp8Tensor, 512, 2048};
  const LinearWeightFacts block{DType::kBF16, QuantFormat::kFp8Block128, 4096, 2048};
  EXPECT_EQ(PlanLinear(w8a8, channel, {true, 4, false, true}).path, LinearPath::kQuantGemvFp8);
  EXPECT_EQ(PlanLinear(w8a8, channel, {true, 8, false, true}).path, LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, tensor, {true, 64, false, true}).path, LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, channel, {true, 2, true, true}).path, LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, channel, {false, 2048, true, false}).path, LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, block, {true, 64, false, true}).path, LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, {DType::kBF16, QuantFormat::kFp8Block128, 4096, 2112},
                       {true, 64, false, true})
                .path,
            LinearPath::kQuantBf16Copy);
  EXPECT_EQ(
      PlanLinear(w8a8, {DType::kBF16, QuantFormat::kFp8Channel, 512, 2080}, {true, 8, false, true})
          .path,
      LinearPath::kQuantGemvFp8);
  LinearWeightFacts misaligned = channel;
  misaligned.codes_aligned = false;
  EXPECT_NE(PlanLinear(w8a8, misaligned, {true, 64, false, true}).path, LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(OptionsWith("qgemm", "w8a16"), channel, {true, 8, false, true}).path,
            LinearPath::kQuantGemvFp8);
  // On sm_90a: E4M3 wgmma on prefill chunks and from kFp8WgmmaMinRows decode rows, for tensor
  // and channel scales with whole 128-row tiles and 128-element K chunks; mma.sync otherwise.
  EXPECT_EQ(PlanLinear(w8a8, channel, {true, 2, true, true, true}).path,
            LinearPath::kQuantFp8Wgmma);
  EXPECT_EQ(PlanLinear(w8a8, tensor, {false, 2048, true, false, true}).path,
            LinearPath::kQuantFp8Wgmma);
  EXPECT_EQ(PlanLinear(w8a8, channel, {true, kFp8WgmmaMinRows, false, true, true}).path,
            LinearPath::kQuantFp8Wgmma);
  EXPECT_EQ(PlanLinear(w8a8, channel, {true, kFp8WgmmaMinRows - 1, false, true, true}).path,
            LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, block, {true, 2, true, true, true}).path, LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, {DType::kBF16, QuantFormat::kFp8Channel, 64, 2048},
                       {true, 2, true, true, true})
                .path,
            LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, {DType::kBF16, QuantFormat::kFp8Channel, 4096, 2112},
                       {true, 2, true, true, true})
                .path,
            LinearPath::kQuantFp8Mma);
  EXPECT_EQ(PlanLinear(w8a8, misaligned, {true, 2, true, true, true}).path,
            LinearPath::kQuantBf16Copy);
  EXPECT_EQ(PlanLinear(OptionsWith("qgemm", "w8a16"), channel, {true, 2, true, true, true}).path,
            LinearPath::kQuantBf16Copy);

  const MoeShape moe{128, 8, 2048, 768};
  MoeLayerFacts fp8;
  fp8.quantized_tables = fp8.experts_quantized_alike = true;
  fp8.gate = fp8.up = {QuantFormat::kFp8Channel, 768, 2048};
  fp8.down = {QuantFormat::kFp8Channel, 2048, 768};
  CudaOptions o = w8a8;
  o.moe = Moe::kFused;
  o.gemm = Gemm::kFused;
  MoePlan p = PlanMoe(o, moe, fp8, {64, 1, false, true});
  EXPECT_EQ(p.experts, MoeExperts::kGrouped);
  EXPECT_EQ(p.grouped, cuda::MoeGroupedKernel::kFp8Mma4);
  p = PlanMoe(o, moe, fp8, {2048, 2048, false, true});
  EXPECT_EQ(p.grouped, cuda::MoeGroupedKernel::kFp8Mma8);
  EXPECT_FALSE(p.bf16_copies);
  o.moe = Moe::kWgmma;
  p = PlanMoe(o, moe, fp8, {2048, 2048, false, true});
  EXPECT_EQ(p.grouped, cuda::MoeGroupedKernel::kFp8Wgmma);
  EXPECT_THAT(p.fallbacks, testing::IsEmpty());
  // A K of 64-wide chunks but not 128-wide ones (inter 704): the mma.sync kernels, said so.
  const MoeShape odd{128, 8, 2048, 704};
  MoeLayerFacts odd_fp8 = fp8;
  odd_fp8.gate = odd_fp8.up = {QuantFormat::kFp8Channel, 704, 2048};
  odd_fp8.down = {QuantFormat::kFp8Channel, 2048, 704};
  p = PlanMoe(o, odd, odd_fp8, {2048, 2048, false, true});
  EXPECT_EQ(p.grouped, cuda::MoeGroupedKernel::kFp8Mma8);
  EXPECT_THAT(p.fallbacks,
              testing::Contains(HasSubstr("qgemm=w8a8: the E4M3 x E4M3 mma.sync grouped kernels")));
  // Block-128 experts: the mma.sync kernels (the wgmma ones scale whole rows only).
  fp8.gate.format = fp8.up.format = fp8.down.format = QuantFormat::kFp8Block128;
  p = PlanMoe(o, moe, fp8, {2048, 2048, false, true});
  EXPECT_EQ(p.grouped, cuda::MoeGroupedKernel::kFp8Mma8);
  EXPECT_FALSE(p.bf16_copies);
  // 64-wide experts: their down projection has no whole 128-block of K.
  const MoeShape narrow{128, 8, 2048, 64};
  fp8.gate = fp8.up = {QuantFormat::kFp8Block128, 64, 2048};
  fp8.down = {QuantFormat::kFp8Block128, 2048, 64};
  p = PlanMoe(o, narrow, fp8, {2048, 2048, false, true});
  EXPECT_NE(p.grouped, cuda::MoeGroupedKernel::kFp8Mma8);
  EXPECT_TRUE(p.bf16_copies);
}

// Preflight of qgemm=w8a8: FP8 weights on sm_89 and newer, beside moe=fused and (on sm_90)
// moe=wgmma (no conflict: its grouped kernels serve both); refused on sm_86 naming sm_89, and on
// FP4 or bf16 weights.
TEST(W8a8Preflight, Fp8WeightsOnSm89AndNewerBesideTheFusedExpertRunners) {
  for (const char* moe : {"fused", "wgmma"}) {
    auto config = NormalizeBackendConfig(
        {{"device", "cuda"}, {"gemm", "fused"}, {"moe", moe}, {"qgemm", "w8a8"}});
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_TRUE(Preflight(*config, {true, 90, 1, "fp8"}).supported) << moe;
    if (std::string(moe) == "fused") {  // moe=wgmma is sm_90's
      EXPECT_TRUE(Preflight(*config, {true, 89, 1, "fp8"}).supported);
      EXPECT_EQ(Preflight(*config, {true, 86, 1, "fp8"}).reason,
                "qgemm=w8a8 needs sm_89 or newer; the GPU is sm_86");
    }
    EXPECT_FALSE(Preflight(*config, {true, 90, 1, "nvfp4"}).supported) << moe;
    EXPECT_FALSE(Preflight(*config, {true, 90, 1, "bf16"}).supported) << moe;
  }
}

// The shared expert runs as one more pair a row in the per-pair expert kernels where its weights
// sit in their tables and the fused router GEMV writes its gate: decode rows only. Elsewhere it
// keeps its own launches: the fused GEMV pair at decode, the unfused MLP on the grouped batches.
TEST(MoePlan, TheSharedExpertRidesWithTheRoutedPairsOnDecodeRows) {
  const MoeShape moe{512, 10, 2048, 512};
  MoeLayerFacts layer;
  layer.experts_bf16 = true;
  layer.router_f32_copy = true;
  layer.shared_expert = true;
  layer.shared_down_cols = 512;
  layer.shared_in_tables = true;
  const CudaOptions o = OptionsWith("moe", "fused");
  MoePlan p = PlanMoe(o, moe, layer, {1, 1, true});
  EXPECT_EQ(p.experts, MoeExperts::kPerPairGemv);
  EXPECT_EQ(p.shared, MoeShared::kFoldedPair);
  // Quantized tables the down kernel takes with the extra slot: folded too.
  MoeLayerFacts fp8 = layer;
  fp8.experts_bf16 = false;
  fp8.quantized_tables = fp8.experts_quantized_alike = true;
  fp8.gate = fp8.up = {QuantFormat::kFp8Channel, 512, 2048};
  fp8.down = {QuantFormat::kFp8Channel, 2048, 512};
  p = PlanMoe(o, moe, fp8, {1, 1, true});
  EXPECT_EQ(p.experts, MoeExperts::kPerPairQuantGemv);
  EXPECT_EQ(p.shared, MoeShared::kFoldedPair);
  // Not in the tables (qwen2_moe's wider shared expert, a rank's run at ep=on): its own GEMVs.
  MoeLayerFacts apart = layer;
  apart.shared_in_tables = false;
  EXPECT_EQ(PlanMoe(o, moe, apart, {1, 1, true}).shared, MoeShared::kFusedGemv);
  // Decode rows without the fused GEMV (gemm=cublaslt): the router runs alone, so the shared gate
  // has no launch to ride in.
  p = PlanMoe(o, moe, layer, {1, 1, false});
  EXPECT_NE(p.router, MoeRouter::kFusedGemv);
  EXPECT_EQ(p.shared, MoeShared::kUnfused);
  // A batch of 64 rows runs the grouped kernels: the shared expert keeps its own GEMMs.
  p = PlanMoe(o, moe, layer, {64, 1, false});
  EXPECT_EQ(p.experts, MoeExperts::kGrouped);
  EXPECT_EQ(p.shared, MoeShared::kUnfused);
}

TEST(MoePlan, FallbacksComeFromThePlan) {
  const MoeShape moe{128, 8, 2048, 768};
  MoeLayerFacts bf16;
  bf16.experts_bf16 = true;
  bf16.router_f32_copy = true;
  CudaOptions o = OptionsWith("moe", "wgmma");
  o.gemm = Gemm::kFused;
  // Decode at batch 2: too few rows for the grouped kernels; the per-pair GEMVs, said so.
  MoePlan p = PlanMoe(o, moe, bf16, {2, 1, true, true});
  EXPECT_EQ(p.experts, MoeExperts::kPerPairGemv);
  EXPECT_EQ(p.router, MoeRouter::kFusedGemv);
  ASSERT_EQ(p.fallbacks.size(), 1u);
  EXPECT_THAT(p.fallbacks[0], HasSubstr("the per-pair expert GEMVs (moe=fused's), not wgmma"));
  // Decode at batch 64: grouped mma.sync (16 or fewer pairs an expert), the router on cuBLASLt.
  p = PlanMoe(o, moe, bf16, {64, 1, false, true});
  EXPECT_TRUE(PlanMoe(o, moe, bf16, {64, 1, false}).fallbacks.empty());  // not recording
  EXPECT_EQ(p.experts, MoeExperts::kGrouped);
  EXPECT_EQ(p.grouped, cuda::MoeGroupedKernel::kMma4);
  EXPECT_EQ(p.router, MoeRouter::kCublasLtF32);
  EXPECT_TRUE(p.bf16_input);
  ASSERT_EQ(p.fallbacks.size(), 2u);
  EXPECT_THAT(p.fallbacks[0], HasSubstr("16 or fewer pairs an expert"));
  EXPECT_THAT(p.fallbacks[1], HasSubstr("cuBLASLt's fp32 GEMM, not the fused GEMV"));
  // A shape wgmma does not take: the mma.sync kernels, said so.
  p = PlanMoe(o, {128, 8, 2048 + 32, 768}, bf16, {2048, 2048, false, true});
  EXPECT_EQ(p.grouped, cuda::MoeGroupedKernel::kMma8);
  EXPECT_THAT(p.fallbacks.back(), HasSubstr("the wgmma tiles take hidden % 128 == 0"));
  // Quantized experts the grouped kernels take, on a prefill chunk: quantized wgmma.
  MoeLayerFacts fp8;
  fp8.quantized_tables = fp8.experts_quantized_alike = true;
  fp8.gate = fp8.up = {QuantFormat::kFp8Channel, 768, 2048};
  fp8.down = {QuantFormat::kFp8Channel, 2048, 768};
  p = PlanMoe(o, moe, fp8, {2048, 2048, false, true});
  EXPECT_EQ(p.grouped, cuda::MoeGroupedKernel::kQuantWgmma);
  EXPECT_FALSE(p.bf16_copies);
  // FP8 block-128 experts: the grouped quantized kernels refuse them; prefill copies to bf16.
  fp8.gate.format = fp8.up.format = fp8.down.format = QuantFormat::kFp8Block128;
  p = PlanMoe(o, moe, fp8, {2048, 2048, false, true});
  EXPECT_EQ(p.experts, MoeExperts::kGrouped);
  EXPECT_TRUE(p.bf16_copies);
  EXPECT_THAT(p.fallbacks[0], HasSubstr("dequantized to bf16"));
  // moe=fused on cuBLASLt: long bf16 prefill chunks go to cuBLAS's grouped GEMMs.
  o.moe = Moe::kFused;
  p = PlanMoe(o, moe, bf16, {2048, 2048, false, true});
  EXPECT_EQ(p.experts, MoeExperts::kCublasGrouped);
  EXPECT_THAT(p.fallbacks[0], HasSubstr("the experts on cuBLAS grouped GEMMs"));
}

// linear_attn=fused_decode: decode rows in one launch, prefill chunks on linear_attn=fused's
// kernels; refused, with both head dims named, where a value head's state does not fit one
// block (dk > 128 or dv > 128), and where the model has no linear-attention layers.
TEST(LinearAttentionPlan, FusedDecodeTakesDecodeRowsAndRefusesHeadsPastOneBlock) {
  const LinearAttentionPlan p = PlanLinearAttention(OptionsWith("linear_attn", "fused_decode"));
  EXPECT_TRUE(p.decode_fused);
  EXPECT_EQ(p.delta_rule, DeltaRulePath::kFused);
  EXPECT_TRUE(p.silu_in_conv);
  EXPECT_FALSE(PlanLinearAttention(OptionsWith("linear_attn", "fused")).decode_fused);
  EXPECT_FALSE(PlanLinearAttention(OptionsWith("linear_attn", "reference")).decode_fused);

  const CudaOptions o = OptionsWith("linear_attn", "fused_decode");
  for (const char* preset : {"tiny-hybrid", "qwen3-next-80b-a3b", "qwen3.5-397b-a17b"}) {
    const ModelConfig model = *PresetConfig(preset);
    EXPECT_THAT(LinearAttentionRefusals(o, model), testing::IsEmpty()) << preset;
  }
  ModelConfig wide = *PresetConfig("tiny-hybrid");
  wide.linear_value_head_dim = 256;
  EXPECT_THAT(LinearAttentionRefusals(o, wide),
              testing::ElementsAre(testing::AllOf(HasSubstr("linear_attn=fused_decode"),
                                                  HasSubstr("value head dim 256 <= 128"))));
  EXPECT_THAT(LinearAttentionRefusals(OptionsWith("linear_attn", "fused"), wide),
              testing::IsEmpty());
  wide.linear_key_head_dim = 192;  // linear_attn=fused takes it, the decode kernel does not
  EXPECT_THAT(LinearAttentionRefusals(o, wide),
              testing::ElementsAre(HasSubstr("key head dim 192 must be <= 128")));
  EXPECT_THAT(LinearAttentionRefusals(o, *PresetConfig("tiny-moe")),
              testing::ElementsAre(HasSubstr("the model has no linear-attention layers")));
}

// linear_attn=chunked: prefill sequences in the chunked form, decode rows in the decode kernel;
// refused, naming both head dims, where a head is not whole 16-row MMA tiles up to 128, and
// where the model has no linear-attention layers. The memory plan counts its terms.
TEST(LinearAttentionPlan, ChunkedTakesPrefillAndRefusesHeadsOffItsTiles) {
  const CudaOptions o = OptionsWith("linear_attn", "chunked");
  const LinearAttentionPlan p = PlanLinearAttention(o);
  EXPECT_EQ(p.delta_rule, DeltaRulePath::kChunked);
  EXPECT_TRUE(p.decode_fused);
  EXPECT_TRUE(p.silu_in_conv);
  for (const char* preset :
       {"tiny-hybrid", "tiny-hybrid-hd256", "qwen3-next-80b-a3b", "qwen3.5-397b-a17b"}) {
    const ModelConfig model = *PresetConfig(preset);
    EXPECT_THAT(LinearAttentionRefusals(o, model), testing::IsEmpty()) << preset;
  }
  ModelConfig odd = *PresetConfig("tiny-hybrid");
  odd.linear_value_head_dim = 40;  // the other values take it
  EXPECT_THAT(LinearAttentionRefusals(o, odd),
              testing::ElementsAre(testing::AllOf(
                  HasSubstr("linear_attn=chunked runs its products in 16-row MMA tiles"),
                  HasSubstr("key head dim 32 and value head dim 40 must be multiples of 16"))));
  EXPECT_THAT(LinearAttentionRefusals(OptionsWith("linear_attn", "fused_decode"), odd),
              testing::IsEmpty());
  EXPECT_THAT(LinearAttentionRefusals(o, *PresetConfig("tiny-moe")),
              testing::ElementsAre(HasSubstr("the model has no linear-attention layers")));
  // 2 x 128 + 128 + 1 floats a row and value head.
  EXPECT_EQ(cuda::GatedDeltaChunkedScratchFloats(4096, 32, 128, 128), int64_t{4096} * 32 * 385);
}

TEST(ModelLimits, EveryReasonIsReported) {
  ModelConfig c = *PresetConfig("tiny-moe");
  c.head_dim = 512;
  c.hidden_size = 2050;  // not a multiple of 4 or 8
  CudaOptions o = OptionsWith("attention", "flash");
  o.moe = Moe::kFused;
  o.parallel.allreduce = AllReduce::kCustom;
  const std::vector<std::string> why = CudaModelLimitRefusals(c, o);
  ASSERT_EQ(why.size(), 3u) << ::testing::PrintToString(why);
  EXPECT_THAT(why[0], HasSubstr("allreduce=custom moves 16-byte packs"));
  EXPECT_THAT(why[1], HasSubstr("attention=flash supports head_dim <= 256"));
  EXPECT_THAT(why[2], HasSubstr("moe=fused supports"));
}

// The hybrids at their real head size (256): attention=flash on every cache, fp8 included, with
// the fused expert and linear-attention kernels, refuses nothing, on the real presets and on the
// tiny one the GPU tests run.
TEST(ModelLimits, HybridsAtHeadDim256TakeFlashOnEveryCache) {
  for (const char* name : {"qwen3-next-80b-a3b", "qwen3.5-397b-a17b", "tiny-hybrid-hd256"}) {
    const ModelConfig c = *PresetConfig(name);
    ASSERT_EQ(c.head_dim, 256) << name;
    for (const KvCache kv : {KvCache::kFp32, KvCache::kBf16, KvCache::kFp8}) {
      CudaOptions o = OptionsWith("attention", "flash");
      o.kv_cache = kv;
      o.moe = Moe::kFused;
      o.linear_attn = LinearAttn::kFused;
      EXPECT_THAT(CudaModelLimitRefusals(c, o), testing::IsEmpty()) << name;
    }
  }
}

TEST(Preflight, ConfigOnlyConflictsAreTheRegistrysAndEveryReasonIsGiven) {
  PreflightTarget h200;
  h200.has_cuda_build = true;
  h200.sm = 90;
  h200.gpu_count = 1;
  h200.weight_format = "nvfp4";
  const BackendConfig tp2 = *NormalizeBackendConfig({{"device", "cuda"},
                                                     {"tp", "2"},
                                                     {"ep", "on"},
                                                     {"gemm", "fused"},
                                                     {"graphs", "persistent"},
                                                     {"kv_cache", "bf16"}});
  const PreflightResult r = Preflight(tp2, h200);
  EXPECT_FALSE(r.supported);
  // ep=on runs at CUDA tp > 1 (each rank's MoE leaves out the experts it does not hold).
  EXPECT_THAT(r.reason, ::testing::Not(HasSubstr("ep=on")));
  EXPECT_THAT(r.reason, HasSubstr("graphs=persistent cannot be combined with tp=2"));
  EXPECT_THAT(r.reason, HasSubstr("tp=2 needs 2 GPUs of one host; this host has 1"));
  // The ranks take quantized shards: tp=2, 4 and 8 refuse no weight format of their own.
  EXPECT_THAT(r.reason, ::testing::Not(HasSubstr("does not take")));
  for (const char* tp : {"2", "4", "8"})
    for (const char* format : {"fp8", "nvfp4", "mxfp4"}) {
      PreflightTarget gpus = h200;
      gpus.gpu_count = 8;
      gpus.weight_format = format;
      const PreflightResult q =
          Preflight(*NormalizeBackendConfig({{"device", "cuda"}, {"tp", tp}}), gpus);
      EXPECT_TRUE(q.supported) << "tp=" << tp << " on " << format << ": " << q.reason;
    }
  // A host without a GPU says so once, not once per CUDA axis.
  PreflightTarget cpu_only;
  cpu_only.has_cuda_build = true;
  const PreflightResult none = Preflight(tp2, cpu_only);
  EXPECT_THAT(none.reason, HasSubstr("needs a GPU; this host has none"));
  EXPECT_EQ(none.reason.find("needs a GPU"), none.reason.rfind("needs a GPU")) << none.reason;
  EXPECT_THAT(none.reason, HasSubstr("graphs=persistent cannot be combined with tp=2"));
  EXPECT_THAT(none.reason, ::testing::Not(HasSubstr("tp=2 needs 2 GPUs")));
}

// ep=on at CUDA tp=2, 4 and 8 is the registry's to run: supported on a host with the GPUs, with
// each moe value and graphs on or off; its one registry refusal is a single rank.
TEST(Preflight, ExpertParallelRunsOnCudaRanks) {
  PreflightTarget h200x8;
  h200x8.has_cuda_build = true;
  h200x8.sm = 90;
  h200x8.gpu_count = 8;
  h200x8.weight_format = "bf16";
  for (const char* tp : {"2", "4", "8"})
    for (const char* moe : {"loop", "grouped", "fused", "wgmma"})
      for (const char* graphs : {"off", "on"}) {
        if (std::string(graphs) == "on" &&
            (std::string(moe) == "loop" || std::string(moe) == "grouped"))
          continue;  // their host sync conflicts with graphs=on at any tp
        const BackendConfig config = *NormalizeBackendConfig({{"device", "cuda"},
                                                              {"tp", tp},
                                                              {"ep", "on"},
                                                              {"gemm", "cublaslt"},
                                                              {"moe", moe},
                                                              {"graphs", graphs},
                                                              {"allreduce", "custom"}});
        const PreflightResult r = Preflight(config, h200x8);
        EXPECT_TRUE(r.supported) << BackendConfigString(config) << ": " << r.reason;
        EXPECT_EQ(RegistryConflict(config, "bf16"), "") << BackendConfigString(config);
      }
  const BackendConfig one_rank =
      *NormalizeBackendConfig({{"device", "cuda"}, {"ep", "on"}, {"moe", "fused"}});
  EXPECT_THAT(Preflight(one_rank, h200x8).reason, HasSubstr("ep=on cannot be combined with tp=1"));
}

}  // namespace
}  // namespace infersweep
