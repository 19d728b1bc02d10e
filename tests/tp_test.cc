// Tensor and expert parallelism on the CPU reference (engine/tp_model.h): every rank count that
// shards a model gives tp=1's logits (within 1e-5 of max|logit|) and tp=1's greedy tokens, on the
// tiny presets and on the transformers fixtures; the all-reduce adds the ranks in a fixed order,
// bitwise the same on every rank; quantized shards keep their format where every cut falls on
// the scale grid, decode bit-identically to the host's rows either way, and the cuts off the grid
// are named; preflight refuses a rank count that does not divide a dimension, naming it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/backend_config.h"
#include "bench/allreduce_bench.h"
#include "core/quant/dequantize.h"
#include "engine/backends.h"
#include "engine/cpu_model.h"
#include "engine/options.h"
#include "engine/sampler.h"
#include "engine/tp_model.h"
#include "engine/weights.h"
#include "kernels/cpu/allreduce.h"
#include "kernels/cpu/matmul.h"
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

const std::string kFixtures = SourceDir() + "/tests/fixtures/hf";

// Presets ("preset:tiny-moe", a quantized one) and transformers' fixture folders.
std::vector<std::string> Models() {
  std::vector<std::string> models = {"preset:tiny-moe",
                                     "preset:tiny-dense",
                                     "preset:tiny-qwen2-moe",
                                     "preset:tiny-hybrid",
                                     "preset:tiny-moe@nvfp4",
                                     "preset:tiny-moe@mxfp4",
                                     "preset:tiny-hybrid@nvfp4",
                                     "preset:tiny-qwen2-moe@fp8_channel",
                                     "preset:tiny-dense@fp8_block128"};
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
      const double rel = RelMaxError(got.prefill, want.prefill);
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

// ---- Quantized shards: codes and scales sliced on the scale grid, decoded exactly off it.

// Every linear of `w` that is not empty, by canonical name, with `fn(name, matrix)`: the lm_head,
// then per layer the attention, MLP, expert, shared-expert and Gated DeltaNet projections.
template <typename Weights, typename Fn>
void ForEachLinear(Weights& w, Fn fn) {
  auto visit = [&](const std::string& name, auto& m) {
    if (!m.empty()) fn(name + ".weight", m);
  };
  visit("lm_head", w.lm_head);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    auto& layer = w.layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    visit(p + "self_attn.q_proj", layer.q);
    visit(p + "self_attn.k_proj", layer.k);
    visit(p + "self_attn.v_proj", layer.v);
    visit(p + "self_attn.o_proj", layer.o);
    auto mlp = [&](const std::string& prefix, auto& e) {
      visit(prefix + "gate_proj", e.gate);
      visit(prefix + "up_proj", e.up);
      visit(prefix + "down_proj", e.down);
    };
    mlp(p + "mlp.", layer.mlp);
    for (size_t e = 0; e < layer.experts.size(); ++e)
      mlp(p + "mlp.experts." + std::to_string(e) + ".", layer.experts[e]);
    mlp(p + "mlp.shared_expert.", layer.shared_expert);
    auto& la = layer.linear_attn;
    visit(p + "linear_attn.in_proj_qkv", la.in_proj_qkv);
    visit(p + "linear_attn.in_proj_z", la.in_proj_z);
    visit(p + "linear_attn.in_proj_b", la.in_proj_b);
    visit(p + "linear_attn.in_proj_a", la.in_proj_a);
    visit(p + "linear_attn.out_proj", la.out_proj);
  }
}

// `host` with every quantized linear replaced by its exact fp32 decoding (held in `storage`):
// its shards are plain fp32 row and column cuts, the oracle for the quantized shards.
std::unique_ptr<HostModel> DecodedCopy(const HostModel& host,
                                       std::vector<std::vector<float>>* storage) {
  auto out = std::make_unique<HostModel>();
  out->config = host.config;
  out->source = host.source;
  out->weights = host.weights;
  ForEachLinear(out->weights, [&](const std::string&, MatrixRef& m) {
    if (!m.quantized()) return;
    storage->push_back(DequantizeMatrix(m));
    m = MatrixRef{storage->back().data(), DType::kF32, m.rows, m.cols, {}};
  });
  return out;
}

struct QuantShardCase {
  std::string preset;
  QuantFormat format;
  int head_dim = 0;  // 0: the preset's
  // Whether rank `rank` of `tp` holds `name` decoded to fp32: its cut falls inside a scale group
  // or block. Derived by hand from the preset's shapes.
  std::function<bool(const std::string& name, int tp, int rank, bool ep)> decoded;
};

std::vector<QuantShardCase> QuantShardCases() {
  std::vector<QuantShardCase> cases;
  const auto never = [](const std::string&, int, int, bool) { return false; };
  for (const char* preset : {"tiny-dense", "tiny-moe", "tiny-qwen2-moe", "tiny-hybrid"}) {
    // Per-tensor and per-row scales go with any cut; NVFP4's 16-column groups with every K cut
    // of these shapes (o: 32 a head; down: 16+ a rank).
    for (QuantFormat f : {QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel, QuantFormat::kNvfp4})
      cases.push_back({preset, f, 0, never});
    // MXFP4's 32-column groups: at tp=4 an expert's down_proj keeps 64 / 4 = 16 columns.
    cases.push_back(
        {preset, QuantFormat::kMxfp4, 0, [](const std::string& name, int tp, int, bool ep) {
           return tp == 4 && !ep && name.find(".mlp.experts.") != std::string::npos &&
                  name.ends_with("down_proj.weight");
         }});
  }
  // FP8 128-blocks with 128-wide heads: attention cuts are whole blocks; the MLP's 384 / tp rows
  // and columns are not, except rank 0's, which start at 0 (a partial last block keeps its scale).
  cases.push_back({"tiny-dense", QuantFormat::kFp8Block128, 128,
                   [](const std::string& name, int, int rank, bool) {
                     return rank > 0 && name.find(".mlp.") != std::string::npos;
                   }});
  // With 32-wide heads every cut but rank 0's starts inside a block; at tp=4 rank 1 replicates
  // KV head 0 (rows [0, 32)), which does not; ep=on experts are whole.
  cases.push_back({"tiny-moe", QuantFormat::kFp8Block128, 0,
                   [](const std::string& name, int tp, int rank, bool ep) {
                     if (ep && name.find(".mlp.experts.") != std::string::npos) return false;
                     const bool kv = name.find(".k_proj.") != std::string::npos ||
                                     name.find(".v_proj.") != std::string::npos;
                     return rank > 0 && !(tp == 4 && rank == 1 && kv);
                   }});
  return cases;
}

// Every shard of every quantized tiny preset at tp=2 and 4 (and ep=on for the MoE ones): each
// linear decodes bit-identically to the same rows and columns of the host's decoded weights; a
// quantized one stays quantized, in its format, exactly where its cut falls on its scale grid,
// and the shard names the others in off_grid.
TEST(QuantizedShards, KeepTheirFormatOnTheScaleGridAndDecodeExactly) {
  for (const QuantShardCase& qc : QuantShardCases()) {
    LoadOptions options;
    options.quantize = qc.format;
    options.head_dim_override = qc.head_dim;
    auto host = LoadHostModel("preset:" + qc.preset, options);
    ASSERT_TRUE(host.ok()) << qc.preset << ": " << host.status();
    ASSERT_EQ((*host)->quant_format, qc.format);
    std::vector<std::vector<float>> storage;
    const std::unique_ptr<HostModel> decoded = DecodedCopy(**host, &storage);
    int quantized_slices = 0;
    for (int tp : {2, 4}) {
      for (bool ep : {false, true}) {
        if (!TensorParallelRefusal((*host)->config, tp, ep).empty()) continue;
        for (int rank = 0; rank < tp; ++rank) {
          SCOPED_TRACE(absl::StrCat(qc.preset, "@", QuantFormatName(qc.format), " head_dim ",
                                    qc.head_dim, " tp=", tp, " ep=", ep, " rank ", rank));
          auto shard = ShardHostModel(**host, tp, rank, ep);
          auto oracle = ShardHostModel(*decoded, tp, rank, ep);
          ASSERT_TRUE(shard.ok()) << shard.status();
          ASSERT_TRUE(oracle.ok()) << oracle.status();
          std::vector<std::pair<std::string, MatrixRef>> got, want;
          ForEachLinear((*shard)->host->weights, [&](const std::string& n, const MatrixRef& m) {
            got.push_back({n, m});
          });
          ForEachLinear((*oracle)->host->weights, [&](const std::string& n, const MatrixRef& m) {
            want.push_back({n, m});
          });
          ASSERT_EQ(got.size(), want.size());
          std::vector<std::string> expect_off_grid;
          for (size_t i = 0; i < got.size(); ++i) {
            const auto& [name, m] = got[i];
            ASSERT_EQ(name, want[i].first);
            ASSERT_EQ(m.rows, want[i].second.rows) << name;
            ASSERT_EQ(m.cols, want[i].second.cols) << name;
            std::vector<float> a(m.cols), b(m.cols);
            for (int64_t r = 0; r < m.rows; ++r) {
              cpu::DecodeRow(m, r, a.data());
              cpu::DecodeRow(want[i].second, r, b.data());
              ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                  << name << " row " << r;
            }
            auto original = FindWeight(**host, name);
            ASSERT_TRUE(original.ok()) << original.status();
            if (!original->quantized()) {
              EXPECT_FALSE(m.quantized()) << name;
              continue;
            }
            if (qc.decoded(name, tp, rank, ep)) {
              EXPECT_FALSE(m.quantized()) << name << " should be decoded";
              EXPECT_EQ(m.dtype, DType::kF32) << name;
              expect_off_grid.push_back(name);
            } else {
              EXPECT_EQ(m.quant.format, qc.format) << name << " should stay quantized";
              EXPECT_EQ(m.quant.scale_dtype, original->quant.scale_dtype) << name;
              EXPECT_EQ(m.quant.global_scale, original->quant.global_scale) << name;
              ++quantized_slices;
            }
          }
          std::vector<std::string> off_grid;
          for (const std::string& line : (*shard)->off_grid)
            off_grid.push_back(line.substr(0, line.find(" (")));
          EXPECT_EQ(off_grid, expect_off_grid);
        }
      }
    }
    EXPECT_GT(quantized_slices, 0) << qc.preset;
  }
}

// What the CUDA ranks refuse: every rank's off-grid cuts, the first few named with their cut;
// nothing where every cut falls on the scale grid, or on dense weights.
TEST(QuantizedShards, RefusalNamesTheCutsOffTheScaleGrid) {
  auto load = [](const std::string& preset, QuantFormat format) {
    LoadOptions options;
    options.quantize = format;
    auto host = LoadHostModel("preset:" + preset, options);
    EXPECT_TRUE(host.ok()) << host.status();
    return *std::move(host);
  };
  for (QuantFormat f : {QuantFormat::kNone, QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel,
                        QuantFormat::kNvfp4}) {
    const auto host = load("tiny-moe", f);
    for (int tp : {2, 4})
      for (bool ep : {false, true}) {
        auto why = QuantizedShardRefusal(*host, tp, ep);
        ASSERT_TRUE(why.ok()) << why.status();
        EXPECT_EQ(*why, "") << QuantFormatName(f) << " tp=" << tp;
      }
  }
  const auto mxfp4 = load("tiny-moe", QuantFormat::kMxfp4);
  EXPECT_EQ(*QuantizedShardRefusal(*mxfp4, 2, false), "");
  EXPECT_EQ(*QuantizedShardRefusal(*mxfp4, 4, true), "");
  // 4 layers x 8 experts x 4 ranks: each expert's down_proj keeps 16 columns.
  EXPECT_THAT(*QuantizedShardRefusal(*mxfp4, 4, false),
              testing::StartsWith(
                  "tp=4 cuts 128 quantized weight slices inside their scale groups or blocks, "
                  "where no quantized shard holds them exactly: "
                  "model.layers.0.mlp.experts.0.down_proj.weight (mxfp4 [128, 64]): rank 0's "
                  "columns [0, 16) end inside a 32-column scale group; "));
  EXPECT_THAT(*QuantizedShardRefusal(*mxfp4, 4, false), testing::EndsWith("; and 125 more"));
  // Rank 1's cuts of every linear at tp=2: 4 layers x (q, k, v, o + 8 experts x 3).
  const auto block = load("tiny-moe", QuantFormat::kFp8Block128);
  EXPECT_THAT(*QuantizedShardRefusal(*block, 2, false),
              HasSubstr("tp=2 cuts 112 quantized weight slices inside their scale groups or "
                        "blocks, where no quantized shard holds them exactly: "
                        "model.layers.0.self_attn.q_proj.weight (fp8_block128 [128, 128]): rank "
                        "1's rows [64, 128) start inside a 128-row scale block; "));
  // A stack of row ranges must also land on the blocks: rank 0's k rows go to row 32.
  const auto hybrid = load("tiny-hybrid", QuantFormat::kFp8Block128);
  EXPECT_THAT(*QuantizedShardRefusal(*hybrid, 2, false),
              HasSubstr("model.layers.0.linear_attn.in_proj_qkv.weight (fp8_block128 [256, 128]): "
                        "rank 0's rows [64, 96) (at row 32 of its stack) start inside a 128-row "
                        "scale block"));
  // A rank's shard names its own off-grid cuts, the refusal's lines.
  auto rank1 = ShardHostModel(*block, 2, 1, false);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  EXPECT_THAT((*rank1)->off_grid,
              testing::Contains("model.layers.0.self_attn.o_proj.weight (fp8_block128 [128, 128]): "
                                "rank 1's columns [64, 128) start inside a 128-column scale "
                                "block"));
  EXPECT_EQ(QuantizedShardRefusal(*block, 8, false).status().code(),
            absl::StatusCode::kInvalidArgument);
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

// The shared expert rides in the device expert tables where it is shaped like the experts and
// every expert is held: qwen3-next-style layers (tiny-hybrid, 64 = 64) at tp=1 and tp=2 without
// ep, not at ep=on (a rank's run of whole experts beside its slice of the shared expert) and not
// qwen2_moe's wider shared expert (128 against 64).
TEST(TensorParallel, TheSharedExpertFitsTheExpertTablesWhereShapedLikeThem) {
  auto hybrid = LoadHostModel("preset:tiny-hybrid");
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  ASSERT_TRUE(MaterializeHostWeights(**hybrid).ok());
  const LayerWeights& layer = (*hybrid)->weights.layers[0];
  auto held = HeldExpertRange(layer.experts);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_TRUE(SharedExpertFitsExpertTables(layer, *held));
  auto sliced = ShardHostModel(**hybrid, 2, 1, /*expert_parallel=*/false);
  ASSERT_TRUE(sliced.ok()) << sliced.status();
  const LayerWeights& slice = (*sliced)->host->weights.layers[0];
  EXPECT_TRUE(SharedExpertFitsExpertTables(slice, *HeldExpertRange(slice.experts)));
  auto run = ShardHostModel(**hybrid, 2, 0, /*expert_parallel=*/true);
  ASSERT_TRUE(run.ok()) << run.status();
  const LayerWeights& ranks = (*run)->host->weights.layers[0];
  EXPECT_FALSE(SharedExpertFitsExpertTables(ranks, *HeldExpertRange(ranks.experts)));
  // A layer holding a run short of every expert keeps it out, and so does one mismatch of dtype
  // or shape.
  LayerWeights other = layer;
  other.experts.back() = ExpertWeights{};
  auto short_run = HeldExpertRange(other.experts);
  ASSERT_TRUE(short_run.ok()) << short_run.status();
  EXPECT_FALSE(SharedExpertFitsExpertTables(other, *short_run));
  other = layer;
  other.shared_expert.down.dtype = DType::kF32;
  EXPECT_FALSE(SharedExpertFitsExpertTables(other, *held));
  other = layer;
  other.shared_expert.gate.rows *= 2;
  EXPECT_FALSE(SharedExpertFitsExpertTables(other, *held));

  auto qwen2 = LoadHostModel("preset:tiny-qwen2-moe");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status();
  ASSERT_TRUE(MaterializeHostWeights(**qwen2).ok());
  const LayerWeights& wide = (*qwen2)->weights.layers[0];
  EXPECT_FALSE(SharedExpertFitsExpertTables(wide, *HeldExpertRange(wide.experts)));
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
