// CUDA launchers. Plain functions with explicit shapes; all asynchronous on `stream`; callers
// check cudaGetLastError. Activations are fp32 row-major; weights are typed views (MatrixRef,
// device pointers). Napkin math is for an H200 (4.46 TB/s read, measured).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor_ref.h"
#include "kernels/cuda/limits.h"

namespace infersweep::cuda {

struct QuantExpertTable;  // kernels/cuda/quant.h

// Programmatic dependent launch for this thread's launches of the decode-chain kernels (GEMV,
// q/k-norm+RoPE, flash attention, top-k, fused MoE): each kernel's weight prefetch overlaps the
// previous kernel's tail. sm_90+.
void SetProgrammaticLaunch(bool on);

// ---- synthetic weights (engine/synthetic.h): bit-identical to the CPU generator.
// Writes n bf16 values of a tensor, elements [0, n). 2 bytes/element: 61 GB (qwen3-30b-a3b) in
// ~20 ms of write bandwidth; the hash makes it ~2x that.
void GenerateSyntheticBf16(uint64_t stream_key, float scale, float offset, int64_t n, uint16_t* out,
                           cudaStream_t stream);

// ---- elementwise
// (The embedding gather is part of StepInputs, below.)

// RMSNorm over rows of n; in place allowed. One block per row. With out_bf16, the result is
// also written rounded to bf16 (the cuBLASLt GEMMs' input).
void RmsNorm(const float* x, int rows, int n, const MatrixRef& gain, float eps, float* out,
             cudaStream_t stream, uint16_t* out_bf16 = nullptr);
// out[i] = offset + m[i] as fp32, for every element of m (bf16, f16 or f32).
void UpcastToF32(const MatrixRef& m, float* out, cudaStream_t stream, float offset = 0.f);
// x += scale * y (n elements).
void AddScaled(float* x, const float* y, float scale, int64_t n, cudaStream_t stream);
// y[r, n] += bias[n].
void AddBias(float* y, int rows, const MatrixRef& bias, cudaStream_t stream);
// out = silu(gate) * up.
void SiluMul(const float* gate, const float* up, int64_t n, float* out, cudaStream_t stream);
// fp32 -> bf16.
void ToBf16(const float* x, int64_t n, uint16_t* out, cudaStream_t stream);
// A lockstep step's lengths for each of `batch` sequences: seq_q[b] = n new tokens, seq_kv[b] =
// *position + n keys (attention=cudnn's graph reads them on the device, so a replay follows the
// position).
void SequenceLengths(const int* position, int n, int batch, int32_t* seq_q, int32_t* seq_kv,
                     cudaStream_t stream);
// A ragged step's decode rows as a batch of every slot (attention=cudnn serving): each of `slots`
// slots a one-token query; seq_kv of a decode row's slot its position + 1, 1 for the others.
void SlotLengths(const int2* ragged, int rows, int slots, int32_t* seq_q, int32_t* seq_kv,
                 cudaStream_t stream);
// Row r of `rows` [rows, width] rows to (bf16) or from (fp32) row ragged[r].x of a per-slot
// array [slots, width]. 4 + 2 bytes a value each way: 64 decode rows of 4096 values move
// 1.5 MB (~1 us).
void RowsToSlotsBf16(const float* rows_in, int rows, int width, const int2* ragged,
                     uint16_t* slots_out, cudaStream_t stream);
void SlotsToRowsF32(const uint16_t* slots_in, int rows, int width, const int2* ragged,
                    float* rows_out, cudaStream_t stream);

// ---- attention
// RoPE cos/sin for positions [0, capacity): table[p * head_dim/2 + i], angles in double.
void BuildRopeTable(int capacity, int head_dim, double theta, float2* table, cudaStream_t stream);
// One layer's KV cache: K and V, each [batch, capacity, kv_dim]: fp32, bf16 (kv_cache=bf16) or
// E4M3 codes (kv_cache=fp8) with their scales, one fp32 each (token, kv head) in k_scale and
// v_scale, [batch, capacity, kv_heads] (kv_cache.cuh). bf16 halves the bytes decode attention
// reads (142 -> 71 MB a layer at batch 64, context 544, on qwen3-30b-a3b) and fp8 halves them
// again (37 MB with its scales); the tensor-core kernels stage every type as bf16 tiles.
enum class KvDtype { kFp32, kBf16, kFp8 };
struct KvCache {
  void* k = nullptr;
  void* v = nullptr;
  KvDtype dtype = KvDtype::kFp32;
  int capacity = 0;
  float* k_scale = nullptr;  // kFp8 only
  float* v_scale = nullptr;
};
inline int KvBytesPerElement(KvDtype dtype) {
  return dtype == KvDtype::kFp32 ? 4 : dtype == KvDtype::kBf16 ? 2 : 1;
}
// The projections' outputs for one layer: q rows q_stride floats apart, their heads
// q_head_stride apart (0: d, the heads packed; 2 d for gated attention's [q_h | gate_h]), k and v
// rows (kv_heads * d wide) kv_stride apart: three buffers, or one [rows, q | k | v] buffer from
// the fused q/k/v GEMM (strides q_dim + 2 kv_dim).
struct QkvRows {
  const float* q = nullptr;
  int q_stride = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int kv_stride = 0;
  int q_head_stride = 0;
};
// Per-head RMSNorm of q and k when the gains are given (qwen3 q_norm/k_norm), RoPE (HF
// rotate_half) from the table; rotated q goes to q_out [rows, q_heads * d] (in.q itself allowed
// when its heads are packed and its stride is q_heads * d), rotated k and v rows are appended to
// the cache at *position + (row % n), rounded to bf16 for a bf16 cache (to E4M3 under the head's
// scale for fp8). One warp per head vector: 36 warps at batch 1 on qwen3-30b-a3b, ~80 KB touched.
// Ragged rows (serving): with `ragged` ([rows] (sequence, position) pairs on the device), row r
// belongs to sequence ragged[r].x at position ragged[r].y instead, for this and the attention
// kernels below; `position` and `n` (then 1) are unused.
void QkNormRopeAppend(const QkvRows& in, float* q_out, int rows, int n, int q_heads, int kv_heads,
                      int head_dim, const MatrixRef& q_norm, const MatrixRef& k_norm, float eps,
                      const float2* rope, const int* position, const KvCache& cache,
                      cudaStream_t stream, const int2* ragged = nullptr);
// QkNormRopeAppend with partial RoPE (qwen3_next, qwen3_5): the norm over the whole head, then
// RoPE over its first rotary_dim dims as a head of that size (the table built for rotary_dim);
// the rest pass through. A warp a head vector, staged in shared memory.
void QkNormPartialRopeAppend(const QkvRows& in, float* q_out, int rows, int n, int q_heads,
                             int kv_heads, int head_dim, int rotary_dim, const MatrixRef& q_norm,
                             const MatrixRef& k_norm, float eps, const float2* rope,
                             const int* position, const KvCache& cache, cudaStream_t stream,
                             const int2* ragged = nullptr);
// Causal GQA attention with materialised scores [rows, q_heads, capacity] in `scores`, on an
// fp32 cache. One block per (row, head): reads position+1 keys and values of kv_dim floats.
void AttentionNaive(const float* q, const float* k_cache, const float* v_cache, int rows, int n,
                    int q_heads, int kv_heads, int head_dim, const int* position, int capacity,
                    float* scores, float* out, cudaStream_t stream, const int2* ragged = nullptr);

// Flash attention (attention_flash.cu): same function as AttentionNaive on either cache, tiled
// online softmax, K/V tiles shared by the q heads of a kv head, keys split over `splits` blocks
// and merged. `partial` holds rows * q_heads * splits * (head_dim + 2) floats.
// Splits, partial floats and supported shapes: kernels/cuda/limits.h.
int FlashSplits(int rows, int kv_heads, int capacity);
// Prefill chunks of kFlashPrefillMinTokens+ tokens take the tensor-core kernel
// (attention_prefill.cu; bf16 Q, K, V and P, f16 over an fp8 cache, fp32 accumulate) when
// FlashPrefillSupports(head_dim);
// AttentionFlash dispatches to it by itself (`splits` and `partial` are then unused).
void AttentionFlashPrefill(const float* q, const KvCache& cache, int rows, int n, int q_heads,
                           int kv_heads, int head_dim, const int* position, float* out,
                           cudaStream_t stream);
// Decode chunks (fewer than kFlashPrefillMinTokens tokens) with head_dim 32/64/128/256 take the
// tensor-core split-KV kernel (attention_decode.cu; bf16 Q, K, V and P, f16 over an fp8 cache,
// fp32 accumulate); it
// writes the same partials as the CUDA-core kernel, merged by the same combine.
void AttentionFlashDecodeMma(const float* q, const KvCache& cache, int rows, int n, int q_heads,
                             int kv_heads, int head_dim, const int* position, int splits,
                             float* partial_acc, float* partial_max, float* partial_sum,
                             cudaStream_t stream, const int2* ragged = nullptr);
// Ragged rows never take the prefill kernel (its tiles are rows of one sequence).
void AttentionFlash(const float* q, const KvCache& cache, int rows, int n, int q_heads,
                    int kv_heads, int head_dim, const int* position, int splits, float* partial,
                    float* out, cudaStream_t stream, const int2* ragged = nullptr);

// ---- GEMM: y[M, N] = x[M, K] . W[N, K]^T (+ bias), fp32 accumulate.
// Reference: one warp per output feature, rows looped; W read once from DRAM, rows re-read
// from L1/L2. Simple on purpose: it is the GPU link of the trust chain, not a fast path.
// Quantized W (qgemm=reference) is dequantized exactly element by element as it is read.
// `inputs`: each x element as it is read, exact, rounded to bf16 (the bf16 yardstick), or for a
// quantized W rounded to E4M3 with its row's scale amax / 448 (bf16 for a dense W: the E4M3
// yardstick, CudaOptions::yardstick).
enum class GemmInputs { kExact, kBf16, kE4m3Rows };
void GemmReference(const float* x, int M, const MatrixRef& w, const MatrixRef& bias, float* y,
                   cudaStream_t stream, GemmInputs inputs = GemmInputs::kExact);

// MoE router logits y[M, N] = x . W^T for many rows (router.cu): fp32 x, fp32 accumulate in k
// order, W bf16/f16/f32 upcast: warp-per-expert GEMV over 8 rows up to 256 rows, register-tiled
// 32 x 64 tiles above.
void RouterGemm(const float* x, int M, const MatrixRef& w, float* y, cudaStream_t stream);

// ---- decode GEMV (gemm_fused.cu), the gemm=fused path for a few rows:
//   y_s[r, n] = (accumulate ? y_s[r, n] : 0) + scale * (xin[r] . W_s[n]) + bias_s[n]
// for up to kGemvMaxSegments segments s (separate W, bias, y; e.g. q, k and v in one launch; a
// linear-attention layer's qkv, z, b and a), where xin is x or,
// with a norm gain, RMSNorm(x) * gain (then optionally written to `normed_out`). W bf16 [n, k],
// k % 8 == 0, rows <= kGemvMaxRows, rows * k * 4 <= kGemvMaxSharedBytes (GemvSupports).
constexpr int kGemvMaxSegments = 4;
struct GemvSegment {
  const uint16_t* w = nullptr;
  const void* bias = nullptr;  // [n] or null
  DType bias_dtype = DType::kBF16;
  float* y = nullptr;
  int n = 0;
  int ld = 0;  // row stride of y
};
// A router GEMV's top-k, fused into its launch (MoE decode rows): once every block has written
// its logits, the last block to finish (an atomic count in `counter`, zero before the launch and
// left zero after it) picks each row's k experts as RouterTopK does, from segment 0's output.
// Up to kGemvTopKMaxExperts experts (16 logits a lane keep the kernel's registers in check);
// more, and Gemv runs RouterTopK after the GEMV instead.
constexpr int kGemvTopKMaxExperts = 512;
// With shared_logit (a shared expert folded in as one more pair a row), each row has k + 1 slots:
// slot k is expert num_experts (the tables' extra entry) with weight sigmoid(shared_logit[r]),
// the shared expert's gate; the top-k's k slots are as without it.
struct GemvTopK {
  unsigned* counter = nullptr;  // null: no top-k
  int* expert_ids = nullptr;    // [rows, k] ([rows, k + 1] with shared_logit)
  float* expert_weights = nullptr;
  int num_experts = 0, k = 0;
  bool renormalize = false;
  const float* shared_logit = nullptr;  // [rows] or null
};
struct GemvArgs {
  const float* x = nullptr;  // [rows, k]
  int rows = 0;
  int k = 0;
  const void* norm_gain = nullptr;  // [k] or null: no norm
  DType norm_dtype = DType::kBF16;
  float norm_eps = 0.f;
  float* normed_out = nullptr;  // [rows, k] or null
  GemvSegment seg[kGemvMaxSegments];
  int segments = 0;
  bool accumulate = false;
  float scale = 1.f;
  GemvTopK topk;  // one segment only (the router)
};
void Gemv(const GemvArgs& args, cudaStream_t stream);
// Above this many rows (all segments) an SM, Gemv streams the matrix with a grid of a few blocks
// an SM walking its rows (the lm_head) instead of one wave of short-lived blocks.
constexpr int kGemvStreamRowsPerSm = 512;
bool GemvStreams(const GemvArgs& args);

// ---- MoE
// Softmax over E router logits per row (fp32), top-k (ties: lower index), optional renormalise.
// One warp per row; E <= 1024, k <= 32. The k ids are distinct and in range even when the
// logits are NaN. With shared_logit, rows have k + 1 slots, the last the folded shared expert's
// (GemvTopK): expert E, weight sigmoid(shared_logit[r]).
void RouterTopK(const float* logits, int rows, int num_experts, int k, bool renormalize,
                int* expert_ids, float* expert_weights, cudaStream_t stream,
                const float* shared_logit = nullptr);
// The MoE expert kernels run the experts [expert_begin, expert_end) of the pointer tables (a
// rank's own at ep=on, whose tables hold null for the other ranks' experts; [0, num_experts)
// otherwise): a pair routed to an expert outside it reads no weights and contributes nothing
// here (the rank that holds the expert adds it in the all-reduce).
// Device-indexed expert MLP for pairs p = (row, slot): h[p] = silu(Wg[e]·x) * (Wu[e]·x),
// e = expert_ids[p]; weights bf16, [inter, hidden] each, addressed through pointer tables. A pair
// of an expert outside [expert_begin, expert_end) gets h[p] = 0.
// Batch-1 decode of qwen3-30b-a3b: 8 pairs x 2 x 768 x 2048 x 2 B = 50 MB/layer -> ~11 us.
void MoeGateUp(const float* x, int rows, int k, const int* expert_ids, int expert_begin,
               int expert_end, const uint16_t* const* gate, const uint16_t* const* up, int hidden,
               int inter, float* h, cudaStream_t stream);
// Down projection and combine in one launch: y[r] += sum_slot w[r, slot] * Wd[e]·h[r, slot] (fixed
// slot order: deterministic), into the residual stream directly; Wd [hidden, inter] bf16. Pairs
// whose expert is `skip_expert` (TEST ONLY zero-expert fault; -1 in production) or outside
// [expert_begin, expert_end) are left out (h from MoeGateUp over the same range).
// Batch-1 decode of qwen3-30b-a3b: 25 MB/layer -> ~6 us. k * inter * 4 bytes of shared memory (24
// KB for qwen3-30b-a3b).
void MoeDownCombine(const float* h, int rows, int k, const int* expert_ids, const float* weights,
                    int skip_expert, int expert_begin, int expert_end, const uint16_t* const* down,
                    int hidden, int inter, float* y, cudaStream_t stream);
// Expert-grouped MoE on tensor cores (moe_fused_mma.cu), for many rows (moe=fused with
// rows >= kMoeGroupedMinRows, decode and prefill): pairs bucketed by expert on the device
// (deterministic order), gate/up and down as bf16 mma.sync over each expert's pairs with each
// expert's weights streamed once, then y[r] += sum_slot w[r, slot] * out[r * k + slot] in slot
// order. No host sync: capturable. Inputs and h are rounded to bf16 (a bf16-class path).
// Batch 64 on qwen3-30b-a3b: 126 of 128 experts touched, 1.19 GB a layer -> ~270 us at roofline;
// the bucketing and the combine add a short launch each.
struct MoeGroupedArgs {
  // The variant the MoE plan chose (engine/plan/moe_plan.h): its shapes are supported (the plan
  // asked kernels/cuda/limits.h).
  MoeGroupedKernel kernel = MoeGroupedKernel::kMma4;
  const uint16_t* x_bf16 = nullptr;  // [rows, hidden], the normalised input
  int rows = 0, k = 0, num_experts = 0, hidden = 0, inter = 0;
  const int* expert_ids = nullptr;        // [rows * k] from RouterTopK
  const float* expert_weights = nullptr;  // [rows * k]
  int skip_expert = -1;                   // TEST ONLY zero-expert fault
  // The experts run here: pairs of experts outside [expert_begin, expert_end) are left out of the
  // buckets and the combine, and only these experts' weights are read (0 <= begin <= end <=
  // num_experts).
  int expert_begin = 0, expert_end = 0;
  const uint16_t* const* gate = nullptr;  // per-expert device pointer tables, bf16 [inter, hidden]
  const uint16_t* const* up = nullptr;
  const uint16_t* const* down = nullptr;  // bf16 [hidden, inter]
  int* offsets = nullptr;                 // scratch [num_experts + 1]
  int* sorted_pairs = nullptr;            // scratch [rows * k]
  uint16_t* h = nullptr;                  // scratch [rows * k, inter] bf16
  float* out = nullptr;                   // scratch [rows * k, hidden]
  float* y = nullptr;                     // [rows, hidden], accumulated into
  // Quantized experts (the kQuant* kernels): the gate, up and down tables, decoded to bf16 in
  // registers (gate/up/down above are then unused). kWgmma and kQuantWgmma run the expert GEMMs
  // on sm_90a warpgroup MMAs (sm90a/moe_wgmma.h); h then holds the pairs in bucketed order.
  const QuantExpertTable* quant = nullptr;
  // kFp8Mma*: the FP8 tables' codes times E4M3 inputs. x_f32 (the normalised input, [rows,
  // hidden]) is quantized to x_fp8 with one scale a row (x_scale), and h (bf16, as above) to
  // h_fp8 with one a pair (h_scale), each by QuantizeRowsE4M3.
  const float* x_f32 = nullptr;
  uint8_t* x_fp8 = nullptr;  // scratch [rows, hidden]
  float* x_scale = nullptr;  // scratch [rows]
  uint8_t* h_fp8 = nullptr;  // scratch [rows * k, inter]
  float* h_scale = nullptr;  // scratch [rows * k]
};
// y[r] = W . x[r] for r < rows, fp32 out, W quantized [n, k] (FP8 tensor / channel, NVFP4,
// MXFP4), x bf16 [rows, k]: its codes decoded to bf16 in registers and fed to mma.sync, 32 or 64
// rows a pass, a block of 8 warps for each 16 output features, each warp a slice of K, their sums
// added in shared memory in a fixed order. qgemm=w4a16|w8a16's dense linears take it on decode
// batches of kQuantMmaMinRows (FP4; FP8 16) to kQuantMmaMaxRows rows (engine/plan/linear_plan.h).
// Batch 16, q_proj of qwen3-30b-a3b NVFP4 [4096, 2048]: 4.7 MB, ~1 us of bandwidth, 256 blocks
// of 8 warps and 16 MB of inputs from L2: expect a few DRAM latencies, a few us.
bool GemmQuantMmaSupports(const MatrixRef& w);  // the format, k % 64 (FP8) or 128 (FP4)
void GemmQuantMma(const uint16_t* x_bf16, int rows, const MatrixRef& w, float* y,
                  cudaStream_t stream);
// y[r] = W . x[r] for r < rows, fp32 out, W FP8 E4M3 [n, k] (tensor, channel or block-128
// scales): x is quantized to E4M3 with one scale a row (QuantizeRowsE4M3 into x_codes [rows, k]
// and x_scales [rows]), then the codes go straight onto E4M3 x E4M3 mma.sync (m16n8k32, fp32
// accumulate; sm_89+), the weight's scales (a row's, or each 128 x 128 block's on that block's
// sums) and the row's multiplying the sums. qgemm=w8a8's dense linears at kQuantMmaMinRows rows
// and more, where GemmFp8Wgmma (kernels/cuda/sm90a/moe_wgmma.h) does not take them.
// Napkin math, a 2048-token prefill chunk through q_proj of qwen3-30b-a3b [4096, 2048]: 34 GFLOP
// at H200's ~990 dense FP8 TFLOP/s is 35 us; mma.sync reaches perhaps a third of it (~100 us),
// against ~60 us of bf16 wgmma at its rate: the win is in the bytes (8 MB of codes, not a 16 MB
// bf16 copy made per call) and in decode batches, where nothing is decoded.
bool GemmFp8MmaSupports(const MatrixRef& w);  // Fp8MmaShapeSupports, aligned codes
void GemmFp8Mma(const float* x, int rows, const MatrixRef& w, uint8_t* x_codes, float* x_scales,
                float* y, cudaStream_t stream);
// codes[r] = E4M3(x[r] / scale[r]) with scale[r] = max |x[r]| / 448 (1 for an all-zero row),
// round to nearest, saturating: x fp32 or bf16 (dtype) [rows, cols], cols even. One block a row.
void QuantizeRowsE4M3(const void* x, DType dtype, int rows, int cols, uint8_t* codes, float* scales,
                      cudaStream_t stream);
// MoeGrouped's first step, exposed for its test: offsets[num_experts + 1] = exclusive prefix sums
// of the per-expert pair counts, sorted_pairs[offsets[e] + i] = the i-th pair (in pair order)
// routed to expert e; pairs of skip_expert, or of an expert outside [expert_begin, expert_end),
// are left out (their experts' counts are 0). num_experts <= 1024; one block, any number of
// pairs.
void BucketPairs(const int* expert_ids, int pairs, int num_experts, int skip_expert,
                 int expert_begin, int expert_end, int* offsets, int* sorted_pairs,
                 cudaStream_t stream);
void MoeGrouped(const MoeGroupedArgs& args, cudaStream_t stream);
// y[r] += sum_slot weights[r, slot] * src[position[r, slot]] over slots with position >= 0, in
// slot order (deterministic; no atomics although rows repeat across experts). src holds the
// pairs' expert outputs [pairs, hidden] in bf16, in expert order (moe=grouped).
void CombinePairsBf16(const uint16_t* src, const int* position, const float* weights, int rows,
                      int k, int hidden, float* y, cudaStream_t stream);
// out = silu(gate) * up over bf16 vectors (fp32 math, one rounding); in place allowed.
void SiluMulBf16(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out,
                 cudaStream_t stream);
// y[r] += sigmoid(gate_logit[r]) * shared[r]  (qwen2_moe shared expert).
void AddSigmoidGated(float* y, const float* shared, const float* gate_logit, int rows, int hidden,
                     cudaStream_t stream);
// Gather rows: out[i] = x[rows_index[i]];  scatter-add: y[rows_index[i]] += w[i] * src[i].
void GatherRows(const float* x, const int* index, int count, int hidden, float* out,
                cudaStream_t stream);
void ScatterAddRows(const float* src, const int* index, const float* weights, int count, int hidden,
                    float* y, cudaStream_t stream);
// out[i] = x[rows_index[i]] for bf16 rows (hidden % 8 == 0, 16-byte aligned rows).
void GatherRowsBf16(const uint16_t* x, const int* index, int count, int hidden, uint16_t* out,
                    cudaStream_t stream);

// ---- a step's inputs and outputs (step_io.cu)
struct StepInputArgs {
  // Pinned host memory (cudaMallocHost: mapped, the same pointer on the device), read when the
  // kernel runs, so a captured graph replays with whatever the host wrote before its launch.
  const int32_t* host_tokens;  // [rows]
  const int* host_position;
  int rows;
  int32_t* tokens;  // device copies of both, for the step's other kernels
  int* position;
  MatrixRef embed;           // [vocab, hidden]
  float* x;                  // [rows, hidden]: the embedding rows, upcast
  unsigned* zero = nullptr;  // counters the step's kernels need zeroed (graphs=persistent's)
  int zero_count = 0;
  // Ragged steps (serving): each row's (sequence, position), pinned host [rows] -> device.
  const int2* host_ragged = nullptr;
  int2* ragged = nullptr;
};
// One kernel a step starts with: tokens and position from the host, the embedding gather, the
// counters zeroed. rows blocks; bf16 hidden 2048: 4 KB read and 8 KB written a row, and one PCIe
// read (~1-2 us) of the token: latency-bound, ~3 us.
void StepInputs(const StepInputArgs& args, cudaStream_t stream);

// Device scratch of GreedyTokens, per row: a rank key and a block ticket, zeroed once at
// allocation; every launch leaves them zeroed again.
struct GreedyScratch {
  unsigned long long* keys;
  unsigned* tickets;
};
// out[r] = the greedy pick of logits row r (engine/sampler.h's Greedy: the lowest index among
// equal maxima; NaN and -inf never win, a row with nothing else picks 0). `out` may be pinned host
// memory. Blocks of 2048 logits, a 64-bit atomicMax each: qwen3's 151,936 logits (608 KB, from
// L2 after the lm_head) in 75 blocks a row, ~2 us.
void GreedyTokens(const float* logits, int rows, int vocab, const GreedyScratch& scratch,
                  int32_t* out, cudaStream_t stream);

// ---- TEST ONLY fault helpers
void SetNan(float* x, cudaStream_t stream);
// row[stuck] = max(row) + 1 for every row of `vocab`.
void ForceToken(float* logits, int rows, int vocab, int stuck, cudaStream_t stream);

}  // namespace infersweep::cuda
