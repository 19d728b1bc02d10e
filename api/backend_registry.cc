// The backend registry: every axis=value the engine knows, one row each (BackendDescriptor in
// api/backend_config.h), with what it runs on, the weight formats it takes, the values it cannot
// be combined with and why. Preflight (backend_config.cc) judges configs from these rows alone.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/backend_config.h"

namespace infersweep {
namespace {

constexpr PrecisionClass kFp32 = PrecisionClass::kFp32;
constexpr PrecisionClass kBf16 = PrecisionClass::kBf16;
constexpr PrecisionClass kFp8 = PrecisionClass::kFp8;
constexpr PrecisionClass kFp4 = PrecisionClass::kFp4;
constexpr Device kCpu = Device::kCpu;
constexpr Device kCuda = Device::kCuda;

// Why graphs=persistent takes gemm=fused only (a conflict's reason: after ": ").
constexpr char kPersistentGemm[] =
    ": its batch-1 decode step runs the persistent kernel's own GEMVs (gemm=fused's numerics), "
    "so that gemm would not be what decode ran; take gemm=fused";

// ep=on needs more than one rank; at tp=1 a sweep would repeat ep=off's run.
constexpr char kEpNeedsRanks[] = "tp=1: one rank holds every expert either way";
// Why the engine takes no allreduce=fused: its blocks apply their RMSNorm inside their own first
// kernel (norm + GEMV), so the fused all-reduce + add + norm has no norm to take over at any rank
// count. It runs in allreduce-bench --device cuda.
std::string FusedNotInTheEngine(const char* tp) {
  return absl::StrCat("tp=", tp,
                      ": the engine's blocks apply their RMSNorm inside their own first kernel "
                      "(norm + GEMV), so the fused all-reduce + add + norm has no norm to take "
                      "over; it runs in allreduce-bench --device cuda");
}

// Why the host-routed MoE runners take no CUDA graph (a conflict's reason: after ": ").
constexpr char kHostRouting[] =
    ": the runner reads the routing on the host (a device sync a step), which a captured graph "
    "cannot replay";
// Why the scaled GEMMs take no fused or grouped MoE runner (a conflict's reason: after ": ").
constexpr char kScaledGemmExperts[] =
    ": it runs the linears' GEMMs; the fused and grouped MoE runners run the experts through "
    "their own kernels, which would bypass it";
// Why the fused expert runners take no qgemm=reference (a conflict's reason: after ": ").
constexpr char kReferenceExperts[] =
    ": qgemm=reference is the exact dequantization the reference GEMM reads; the fused expert "
    "kernels decode the codes themselves, so the reference would not be what ran";
// Why graphs=persistent takes no collective (a conflict's reason: after ": ").
constexpr char kPersistentNoSeam[] =
    ": graphs=persistent runs every layer in one kernel, with no seam between its blocks for an "
    "all-reduce";

std::vector<BackendDescriptor> MakeRegistry() {
  // The CPU dequantizes quantized weights exactly (core/quant/dequantize.h): still fp32.
  const std::vector<std::string> any_format = {"bf16", "f16", "f32", "fp8", "nvfp4", "mxfp4"};
  const std::vector<std::string> quantized_formats = {"fp8", "nvfp4", "mxfp4"};
  const std::vector<std::string> fp4_formats = {"nvfp4", "mxfp4"};
  const std::vector<std::string> quantized_or_bf16 = {"bf16", "fp8", "nvfp4", "mxfp4"};
  std::vector<BackendDescriptor> r;
  // ---- CPU: the reference device; its axes run everywhere, CI included.
  r.push_back({"device", "cpu", kCpu, 0, 0, false, {}, {}, kFp32, "host CPU, fp32 arithmetic"});
  r.push_back({"matmul",
               "naive",
               kCpu,
               0,
               0,
               false,
               any_format,
               {},
               kFp32,
               "one dot product per output; the reference"});
  r.push_back({"matmul",
               "blocked",
               kCpu,
               0,
               0,
               false,
               any_format,
               {},
               kFp32,
               "weight rows decoded once per block, 4 accumulators"});
  for (const char* t : {"1", "2", "4", "8", "all"})
    r.push_back({"threads", t, kCpu, 0, 0, false, {}, {}, kFp32, "worker threads"});
  // Tensor parallelism on the CPU reference: ranks as threads (engine/tp_model.h), each on its
  // shard of the host's weights, so the sharded model is judged against tp=1 on one host.
  r.push_back({"tp", "1", kCpu, 0, 0, false, {}, {}, kFp32, "one rank: the whole model"});
  for (const char* t : {"2", "4", "8"})
    r.push_back({"tp",
                 t,
                 kCpu,
                 0,
                 0,
                 false,
                 {},
                 {},
                 kFp32,
                 absl::StrCat(t,
                              " ranks as threads, weights sharded as vLLM and SGLang shard "
                              "them (q/k/v and gate/up by columns, o and down by rows, the "
                              "lm_head by vocabulary), each rank's kernels on its own thread; "
                              "the threads axis does not apply")});
  r.push_back({"ep",
               "off",
               kCpu,
               0,
               0,
               false,
               {},
               {},
               kFp32,
               "experts sharded on their intermediate dimension across the tp ranks"});
  r.push_back({"ep",
               "on",
               kCpu,
               0,
               0,
               false,
               {},
               {kEpNeedsRanks},
               kFp32,
               "whole experts per rank (experts / tp each), the router replicated"});
  r.push_back({"allreduce",
               "reference",
               kCpu,
               0,
               0,
               false,
               {},
               {},
               kFp32,
               "every rank sums its share of the elements over the ranks' partials in rank "
               "order 0..tp-1, then every rank copies the whole sum: deterministic, and bitwise "
               "the same on every rank"});
  // ---- CUDA (docs/BACKENDS.md). sm ranges are inclusive; 0 means unbounded.
  r.push_back({"device", "cuda", kCuda, 80, 0, true, {}, {}, kFp32, "one NVIDIA GPU"});
  // gemm runs the dense linears; in a quantized model those are the bf16 ones (lm_head,
  // router, excluded modules), so it takes the quantized formats too.
  r.push_back({"gemm",
               "reference",
               kCuda,
               80,
               0,
               true,
               any_format,
               {},
               kFp32,
               "simple fp32-accumulate kernels: the GPU reference"});
  r.push_back({"gemm",
               "cublaslt",
               kCuda,
               80,
               0,
               true,
               {"bf16", "fp8", "nvfp4", "mxfp4"},
               {},
               kBf16,
               "cuBLASLt bf16 tensor cores, fp32 accumulate (activations rounded to bf16)"});
  // In a quantized model gemm=fused keeps the fused GEMV for the bf16 linears and runs the
  // quantized ones through qgemm's fused kernel (w4a16, w8a16) or its copies.
  r.push_back({"gemm",
               "fused",
               kCuda,
               80,
               0,
               true,
               {"bf16", "fp8", "nvfp4", "mxfp4"},
               {},
               kBf16,
               "decode (<= 4 rows): our GEMV with RMSNorm, bias and residual fused in, fp32 "
               "activations (bf16 weights, or qgemm's in-register dequantization); more rows: "
               "cuBLASLt"});
  r.push_back({"gemm",
               "tma",
               kCuda,
               90,
               90,
               true,
               {"bf16"},
               {},
               kBf16,
               "as gemm=fused, with the q/k/v and o GEMVs streaming weight tiles through the "
               "Hopper TMA engine (cp.async.bulk + mbarrier ring); machine code for sm_90a only"});
  r.push_back(
      {"attention", "naive", kCuda, 80, 0, true, {}, {}, kFp32, "materialised scores, fp32"});
  r.push_back({"attention",
               "flash",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kBf16,
               "decode: split-KV tiled online softmax + combine, each K/V tile shared by the q "
               "heads of a kv head (GQA groups up to 16), on bf16 tensor cores (mma.sync) at "
               "head_dim 32, 64, 128 and 256, in fp32 on CUDA cores at the other multiples of 8 "
               "up to 256; prefill chunks of 16+ tokens: FlashAttention-2 on bf16 tensor cores "
               "(mma.sync) at head_dim 32, 64, 128 and 256; fp32 accumulate"});
  // cuDNN is dlopened at run time (engine/cudnn_loader.h): the capability probe refuses the
  // value where cuDNN is missing, too old, or finalizes no plan for the model's shapes.
  r.push_back({"attention",
               "cudnn",
               kCuda,
               80,
               0,
               true,
               {},
               {"kv_cache=fp32: cuDNN's fused attention reads bf16 K and V",
                "kv_cache=fp8: cuDNN's fused attention reads bf16 K and V",
                "graphs=persistent: its batch-1 decode step runs the persistent kernel's own "
                "attention, so cuDNN's would not be what decode ran"},
               kBf16,
               "cuDNN 9's fused flash attention (SDPA) through its graph API: Q.K^T, scale, "
               "padding and bottom-right causal masks from device sequence lengths, softmax and "
               "P.V as one cuDNN kernel over the bf16 KV cache in place (GQA broadcast); serving: "
               "a ragged step's decode rows as a batch of every KV slot (per-slot lengths), each "
               "prefill chunk as one sequence"});
  r.push_back({"kv_cache", "fp32", kCuda, 80, 0, true, {}, {}, kFp32, "K and V cached in fp32"});
  r.push_back({"kv_cache",
               "bf16",
               kCuda,
               80,
               0,
               true,
               {},
               {"attention=naive: the naive kernel is the fp32 reference, reading an fp32 cache"},
               kBf16,
               "K and V rounded to bf16 as they are appended: half the bytes decode attention "
               "reads; attention=flash only (the naive kernel is the fp32 reference)"});
  r.push_back({"kv_cache",
               "fp8",
               kCuda,
               80,
               0,
               true,
               {},
               {"attention=naive: the naive kernel is the fp32 reference, reading an fp32 cache"},
               kFp8,
               "K and V as E4M3 codes with one fp32 scale per token and kv head each (amax / "
               "448), set as they are appended: a quarter of fp32's bytes (+3 % for the scales "
               "at head_dim 128, +1.6 % at 256); the flash tensor-core kernels convert them to "
               "f16 (times their scale) as they stage K/V tiles; head_dim 32, 64, 128 or 256"});
  r.push_back(
      {"moe",
       "loop",
       kCuda,
       80,
       0,
       true,
       {},
       {absl::StrCat("graphs=on", kHostRouting), absl::StrCat("graphs=persistent", kHostRouting)},
       kFp32,
       "per-expert GEMMs on gathered rows; host sync to read the routing"});
  r.push_back(
      {"moe",
       "grouped",
       kCuda,
       80,
       0,
       true,
       {"bf16"},
       {absl::StrCat("graphs=on", kHostRouting), absl::StrCat("graphs=persistent", kHostRouting),
        "gemm=reference: cuBLAS's grouped GEMMs are bf16 tensor-core GEMMs; the fp32 "
        "reference config keeps moe=loop's fp32 GEMMs"},
       kBf16,
       "rows gathered by expert, gate/up/down as cuBLAS grouped GEMMs (bf16); host sync "
       "to read the routing"});
  // Quantized experts: read in place by w4a16/w8a16's per-pair expert kernels at every decode
  // batch, or as dequant_bf16's bf16 copies; qgemm=reference (exact dequantization in the
  // reference GEMM) has no fused runner.
  r.push_back(
      {"moe",
       "fused",
       kCuda,
       80,
       0,
       true,
       quantized_or_bf16,
       {},
       kBf16,
       "device-side routing, no host sync (capturable): 1-3 rows take per-pair expert "
       "GEMVs (fp32 activations), a shared expert as wide as the experts among them as one "
       "more pair a row (its gate in the router's GEMV); 4+ rows (batched decode, prefill) "
       "are bucketed by expert on the device and run as bf16 tensor-core MMAs, each expert "
       "read once; quantized experts (w4a16, w8a16) likewise: per-pair GEMVs below 4 rows, and from 4 "
       "rows the same MMAs with FP8 / FP4 codes decoded to bf16 in registers (fp8 "
       "block-128: per-pair GEMVs at decode, a bf16 copy of the layer's experts in prefill)",
       {absl::StrCat("qgemm=reference", kReferenceExperts)}});
  r.push_back({"moe",
               "wgmma",
               kCuda,
               90,
               90,
               true,
               quantized_or_bf16,
               {},
               kBf16,
               "as moe=fused, with the expert-grouped GEMMs of prefill chunks (more than 16 pairs "
               "an expert; decode batches: moe=fused's) on Hopper warpgroup MMAs (wgmma) from a "
               "cp.async ring of swizzled shared-memory tiles, device-side group sizes, SiLU "
               "fused: no host sync even for long prefill chunks; FP8 / FP4 codes decoded to "
               "bf16 in shared memory each K chunk (fp8 block-128: as moe=fused); machine code "
               "for sm_90a only",
               {absl::StrCat("qgemm=reference", kReferenceExperts)}});
  r.push_back({"graphs", "off", kCuda, 80, 0, true, {}, {}, kFp32, "eager launches"});
  r.push_back({"graphs",
               "on",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "decode step captured once per batch size and replayed"});
  // The model's side (linears bf16, or fp8_tensor / fp8_channel / nvfp4 codes, without biases or
  // shared experts, shapes) is checked when the model is built: UNSUPPORTED with the reason
  // (CudaModelRefusal, engine/cuda/cuda_model.h). Quantized weights stream as qgemm=w8a16 /
  // w4a16 read them (the codes, dequantized in registers) or as dequant_bf16's copies.
  // Its batch-1 decode step is the kernel's own GEMVs, whatever the gemm axis says (they follow
  // gemm=fused): with gemm=reference, cublaslt or tma, a result's batch-1 decode figures would
  // name a GEMM that never ran there (moe=wgmma differs from moe=fused only at 4+ rows).
  r.push_back(
      {"graphs",
       "persistent",
       kCuda,
       90,
       90,
       true,
       {"bf16", "fp8", "nvfp4", "mxfp4"},
       {"kv_cache=fp32: the persistent kernel's own attention reads a bf16 cache",
        "kv_cache=fp8: the persistent kernel's own attention reads a bf16 cache",
        absl::StrCat("gemm=reference", kPersistentGemm),
        absl::StrCat("gemm=cublaslt", kPersistentGemm), absl::StrCat("gemm=tma", kPersistentGemm),
        absl::StrCat("tp=2", kPersistentNoSeam), absl::StrCat("tp=4", kPersistentNoSeam),
        absl::StrCat("tp=8", kPersistentNoSeam), absl::StrCat("allreduce=nccl", kPersistentNoSeam),
        absl::StrCat("allreduce=custom", kPersistentNoSeam)},
       kBf16,
       "batch-1 decode steps as one cooperative kernel over every layer: each consumer "
       "warp's share of every phase's weights streamed into its own shared-memory ring "
       "by a producer warp (cp.async.bulk + mbarriers), running ahead across phases and "
       "layers; grid barriers between phases; fp32 activations; bf16 weights, or fp8, "
       "nvfp4 or mxfp4 codes with their scales (qgemm=w8a16 / w4a16) dequantized in registers; "
       "captured like graphs=on. Other steps as graphs=on. sm_90a machine code only",
       {"qgemm=reference: its batch-1 decode step streams the codes through the kernel's own "
        "GEMVs (qgemm=w8a16 / w4a16's numerics), not the reference's",
        "qgemm=fp8_cublaslt: its batch-1 decode step streams the codes through the kernel's own "
        "GEMVs, not cuBLASLt's FP8 GEMMs",
        "qgemm=native_fp4: its batch-1 decode step streams the codes through the kernel's own "
        "GEMVs, not cuBLASLt's FP4 GEMMs"}});
  // linear_attn: how Gated DeltaNet layers (qwen3_next, qwen3_5) run; a value other than the
  // reference on a model without them is UNSUPPORTED (CudaModelRefusal), as qgemm is on dense
  // models.
  r.push_back({"linear_attn",
               "reference",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "causal conv, then SiLU, then the gated delta rule a thread a state column, the "
               "state in global memory, fp32: the GPU reference for linear attention"});
  r.push_back({"linear_attn",
               "fused",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "conv fused with its SiLU; the gated delta rule with a [dk, 32] state slice a "
               "block held in registers through the step's tokens and written back once (decode "
               "and prefill), fp32"});
  r.push_back({"linear_attn",
               "fused_decode",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "decode rows as one launch a layer after the projections' one GEMV: conv and "
               "SiLU, q/k L2 norm, gates, the gated delta rule over a value head's whole [dk, dv] "
               "state in one block's registers, and the gated RMSNorm; prefill chunks as "
               "linear_attn=fused. fp32; dk <= 128, dv <= 128"});
  r.push_back({"linear_attn",
               "chunked",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "prefill sequences of 16+ tokens in the chunked form of the gated delta rule, 32 "
               "tokens a chunk: a chunk-parallel pass (k.k and q.k products, the chunk's "
               "triangular solve, its state-independent terms) then a pass a value head that "
               "carries the state chunk to chunk, every product on tensor cores as 3xTF32 "
               "(mma.sync, fp32-class); shorter sequences as linear_attn=fused, decode rows as "
               "linear_attn=fused_decode. dk and dv multiples of 16, <= 128"});
  // Tensor and expert parallelism: tp > 1 runs one rank process a GPU (harness/rank_supervisor.h),
  // each on its shard (engine/tp_model.h's ShardHostModel); at tp=1 allreduce=nccl and custom run
  // the collective seam (engine/cuda/communicator.h) over one rank, and auto, the default, none.
  r.push_back({"tp", "1", kCuda, 80, 0, true, {}, {}, kFp32, "one GPU"});
  // Quantized weights shard as their codes and scales (ShardHostModel); a model whose cuts fall
  // inside its scale groups or blocks is refused when the ranks build it (QuantizedShardRefusal).
  for (const char* t : {"2", "4", "8"})
    r.push_back({"tp",
                 t,
                 kCuda,
                 80,
                 0,
                 true,
                 {},
                 {},
                 kFp32,
                 absl::StrCat(t,
                              " GPUs of one agent, one rank process each on its shard "
                              "(sharded as on the CPU; quantized weights as their codes and "
                              "scales, cut on their scale groups and blocks), joined through the "
                              "trial's parent; serving steps planned on rank 0's clock, so every "
                              "rank runs the same ragged steps")});
  r.push_back({"ep",
               "off",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "experts sharded on their intermediate dimension across the tp ranks"});
  r.push_back({"ep",
               "on",
               kCuda,
               80,
               0,
               true,
               {},
               {kEpNeedsRanks},
               kFp32,
               "whole experts per rank (experts / tp each), the router replicated: every moe "
               "value leaves out the pairs routed to experts the rank does not hold (fused and "
               "wgmma on the device, capturable), and the all-reduce adds the ranks' partials"});
  r.push_back({"allreduce",
               "auto",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "the default: nccl at tp > 1; at tp=1 no all-reduce runs (no communicator, no "
               "launch)"});
  r.push_back({"allreduce",
               "nccl",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "ncclAllReduce, capturable in a CUDA graph; at tp=1 a single-rank communicator: "
               "the o projection's and the MLP/MoE's outputs pass through it before the "
               "residual add"});
  r.push_back({"allreduce",
               "custom",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "one-shot (<= 512 KB or 2 ranks) and two-shot kernels over the ranks' peer "
               "buffers, per-block flags, peers summed in a fixed rank order; at tp=1 over one "
               "peer buffer"});
  r.push_back({"allreduce",
               "fused",
               kCuda,
               80,
               0,
               true,
               {},
               {FusedNotInTheEngine("1"), FusedNotInTheEngine("2"), FusedNotInTheEngine("4"),
                FusedNotInTheEngine("8")},
               kFp32,
               "the all-reduce, the residual add and the next RMSNorm in one kernel"});
  // qgemm: how quantized linears run (docs/QUANTIZATION.md). Dense linears (and dense models)
  // follow `gemm`; a value other than the reference on a dense model is UNSUPPORTED, so sweeps
  // over qgemm do not repeat the same dense run.
  r.push_back({"qgemm",
               "reference",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "exact dequantization to fp32 as the reference GEMM reads each weight (the CPU's "
               "formula), fp32 accumulate: the GPU reference for quantized weights"});
  r.push_back({"qgemm",
               "dequant_bf16",
               kCuda,
               80,
               0,
               true,
               quantized_formats,
               {},
               kBf16,
               "weights dequantized to bf16 once at upload, then the gemm axis's GEMM"});
  r.push_back({"qgemm",
               "w4a16",
               kCuda,
               80,
               0,
               true,
               fp4_formats,
               {},
               kBf16,
               "FP4 weights dequantized in registers inside the GEMV/GEMM, bf16 activations, "
               "fp32 accumulate (Hopper's FP4 path: no FP4 tensor cores)"});
  r.push_back({"qgemm",
               "w8a16",
               kCuda,
               80,
               0,
               true,
               {"fp8"},
               {},
               kBf16,
               "FP8 E4M3 weights dequantized in registers inside the GEMV (tensor, channel and "
               "block-128 scales), fp32 activations and accumulate; decode batches of 16-32 "
               "rows (tensor, channel) onto bf16 tensor cores from the codes"});
  // The scaled GEMMs run the linears only: the fused and grouped MoE runners would bypass them.
  // FP8: cuBLASLt's FP8 GEMMs need sm_89, its outer-vector and 128-block scale modes sm_90, and
  // our activation quantizers are built for sm_90 (machine code + PTX): sm_90 or newer.
  r.push_back({"qgemm",
               "fp8_cublaslt",
               kCuda,
               90,
               0,
               true,
               {"fp8"},
               {absl::StrCat("moe=fused", kScaledGemmExperts),
                absl::StrCat("moe=wgmma", kScaledGemmExperts),
                absl::StrCat("moe=grouped", kScaledGemmExperts)},
               kFp8,
               "FP8 E4M3 tensor cores through cuBLASLt: weights as loaded, activations quantized "
               "to E4M3 on the device each call (per tensor, per token, or 1 x 128 for block-wise "
               "weights), scales applied by cuBLASLt or an epilogue, fp32 accumulate and output; "
               "128-block scales need sm_90's cuBLASLt modes"});
  // cuDNN is dlopened at run time; its answer for FP4 on GPUs without FP4 tensor cores is its
  // own refusal, given by the capability probe (sm_90 is in range on purpose).
  r.push_back({"qgemm",
               "cudnn",
               kCuda,
               90,
               0,
               true,
               quantized_formats,
               {absl::StrCat("moe=fused", kScaledGemmExperts),
                absl::StrCat("moe=wgmma", kScaledGemmExperts),
                absl::StrCat("moe=grouped", kScaledGemmExperts)},
               kFp8,
               "cuDNN's matmul graph: FP8 E4M3 x E4M3 (fp8_tensor, fp8_channel weights as "
               "loaded, activations quantized per token on the device) with the row and column "
               "scales fused into its epilogue, fp32 out; block-scaled FP4 (nvfp4, mxfp4) is "
               "cuDNN's on sm_100+ and refused in cuDNN's words elsewhere"});
  r.push_back({"qgemm",
               "native_fp4",
               kCuda,
               100,
               0,
               true,
               fp4_formats,
               {absl::StrCat("moe=fused", kScaledGemmExperts),
                absl::StrCat("moe=wgmma", kScaledGemmExperts),
                absl::StrCat("moe=grouped", kScaledGemmExperts)},
               kFp4,
               "block-scaled FP4 tensor cores through cuBLASLt (VEC16_UE4M3 for NVFP4, "
               "VEC32_UE8M0 for MXFP4), activations quantized to FP4 on the device each call: "
               "sm_100 / sm_120 only (on sm_90 preflight answers UNSUPPORTED); not yet run on "
               "such a GPU"});
  // E4M3 x E4M3 mma.sync (m16n8k32) is sm_89's.
  r.push_back({"qgemm",
               "w8a8",
               kCuda,
               89,
               0,
               true,
               {"fp8"},
               {},
               kFp8,
               "FP8 E4M3 weights as loaded times activations quantized to E4M3 on the device (one "
               "scale a row, amax / 448) on E4M3 x E4M3 tensor cores (mma.sync m16n8k32, fp32 "
               "accumulate), the weight's and the row's scales on the sums: dense linears at 8+ "
               "rows (on sm_90 prefill chunks and 64+ rows take E4M3 wgmma k32 where the "
               "features are whole 128-row tiles and K whole 128-element chunks) and the grouped "
               "experts (moe=fused; moe=wgmma's long prefill chunks on "
               "E4M3 wgmma k32 where hidden and inter are multiples of 128), nothing decoded; "
               "decode GEMV rows as qgemm=w8a16. Tensor and channel scales (K a multiple of 64), "
               "and block-128 scales (K a multiple of 128: each k block's sums scaled apart); "
               "other shapes take qgemm=w8a16's kernels"});
  // TEST ONLY: the sm100a kernel's row claims every arch from sm_80 on purpose (its image is
  // sm_100a's alone): the static table lets it through, so the capability probe's refusal of a
  // missing kernel image is what a test of it sees.
  r.push_back({"test_kernel",
               "none",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "no test kernel",
               {},
               /*test_only=*/true});
  r.push_back({"test_kernel",
               "sm100a",
               kCuda,
               80,
               0,
               true,
               {},
               {},
               kFp32,
               "TEST ONLY: a kernel compiled for sm_100a alone, launched once as the model is "
               "built; the capability probe refuses it on every other GPU",
               {},
               /*test_only=*/true});
  return r;
}

}  // namespace

const std::vector<BackendDescriptor>& BackendRegistry() {
  static const std::vector<BackendDescriptor> registry = MakeRegistry();
  return registry;
}

}  // namespace infersweep
