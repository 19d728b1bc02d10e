// The persistent decode step (graphs=persistent): every layer of a batch-1 decode step in one
// cooperative kernel, weights streamed through per-warp TMA rings that run ahead across phases.
// sm_90a only, like the rest of this folder.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "core/quant/format.h"

namespace infersweep::cuda {

// One decoder layer as the kernel reads it. Device pointers; row-major weights, every row
// 16-byte aligned: bf16, or (PersistentDecodeShape::format) the codes of quantized ones, fp8
// E4M3 [rows, cols] or FP4 [rows, cols / 2] (low nibble first), their scales in
// PersistentQuant. The router stays bf16 (it is never quantized).
struct PersistentLayer {
  const void* q = nullptr;           // [q_dim, hidden]
  const void* k = nullptr;           // [kv_dim, hidden]
  const void* v = nullptr;           // [kv_dim, hidden]
  const void* o = nullptr;           // [hidden, q_dim]
  const void* input_norm = nullptr;  // [hidden]
  const void* post_norm = nullptr;   // [hidden]
  const void* q_norm = nullptr;      // [head_dim] or null (no q/k norm)
  const void* k_norm = nullptr;
  // The router transposed, [hidden, num_experts] (row i: what x[i] adds to each logit, streamed
  // with o's row i); null: a dense MLP layer.
  const uint16_t* router = nullptr;
  // Tables of device pointers, one entry per expert (one for a dense layer's MLP).
  const void* const* gate = nullptr;  // [inter, hidden] each
  const void* const* up = nullptr;    // [inter, hidden] each
  // [hidden, inter] each; in the bf16 build (format kNone) the copies PersistentDownTiles makes.
  const void* const* down = nullptr;
  int inter = 0;
  int top_k = 1;           // experts a token takes (1 for a dense layer)
  float o_scale = 1.f;     // fault injection (bad-scale): the o projection's output scale
  int skip_expert = -1;    // fault injection (zero-expert): an expert whose output is dropped
  int nan_after = 0;       // fault injection (nan-layer): x[0] = NaN after this layer
};

// A quantized layer's scales (PersistentDecodeShape::format fp8_tensor, fp8_channel, nvfp4 or
// mxfp4), per projection; device pointers. What multiplies a row's dot product, its "factor":
// the fp8 tensor scale ([1]) or channel scale ([rows]), in PersistentDecodeArgs::scale_dtype,
// nvfp4's scale_2 (fp32 [1]); mxfp4 has none (its entry is unread). FP4's group scales (nvfp4
// E4M3 [rows, cols / 16], mxfp4 E8M0 [rows, cols / 32]) are streamed with the codes.
struct PersistentQuant {
  const void* factor[4] = {};  // q, k, v, o
  const void* groups[4] = {};  // q, k, v, o: FP4 only
  // gate, up, down: device tables, one entry per expert (one for a dense layer's MLP).
  const void* const* expert_factor[3] = {};
  const void* const* expert_groups[3] = {};  // FP4 only
};

// The shapes the kernel is compiled around, checked before any launch.
struct PersistentDecodeShape {
  // The weights' format: kNone (bf16), kFp8Tensor, kFp8Channel, kNvfp4 or kMxfp4; each has its
  // own build of the kernel.
  QuantFormat format = QuantFormat::kNone;
  int num_layers = 0;
  int hidden = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int num_experts = 0;  // router rows (0: no MoE layer)
  int max_top_k = 1;    // over the layers
  int max_inter = 0;    // over the layers
};

struct PersistentDecodeArgs {
  PersistentDecodeShape shape;
  const PersistentLayer* layers = nullptr;  // device array of shape.num_layers
  // Quantized weights: a device array of shape.num_layers, and the fp8 scales' dtype.
  const PersistentQuant* quant = nullptr;
  DType scale_dtype = DType::kF32;
  bool renormalize = false;  // norm_topk_prob
  float eps = 0.f;
  DType norm_dtype = DType::kBF16;
  float* x = nullptr;  // [hidden]: the residual stream, in and out
  // [hidden]: x after the o projection, what the bf16 build's MLP reads (x itself takes the
  // blocks' down sums by red.add while slower blocks may still be staging it).
  float* x_mlp = nullptr;
  uint16_t* k_cache = nullptr;  // bf16 [num_layers][capacity][kv_dim] (batch 1)
  uint16_t* v_cache = nullptr;
  int capacity = 0;
  const float2* rope = nullptr;  // [capacity][head_dim / 2] (cos, sin)
  const int* position = nullptr;  // the new token's position
  // Scratch written and read inside the launch.
  float* qkv = nullptr;     // [q_dim + 2 kv_dim]
  float* attn = nullptr;    // [q_dim]
  // [num_experts + 1]: sum_i x[i] gain[i] Wr[e, i], then sum_i x[i]^2 (the post-attention norm's
  // rms), summed by atomics in the o phase.
  float* logits = nullptr;
  float* h = nullptr;       // [max_top_k * max_inter]
  float* partials = nullptr;  // [PersistentDecodePartialFloats(shape)]: attention's splits
  // [PersistentDecodeCounters(shape)]: the grid barrier's counter, then one per layer and kv
  // head (attention's last split combines); zero at launch (the launcher's memset, unless the
  // caller zeroed them: PersistentDecode's counters_zeroed).
  unsigned* barrier = nullptr;
  // TEST ONLY (profiling): null, or [gridDim][PersistentTimelineEvents(num_layers)] globaltimer
  // stamps (ns) by each block: the kernel's start, then per layer and phase (q/k/v, attention,
  // o, router, gate/up, down) the block's arrival at the barrier that ends the phase and its
  // departure (the last layer's down: its end). The router slots stay 0 (no phase). Then per
  // layer kPersistentAttentionStamps inside the block's attention split: q/k/v loaded and
  // normalised; keys done; partial published and counted; its slice combined (the wait for the
  // other splits included); then the layer's kPersistentStepStamps inside the other phases
  // (PersistentStep). Last, the SM the block ran on (%smid).
  unsigned long long* timeline = nullptr;
  // [PersistentAddFloats(hidden)]: the bf16 build's down sums of every layer but the last, x's
  // element i at PersistentAddIndex(i) (x at the next layer's start is x plus these). Last, so
  // that the quantized builds' parameter offsets stay as they were (their register allocation
  // moves with anything).
  float* x_adds = nullptr;
};

constexpr int kPersistentPhases = 6;
// The bf16 build's down sums (x_adds) are spread out: each 8 floats (the 32 bytes a lane adds by
// two red.add.v4) at the start of a 128-byte line of their own. Every block adds to every element
// of x: on x's own 64 lines the red.adds queue (spreading them shortens the MLP phase's slowest
// block; four dense copies of x cost the readers four loads an element).
INFERSWEEP_HD int PersistentAddIndex(int i) { return (i & ~7) * 4 | (i & 7); }
inline size_t PersistentAddFloats(int hidden) { return static_cast<size_t>(hidden) * 4; }
constexpr int kPersistentAttentionStamps = 4;
// TEST ONLY timeline: steps inside the phases, stamped by each block's thread 0 (warp 0's view
// for the rows): after the block staged x (q/k/v) or attention's output (o), after warp 0's rows;
// in the MLP phase after the block barrier that follows the top-k and x's staging (the routing
// reaches the producers at or before it), warp 0's first pair, its last pair.
enum PersistentStep : int {
  kQkvStaged,
  kQkvRows,
  kOStaged,
  kORows,
  kMlpRouted,
  kMlpFirstPair,
  kMlpPairs,
  kPersistentStepStamps
};
INFERSWEEP_HD int PersistentTimelineEvents(int num_layers) {
  return 1 +
         num_layers * (kPersistentPhases * 2 + kPersistentAttentionStamps + kPersistentStepStamps) +
         1;  // + %smid
}
// Where layer l's attention stamps start in a block's row of the timeline.
INFERSWEEP_HD int PersistentAttentionStamp(int num_layers, int layer) {
  return 1 + num_layers * kPersistentPhases * 2 + layer * kPersistentAttentionStamps;
}
// Where layer l's step stamps start in a block's row of the timeline.
INFERSWEEP_HD int PersistentStepStamp(int num_layers, int layer) {
  return 1 + num_layers * (kPersistentPhases * 2 + kPersistentAttentionStamps) +
         layer * kPersistentStepStamps;
}
// The grid size PersistentDecode launches (one block per SM of the current device).
int PersistentDecodeBlocks();
// Sizes of the scratch PersistentDecodeArgs points at, on the current device.
size_t PersistentDecodePartialFloats(const PersistentDecodeShape& shape);
// Bytes of each consumer warp's ring of weight units (shared memory left after the rest).
int PersistentDecodeRingBytes(const PersistentDecodeShape& shape);
inline int PersistentDecodeCounters(const PersistentDecodeShape& shape) {
  return 1 + shape.num_layers * shape.kv_heads;
}

// The bf16 build's down weights (the down projection fused into the gate/up phase): down
// [hidden, inter] bf16 as tiles [inter][hidden], row g * 16 + w holding down[w * c .. (w + 1) * c,
// g * 16 .. g * 16 + 16) transposed, [16][c] with c = hidden / 16: the rows j of a block's round of
// gate/up pairs times the columns its warp w sums. inter must be a multiple of 16 and hidden of
// 128. Asynchronous on `stream`.
void PersistentDownTiles(const uint16_t* down, uint16_t* tiles, int hidden, int inter,
                         cudaStream_t stream);
// Empty when PersistentDownTiles (and the kernel's tiles) take these shapes, else the reason.
std::string PersistentDownTilesUnsupported(int hidden, int inter);

// Empty when the kernel takes these shapes on the current device, else the reason it does not.
std::string PersistentDecodeUnsupported(const PersistentDecodeShape& shape);

// One batch-1 decode step through every layer: x (the embedded token) in, x (before the final
// norm) out, this step's K and V appended to the cache. A cooperative launch of one block per
// SM, preceded by a memset of the barrier counters unless an earlier kernel on `stream` zeroed
// them (counters_zeroed: the engine's step-input kernel does, a graph node fewer); capturable in
// a graph.
void PersistentDecode(const PersistentDecodeArgs& args, cudaStream_t stream,
                      bool counters_zeroed = false);

}  // namespace infersweep::cuda
