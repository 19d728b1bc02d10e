// The memory plan (engine/plan/memory_plan.h): its pools against hand-computed sizes, and its
// invariants over every preset, weight format and batch.
#include "engine/plan/memory_plan.h"

#include <gtest/gtest.h>

#include <string>

#include "api/model_config.h"
#include "core/quant/format.h"
#include "core/tensor_ref.h"

namespace infersweep {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

ModelConfig Preset(const std::string& name, int layers = 0) {
  absl::StatusOr<ModelConfig> c = PresetConfig(name, layers);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// 1024 prompt tokens and 1024 generated: a 2048-token context.
MemoryWorkload Workload(int batch) {
  MemoryWorkload w;
  w.batch = batch;
  w.prompt_tokens = 1024;
  w.generated_tokens = 1024;
  return w;
}

MemoryPlan Plan(const CudaOptions& o, const ModelConfig& c, QuantFormat f,
                const MemoryWorkload& w) {
  absl::StatusOr<MemoryPlan> plan = PlanMemory(o, c, f, w);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : MemoryPlan{};
}

CudaOptions Bf16Kv() {
  CudaOptions o;
  o.kv_cache = KvCache::kBf16;
  return o;
}

// ---- qwen3-30b-a3b, 48 layers: hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768, vocab
// 151936, untied.
//   embed + lm_head: 2 x 151936 x 2048                    =    622,329,856 params
//   a layer: q 4096x2048 = 8,388,608; k, v 512x2048 = 1,048,576 each; o 2048x4096 = 8,388,608;
//     norms 2048 + 2048 + 128 + 128 = 4,352; router 128x2048 = 262,144;
//     experts 128 x 3 x 768 x 2048 = 603,979,776           =    623,120,640 params
//   48 layers                                              = 29,909,790,720
//   + final norm 2048                                      = 30,532,122,624 params (30.5B)
//   bf16: x 2 bytes                                        = 61,064,245,248 bytes
//   expert pointer tables: 48 layers x 3 x (128 experts + the shared expert's entry) x 8
//                                                          =        148,608 bytes
TEST(MemoryPlan, Qwen3MoeBf16Weights) {
  const ModelConfig c = Preset("qwen3-30b-a3b");
  for (int batch : {1, 64}) {
    const MemoryPlan p = Plan(Bf16Kv(), c, QuantFormat::kNone, Workload(batch));
    EXPECT_EQ(p.item_bytes(MemoryPool::kWeights, "dense tensors (bf16)"), 61'064'245'248);
    EXPECT_EQ(p.bytes(MemoryPool::kWeights), 61'064'245'248 + 148'608);
    // No quantized linears, no cuBLASLt, no graphs: no copies.
    EXPECT_EQ(p.bytes(MemoryPool::kCopies), 0);
    // KV (bf16): 48 layers x 2 (K, V) x 4 kv heads x 128 x 2048 tokens x 2 bytes
    //   = 201,326,592 bytes (192 MiB) a sequence.
    EXPECT_EQ(p.bytes(MemoryPool::kKvCache), int64_t{201'326'592} * batch);
    EXPECT_EQ(p.bytes(MemoryPool::kRecurrentState), 0);
  }
}

// nvfp4 quantizes q, k, v, o and the experts (ModelOpt's exclusions keep embed, lm_head, norms
// and the router in bf16):
//   quantized elements a layer: 8,388,608 + 2 x 1,048,576 + 8,388,608 + 603,979,776
//     = 622,854,144 over 4 + 384 = 388 linears
//   codes: / 2 = 311,427,072 bytes; E4M3 scales: / 16 = 38,928,384; weight_scale_2: 388 x 4 = 1,552
//   dense a layer: (4,352 + 262,144) x 2 = 532,992 bytes
//   a layer: 311,427,072 + 38,928,384 + 1,552 + 532,992 = 350,890,000 bytes
//   48 layers = 16,842,720,000; + (622,329,856 + 2,048) x 2 = 1,244,663,808 of embed, lm_head,
//   final norm = 18,087,383,808; + pointer tables 148,608 = 18,087,532,416 bytes.
TEST(MemoryPlan, Qwen3MoeNvfp4Weights) {
  const ModelConfig c = Preset("qwen3-30b-a3b");
  for (int batch : {1, 64}) {
    const MemoryPlan p = Plan(Bf16Kv(), c, QuantFormat::kNvfp4, Workload(batch));
    EXPECT_EQ(p.item_bytes(MemoryPool::kWeights, "nvfp4 codes"), int64_t{311'427'072} * 48);
    EXPECT_EQ(p.item_bytes(MemoryPool::kWeights, "nvfp4 scales"),
              (int64_t{38'928'384} + 1'552) * 48);
    EXPECT_EQ(p.item_bytes(MemoryPool::kWeights, "dense tensors (bf16)"),
              int64_t{532'992} * 48 + 1'244'663'808);
    EXPECT_EQ(p.bytes(MemoryPool::kWeights), 18'087'532'416);
    EXPECT_EQ(p.bytes(MemoryPool::kKvCache), int64_t{201'326'592} * batch);
  }
  // qgemm=dequant_bf16 keeps a bf16 copy of every quantized linear:
  //   622,854,144 x 48 x 2 bytes = 59,793,997,824.
  CudaOptions dequant = Bf16Kv();
  dequant.qgemm = QGemm::kDequantBf16;
  const MemoryPlan p = Plan(dequant, c, QuantFormat::kNvfp4, Workload(1));
  EXPECT_EQ(
      p.item_bytes(MemoryPool::kCopies, "qgemm=dequant_bf16: bf16 copies of the quantized linears"),
      59'793'997'824);
}

// fp8 KV with flash: codes 48 x 2 x 512 x 2048 x 1 byte = 100,663,296, scales
// 48 x 2 x 4 heads x 2048 x 4 bytes = 3,145,728: 103,809,024 bytes a sequence.
TEST(MemoryPlan, Qwen3MoeFp8Kv) {
  CudaOptions o;
  o.attention = Attention::kFlash;
  o.kv_cache = KvCache::kFp8;
  const ModelConfig c = Preset("qwen3-30b-a3b");
  for (int batch : {1, 64}) {
    const MemoryPlan p = Plan(o, c, QuantFormat::kNone, Workload(batch));
    EXPECT_EQ(p.bytes(MemoryPool::kKvCache), int64_t{103'809'024} * batch);
  }
}

// ---- qwen3.5-397b-a17b@nvfp4, 8 layers: layers 3 and 7 full attention (32 q / 2 kv heads of
// 256, gated q_proj), the other 6 Gated DeltaNet (16 key heads, 64 value heads of 128, conv 4);
// hidden 4096, 512 experts of 1024 plus a shared expert of 1024, vocab 248320.
//   bf16 elements: embed + lm_head 2 x 248320 x 4096 = 2,034,237,440; final norm 4,096;
//     full layer: norms 4096 x 2 + 256 x 2 = 8,704, router 512x4096 = 2,097,152, shared gate
//     4,096: 2,109,952 (x 2 layers);
//     linear layer: norms 8,192, in_proj_a, in_proj_b 2 x 64 x 4096 = 524,288, conv 12288 x 4 =
//     49,152, dt_bias + A_log 128, gated norm 128, router + shared gate 2,101,248: 2,683,136
//     (x 6 layers);
//     in all 2,054,560,256 elements = 4,109,120,512 bytes.
//   quantized elements: MoE a layer 512 x 3 x 1024 x 4096 + 3 x 1024 x 4096 = 6,455,033,856
//     (1,539 linears) x 8; full attention q 16384x4096 + k, v 512x4096 + o 4096x8192 =
//     104,857,600 (4 linears) x 2; linear attention qkv 12288x4096 + z 8192x4096 + out
//     4096x8192 = 117,440,512 (3 linears) x 6: 52,554,629,120 elements over 12,338 linears.
//   codes / 2 = 26,277,314,560; scales / 16 = 3,284,664,320 + 12,338 x 4 = 3,284,713,672.
//   zero-centred gains in fp32: (8 x 8192 + 2 x 512 + 4096) x 4 = 282,624.
//   pointer tables: 8 x 3 x (512 + the shared expert's entry) x 8 = 98,496.
//   weights: 4,109,120,512 + 26,277,314,560 + 3,284,713,672 + 282,624 + 98,496 = 33,671,529,864.
//   KV (bf16): 2 layers x 2 x 512 x 2048 x 2 bytes = 8,388,608 a sequence.
//   state: 6 layers x (conv 3 x 12288 + recurrent 64 x 128 x 128) x 4 bytes = 26,050,560 a
//   sequence.
TEST(MemoryPlan, Qwen35Nvfp4EightLayers) {
  const ModelConfig c = Preset("qwen3.5-397b-a17b", 8);
  for (int batch : {1, 64}) {
    const MemoryPlan p = Plan(Bf16Kv(), c, QuantFormat::kNvfp4, Workload(batch));
    EXPECT_EQ(p.item_bytes(MemoryPool::kWeights, "dense tensors (bf16)"), 4'109'120'512);
    EXPECT_EQ(p.item_bytes(MemoryPool::kWeights, "nvfp4 codes"), 26'277'314'560);
    EXPECT_EQ(p.item_bytes(MemoryPool::kWeights, "nvfp4 scales"), 3'284'713'672);
    EXPECT_EQ(p.item_bytes(MemoryPool::kWeights, "zero-centred norm gains (fp32)"), 282'624);
    EXPECT_EQ(p.bytes(MemoryPool::kWeights), 33'671'529'864);
    EXPECT_EQ(p.bytes(MemoryPool::kKvCache), int64_t{8'388'608} * batch);
    EXPECT_EQ(p.bytes(MemoryPool::kRecurrentState), int64_t{26'050'560} * batch);
  }
}

// qwen3-30b-a3b bf16 at batch 1, decode only (no prompt: the step is one row):
//   residual 2048 + logits 151936 floats = 615,936 bytes;
//   attention=naive scores: 1 row x 32 heads x 2048 tokens x 4 = 262,144 bytes.
TEST(MemoryPlan, DecodeScratch) {
  MemoryWorkload w;
  w.batch = 1;
  w.generated_tokens = 2048;
  const MemoryPlan p = Plan(CudaOptions{}, Preset("qwen3-30b-a3b"), QuantFormat::kNone, w);
  EXPECT_EQ(p.step_rows, 1);
  EXPECT_EQ(p.item_bytes(MemoryPool::kScratch, "model: residual stream and logits"), 615'936);
  EXPECT_EQ(p.item_bytes(MemoryPool::kScratch, "attention runner: scores (attention=naive)"),
            262'144);
}

// qwen3.5-397b-a17b, 8 layers, attention=flash on an fp8 cache at head_dim 256 (32 q / 2 kv heads),
// decode only at batch 64 and 4096 tokens:
//   flash partials: (64 rows + 1056 / 2 + 1) x 32 heads x (256 + 2) floats x 4 = 19,583,232 bytes;
//   KV: 2 layers x 2 x 512 x 4096 x 1 byte = 8,388,608 of codes + 2 layers x 2 x 2 heads x 4096
//   x 4 bytes = 131,072 of scales: 8,519,680 bytes a sequence.
TEST(MemoryPlan, FlashAtHeadDim256) {
  CudaOptions o;
  o.attention = Attention::kFlash;
  o.kv_cache = KvCache::kFp8;
  MemoryWorkload w;
  w.batch = 64;
  w.generated_tokens = 4096;
  const MemoryPlan p = Plan(o, Preset("qwen3.5-397b-a17b", 8), QuantFormat::kNone, w);
  EXPECT_EQ(p.step_rows, 64);
  EXPECT_EQ(p.item_bytes(MemoryPool::kScratch, "attention runner: scores (attention=flash)"),
            19'583'232);
  EXPECT_EQ(p.bytes(MemoryPool::kKvCache), int64_t{8'519'680} * 64);
}

// Lockstep prefill of 64 x 1024 rows runs as chunks of 32768 / 64 = 512 tokens a sequence.
TEST(MemoryPlan, PrefillChunksAtTheEnginesStepRows) {
  const MemoryPlan p = Plan(Bf16Kv(), Preset("qwen3-30b-a3b"), QuantFormat::kNone, Workload(64));
  EXPECT_EQ(p.step_rows, 32768);
  EXPECT_EQ(p.logit_rows, 64);
  MemoryWorkload chunked = Workload(64);
  chunked.prefill_chunk_tokens = 128;
  EXPECT_EQ(Plan(Bf16Kv(), Preset("qwen3-30b-a3b"), QuantFormat::kNone, chunked).step_rows, 8192);
}

// linear_attn=chunked on qwen3-next (32 value heads, dk = dv = 128): its terms are
// 2 x 128 + 128 + 1 = 385 floats a row and value head, at the step's rows; other values hold none.
TEST(MemoryPlan, ChunkedDeltaRuleTermsAtTheStepRows) {
  CudaOptions o = Bf16Kv();
  o.linear_attn = LinearAttn::kChunked;
  const MemoryPlan p = Plan(o, Preset("qwen3-next-80b-a3b", 8), QuantFormat::kNone, Workload(4));
  EXPECT_EQ(p.step_rows, 4096);
  EXPECT_EQ(p.item_bytes(MemoryPool::kScratch, "linear attention runner: chunked delta rule terms"),
            int64_t{4096} * 32 * 385 * 4);
  o.linear_attn = LinearAttn::kFusedDecode;
  EXPECT_EQ(
      Plan(o, Preset("qwen3-next-80b-a3b", 8), QuantFormat::kNone, Workload(4))
          .item_bytes(MemoryPool::kScratch, "linear attention runner: chunked delta rule terms"),
      0);
}

// qgemm=w8a8 on qwen3-30b-a3b fp8_channel, 4 x 1024 prompt rows a step: the linear runner's
// E4M3 rows at the widest K (the dense intermediate, 6144) and a scale each, and the MoE runner's
// x [4096, 2048] and h [4096 x 8, 768] codes and their scales:
//   4096 x 6144 + 4096 x 4 + 4096 x 2048 + 32768 x 768 + (4096 + 32768) x 4 = 58,884,096 bytes.
TEST(MemoryPlan, W8a8ActivationCodesAtTheStepRows) {
  CudaOptions o = Bf16Kv();
  o.qgemm = QGemm::kW8A8;
  const MemoryPlan p = Plan(o, Preset("qwen3-30b-a3b"), QuantFormat::kFp8Channel, Workload(4));
  EXPECT_EQ(p.step_rows, 4096);
  EXPECT_EQ(p.item_bytes(MemoryPool::kScratch, "qgemm=w8a8: E4M3 activations and their scales"),
            58'884'096);
  o.qgemm = QGemm::kW8A16;
  EXPECT_EQ(Plan(o, Preset("qwen3-30b-a3b"), QuantFormat::kFp8Channel, Workload(4))
                .item_bytes(MemoryPool::kScratch, "qgemm=w8a8: E4M3 activations and their scales"),
            0);
}

// ---- Invariants over every preset, weight format and batch.
TEST(MemoryPlan, EveryPresetAndFormat) {
  for (const std::string& name : PresetNames()) {
    // The big presets at 8 layers: the invariants hold layer by layer.
    const bool big = name == "qwen3.5-397b-a17b" || name == "qwen3-235b-a22b";
    const ModelConfig c = Preset(name, big ? 8 : 0);
    const MemoryPlan bf16 = Plan(CudaOptions{}, c, QuantFormat::kNone, Workload(1));
    const int64_t bf16_dense = bf16.item_bytes(MemoryPool::kWeights, "dense tensors (bf16)");
    for (QuantFormat f : kQuantFormats) {
      SCOPED_TRACE(name + "@" + QuantFormatName(f));
      const MemoryPlan one = Plan(CudaOptions{}, c, f, Workload(1));
      const MemoryPlan many = Plan(CudaOptions{}, c, f, Workload(64));
      for (const MemoryPlan* p : {&one, &many}) {
        int64_t sum = 0;
        for (MemoryPool pool : kMemoryPools) sum += p->bytes(pool);
        EXPECT_EQ(p->total_bytes(), sum);
        EXPECT_GT(p->bytes(MemoryPool::kWeights), 0);
        EXPECT_GT(p->bytes(MemoryPool::kScratch), 0);
        // The reference config makes no copies and captures no graphs.
        EXPECT_EQ(p->bytes(MemoryPool::kCopies), 0);
        EXPECT_EQ(p->bytes(MemoryPool::kGraphPools), 0);
      }
      EXPECT_EQ(one.bytes(MemoryPool::kWeights), many.bytes(MemoryPool::kWeights));
      EXPECT_EQ(many.bytes(MemoryPool::kKvCache), 64 * one.bytes(MemoryPool::kKvCache));
      EXPECT_EQ(many.bytes(MemoryPool::kRecurrentState),
                64 * one.bytes(MemoryPool::kRecurrentState));
      EXPECT_EQ(c.has_linear_attention(), one.bytes(MemoryPool::kRecurrentState) > 0);
      MemoryWorkload longer = Workload(1);
      longer.generated_tokens += 2048;  // twice the context
      EXPECT_EQ(Plan(CudaOptions{}, c, f, longer).bytes(MemoryPool::kKvCache),
                2 * one.bytes(MemoryPool::kKvCache));
      if (f == QuantFormat::kNone) continue;

      // What left the bf16 tensors is the quantized linears' elements x 2 bytes; their codes
      // take 1 byte an element (fp8) or half of one (nvfp4, mxfp4), their scales less.
      const int64_t quantized_elements =
          (bf16_dense - one.item_bytes(MemoryPool::kWeights, "dense tensors (bf16)")) / 2;
      EXPECT_GT(quantized_elements, 0);
      const bool fp4 = f == QuantFormat::kNvfp4 || f == QuantFormat::kMxfp4;
      const std::string format = QuantFormatName(f);
      EXPECT_EQ(one.item_bytes(MemoryPool::kWeights, format + " codes"),
                fp4 ? quantized_elements / 2 : quantized_elements);
      const int64_t scales = one.item_bytes(MemoryPool::kWeights, format + " scales");
      EXPECT_GT(scales, 0);
      EXPECT_LT(scales, fp4 ? quantized_elements / 8 : quantized_elements / 16);
      EXPECT_LT(one.bytes(MemoryPool::kWeights), bf16.bytes(MemoryPool::kWeights));

      // dequant_bf16's copies are those elements in bf16 again.
      CudaOptions dequant;
      dequant.qgemm = QGemm::kDequantBf16;
      EXPECT_EQ(Plan(dequant, c, f, Workload(1))
                    .item_bytes(MemoryPool::kCopies,
                                "qgemm=dequant_bf16: bf16 copies of the quantized linears"),
                quantized_elements * 2);
    }
  }
}

// Copies appear only with the configs that make them.
TEST(MemoryPlan, CopiesComeWithTheirConfigs) {
  const ModelConfig moe = Preset("qwen3-30b-a3b");
  const ModelConfig dense = Preset("tiny-dense");
  CudaOptions cublaslt;
  cublaslt.gemm = Gemm::kCublasLt;
  // fp32 routers: 48 layers x 128 x 2048 x 4 bytes = 50,331,648.
  EXPECT_EQ(Plan(cublaslt, moe, QuantFormat::kNone, Workload(1))
                .item_bytes(MemoryPool::kCopies, "MoE routers in fp32 (cuBLASLt)"),
            50'331'648);
  EXPECT_EQ(Plan(cublaslt, dense, QuantFormat::kNone, Workload(1)).bytes(MemoryPool::kCopies), 0);
  EXPECT_EQ(Plan(cublaslt, moe, QuantFormat::kNone, Workload(1))
                .item_bytes(MemoryPool::kWorkspaces, "cuBLASLt workspace"),
            int64_t{32} << 20);

  // w4a16 on cuBLASLt: a prefill dequantizes each dense linear into one bf16 buffer, the largest
  // q_proj 4096 x 2048 x 2 bytes = 16,777,216; decode-only at batch 1 makes none.
  CudaOptions w4a16 = cublaslt;
  w4a16.qgemm = QGemm::kW4A16;
  w4a16.moe = Moe::kFused;
  const std::string copy = "bf16 copy of the largest quantized linear (w4a16/w8a16 on cuBLASLt)";
  EXPECT_EQ(
      Plan(w4a16, moe, QuantFormat::kNvfp4, Workload(1)).item_bytes(MemoryPool::kCopies, copy),
      16'777'216);
  MemoryWorkload decode;
  decode.generated_tokens = 16;
  EXPECT_EQ(Plan(w4a16, moe, QuantFormat::kNvfp4, decode).item_bytes(MemoryPool::kCopies, copy), 0);

  // graphs=on: an allowance of two decode graphs; graphs=off none.
  CudaOptions graphs = cublaslt;
  graphs.graphs = Graphs::kOn;
  EXPECT_EQ(Plan(graphs, moe, QuantFormat::kNone, Workload(1)).bytes(MemoryPool::kGraphPools),
            2 * kGraphAllowanceBytes);
}

// graphs=persistent on codes with scales along K: FP4 group-scale rows that are not 16-byte
// multiples are copied into padded rows, fp8 block-128's blocks are expanded to an fp32 row a
// weight row, and each expert has codes, factor and group tables. tiny-moe (4 layers, hidden
// 128, q_dim 128, kv_dim 64, 8 experts of 64): every row's scales take 16 bytes, nvfp4's (a byte
// per 16 weights: 8 or 4), mxfp4's (per 32: 4 or 2) and block-128's (one fp32) alike.
//   a layer: q, o 128 rows + k, v 64 rows = 384 rows; experts 8 x (64 + 64 + 128) = 2048 rows
//   4 layers x 2432 rows x 16 bytes = 155,648 bytes
//   tables: 4 layers x 8 experts x 3 projections x 3 kinds x 8 bytes = 2,304 bytes (fp8 tensor
//   and channel: 2 kinds, 1,536 bytes, and no group scales)
TEST(MemoryPlan, PersistentGroupScalesArePaddedRows) {
  CudaOptions o = Bf16Kv();
  o.gemm = Gemm::kFused;
  o.attention = Attention::kFlash;
  o.moe = Moe::kFused;
  o.graphs = Graphs::kPersistent;
  const ModelConfig moe = Preset("tiny-moe");
  const std::string groups = "graphs=persistent: padded group scales (FP4, fp8 block-128)";
  const std::string tables = "graphs=persistent: expert tables";
  for (QuantFormat f : {QuantFormat::kNvfp4, QuantFormat::kMxfp4, QuantFormat::kFp8Block128}) {
    o.qgemm = IsFp4(f) ? QGemm::kW4A16 : QGemm::kW8A16;
    const MemoryPlan p = Plan(o, moe, f, Workload(1));
    EXPECT_EQ(p.item_bytes(MemoryPool::kCopies, groups), 155'648) << QuantFormatName(f);
    EXPECT_EQ(p.item_bytes(MemoryPool::kScratch, tables), 2'304) << QuantFormatName(f);
  }
  o.qgemm = QGemm::kW8A16;
  const MemoryPlan fp8 = Plan(o, moe, QuantFormat::kFp8Channel, Workload(1));
  EXPECT_EQ(fp8.item_bytes(MemoryPool::kCopies, groups), 0);
  EXPECT_EQ(fp8.item_bytes(MemoryPool::kScratch, tables), 1'536);
}

TEST(MemoryPlan, TensorParallelRanksHoldTheirShard) {
  const ModelConfig c = Preset("qwen3-30b-a3b");
  CudaOptions tp2 = Bf16Kv();
  tp2.parallel.tp = 2;
  const MemoryPlan one = Plan(Bf16Kv(), c, QuantFormat::kNone, Workload(1));
  const MemoryPlan rank = Plan(tp2, c, QuantFormat::kNone, Workload(1));
  EXPECT_EQ(rank.tp, 2);
  // KV: 2 of the 4 kv heads a rank.
  EXPECT_EQ(rank.bytes(MemoryPool::kKvCache), one.bytes(MemoryPool::kKvCache) / 2);
  // Everything but the embedding, the norms and the routers halves: (61,064,245,248 - embed
  // 622,329,856 - norms (48 x 4,352 + 2,048) x 2 - routers 48 x 262,144 x 2) / 2 back on top.
  const int64_t replicated = 622'329'856 + (48 * 4'352 + 2'048) * 2 + 48 * 262'144 * 2;
  EXPECT_EQ(rank.item_bytes(MemoryPool::kWeights, "dense tensors (bf16)"),
            (61'064'245'248 - replicated) / 2 + replicated);
  EXPECT_GT(rank.bytes(MemoryPool::kWorkspaces), 0);  // the ranks' all-reduce
}

// A rank's quantized linears are its shard's codes and scales: every quantized linear of
// qwen3-30b-a3b splits in two at tp=2 (heads, KV heads and expert widths, 128-blocks whole), so
// the codes halve, as do the group and block scales; nvfp4's global scales (one fp32 a linear:
// 48 layers x (q, k, v, o + 128 experts x 3) = 18,624) stay whole.
TEST(MemoryPlan, TensorParallelRanksHoldQuantizedShards) {
  const ModelConfig c = Preset("qwen3-30b-a3b");
  CudaOptions tp2 = Bf16Kv();
  tp2.parallel.tp = 2;
  for (QuantFormat f : {QuantFormat::kNvfp4, QuantFormat::kFp8Block128, QuantFormat::kMxfp4}) {
    SCOPED_TRACE(QuantFormatName(f));
    const MemoryPlan one = Plan(Bf16Kv(), c, f, Workload(1));
    const MemoryPlan rank = Plan(tp2, c, f, Workload(1));
    const std::string codes = QuantFormatName(f) + " codes",
                      scales = QuantFormatName(f) + " scales";
    const int64_t global = f == QuantFormat::kNvfp4 ? int64_t{18'624} * 4 : 0;
    ASSERT_GT(one.item_bytes(MemoryPool::kWeights, codes), 0);
    EXPECT_EQ(rank.item_bytes(MemoryPool::kWeights, codes),
              one.item_bytes(MemoryPool::kWeights, codes) / 2);
    EXPECT_EQ(rank.item_bytes(MemoryPool::kWeights, scales) - global,
              (one.item_bytes(MemoryPool::kWeights, scales) - global) / 2);
  }
}

// ep=on: a rank's prefill copies of quantized experts (fp8 block-128 under w8a16) hold its own
// experts, 64 of qwen3-30b-a3b's 128 at tp=2, their pointer table still a slot for every expert.
TEST(MemoryPlan, ExpertParallelRanksCopyTheirOwnExperts) {
  const ModelConfig c = Preset("qwen3-30b-a3b");
  CudaOptions o;
  o.gemm = Gemm::kCublasLt;
  o.qgemm = QGemm::kW8A16;
  o.moe = Moe::kFused;
  CudaOptions ep = o;
  ep.parallel.tp = 2;
  ep.parallel.expert_parallel = true;
  const std::string item = "MoE prefill: one layer's experts in bf16";
  const int64_t one =
      Plan(o, c, QuantFormat::kFp8Block128, Workload(1)).item_bytes(MemoryPool::kCopies, item);
  const int64_t rank =
      Plan(ep, c, QuantFormat::kFp8Block128, Workload(1)).item_bytes(MemoryPool::kCopies, item);
  // 3 x 128 x 768 x 2048 x 2 bytes of copies, 3 x 128 pointers, 48 layers x 3 x 128 MatrixRefs.
  const int64_t refs = 48 * 3 * 128 * static_cast<int64_t>(sizeof(MatrixRef));
  EXPECT_EQ(one, 1'207'959'552 + 3 * 128 * 8 + refs);
  EXPECT_EQ(rank, 1'207'959'552 / 2 + 3 * 128 * 8 + refs / 2);
}

TEST(MemoryPlan, RefusedAttentionIsAnError) {
  CudaOptions o;
  o.attention = Attention::kFlash;
  ModelConfig wide = Preset("qwen3.5-397b-a17b", 8);
  wide.head_dim = 512;  // more than flash takes
  EXPECT_EQ(PlanMemory(o, wide, QuantFormat::kNone, Workload(1)).status().code(),
            absl::StatusCode::kUnimplemented);
  MemoryWorkload empty;
  EXPECT_EQ(
      PlanMemory(CudaOptions{}, Preset("tiny-dense"), QuantFormat::kNone, empty).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(MemoryPlan, VerdictNamesEveryPool) {
  CudaOptions o;
  o.gemm = Gemm::kCublasLt;
  o.graphs = Graphs::kOn;
  const MemoryPlan p = Plan(o, Preset("qwen3-30b-a3b"), QuantFormat::kNone, Workload(64));
  const std::string text = MemoryVerdictText(p, 139 * kGiB);
  EXPECT_EQ(text.rfind("needs ", 0), 0u) << text;
  for (const char* pool : {"weights ", "copies ", "KV ", "recurrent state ", "scratch ",
                           "workspaces ", "graph pools "})
    EXPECT_NE(text.find(pool), std::string::npos) << pool << " in " << text;
  EXPECT_NE(text.find(", 139.00 GiB free"), std::string::npos) << text;
  EXPECT_NE(text.find("on the device (weights 56.87 GiB"), std::string::npos) << text;
  EXPECT_TRUE(Fits(p, p.total_bytes()));
  EXPECT_FALSE(Fits(p, p.total_bytes() - 1));
  EXPECT_EQ(FormatMemoryBytes(0), "0 B");
  EXPECT_EQ(FormatMemoryBytes(int64_t{3} << 20), "3.0 MiB");
}

TEST(MemoryPlan, FromTheHarnessInputs) {
  absl::StatusOr<BackendConfig> parsed = ParseBackendConfig("device=cuda,gemm=cublaslt");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  absl::StatusOr<BackendConfig> config = NormalizeBackendConfig(*parsed);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<MemoryPlan> p = PlanMemory(*config, Preset("tiny-moe"), "nvfp4", Workload(1));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(p->item_bytes(MemoryPool::kWeights, "nvfp4 codes"), 0);
  EXPECT_GT(p->item_bytes(MemoryPool::kWorkspaces, "cuBLASLt workspace"), 0);
  EXPECT_FALSE(PlanMemory(*config, Preset("tiny-moe"), "int3", Workload(1)).ok());
}

}  // namespace
}  // namespace infersweep
