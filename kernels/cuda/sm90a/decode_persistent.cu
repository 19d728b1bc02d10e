// The persistent decode step (graphs=persistent): one cooperative kernel runs every layer of a
// batch-1 decode step, phase after phase, with grid-wide barriers between phases:
//   q/k/v GEMV (input RMSNorm) | attention (q/k norm, RoPE, KV append) |
//   o GEMV + residual, with the router's logits summed as x's rows are made |
//   top-k, expert gate/up + SiLU | expert down + combine
// (the bf16 build has no down phase: each block's gate/up pairs are followed by their down
// weights, tiled so that each warp sums a fixed column range of x's update, added by red.add
// to a copy of x spread over L2 lines, x_adds, which the next layer reads with x).
// Why: at batch 1 a layer's weights (113.8 MB on qwen3-30b-a3b, 25.5 us at 4.46 TB/s) take 9
// kernels on the kernel chain (graphs=on), each paying its own ramp and tail, and the
// latency-bound kernels in between (RoPE, attention, router, top-k) leave DRAM idle.
//
// How: each of a block's 16 consumer warps owns a fixed share of every phase's weight rows and a
// private ring in shared memory; a lane of one of two producer warps keeps each ring filled
// with bulk asynchronous copies (cp.async.bulk, mbarrier completion) of its warp's next units of
// weights, in the order the warp will consume them, across phase and layer boundaries: while a
// few blocks run attention, the others' rings already hold their o rows; while the barrier
// after the down projection is pending, the next layer's q/k/v rows are in flight. Only the
// experts wait for the routing (their rows are unknown until top-k).
// The activations a phase reads (x, RMS-normalised; attention's output; the experts' h) are
// staged in shared memory once per block after each barrier.
// The router has no phase of its own: RMSNorm(x) . Wr^T = (sum_i x[i] gain[i] Wr[:, i]) / rms(x),
// so each o row i carries column i of the router (a transposed copy), and the warp that makes
// x[i] adds x[i] gain[i] Wr[:, i] and x[i]^2 to its sums (in registers), which are summed over
// the block's warps and reach the grid's by red.add before the o barrier; after it every block
// scales them by 1 / rms(x) in its top-k, and hands the routing to its producers at once.
//
// Weights: bf16, or in their own builds of the kernel (the template's QuantFormat) the codes of
// fp8 (tensor, channel or block-128), nvfp4 or mxfp4 weights as qgemm=w8a16 / w4a16 read them:
// each ring unit is a row's codes (then, FP4 and block-128, their group scales), decoded in
// registers (quant_decode.cuh's exact decodes), the row's scale or scale_2 applied to its sum.
// The router stays bf16.
//
// Napkin math, qwen3-30b-a3b, one layer: weights 113.8 MB -> 25.5 us at 4.46 TB/s (fp8 58.4 MB,
// 13.1 us; nvfp4 33.5 MB, 7.5 us); 132 SMs x 16 warps x 12 KB rings (three 4 KB units) = 26 MB in
// flight (the bandwidth-latency product is ~9 MB); K/V 1 MB at context 512; 5 grid barriers at
// ~1 us (four in the bf16 build). FLOPs are 2 per weight: bandwidth-bound in bf16; the quantized
// builds' gate/up is bounded by the staged x's shared-memory reads (4 bytes a weight).
// docs/PERFORMANCE.md has the measured time a layer.
// Registers: 17 warps a block put 5 on one SM sub-partition, so 96 a thread at most; the kernel
// sits at that cap, and a change anywhere can starve a loop elsewhere (check the spills).
//
// Numerics follow gemm=fused + attention=flash + moe=fused: fp32 activations and accumulation,
// bf16 weights (or exactly decoded codes), K and V rounded to bf16 as they are cached; the router
// and top-k are fp32 and the same top-k code (routing.cuh), the logits' sums formed in another
// order (and, across blocks, in the order the atomics land). Attention here runs on CUDA cores
// in fp32 (the flash decode kernel rounds q to bf16 for its MMAs): results agree to fp32
// rounding, not bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "core/quant/format.h"
#include "core/tensor_ref.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/limits.h"
#include "kernels/cuda/probe_kernels.h"
#include "kernels/cuda/quant_decode.cuh"
#include "kernels/cuda/routing.cuh"
#include "kernels/cuda/sm90a/bulk_copy.cuh"
#include "kernels/cuda/sm90a/decode_persistent.h"

namespace infersweep::cuda {
namespace {

constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;  // the consumer warps
// And the producer warps, each keeping kRingsPerProducer rings filled (one lane a ring). One
// producer warp for all 16 rings is nearly always busy (its branchy, divergent issue path
// serialises over the lanes), so the copies' issue rate would bound the streaming; two are
// fastest on the H200 (four are slower again). More warps cost no registers up to 20: 17 to 20 all
// put 5 on one SM sub-partition (96 registers a thread).
constexpr int kProducerWarps = 2;
constexpr int kRingsPerProducer = kWarps / kProducerWarps;
static_assert(kWarps % kProducerWarps == 0);
constexpr int kBlockThreads = kThreads + 32 * kProducerWarps;
constexpr int kUnitShift = 11;
constexpr int kUnitElems = 1 << kUnitShift;  // a weight unit: up to 2048 bf16 (4 KB) of one row
constexpr int kInFlight = 8;      // units in flight per warp: its mbarriers
constexpr int kMaxTopK = 32;
constexpr int kMaxExperts = 128;  // WarpTopK<4>
constexpr int kMinRingBytes = 2 * kUnitElems * 2;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxSplits = 32;  // attention splits a kv head: a warp combines their weights

// The bf16 build folds the down projection into the gate/up phase: the down weights are streamed
// in tiles (PersistentDownTiles' layout) right behind the gate/up rows, and each warp sums one
// column range of x's update over its block's pairs (DownTiles below). The quantized builds keep a
// down phase of their own (their row factors and group scales run along down's rows).
template <QuantFormat F>
constexpr bool kFusedDown = F == QuantFormat::kNone;
// A down tile: the kWarps rows j of a block's round of pairs, times hidden / kWarps columns.
constexpr int kTileRows = kWarps;

// kRouter streams nothing and has no barrier: each o row carries its column of the router (the
// logits are sums over x's rows, formed where each row is made); its timeline slots stay 0.
enum Phase : int { kQkv, kAttention, kO, kRouter, kGateUp, kDown, kPhaseCount };
static_assert(kPhaseCount == kPersistentPhases);
static_assert(sizeof(PersistentLayer) % 8 == 0);  // copied in 8-byte pieces

// What the producer reads of a layer for every unit it issues, every layer of it in shared memory
// (from global memory those dependent loads would cost more than the streaming itself), and the
// input norm's gains, asked into L2 a layer ahead: 56 bytes a layer where the whole
// PersistentLayer is 120, so that the rings get a third 4 KB unit.
struct StreamLayer {
  const unsigned char *q, *k, *v, *o;
  const uint16_t* router;
  const void* input_norm;
  int inter, top_k;
};

// Quantized builds (F other than kNone): bytes of `elems` weights of a row as streamed. fp8: one
// code a weight; FP4: two codes a byte. The formats with scales along K then stream the unit's
// group scales into the same ring unit (limits.h: PersistentGroupRowBytes). bf16: the router's
// columns in every build, and every weight in the kNone build.
template <QuantFormat F>
constexpr bool kHasGroups = PersistentStreamsGroupScales(F);
template <QuantFormat F>
INFERSWEEP_HD int CodeBytes(int elems) {
  return F == QuantFormat::kNone ? 2 * elems : IsFp4(F) ? elems / 2 : elems;
}
template <QuantFormat F>
INFERSWEEP_HD int GroupBytes(int elems) {
  return PersistentGroupRowBytes(F, elems);
}
template <QuantFormat F>
INFERSWEEP_HD int UnitBytes(int elems) {
  return CodeBytes<F>(elems) + GroupBytes<F>(elems);
}
// Device pointer tables a layer's experts have, staged per expert for the top-k: the codes (or
// bf16 weights) of gate, up, down; quantized, their factor sources; FP4 and fp8 block-128, their
// group scales.
INFERSWEEP_HD constexpr int ExpertTables(QuantFormat f) {
  return f == QuantFormat::kNone ? 3 : PersistentStreamsGroupScales(f) ? 9 : 6;
}

// The floats the o phase's staged expert pointers take (ExpertTables of them an expert).
INFERSWEEP_HD int ExpertPointerFloats(QuantFormat f, int num_experts) {
  return ExpertTables(f) * num_experts * static_cast<int>(sizeof(void*) / sizeof(float));
}
// Where in the staged area the o phase's warps leave their router sums ([kWarps][experts + 1],
// the last the sum of x^2): over the staged attention output (dead once every warp is past its
// rows) where they fit below the expert pointers, else past those.
INFERSWEEP_HD int RouterSumsAt(int hidden, int q_dim, int num_experts, QuantFormat f) {
  const int front = hidden > q_dim ? hidden : q_dim;
  return kWarps * (num_experts + 1) <= front ? 0 : front + ExpertPointerFloats(f, num_experts);
}

// The experts a quantized build's top-k picked, past Routing's codes: each slot's factor source
// and (FP4, fp8 block-128) group scales, per projection (gate, up, down). In dynamic shared memory,
// so that the bf16 build keeps its static size (its rings are exactly three 4 KB units).
struct RoutingQuant {
  const void* factor[3][kMaxTopK];
  const unsigned char* groups[3][kMaxTopK];
};

// Where the partial outputs start in PersistentDecodeArgs::partials, after the (max, sum) pairs:
// 16-byte aligned for the combine's float4 loads.
INFERSWEEP_HD int PartialAccOffset(int q_heads, int splits) { return (2 * q_heads * splits + 3) / 4 * 4; }

constexpr int kAttentionChunk = 32;  // attention's keys a chunk: one a lane

// Where attention keeps what it works on in the staged-activation area (xs). The K and V chunk
// sits past the first `hidden` floats, which hold the q/k/v phase's staged x while it lands.
// K rows are padded by 16 bytes: the lanes (one key each) of a quarter warp read the same
// column of different rows, and a stride of hd * 2 + 16 bytes spreads them over the banks.
INFERSWEEP_HD int AttentionKRowBytes(int hd) { return hd * 2 + 16; }
INFERSWEEP_HD int AttentionKvOffsetFloats(int hidden, int group, int hd) {
  const int front = group * hd /* q */ + 2 * hd /* new k, v */ + group * kMaxSplits /* combine */ +
                    group * hd /* out */ + 2 * group /* running max, sum */;
  return ((hidden > front ? hidden : front) + 3) / 4 * 4;
}
INFERSWEEP_HD int AttentionStageFloats(int hidden, int group, int hd) {
  return AttentionKvOffsetFloats(hidden, group, hd) +
         kAttentionChunk * (AttentionKRowBytes(hd) + hd * 2) / 4;
}

struct Dims {
  int hidden, q_dim, kv_dim, head_dim;
  int gw, warps;  // this warp's global index, and the grid's warp count
};

__device__ __forceinline__ int TasksOf(int items, const Dims& d) {
  return items > d.gw ? (items - 1 - d.gw) / d.warps + 1 : 0;
}
__device__ __forceinline__ int UnitsOfRow(int k) { return (k + kUnitElems - 1) >> kUnitShift; }
__device__ __forceinline__ int UnitElems(int k, int unit) {
  return min(kUnitElems, k - unit * kUnitElems);
}

// Work items of a phase (rows, or gate/up pairs; fused: a pair's down tile), spread over the
// grid's warps round robin.
template <bool kFused>
__device__ __forceinline__ int PhaseItems(const StreamLayer& L, int phase, const Dims& d) {
  switch (phase) {
    case kQkv:
      return d.q_dim + 2 * d.kv_dim;
    case kDown:  // fused: a pair's tile; else a row of x
      if (kFused) return L.top_k * L.inter;
      [[fallthrough]];
    case kO:
      return d.hidden;
    case kGateUp:
      return L.top_k * L.inter;
    default:  // attention streams no weights
      return 0;
  }
}
template <bool kFused>
__device__ __forceinline__ int TaskUnits(const StreamLayer& L, int phase, const Dims& d) {
  switch (phase) {
    case kO:  // and the router's column for the row's x
      return UnitsOfRow(d.q_dim) + (L.router ? 1 : 0);
    case kGateUp:
      return 2 * UnitsOfRow(d.hidden);
    case kDown:  // fused: a tile of hidden weights
      return kFused ? UnitsOfRow(d.hidden) : L.top_k * UnitsOfRow(L.inter);
    default:
      return UnitsOfRow(d.hidden);
  }
}

// The experts chosen for the layer being computed, set by each block after its top-k.
struct Routing {
  const unsigned char* gate[kMaxTopK];  // bf16 weights or codes
  const unsigned char* up[kMaxTopK];
  const unsigned char* down[kMaxTopK];
  float weight[kMaxTopK];
  int layer;  // the layer these are for; -1 before the first
  // The last layer whose attention this block is past, or (an attention block) whose
  // attention's inputs have landed: the producers hold the layer's o weights until then.
  int attended;
  int started;   // the last layer whose q/k/v phase this block has begun
};

// Hands layer l's routing (written by this thread, or ordered before it by __syncwarp) to the
// producers, which read `layer` first.
__device__ __forceinline__ void PublishRouting(Routing* routing, int l) {
  __threadfence_block();
  *reinterpret_cast<volatile int*>(&routing->layer) = l;
}

// Where a warp's producer is in the sequence of units it will consume. Kept without integer
// divisions in the steps (the producer runs once per unit, on the consumer's critical path).
struct Cursor {
  int layer, phase;
  int item;   // the phase's work item: a row, or a gate/up (slot, row) pair
  int unit;   // the unit within the item
  int units;  // units of the item
  int slot;   // gate/up (and fused down): the item's expert slot; down: the current unit's slot
  int j;      // gate/up (and fused down): the item's row; down: the unit within the slot's row
};

// A place in a warp's ring: a monotonic byte position and its offset in the ring.
struct RingPlace {
  unsigned pos = 0;
  int off = 0;
};

// A warp's ring: the producer lane that fills it keeps the issue side (next, issued, issue), the
// consumer warp the free side (consumed, free), each in its own copy of this struct.
struct Ring {
  unsigned char* base;
  uint64_t* full;  // kInFlight mbarriers
  int bytes;       // ring size, a multiple of 16
  Cursor next;     // the next unit to issue
  int issued = 0, consumed = 0;
  RingPlace issue, free;  // [free, issue) is busy
  int max_in_flight = kInFlight;
  bool skip_math = false;  // TEST ONLY knob
  // The o weights wait for `attended`: an attention block's always, every block's under the TEST
  // ONLY knob 128 (held until the attention barrier).
  bool hold_o = false;
  bool skip_adds = false;  // TEST ONLY: the fused down's sums never reach x (timing only)
  // With n > 0, at most n - 1 units in flight while the next is a q/k/v unit of a layer this
  // block has not begun: the next layer's rows, issued while the MLP's slowest blocks still
  // stream their experts. The bf16 build takes 3 (2 in flight; the ring holds 3: its MLP phase
  // gains more than q/k/v loses); the quantized builds are slower with a cap and have none: the
  // check is compiled out of them (their register allocation moves with any change).
  int qkv_cap = 0;
  // Weights are streamed evict-first: each is read once a step, while the activations (x, q/k/v,
  // attention's partials, the logits, h), written by one SM and read by others microseconds
  // later, should stay in L2. (TEST ONLY knob 256 turns it off.)
  bool evict_first = true;
  uint64_t policy = 0;
};

// A consumer warp's progress, published in shared memory for the producer lane that fills its
// ring: units consumed, and the ring position up to which they are free.
struct Progress {
  int consumed;
  unsigned free_pos;
};

// The ring offset of the next unit of `size` bytes at *p; a unit never wraps (the ring's tail is
// skipped). Advances *p past it. The producer and the consumer call it in the same order with the
// same sizes, so they agree on every unit's place.
__device__ __forceinline__ int Place(RingPlace* p, int size, int ring_bytes) {
  if (p->off + size > ring_bytes) {
    p->pos += ring_bytes - p->off;
    p->off = 0;
  }
  const int off = p->off;
  p->pos += size;
  p->off += size;
  return off;
}

// Moves c to the first phase (from c.phase of c.layer on) in which this warp has an item at or
// after c.item, and sets up that item's fields.
template <bool kFused>
__device__ __forceinline__ void Settle(Cursor& c, const StreamLayer* layers, int num_layers,
                                       const Dims& d) {
  while (c.layer < num_layers) {
    const StreamLayer& L = layers[c.layer];
    if (c.item < PhaseItems<kFused>(L, c.phase, d)) {
      c.unit = 0;
      c.units = TaskUnits<kFused>(L, c.phase, d);
      if (c.phase == kGateUp || (kFused && c.phase == kDown)) {
        c.slot = c.item / L.inter;
        c.j = c.item - c.slot * L.inter;
      } else {
        c.slot = c.j = 0;
      }
      return;
    }
    c.item = d.gw;
    if (++c.phase == kPhaseCount) {
      c.phase = 0;
      ++c.layer;
    }
  }
}

template <bool kFused>
__device__ __forceinline__ void Advance(Cursor& c, const StreamLayer* layers, int num_layers,
                                        const Dims& d) {
  const StreamLayer& L = layers[c.layer];
  if (!kFused && c.phase == kDown && ++c.j == UnitsOfRow(L.inter)) {
    c.j = 0;
    ++c.slot;
  }
  if (++c.unit < c.units) return;
  c.unit = 0;
  c.item += d.warps;
  if (c.phase == kGateUp || (kFused && c.phase == kDown)) {
    c.j += d.warps;
    while (c.j >= L.inter) c.j -= L.inter, ++c.slot;
  } else {
    c.slot = c.j = 0;
  }
  if (c.item >= PhaseItems<kFused>(L, c.phase, d)) Settle<kFused>(c, layers, num_layers, d);
}

// Which of q, k, v row `item` of the stacked [Wq; Wk; Wv] is in, and its row there.
__device__ __forceinline__ int QkvMatrix(const Dims& d, int item, int* row) {
  const int m = item < d.q_dim ? 0 : item < d.q_dim + d.kv_dim ? 1 : 2;
  *row = item - (m == 0 ? 0 : m == 1 ? d.q_dim : d.q_dim + d.kv_dim);
  return m;
}

// A unit's bulk copies: its codes (or bf16 weights) and its group scales (FP4, fp8 block-128).
struct UnitCopy {
  const unsigned char* codes;
  const unsigned char* groups;
  int code_bytes, group_bytes;
};

// The unit at cursor c. quant: this build's layer table (null in the kNone build).
template <QuantFormat F>
__device__ __forceinline__ UnitCopy UnitSource(const Cursor& c, const StreamLayer& L,
                                               const PersistentQuant* quant, const Dims& d,
                                               int num_experts, const Routing& routing,
                                               const RoutingQuant* rq) {
  const int item = c.item;
  const unsigned char *row, *groups = nullptr;
  int k = d.hidden, unit = c.unit;
  switch (c.phase) {
    case kQkv: {
      int r;
      const int m = QkvMatrix(d, item, &r);
      row = (m == 0 ? L.q : m == 1 ? L.k : L.v) + static_cast<int64_t>(r) * CodeBytes<F>(k);
      if constexpr (kHasGroups<F>)
        groups = static_cast<const unsigned char*>(quant[c.layer].groups[m]) + r * GroupBytes<F>(k);
      break;
    }
    case kO:
      k = d.q_dim;
      if (unit == UnitsOfRow(k))  // the router's column (bf16 in every build)
        return {reinterpret_cast<const unsigned char*>(L.router +
                                                       static_cast<int64_t>(item) * num_experts),
                nullptr, CodeBytes<QuantFormat::kNone>(num_experts), 0};
      row = L.o + static_cast<int64_t>(item) * CodeBytes<F>(k);
      if constexpr (kHasGroups<F>)
        groups =
            static_cast<const unsigned char*>(quant[c.layer].groups[3]) + item * GroupBytes<F>(k);
      break;
    case kGateUp: {
      // Quantized builds: gate and up units alternate, the consumer dots each pair with one read
      // of x. bf16: the row's gate units, then its up units (alternating pairs is slower there).
      const int per_row = UnitsOfRow(d.hidden);
      const int p = F == QuantFormat::kNone ? unit >= per_row : unit & 1;  // 0: gate, 1: up
      row = (p ? routing.up[c.slot] : routing.gate[c.slot]) +
            static_cast<int64_t>(c.j) * CodeBytes<F>(k);
      if constexpr (kHasGroups<F>) groups = rq->groups[p][c.slot] + c.j * GroupBytes<F>(k);
      unit = F == QuantFormat::kNone ? unit - (p ? per_row : 0) : unit >> 1;
      break;
    }
    default:  // kDown
      if constexpr (kFusedDown<F>) {  // the item's tile: row j of the slot's tiled copy
        row = routing.down[c.slot] + static_cast<int64_t>(c.j) * CodeBytes<F>(k);
        break;
      }
      k = L.inter;
      row = routing.down[c.slot] + static_cast<int64_t>(item) * CodeBytes<F>(k);
      if constexpr (kHasGroups<F>) groups = rq->groups[2][c.slot] + item * GroupBytes<F>(k);
      unit = c.j;
      break;
  }
  const int elems = UnitElems(k, unit);
  return {row + static_cast<int64_t>(unit) * CodeBytes<F>(kUnitElems),
          groups ? groups + unit * GroupBytes<F>(kUnitElems) : nullptr, CodeBytes<F>(elems),
          GroupBytes<F>(elems)};
}

#if defined(__CUDA_ARCH__)
// Issues units into the ring until it is full, kInFlight are in flight, the sequence ends, or the
// next unit is an expert's whose routing this block has not computed yet.
// Runs on one lane of a producer warp per ring (each with its own state): the copies never
// wait on the consumer's critical path.
template <QuantFormat F>
__device__ __forceinline__ int Pump(Ring& r, const StreamLayer* layers,
                                    const PersistentQuant* quant, int num_layers, const Dims& d,
                                    int num_experts, const Routing& routing,
                                    const RoutingQuant* rq) {
  int issued = 0;
  while (r.next.layer < num_layers && r.issued - r.consumed < r.max_in_flight) {
    if (r.next.phase >= kGateUp && *reinterpret_cast<const volatile int*>(&routing.layer) != r.next.layer)
      break;
    // An attention block's o weights once its attention's inputs landed (TEST ONLY knob 128:
    // every block's once the attention barrier is passed).
    if (r.hold_o && r.next.phase == kO &&
        *reinterpret_cast<const volatile int*>(&routing.attended) < r.next.layer)
      break;
    if (kFusedDown<F> && r.qkv_cap && r.next.phase == kQkv && r.issued - r.consumed >= r.qkv_cap - 1 &&
        *reinterpret_cast<const volatile int*>(&routing.started) < r.next.layer)
      break;
    const UnitCopy u =
        UnitSource<F>(r.next, layers[r.next.layer], quant, d, num_experts, routing, rq);
    const int size = u.code_bytes + u.group_bytes;
    RingPlace place = r.issue;
    const int off = Place(&place, size, r.bytes);
    if (place.pos - r.free.pos > static_cast<unsigned>(r.bytes)) break;
    uint64_t* bar = &r.full[r.issued % kInFlight];
    ArmBarrier(bar, size);
    if (r.evict_first)
      BulkCopyTx(r.base + off, u.codes, u.code_bytes, bar, r.policy);
    else
      BulkCopyTx(r.base + off, u.codes, u.code_bytes, bar);
    if constexpr (kHasGroups<F>)
      if (u.group_bytes) BulkCopyTx(r.base + off + u.code_bytes, u.groups, u.group_bytes, bar);
    r.issue = place;
    ++r.issued;
    ++issued;
    Advance<kFusedDown<F>>(r.next, layers, num_layers, d);
  }
  return issued;
}

// Staged activations in shared memory, split so that the lanes' reads are conflict-free: for
// each 8-element chunk c of the vector, lo[c] holds elements 8c..8c+3 and hi[c] 8c+4..8c+7.
struct Staged {
  const float4* lo;
  const float4* hi;
};
__device__ __forceinline__ Staged StagedAt(const float* xs, int n, int first) {
  const float4* lo = reinterpret_cast<const float4*>(xs);
  return {lo + first / 8, lo + n / 8 + first / 8};
}

// Eight fp8 E4M3 codes (elements 0-3 in .x, 4-7 in .y) dotted with lo (0-3) and hi (4-7).
__device__ __forceinline__ float Dot8Fp8(uint2 codes, float4 lo, float4 hi) {
  const float2 f[4] = {E4M3PairToFloat2(codes.x), E4M3PairToFloat2(codes.x >> 16),
                       E4M3PairToFloat2(codes.y), E4M3PairToFloat2(codes.y >> 16)};
  return f[0].x * lo.x + f[0].y * lo.y + f[1].x * lo.z + f[1].y * lo.w + f[2].x * hi.x +
         f[2].y * hi.y + f[3].x * hi.z + f[3].y * hi.w;
}
// Eight E2M1 codes (element i in bits 4i of the word) dotted with lo and hi, times 2^-14 (the
// fp16 decode's: DecodeRowFactor's kE2M1F16Scale puts it back per row).
__device__ __forceinline__ float Dot8E2M1(uint32_t word, float4 lo, float4 hi) {
  float2 w[4];  // w[s]: elements s (.x) and s + 4 (.y)
#pragma unroll
  for (int s = 0; s < 4; ++s) w[s] = HalfBitsToFloat2(E2M1PairToF16x2Bits(word >> (4 * s)));
  return w[0].x * lo.x + w[1].x * lo.y + w[2].x * lo.z + w[3].x * lo.w + w[0].y * hi.x +
         w[1].y * hi.y + w[2].y * hi.z + w[3].y * hi.w;
}

// 8-weight chunk c of a unit (in shared memory, `elems` weights) dotted with its staged
// activations lo and hi. Quantized builds leave out what multiplies whole rows (the factor:
// RowFactor); group scales (the unit's tail: FP4, fp8 block-128) multiply each chunk's sum.
template <QuantFormat F>
__device__ __forceinline__ float Dot8(const unsigned char* unit, int c, int elems, float4 lo,
                                      float4 hi) {
  if constexpr (F == QuantFormat::kNone) {
    const float xv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    return Dot8Bf16(reinterpret_cast<const uint4*>(unit)[c], xv);
  } else if constexpr (F == QuantFormat::kNvfp4) {
    const __half_raw scale = __nv_cvt_fp8_to_halfraw(unit[CodeBytes<F>(elems) + c / 2], __NV_E4M3);
    return Dot8E2M1(reinterpret_cast<const uint32_t*>(unit)[c], lo, hi) * __half2float(scale);
  } else if constexpr (F == QuantFormat::kMxfp4) {  // one E8M0 scale per 4 chunks
    return Dot8E2M1(reinterpret_cast<const uint32_t*>(unit)[c], lo, hi) *
           E8M0ToFloat(unit[CodeBytes<F>(elems) + c / 4]);
  } else if constexpr (F == QuantFormat::kFp8Block128) {  // one fp32 scale per 16 chunks
    return Dot8Fp8(reinterpret_cast<const uint2*>(unit)[c], lo, hi) *
           reinterpret_cast<const float*>(unit + CodeBytes<F>(elems))[c / 16];
  } else {
    return Dot8Fp8(reinterpret_cast<const uint2*>(unit)[c], lo, hi);
  }
}
// The warp's share of a dot product over one unit with x[0, elems): lane l takes the chunks l,
// l + 32, ..., whose staged activations are bank-conflict free.
template <QuantFormat F>
__device__ __forceinline__ float UnitDot(const unsigned char* unit, Staged x, int elems) {
  float acc = 0.f;
#pragma unroll 4
  for (int c = threadIdx.x & 31; c < elems / 8; c += 32)
    acc += Dot8<F>(unit, c, elems, x.lo[c], x.hi[c]);
  return acc;
}
// Two units of the same shape against one read of x (gate and up rows of quantized builds).
template <QuantFormat F>
__device__ __forceinline__ void UnitDot2(const unsigned char* a, const unsigned char* b, Staged x,
                                         int elems, float* acc_a, float* acc_b) {
#pragma unroll 2
  for (int c = threadIdx.x & 31; c < elems / 8; c += 32) {
    const float4 lo = x.lo[c], hi = x.hi[c];
    *acc_a += Dot8<F>(a, c, elems, lo, hi);
    *acc_b += Dot8<F>(b, c, elems, lo, hi);
  }
}

// What multiplies row `row`'s dot product in a quantized build (1 in the bf16 one): the fp8
// tensor or channel scale; the 2^14 that FP4's decode leaves out, times nvfp4's scale_2.
template <QuantFormat F>
__device__ __forceinline__ float RowFactor(const void* factor, int row, DType scale_dtype) {
  if constexpr (F == QuantFormat::kFp8Tensor) return LoadAsFloat(factor, scale_dtype, 0);
  if constexpr (F == QuantFormat::kFp8Channel) return LoadAsFloat(factor, scale_dtype, row);
  if constexpr (F == QuantFormat::kNvfp4) return *static_cast<const float*>(factor) * kE2M1F16Scale;
  if constexpr (F == QuantFormat::kMxfp4) return kE2M1F16Scale;  // every scale is a group's
  return 1.f;
}

// Waits for the warp's oldest unit, returns its dot with x, and hands its place back to the
// producer.
// The warp's oldest unit (or the one `ahead` of it, the units before it already waited for, in
// order), of `bytes`, once it has landed.
__device__ __forceinline__ const unsigned char* WaitUnit(Ring& r, int bytes, int ahead = 0) {
  const int unit = r.consumed + ahead;
  BarrierWait(&r.full[unit % kInFlight], (unit / kInFlight) & 1);
  return r.base + Place(&r.free, bytes, r.bytes);
}
// Hands the oldest `count` units' places back to the producer.
__device__ __forceinline__ void ReleaseUnit(Ring& r, Progress* progress, int count = 1) {
  __syncwarp();  // every lane has read the unit before its place is refilled
  r.consumed += count;
  if ((threadIdx.x & 31) == 0) {
    volatile Progress* p = progress;
    p->free_pos = r.free.pos;
    __threadfence_block();
    p->consumed = r.consumed;
  }
}
template <QuantFormat F>
__device__ __forceinline__ float ConsumeUnit(Ring& r, Progress* progress, int elems, Staged x) {
  const unsigned char* unit = WaitUnit(r, UnitBytes<F>(elems));
  const float acc = r.skip_math ? 0.f : UnitDot<F>(unit, x, elems);
  ReleaseUnit(r, progress);
  return acc;
}
// The router's column for row i of x (num_experts bf16): sums[k] += xg * Wr[e, i] for the
// lane's experts e = lane + 32 k, xg = x[i] * gain[i] on every lane. In registers: the warps'
// sums meet once, after their rows (RouterSumsAt); shared-memory atomics on floats are
// compare-and-swap loops on sm_90, and 16 warps adding to the same 128 words would serialise.
__device__ __forceinline__ void ConsumeRouterColumn(Ring& r, Progress* progress, int num_experts,
                                                    float xg, float (&sums)[kMaxExperts / 32]) {
  const uint16_t* column = reinterpret_cast<const uint16_t*>(WaitUnit(r, 2 * num_experts));
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < kMaxExperts / 32; ++k)
    if (lane + 32 * k < num_experts) sums[k] += xg * Bf16ToFloat(column[lane + 32 * k]);
  ReleaseUnit(r, progress);
}

// The bf16 build's down projection (kFusedDown): x[cols] += sum_rounds sum_r round_h[round][r] *
// tile[r][cols], cols this warp's hidden / kWarps columns, one tile (PersistentDownTiles) a round
// of its block's pairs. Lane l sums the 8 columns of chunk l % groups (groups = the 8-column
// chunks a tile row has, a power of two up to 32) over the rows of its chunks; the lanes with
// the same columns are then summed by shuffles, and those of the first `groups` lanes reach x (or,
// with adds, the spread-out down sums: PersistentAddIndex) by red.add (the grid's blocks each
// add theirs; the barrier after publishes them). In registers: 8
// sums a lane, where a warp-private copy of its columns' sums would not fit in shared memory and
// shared-memory atomics on floats are compare-and-swap loops on sm_90.
__device__ __forceinline__ void DownTiles(Ring& r, Progress* progress, int hidden, int rounds,
                                          const float* round_h, float* x, float* adds,
                                          bool nan_fault) {
  const int lane = threadIdx.x & 31, cols = hidden / kWarps, groups = cols / 8;
  const int group_shift = 31 - __clz(groups), unit_rows = kUnitElems / cols;
  float acc[8] = {};
  for (int t = 0; t < rounds; ++t)
    for (int u = 0; u < UnitsOfRow(hidden); ++u) {
      const int elems = UnitElems(hidden, u);
      const uint4* unit = reinterpret_cast<const uint4*>(WaitUnit(r, 2 * elems));
      const float* h = round_h + t * kTileRows + u * unit_rows;
      if (!r.skip_math)
#pragma unroll 4
        for (int c = lane; c < elems / 8; c += 32) {
          const float w = h[c >> group_shift];
          const uint4 raw = unit[c];
          const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(pairs[i]);
            acc[2 * i] += w * f.x;
            acc[2 * i + 1] += w * f.y;
          }
        }
      ReleaseUnit(r, progress);
    }
  for (int s = groups; s < 32; s <<= 1)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], s);
  if (lane < groups && !r.skip_adds) {
    if (nan_fault && lane == 0) acc[0] = __int_as_float(0x7fc00000);  // fault injection: x[0]
    const int col = threadIdx.x / 32 * cols + 8 * lane;               // 8 columns of this warp's
    float* dst = adds ? adds + PersistentAddIndex(col) : x + col;
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst),
                 "f"(acc[0]), "f"(acc[1]), "f"(acc[2]), "f"(acc[3])
                 : "memory");
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 4),
                 "f"(acc[4]), "f"(acc[5]), "f"(acc[6]), "f"(acc[7])
                 : "memory");
  }
}

// Row `row` of the residual stream x: x itself plus, with `adds`, the previous layer's down sums
// (the bf16 build: PersistentDecodeArgs::x_adds).
__device__ __forceinline__ float ResidualAt(const PersistentDecodeArgs& a, int row, bool adds) {
  const float x = __ldcg(a.x + row);
  return adds ? x + __ldcg(a.x_adds + PersistentAddIndex(row)) : x;
}

// A barrier of the consumer warps only (the producer warps never wait on them).
__device__ __forceinline__ void ConsumerSync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }

// The consumer warps as a group for the block reductions.
struct Consumers {
  __device__ __forceinline__ void operator()() const { ConsumerSync(); }
  __device__ __forceinline__ int warps() const { return kWarps; }
};
// Grid-wide barrier number *count (counted from 1) on a counter zeroed before the launch. The
// arrival is a release reduction (no fence, no returned value to wait for) and the polling an
// acquire load: one round trip after the last block arrives. (TEST ONLY knob 512: the fence +
// atomicAdd + fence barrier it replaced.)
__device__ __forceinline__ void GridSync(unsigned* counter, unsigned* count, bool fenced) {
  ConsumerSync();
  ++*count;
  if (threadIdx.x == 0) {
    if (fenced) {
      __threadfence();
      atomicAdd(counter, 1u);
    } else {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    }
    const unsigned target = *count * gridDim.x;
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
    if (fenced) __threadfence();
  }
  ConsumerSync();
}

// Asks L2 for a norm's gains a phase ahead: StageNormed runs right after a grid barrier, and a
// DRAM load there queues behind the rings' traffic.
__device__ __forceinline__ void GainsAhead(const void* gain, DType gain_dtype, int n) {
  const int line = threadIdx.x, lines = (n * (gain_dtype == DType::kF32 ? 4 : 2) + 127) / 128;
  if (line < lines) PrefetchLineL2EvictLast(static_cast<const char*>(gain) + line * 128);
}

// xs = x * gain over [0, n) in the Staged layout, x plus, with adds, the previous layer's
// spread-out down sums (PersistentAddIndex); returns the thread's share of sum x^2. Reads x
// through L2 (other SMs wrote it in this launch). No barrier.
__device__ __forceinline__ float StageScaled(const float* x, const void* gain, DType gain_dtype,
                                             int n, float* xs, const float* adds = nullptr) {
  float sum_sq = 0.f;
  for (int q = threadIdx.x; q < n / 4; q += kThreads) {
    float4 v = __ldcg(reinterpret_cast<const float4*>(x) + q);
    if (adds) {
      const float4 add = __ldcg(reinterpret_cast<const float4*>(adds + PersistentAddIndex(4 * q)));
      v.x += add.x, v.y += add.y, v.z += add.z, v.w += add.w;
    }
    sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    v.x *= LoadAsFloat(gain, gain_dtype, 4 * q);
    v.y *= LoadAsFloat(gain, gain_dtype, 4 * q + 1);
    v.z *= LoadAsFloat(gain, gain_dtype, 4 * q + 2);
    v.w *= LoadAsFloat(gain, gain_dtype, 4 * q + 3);
    reinterpret_cast<float4*>(xs)[(q & 1) * (n / 8) + (q >> 1)] = v;  // the Staged layout
  }
  return sum_sq;
}
// StageScaled, then 1 / rms(x). Ends with every thread past a block barrier.
__device__ __forceinline__ float StageNormed(const float* x, const void* gain, DType gain_dtype,
                                             int n, float eps, float* xs, float* scratch,
                                             const float* adds = nullptr) {
  const float sum_sq = StageScaled(x, gain, gain_dtype, n, xs, adds);
  return rsqrtf(BlockSum(sum_sq, scratch, Consumers{}) / n + eps);  // its barriers publish xs
}

// xs = src[0, n) in the Staged layout.
__device__ __forceinline__ void Stage(const float* src, int n, float* xs) {
  for (int q = threadIdx.x; q < n / 4; q += kThreads)
    reinterpret_cast<float4*>(xs)[(q & 1) * (n / 8) + (q >> 1)] =
        __ldcg(reinterpret_cast<const float4*>(src) + q);
  ConsumerSync();
}

__device__ __forceinline__ float RoundBf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// Attention of the new token, split over the grid: block item (kv head h, split s) of
// kv_heads x S items takes the split's keys (at most kAttentionChunk a chunk) for the GQA group's
// G q heads, so every K/V row is read once per step. The split's K and V rows of earlier steps
// are copied into shared memory (cp.async) while the block still streams its q/k/v rows; after
// the barrier the block loads the group's q heads and the new k and v, q/k-normalises and ropes
// them (the formulas of QkNormRopeAppendKernel; the new K and V rounded as the cache holds them,
// and appended by the split that holds the position), and one warp per q head scores the chunk
// with one key a lane (no shuffles in the dot products), takes its softmax with two warp
// reductions and sums the V rows with the lanes' weights broadcast. Its partial (max, sum,
// unnormalised output) per head goes to global memory; the split that arrives last for h (a
// counter per layer and kv head) combines the S partials into attn.
// Why splits and a key a lane: one block per q head walking all keys in chunks of 512 chains
// ~12 dependent DRAM round trips a layer, and 16 lanes a key need shuffled dot products and three
// block barriers a chunk.

struct AttentionShape {
  int hd, group, splits, q_dim, kv_dim;
};

// Splits a kv head: as many as make each split one chunk of keys (one round of K/V loads, and
// the fewest partials to combine), up to the grid's blocks over the kv heads. (TEST ONLY knob
// 2048: always the most.)
__device__ __forceinline__ AttentionShape MakeAttentionShape(const PersistentDecodeArgs& a, int pos,
                                                             bool most_splits = false) {
  AttentionShape s;
  s.hd = a.shape.head_dim;
  s.group = a.shape.q_heads / a.shape.kv_heads;
  s.q_dim = a.shape.q_heads * s.hd;
  s.kv_dim = a.shape.kv_heads * s.hd;
  const int most = min(kMaxSplits, max(1, static_cast<int>(gridDim.x) / a.shape.kv_heads));
  s.splits = most_splits ? most : min(most, (pos + kAttentionChunk) / kAttentionChunk);  // ceil((pos+1)/C)
  return s;
}

// Whether this block runs an attention item (kv head, split) of the step at position `pos`: the
// items go to the grid's last blocks (attention_item in the kernel says why).
__device__ __forceinline__ bool RunsAttention(const PersistentDecodeArgs& a, int pos,
                                              bool most_splits) {
  return static_cast<int>(gridDim.x - 1 - blockIdx.x) <
         a.shape.kv_heads * MakeAttentionShape(a, pos, most_splits).splits;
}

struct AttentionSmem {
  float *q, *kn, *vn, *combine, *out, *run_max, *run_sum;  // [G][hd], [hd], [hd], [G][S], [G][hd], [G], [G]
  unsigned char *k, *v;  // [C][hd * 2 + 16] and [C][hd * 2] bf16
};
__device__ __forceinline__ AttentionSmem AttentionLayout(const AttentionShape& sh, float* xs,
                                                         int hidden) {
  AttentionSmem m;
  m.q = xs;
  m.kn = m.q + sh.group * sh.hd;
  m.vn = m.kn + sh.hd;
  m.combine = m.vn + sh.hd;
  m.out = m.combine + sh.group * kMaxSplits;
  m.run_max = m.out + sh.group * sh.hd;
  m.run_sum = m.run_max + sh.group;
  m.k = reinterpret_cast<unsigned char*>(xs + AttentionKvOffsetFloats(hidden, sh.group, sh.hd));
  m.v = m.k + kAttentionChunk * AttentionKRowBytes(sh.hd);
  return m;
}

// RMSNorm (when gain) and RoPE of one head vector by one warp, in place in shared memory;
// rounded to bf16 when it is a key for the cache.
__device__ __forceinline__ void NormRope(float* vec, const float* gain, float eps,
                                         const float2* rope_row, int hd, bool round) {
  const int lane = threadIdx.x & 31, half = hd / 2;
  float sum_sq = 0.f;
  for (int i = lane; i < hd; i += 32) sum_sq += vec[i] * vec[i];
  const float inv = gain ? rsqrtf(WarpSum(sum_sq) / hd + eps) : 1.f;
  for (int i = lane; i < half; i += 32) {
    const float g1 = gain ? gain[i] : 1.f;
    const float g2 = gain ? gain[i + half] : 1.f;
    const float x1 = vec[i] * inv * g1, x2 = vec[i + half] * inv * g2;
    const float2 c = rope_row[i];
    const float r1 = x1 * c.x - x2 * c.y, r2 = x2 * c.x + x1 * c.y;
    vec[i] = round ? RoundBf16(r1) : r1;
    vec[i + half] = round ? RoundBf16(r2) : r2;
  }
}

// The q/k norm gains and the position's RoPE row, staged in shared memory during the q/k/v phase
// (they do not depend on it), so that attention starts on one round trip (q, k, v) only.
struct AttentionConstants {
  float q_gain[kMaxHeadDim], k_gain[kMaxHeadDim];
  float2 rope[kMaxHeadDim / 2];
};

// acc[i] += sum_j w_j V[j][kDims * lane + i] over the chunk's rows, w_j the softmax weight lane j
// holds: one load of the lane's kDims bf16 a key (2, 4 or 8; head_dim 64, 128, 256), a
// compile-time count, so that builds short of registers still issue it as one vector load.
template <int kDims>
__device__ __forceinline__ void SumValues(float (&acc)[8], const __nv_bfloat16* vcol, int hd, int rows,
                                          float weight) {
  using Load = std::conditional_t<kDims == 8, uint4, std::conditional_t<kDims == 4, uint2, unsigned>>;
  static_assert(sizeof(Load) == 2 * kDims);
#pragma unroll 2
  for (int j = 0; j < rows; ++j) {
    const float w = __shfl_sync(0xffffffffu, weight, j);
    const Load raw = *reinterpret_cast<const Load*>(vcol + j * hd);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < kDims / 2; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      acc[2 * i] += w * f.x;
      acc[2 * i + 1] += w * f.y;
    }
  }
}
// Any other head_dim (dims = head_dim / 32 of them a lane).
__device__ __forceinline__ void SumValuesAny(float (&acc)[8], const __nv_bfloat16* vcol, int hd,
                                             int rows, float weight, int dims) {
  for (int j = 0; j < rows; ++j) {
    const float w = __shfl_sync(0xffffffffu, weight, j);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < dims) acc[i] += w * __bfloat162float(vcol[j * hd + i]);
  }
}

// The keys [begin, end) of attention item `item` (kv head item % kv_heads, split item / kv_heads).
__device__ __forceinline__ void SplitKeys(const AttentionShape& sh, int item, int kv_heads, int pos,
                                          int* begin, int* end) {
  const int split = item / kv_heads, count = pos + 1, per_split = (count + sh.splits - 1) / sh.splits;
  *begin = min(count, split * per_split);
  *end = min(count, *begin + per_split);
}

// Starts copying the cached K and V rows [c0, min(c0 + C, end, pos)) of item's kv head into the
// chunk area (cp.async, one commit group): the keys of earlier steps. The block waits with
// cp.async.wait_all and a barrier.
__device__ __forceinline__ void LoadKeyChunk(const PersistentDecodeArgs& a, const AttentionShape& sh,
                                             const AttentionSmem& m, int layer, int item, int c0,
                                             int end, int pos) {
  const int pieces = sh.hd / 8;  // 16-byte pieces of a row
  const int rows = max(0, min(min(end, pos), c0 + kAttentionChunk) - c0);
  const int64_t base = static_cast<int64_t>(layer) * a.capacity * sh.kv_dim +
                       (item % a.shape.kv_heads) * sh.hd + static_cast<int64_t>(c0) * sh.kv_dim;
  for (int i = threadIdx.x; i < 2 * rows * pieces; i += kThreads) {
    const bool value = i >= rows * pieces;
    const int r = (value ? i - rows * pieces : i) / pieces, c = i % pieces;
    const uint16_t* src = (value ? a.v_cache : a.k_cache) + base + static_cast<int64_t>(r) * sh.kv_dim + c * 8;
    unsigned char* dst = value ? m.v + r * sh.hd * 2 + c * 16 : m.k + r * AttentionKRowBytes(sh.hd) + c * 16;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(SharedAddress(dst)), "l"(src) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// TEST ONLY timeline: thread 0 writes %globaltimer to *at (when there is a timeline).
__device__ __forceinline__ void StampAt(unsigned long long* at) {
  if (at && threadIdx.x == 0) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *at = now;
  }
}

// stamps: null, or this block's kPersistentAttentionStamps slots of the timeline for the layer.
// The item's first chunk of keys was asked for by LoadKeyChunk during q/k/v. *loaded = layer once
// the inputs have landed (the block's producers hold its o weights until then).
// kSlicedCombine: every split combines a slice of its kv head's outputs once all have published
// (the quantized builds, where it shortens attention); else the last split to publish
// combines them all (the bf16 build, whose register allocation the sliced combine upsets).
template <bool kSlicedCombine>
__device__ void AttendSplit(const PersistentDecodeArgs& a, const AttentionShape& sh,
                            const PersistentLayer& L, int layer, int item, int pos, float* xs,
                            int hidden, const AttentionConstants& constants,
                            unsigned long long* stamps, int* loaded) {
  const int hd = sh.hd, G = sh.group, S = sh.splits;
  const int kv_head = item % a.shape.kv_heads, split = item / a.shape.kv_heads;
  const int t = threadIdx.x, warp = t / 32, lane = t & 31;
  const int dims = hd / 32;  // output dims a lane owns: [dims * lane, dims * (lane + 1))
  int begin, end;
  SplitKeys(sh, item, a.shape.kv_heads, pos, &begin, &end);
  const AttentionSmem m = AttentionLayout(sh, xs, hidden);
  const int first_q = kv_head * G;
  // The group's q heads, then k and v (m.q, m.kn, m.vn are contiguous), copied in 16-byte pieces
  // by cp.async: every piece in flight at once, one round trip (plain loads in a loop with a
  // run-time count issue one iteration after another). head_dim is a multiple of 32.
  for (int i = t; i < (G + 2) * hd / 4; i += kThreads) {
    const int head = i / (hd / 4);  // < G: q head first_q + head; G: k; G + 1: v
    const float* src = a.qkv + (head < G ? (first_q + head) * hd
                                         : sh.q_dim + (head - G) * sh.kv_dim + kv_head * hd) +
                       (i - head * (hd / 4)) * 4;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(SharedAddress(m.q + 4 * i)),
                 "l"(src)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  for (int g = t; g < G; g += kThreads) m.run_max[g] = -INFINITY, m.run_sum[g] = 0.f;
  for (int o = t; o < G * hd; o += kThreads) m.out[o] = 0.f;
  // Also waits for the key chunk's copies (issued during q/k/v: long landed).
  asm volatile("cp.async.wait_all;" ::: "memory");
  ConsumerSync();  // every thread's copies landed (v is rounded to bf16 where it is used)
  for (int v = warp; v <= G; v += kWarps)  // G q heads, then the new key
    NormRope(v < G ? m.q + v * hd : m.kn,
             v < G ? (L.q_norm ? constants.q_gain : nullptr) : (L.k_norm ? constants.k_gain : nullptr),
             a.eps, constants.rope, hd, v == G);
  ConsumerSync();
  StampAt(stamps);
  if (threadIdx.x == 0) *reinterpret_cast<volatile int*>(loaded) = layer;  // the o weights may come
  const int64_t layer_offset = static_cast<int64_t>(layer) * a.capacity * sh.kv_dim + kv_head * hd;
  if (begin <= pos && pos < end)  // the split holding the new position appends it
    for (int i = t; i < hd; i += kThreads) {
      const int64_t slot = layer_offset + static_cast<int64_t>(pos) * sh.kv_dim + i;
      reinterpret_cast<__nv_bfloat16*>(a.k_cache)[slot] = __float2bfloat16_rn(m.kn[i]);
      reinterpret_cast<__nv_bfloat16*>(a.v_cache)[slot] = __float2bfloat16_rn(m.vn[i]);
    }
  const float scale = rsqrtf(static_cast<float>(hd));
  for (int c0 = begin; c0 < end; c0 += kAttentionChunk) {
    if (c0 != begin) {
      ConsumerSync();  // every warp is done with the previous chunk
      LoadKeyChunk(a, sh, m, layer, item, c0, end, pos);
    }
    if (c0 <= pos && pos < c0 + kAttentionChunk && pos < end)  // the new key and value, as cached
      for (int i = t; i < hd; i += kThreads) {
        reinterpret_cast<__nv_bfloat16*>(m.k + (pos - c0) * AttentionKRowBytes(hd))[i] = __float2bfloat16_rn(m.kn[i]);
        reinterpret_cast<__nv_bfloat16*>(m.v + (pos - c0) * hd * 2)[i] = __float2bfloat16_rn(m.vn[i]);
      }
    asm volatile("cp.async.wait_all;" ::: "memory");
    ConsumerSync();  // every thread's copies landed
    const int rows = min(kAttentionChunk, end - c0);
    for (int g = warp; g < G; g += kWarps) {
      const float4* q4 = reinterpret_cast<const float4*>(m.q + g * hd);
      float score = -INFINITY;
      if (lane < rows) {  // lane = key c0 + lane
        const uint4* krow = reinterpret_cast<const uint4*>(m.k + lane * AttentionKRowBytes(hd));
        float dot = 0.f;
#pragma unroll 4
        for (int c = 0; c < hd / 8; ++c) {
          const float4 lo = q4[2 * c], hi = q4[2 * c + 1];
          const float xv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          dot += Dot8Bf16(krow[c], xv);
        }
        score = dot * scale;
      }
      const float old_max = m.run_max[g];
      const float new_max = fmaxf(old_max, WarpMax(score));
      const float weight = lane < rows ? expf(score - new_max) : 0.f;
      const float rescale = old_max == -INFINITY ? 0.f : expf(old_max - new_max);
      const float sum = WarpSum(weight);
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = i < dims ? m.out[g * hd + dims * lane + i] * rescale : 0.f;
      const __nv_bfloat16* vcol = reinterpret_cast<const __nv_bfloat16*>(m.v) + dims * lane;
      switch (dims) {
        case 4:
          SumValues<4>(acc, vcol, hd, rows, weight);
          break;
        case 2:
          SumValues<2>(acc, vcol, hd, rows, weight);
          break;
        case 8:
          SumValues<8>(acc, vcol, hd, rows, weight);
          break;
        default:
          SumValuesAny(acc, vcol, hd, rows, weight, dims);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i < dims) m.out[g * hd + dims * lane + i] = acc[i];
      __syncwarp();
      if (lane == 0) {
        m.run_max[g] = new_max;
        m.run_sum[g] = m.run_sum[g] * rescale + sum;
      }
      __syncwarp();
    }
  }
  ConsumerSync();
  StampAt(stamps ? stamps + 1 : nullptr);
  // This split's partial per head: [q head][split] (max, sum) and [q head][split][d].
  float* part_ml = a.partials;
  float* part_acc = a.partials + PartialAccOffset(a.shape.q_heads, S);
  const int outputs = G * hd;
  for (int o = t; o < outputs; o += kThreads)
    part_acc[(static_cast<int64_t>(first_q + o / hd) * S + split) * hd + o % hd] = m.out[o];
  for (int g = t; g < G; g += kThreads) {
    part_ml[((first_q + g) * S + split) * 2] = m.run_max[g];
    part_ml[((first_q + g) * S + split) * 2 + 1] = m.run_sum[g];
  }
  if constexpr (kSlicedCombine) {
    // Counted by thread 0 with an acq_rel atomic after the block barrier: its release covers the
    // whole block's partials (cumulative through the barrier), its acquire (or, for the splits that
    // count before the last, the acquire load that sees the last count) the other splits'.
    ConsumerSync();
    if (t == 0) {
      const unsigned* counter = a.barrier + 1 + layer * a.shape.kv_heads + kv_head;
      unsigned before;
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                   : "=r"(before)
                   : "l"(counter)
                   : "memory");
      StampAt(stamps ? stamps + 2 : nullptr);
      for (unsigned count = before + 1; count < static_cast<unsigned>(S);)
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(count) : "l"(counter) : "memory");
    }
    ConsumerSync();
    // The combine, spread over the kv head's splits: each takes a slice of the group's G x hd
    // outputs, a warp a float4 of them, lane s the split s's partial and its (max, sum), all
    // loaded in one round trip. (One split combining everything would pay the weights' round
    // trip, then S / 2 loads a thread in batches of four.)
    const int quads = G * hd / 4, per_split = (quads + S - 1) / S;
    const float4* acc4 = reinterpret_cast<const float4*>(part_acc);
    for (int q = split * per_split + warp; q < min(quads, (split + 1) * per_split); q += kWarps) {
      const int head = first_q + 4 * q / hd;
      float max_s = -INFINITY, sum_s = 0.f;
      float4 v{};
      if (lane < S) {
        max_s = __ldcg(part_ml + (head * S + lane) * 2);
        sum_s = __ldcg(part_ml + (head * S + lane) * 2 + 1);
        v = __ldcg(acc4 + (static_cast<int64_t>(head * S + lane) * hd + 4 * q % hd) / 4);
      }
      const float top = WarpMax(max_s);
      const float w = max_s == -INFINITY ? 0.f : expf(max_s - top);  // an empty split weighs 0
      const float total = WarpSum(w * sum_s);
      const float4 out{WarpSum(w * v.x), WarpSum(w * v.y), WarpSum(w * v.z), WarpSum(w * v.w)};
      if (lane == 0)
        reinterpret_cast<float4*>(a.attn)[(first_q * hd) / 4 + q] =
            make_float4(out.x / total, out.y / total, out.z / total, out.w / total);
    }
  } else {
    __shared__ int last_split;  // (declared here: the sliced combine has none)
    // Counted by thread 0 with an acq_rel atomic after the block barrier: its release covers the
    // whole block's partials (cumulative through the barrier), its acquire the other splits' for
    // the combining one; where every thread fenced (fence.sc) before and after.
    ConsumerSync();
    if (t == 0) {
      unsigned before;
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                   : "=r"(before)
                   : "l"(a.barrier + 1 + layer * a.shape.kv_heads + kv_head)
                   : "memory");
      last_split = before == static_cast<unsigned>(S - 1);
    }
    ConsumerSync();
    StampAt(stamps ? stamps + 2 : nullptr);
    if (!last_split) return;
    // The combine: two threads own 4 outputs of a head (one float4), each half of the splits, their
    // loads issued four at a time (one round trip for S up to 8; three at context 576, S = 19).
    // Slower on the H200 (qwen3-30b-a3b, context ~576): merging the splits online (the merge's
    // chain of exps), or issuing a thread's first four loads before the weights.
    const int quads = outputs / 4, half = t & 1;
    const float4* acc4 = reinterpret_cast<const float4*>(part_acc);
    for (int g = warp; g < G; g += kWarps) {  // each split's weight in head g's output (S <= 32)
      const float* ml = part_ml + (first_q + g) * S * 2;
      const float ms = lane < S ? __ldcg(ml + lane * 2) : -INFINITY;
      const float ls = lane < S ? __ldcg(ml + lane * 2 + 1) : 0.f;
      const float max_s = WarpMax(ms);
      const float w = ms == -INFINITY ? 0.f : expf(ms - max_s);
      const float total = WarpSum(w * ls);
      if (lane < S) m.combine[g * S + lane] = w / total;
    }
    ConsumerSync();
    for (int q0 = 0; q0 < quads; q0 += kThreads / 2) {  // uniform trip count: the pairs shuffle
      const int q = q0 + t / 2, g = 4 * q / hd;
      float4 out{};
      if (q < quads) {
        const float4* src = acc4 + (static_cast<int64_t>(first_q + g) * S * hd + 4 * q % hd) / 4;
#pragma unroll 4
        for (int split_i = half; split_i < S; split_i += 2) {
          const float4 v = __ldcg(src + static_cast<int64_t>(split_i) * hd / 4);
          const float w = m.combine[g * S + split_i];
          out.x += w * v.x, out.y += w * v.y, out.z += w * v.z, out.w += w * v.w;
        }
      }
      out.x += __shfl_xor_sync(0xffffffffu, out.x, 1);
      out.y += __shfl_xor_sync(0xffffffffu, out.y, 1);
      out.z += __shfl_xor_sync(0xffffffffu, out.z, 1);
      out.w += __shfl_xor_sync(0xffffffffu, out.w, 1);
      if (q < quads && half == 0) reinterpret_cast<float4*>(a.attn)[(first_q * hd) / 4 + q] = out;
    }
  }
  StampAt(stamps ? stamps + 3 : nullptr);
  ConsumerSync();  // xs is reused
}

#endif

// Where a quantized build's tables start in dynamic shared memory, after the producer's.
INFERSWEEP_HD int StreamTableBytes(int num_layers) {
  return (num_layers * static_cast<int>(sizeof(StreamLayer)) + 127) / 128 * 128;
}

// Shared memory: [layer tables][staged activations][16 warp rings]; the mbarriers and the
// routing are static. The layer tables: the producer's StreamLayer per layer, then in quantized
// builds every layer's PersistentQuant and the RoutingQuant.
template <QuantFormat F>
__global__ void __launch_bounds__(kBlockThreads, 1)
    PersistentDecodeKernel(PersistentDecodeArgs a, int table_bytes, int stage_floats,
                           int ring_bytes, int knobs) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kWarps][kInFlight];
  __shared__ Routing routing;
  __shared__ AttentionConstants constants;
  __shared__ float scratch[32];
  // The consumers' copy of the layer they compute, and of the next one (copied in a layer ahead).
  __shared__ PersistentLayer layer_entry[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int num_layers = a.shape.num_layers, num_experts = a.shape.num_experts;
  StreamLayer* layers = reinterpret_cast<StreamLayer*>(smem);  // the producer's table
  for (int l = threadIdx.x; l < num_layers; l += kBlockThreads) {
    const PersistentLayer& L = a.layers[l];
    layers[l] = {static_cast<const unsigned char*>(L.q),
                 static_cast<const unsigned char*>(L.k),
                 static_cast<const unsigned char*>(L.v),
                 static_cast<const unsigned char*>(L.o),
                 L.router,
                 L.input_norm,
                 L.inter,
                 L.top_k};
  }
  // Quantized builds: every layer's scales, read by the producers (the group scales) and
  // the consumers (the row factors).
  PersistentQuant* quant = nullptr;
  RoutingQuant* rq = nullptr;
  if constexpr (F != QuantFormat::kNone) {
    quant = reinterpret_cast<PersistentQuant*>(smem + StreamTableBytes(num_layers));
    rq = reinterpret_cast<RoutingQuant*>(quant + num_layers);
    for (int l = threadIdx.x; l < num_layers; l += kBlockThreads) quant[l] = a.quant[l];
  }
  if (threadIdx.x == 0) layer_entry[0] = a.layers[0];
  Dims d;
  d.hidden = a.shape.hidden;
  d.head_dim = a.shape.head_dim;
  d.q_dim = a.shape.q_heads * d.head_dim;
  d.kv_dim = a.shape.kv_heads * d.head_dim;
  d.warps = gridDim.x * kWarps;
  float* xs = reinterpret_cast<float*>(smem + table_bytes);
  // Every expert's weight pointers (quantized builds: then their factor sources and group
  // scales), staged in the o phase past its staged attention output (and past the gate/up
  // phase's x; the down projection's h overwrites them after the top-k).
  const void** expert_ptr = reinterpret_cast<const void**>(xs + max(d.hidden, d.q_dim));
  unsigned char* rings = smem + table_bytes + static_cast<size_t>(stage_floats) * sizeof(float);
  __shared__ Progress progress[kWarps];
  if (threadIdx.x < kWarps) {
    for (int i = 0; i < kInFlight; ++i) BarrierInit(&full[threadIdx.x][i], 1);  // expect_tx
    progress[threadIdx.x] = {0, 0u};
    FenceBarrierInit();
  }
  // The position and the knobs, read from shared memory where used (volatile): values derived
  // from them would otherwise be hoisted out of the layer loop into registers the kernel lacks.
  __shared__ int step_position, step_knobs;
  if (threadIdx.x == 0) {
    routing.layer = routing.attended = -1;
    if (kFusedDown<F>) routing.started = -1;
    step_position = *a.position;
    step_knobs = knobs;
  }
  __syncthreads();  // the last barrier of every warp: from here the producers run on their own
  // Ring i (the consumer warp i's) has its state in lane i % kRingsPerProducer of producer warp
  // i / kRingsPerProducer.
  const int ring = warp >= kWarps ? (warp - kWarps) * kRingsPerProducer + lane : warp;
  d.gw = blockIdx.x * kWarps + ring;
  Ring r;
  r.base = rings + static_cast<size_t>(ring) * ring_bytes;
  r.full = full[ring];
  r.bytes = ring_bytes;
  r.next = {0, kQkv, d.gw, 0, 0, 0, 0};
  if ((knobs >> 1) & 15) r.max_in_flight = max(2, (knobs >> 1) & 15);  // gate/up waits for pairs
  r.skip_math = (knobs >> 5) & 1;
  // An attention block's o weights wait for its attention's inputs to land (AttendSplit's
  // `loaded`): arriving while those loads are in flight, they delay them (and the starved
  // blocks' first experts). Held until the keys are scored instead, the partials' publication
  // waits longer and the step is slower.
  r.hold_o = ((knobs >> 7) & 1) || RunsAttention(a, step_position, (knobs >> 11) & 1);
  r.evict_first = !((knobs >> 8) & 1);
  if constexpr (kFusedDown<F>) {  // (the quantized builds' code stays as it was: see qkv_cap)
    r.qkv_cap = (knobs >> 19) & 3;
    if (!r.qkv_cap) r.qkv_cap = 3;
    r.skip_adds = (knobs >> 21) & 1;
  }
  if (warp >= kWarps) {  // a producer: lane i of producer warp p fills ring p * kRingsPerProducer + i
    if (lane >= kRingsPerProducer) return;
    r.policy = EvictFirstPolicy();
    Settle<kFusedDown<F>>(r.next, layers, num_layers, d);  // a ring with no q/k/v row starts later
    const volatile Progress* p = &progress[ring];
    // TEST ONLY knobs: 32768 fences on every poll; 65536 / 131072 sleep 256 / 1000 ns when idle.
    const bool always_fence = (knobs >> 15) & 1;
    const unsigned idle_ns = (knobs >> 17) & 1 ? 1000 : (knobs >> 16) & 1 ? 256 : 32;
    int fenced = 0;  // consumed units whose reads are ordered before the refills
    while (r.next.layer < num_layers) {
      r.consumed = p->consumed;
      __threadfence_block();
      r.free.pos = p->free_pos;
      // The consumer's reads of freed places before the copies that refill them: needed only
      // when places were freed (knob 32768 fences on every poll).
      if (r.consumed != fenced || always_fence) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        fenced = r.consumed;
      }
      if (Pump<F>(r, layers, quant, num_layers, d, num_experts, routing, rq) == 0)
        __nanosleep(idle_ns);
    }
    return;
  }
  auto knob = [&](int bit) { return (*reinterpret_cast<volatile int*>(&step_knobs) >> bit) & 1; };
  auto consume = [&](int elems, Staged x) { return ConsumeUnit<F>(r, &progress[warp], elems, x); };
  auto stamp = [&](int event) {  // TEST ONLY timeline
    if (a.timeline && threadIdx.x == 0) {
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      a.timeline[static_cast<int64_t>(blockIdx.x) * PersistentTimelineEvents(num_layers) + event] = now;
    }
  };
  stamp(0);
  if (a.timeline && threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    a.timeline[static_cast<int64_t>(blockIdx.x + 1) * PersistentTimelineEvents(num_layers) - 1] =
        sm;
  }
  auto step = [&](int layer, PersistentStep k) {
    stamp(PersistentStepStamp(num_layers, layer) + k);
  };
  // The barrier ending phase `phase` of layer `layer`, stamped on both sides.
  auto sync = [&](unsigned* count, int layer, int phase) {
    stamp(1 + (layer * kPhaseCount + phase) * 2);
    GridSync(a.barrier, count, knob(9));
    stamp(2 + (layer * kPhaseCount + phase) * 2);
  };
  auto position = [&] { return *reinterpret_cast<volatile int*>(&step_position); };
  auto attention = [&] { return MakeAttentionShape(a, position(), knob(11)); };
  // This block's attention item: the items go to the grid's last blocks, which have the fewest
  // q/k/v rows (round robin gives the first warps the extra ones), so that the blocks that also
  // copy in their keys during q/k/v are not the ones with a third row. H200 qwen3-30b-a3b batch 1
  // (timeline): a block with keys and a third row is the q/k/v phase's slowest. (At most
  // gridDim.x items: MakeAttentionShape.)
  auto attention_item = [] { return static_cast<int>(gridDim.x - 1 - blockIdx.x); };
  // Whether the bf16 build's down sums of layer l go to x_adds (zeroed by layer l's o phase)
  // rather than to x: every layer's but the last's (x is what the lm_head reads).
  auto has_adds = [&](int l) { return kFusedDown<F> && l >= 0 && l < num_layers - 1; };
  // This warp's residual row (o and down add to it; the warp owns the same rows in both), held
  // here: no dependent read of it after the dot products.
  float x_own = d.gw < d.hidden && lane == 0 ? __ldcg(a.x + d.gw) : 0.f;
  GainsAhead(layer_entry[0].input_norm, a.norm_dtype, d.hidden);
  // Fused down: each round's kWarps values weight * h of the block's pairs, where the expert
  // pointers were (dead after the top-k).
  float* round_h = xs + max(d.hidden, d.q_dim);
  // The next layer's entry, copied in while the down projection streams (its slot's layer, l - 1,
  // is done); landed before the barrier ending this layer (cp.async.wait_all).
  auto NextLayerAhead = [&](int l) {
    if (l + 1 >= num_layers) return;
    constexpr int kPieces = sizeof(PersistentLayer) / 8;
    if (threadIdx.x < kPieces)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(SharedAddress(
                       reinterpret_cast<uint64_t*>(&layer_entry[(l + 1) & 1]) + threadIdx.x)),
                   "l"(reinterpret_cast<const uint64_t*>(a.layers + l + 1) + threadIdx.x)
                   : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
    GainsAhead(layers[l + 1].input_norm, a.norm_dtype, d.hidden);
  };
  unsigned barriers = 0;
  for (int l = 0; l < num_layers; ++l) {
    const PersistentLayer& L = layer_entry[l & 1];
    if (l > 0) sync(&barriers, l - 1, kDown);  // the previous layer's down projection is in x
    // Fused: the blocks' down sums reached x by red.add; read the own row once they all have.
    if (kFusedDown<F> && l > 0)
      x_own = d.gw < d.hidden && lane == 0 ? ResidualAt(a, d.gw, has_adds(l - 1)) : 0.f;
    if (kFusedDown<F> && threadIdx.x == 0) routing.started = l;
    // This block's attention keys of earlier steps, copied in during the q/k/v phase (past the
    // staged x; the previous phase's h, which they overwrite, is consumed).
    if (RunsAttention(a, position(), knob(11))) {
      int begin, end;
      SplitKeys(attention(), attention_item(), a.shape.kv_heads, position(), &begin, &end);
      LoadKeyChunk(a, attention(), AttentionLayout(attention(), xs, d.hidden), l, attention_item(), begin,
                   end, position());
    }
    // q, k, v = RMSNorm(x) . [Wq | Wk | Wv]^T
    float inv = StageNormed(a.x, L.input_norm, a.norm_dtype, d.hidden, a.eps, xs, scratch,
                            has_adds(l - 1) ? a.x_adds : nullptr);
    step(l, kQkvStaged);
    if (L.router && blockIdx.x == 0)  // the o phase's sums start from zero (the last top-k read
      for (int e = threadIdx.x; e <= num_experts; e += kThreads) a.logits[e] = 0.f;  // them)
    // Attention's constants, loaded now and stored after the q/k/v rows (their latency hides).
    const int t = threadIdx.x, half = d.head_dim / 2;
    const float q_gain = t < d.head_dim && L.q_norm ? LoadAsFloat(L.q_norm, a.norm_dtype, t) : 1.f;
    const float k_gain = t < d.head_dim && L.k_norm ? LoadAsFloat(L.k_norm, a.norm_dtype, t) : 1.f;
    const float2 rope = t < half ? a.rope[static_cast<int64_t>(position()) * half + t] : float2{};
    for (int task = 0, n = TasksOf(d.q_dim + 2 * d.kv_dim, d); task < n; ++task) {
      float factor = 1.f;  // loaded first: its latency hides under the row's units
      if constexpr (F != QuantFormat::kNone) {
        int row;
        const int m = QkvMatrix(d, d.gw + task * d.warps, &row);
        if (lane == 0) factor = RowFactor<F>(quant[l].factor[m], row, a.scale_dtype);
      }
      float acc = 0.f;
      for (int u = 0; u < UnitsOfRow(d.hidden); ++u)
        acc += consume(UnitElems(d.hidden, u), StagedAt(xs, d.hidden, u * kUnitElems));
      acc = WarpSum(acc) * inv;
      if (lane == 0) a.qkv[d.gw + task * d.warps] = acc * factor;
    }
    step(l, kQkvRows);
    if (t < d.head_dim) constants.q_gain[t] = q_gain, constants.k_gain[t] = k_gain;
    if (t < half) constants.rope[t] = rope;
    sync(&barriers, l, kQkv);
    // The o phase's gains (each row's x times its gain feeds the router), asked into L2 a phase
    // ahead.
    GainsAhead(L.post_norm, a.norm_dtype, d.hidden);
    if (RunsAttention(a, position(), knob(11)))
      AttendSplit<F != QuantFormat::kNone>(
          a, attention(), L, l, attention_item(), position(), xs, d.hidden, constants,
          a.timeline ? a.timeline +
                           static_cast<int64_t>(blockIdx.x) * PersistentTimelineEvents(num_layers) +
                           PersistentAttentionStamp(num_layers, l)
                     : nullptr,
          &routing.attended);
    sync(&barriers, l, kAttention);
    if (threadIdx.x == 0) routing.attended = l;
    // x += o_scale * attn . Wo^T; with a router, each new x[i] times the post-attention norm's
    // gain[i] times the router's column i summed into the warp's logits (then the block's and
    // the grid's): after the barrier
    // logits = RMSNorm(x) . Wr^T is those sums over the blocks times 1 / rms(x), and the top-k
    // needs no phase (and no barrier) of its own.
    Stage(a.attn, d.q_dim, xs);
    step(l, kOStaged);
    if (L.router) {  // every expert's weight pointers, so that the top-k's picks cost no round
      // trip: copied asynchronously (landed before the barrier), no thread waits on them here
      for (int i = threadIdx.x; i < ExpertTables(F) * num_experts; i += kThreads) {
        const int table = i / num_experts;
        const void* const* src = table == 0 ? L.gate : table == 1 ? L.up : L.down;
        if constexpr (F != QuantFormat::kNone)
          if (table >= 3)
            src = table < 6 ? quant[l].expert_factor[table - 3] : quant[l].expert_groups[table - 6];
        asm volatile(
            "cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(SharedAddress(expert_ptr + i)),
            "l"(src + (i - table * num_experts))
            : "memory");
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    float router_sums[kMaxExperts / 32] = {}, sum_sq = 0.f;  // this warp's rows' (lane 0: x^2)
    for (int t = 0, n = TasksOf(d.hidden, d); t < n; ++t) {
      const int row = d.gw + t * d.warps;
      float factor = 1.f;
      if constexpr (F != QuantFormat::kNone)
        if (lane == 0) factor = RowFactor<F>(quant[l].factor[3], row, a.scale_dtype);
      const float gain = L.router && lane == 0 ? LoadAsFloat(L.post_norm, a.norm_dtype, row) : 0.f;
      float acc = 0.f;
      for (int u = 0; u < UnitsOfRow(d.q_dim); ++u)
        acc += consume(UnitElems(d.q_dim, u), StagedAt(xs, d.q_dim, u * kUnitElems));
      acc = WarpSum(acc) * factor;
      float x = 0.f;
      if (lane == 0) {
        x = (t == 0 ? x_own : ResidualAt(a, row, has_adds(l - 1))) + L.o_scale * acc;
        a.x[row] = x;
        if constexpr (kFusedDown<F>) {
          a.x_mlp[row] = x;  // x (or x_adds) takes the blocks' down sums
          if (has_adds(l)) a.x_adds[PersistentAddIndex(row)] = 0.f;
        }
        if (t == 0) x_own = x;
      }
      if (L.router) {
        sum_sq += x * x;  // the norm's sum of squares (lane 0's)
        ConsumeRouterColumn(r, &progress[warp], num_experts, __shfl_sync(0xffffffffu, x * gain, 0),
                            router_sums);
      }
    }
    step(l, kORows);
    if (L.router) {  // this block's sums into the grid's (zeroed in this layer's q/k/v phase)
      float* warp_sums = xs + RouterSumsAt(d.hidden, d.q_dim, num_experts, F);
      ConsumerSync();  // every warp is past its rows: the staged attention output is dead
#pragma unroll
      for (int k = 0; k < kMaxExperts / 32; ++k)
        if (lane + 32 * k < num_experts)
          warp_sums[warp * (num_experts + 1) + lane + 32 * k] = router_sums[k];
      if (lane == 0) warp_sums[warp * (num_experts + 1) + num_experts] = sum_sq;
      asm volatile("cp.async.wait_all;" ::: "memory");  // the expert pointers
      ConsumerSync();
      for (int e = threadIdx.x; e <= num_experts; e += kThreads) {
        float sum = 0.f;
#pragma unroll 4
        for (int w = 0; w < kWarps; ++w) sum += warp_sums[w * (num_experts + 1) + e];
        asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" ::"l"(a.logits + e), "f"(sum)
                     : "memory");
      }
    }
    // The barrier's release covers the block's reductions (through the block barrier).
    sync(&barriers, l, kO);
    if (L.router) {  // every block picks the same top-k
      // The logits and the sum of squares are complete: the top-k starts at once, its loads in
      // flight with x's staging (no block reduction before it).
      inv = rsqrtf(__ldcg(a.logits + num_experts) / d.hidden + a.eps);
      if (warp == 0) {
        int id;
        float weight;
        WarpTopK<kMaxExperts / 32>(a.logits, num_experts, L.top_k, a.renormalize, &id, &weight,
                                   inv);
        if (lane < L.top_k) {
          routing.gate[lane] = static_cast<const unsigned char*>(expert_ptr[id]);
          routing.up[lane] = static_cast<const unsigned char*>(expert_ptr[num_experts + id]);
          routing.down[lane] = static_cast<const unsigned char*>(expert_ptr[2 * num_experts + id]);
          routing.weight[lane] = id == L.skip_expert ? 0.f : weight;
          if constexpr (F != QuantFormat::kNone)
            for (int p = 0; p < 3; ++p) {
              rq->factor[p][lane] = expert_ptr[(3 + p) * num_experts + id];
              if constexpr (kHasGroups<F>)
                rq->groups[p][lane] =
                    static_cast<const unsigned char*>(expert_ptr[(6 + p) * num_experts + id]);
            }
        }
        // To the producers at once: the experts' first units are in flight while x is staged
        // (published after the block barrier, they would wait for warp 0's staging loads).
        __syncwarp();
        if (lane == 0) PublishRouting(&routing, l);
      }
      // x staged; the consumers see it and the routing after the barrier below.
      StageScaled(kFusedDown<F> ? a.x_mlp : a.x, L.post_norm, a.norm_dtype, d.hidden, xs);
    } else {  // a dense MLP: one "expert" of weight 1
      inv = StageNormed(kFusedDown<F> ? a.x_mlp : a.x, L.post_norm, a.norm_dtype, d.hidden, a.eps,
                        xs, scratch);
    }
    if (!L.router && threadIdx.x == 0) {
      routing.gate[0] = static_cast<const unsigned char*>(L.gate[0]);
      routing.up[0] = static_cast<const unsigned char*>(L.up[0]);
      routing.down[0] = static_cast<const unsigned char*>(L.down[0]);
      routing.weight[0] = 1.f;
      if constexpr (F != QuantFormat::kNone)
        for (int p = 0; p < 3; ++p) {
          rq->factor[p][0] = quant[l].expert_factor[p][0];
          if constexpr (kHasGroups<F>)
            rq->groups[p][0] = static_cast<const unsigned char*>(quant[l].expert_groups[p][0]);
        }
      PublishRouting(&routing, l);
    }
    ConsumerSync();
    step(l, kMlpRouted);
    // h[slot, j] = silu(gate_slot[j] . xn) * (up_slot[j] . xn)
    const int per_row = UnitsOfRow(d.hidden);
    for (int t = 0, n = TasksOf(L.top_k * L.inter, d); t < n; ++t) {
      float gate_factor = 1.f, up_factor = 1.f;
      if constexpr (F != QuantFormat::kNone) {
        const int item = d.gw + t * d.warps, slot = item / L.inter, j = item - slot * L.inter;
        if (lane == 0) {
          gate_factor = RowFactor<F>(rq->factor[0][slot], j, a.scale_dtype);
          up_factor = RowFactor<F>(rq->factor[1][slot], j, a.scale_dtype);
        }
      }
      float gate = 0.f, up = 0.f;
      if constexpr (F == QuantFormat::kNone) {
        for (int u = 0; u < per_row; ++u)
          gate += consume(UnitElems(d.hidden, u), StagedAt(xs, d.hidden, u * kUnitElems));
        for (int u = 0; u < per_row; ++u)
          up += consume(UnitElems(d.hidden, u), StagedAt(xs, d.hidden, u * kUnitElems));
      } else {
        // The staged x's shared-memory reads (4 bytes a weight) bounded these builds' gate/up:
        // each pair of units is dotted with one read of it.
        for (int u = 0; u < per_row; ++u) {  // the row's gate and up units alternate in the ring
          const int elems = UnitElems(d.hidden, u);
          const unsigned char* gate_unit = WaitUnit(r, UnitBytes<F>(elems));
          const unsigned char* up_unit = WaitUnit(r, UnitBytes<F>(elems), 1);
          if (!r.skip_math)
            UnitDot2<F>(gate_unit, up_unit, StagedAt(xs, d.hidden, u * kUnitElems), elems, &gate,
                        &up);
          ReleaseUnit(r, &progress[warp], 2);
        }
      }
      gate = WarpSum(gate) * inv * gate_factor;
      up = WarpSum(up) * inv * up_factor;
      if constexpr (kFusedDown<F>) {  // the pair's weight in x, for its block's down tiles
        if (lane == 0)
          round_h[t * kWarps + warp] =
              gate / (1.f + expf(-gate)) * up * routing.weight[(d.gw + t * d.warps) / L.inter];
      } else {
        if (lane == 0) a.h[d.gw + t * d.warps] = gate / (1.f + expf(-gate)) * up;
      }
      if (t == 0) step(l, kMlpFirstPair);
    }
    step(l, kMlpPairs);
    if constexpr (kFusedDown<F>) {
      ConsumerSync();  // the block's h of every round
      NextLayerAhead(l);
      // x[cols] += sum over the block's pairs of weight * h * down[cols, j]: this warp's
      // columns, a tile a round (its block's kWarps rows j), summed over the grid by red.add.
      DownTiles(r, &progress[warp], d.hidden, TasksOf(L.top_k * L.inter, d), round_h, a.x,
                has_adds(l) ? a.x_adds : nullptr, L.nan_after && blockIdx.x == 0 && warp == 0);
      asm volatile("cp.async.wait_all;" ::: "memory");  // the next layer's entry
      continue;  // the layer's last phase: the barrier at the next layer's start ends it
    }
    sync(&barriers, l, kGateUp);
    NextLayerAhead(l);
    // x += sum_slot weight_slot * (Wd_slot . h_slot)
    Stage(a.h, L.top_k * L.inter, xs);
    for (int t = 0, n = TasksOf(d.hidden, d); t < n; ++t) {
      float acc = 0.f;
      for (int slot = 0; slot < L.top_k; ++slot) {
        float factor = 1.f;  // a lane's part is scaled before the warp sum
        if constexpr (F != QuantFormat::kNone)
          factor = RowFactor<F>(rq->factor[2][slot], d.gw + t * d.warps, a.scale_dtype);
        float part = 0.f;
        for (int u = 0; u < UnitsOfRow(L.inter); ++u)
          part += consume(UnitElems(L.inter, u),
                          StagedAt(xs, L.top_k * L.inter, slot * L.inter + u * kUnitElems));
        acc += routing.weight[slot] * factor * part;
      }
      acc = WarpSum(acc);
      const int row = d.gw + t * d.warps;
      if (lane == 0) {
        const float x = L.nan_after && row == 0 ? __int_as_float(0x7fc00000)
                                                : (t == 0 ? x_own : __ldcg(a.x + row)) + acc;
        a.x[row] = x;
        if (t == 0) x_own = x;
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // the next layer's entry (long landed)
  }
  stamp(1 + ((num_layers - 1) * kPhaseCount + kDown) * 2);
#endif
}

// Rounded to 128 bytes: the rings after it take 16-byte aligned bulk copies.
int StageFloats(const PersistentDecodeShape& s) {
  const int q_dim = s.q_heads * s.head_dim;
  const int expert_pointers = ExpertPointerFloats(s.format, s.num_experts);
  // The bf16 build's fused down projection: kTileRows weights * h a round of the block's pairs.
  const int warps = PersistentDecodeBlocks() * kWarps;
  const int round_h = s.format == QuantFormat::kNone
                          ? (s.max_top_k * s.max_inter + warps - 1) / warps * kTileRows
                          : 0;
  const int router_sums =
      RouterSumsAt(s.hidden, q_dim, s.num_experts, s.format) + kWarps * (s.num_experts + 1);
  const int floats =
      std::max({std::max(s.hidden, q_dim) + std::max(expert_pointers, round_h),
                s.max_top_k * s.max_inter, router_sums,
                AttentionStageFloats(s.hidden, s.q_heads / std::max(1, s.kv_heads), s.head_dim)});
  return (floats + 31) / 32 * 32;
}

// The layer tables' bytes at the front of dynamic shared memory (128-byte aligned).
int TableBytes(const PersistentDecodeShape& s) {
  const int quant = s.format == QuantFormat::kNone
                        ? 0
                        : s.num_layers * static_cast<int>(sizeof(PersistentQuant)) +
                              static_cast<int>(sizeof(RoutingQuant));
  return StreamTableBytes(s.num_layers) + (quant + 127) / 128 * 128;
}

// Calls fn with the kernel's build for the weights' format; false (fn not called) for a format
// it has none for.
template <typename Fn>
bool WithKernelFor(QuantFormat format, Fn&& fn) {
  switch (format) {
    case QuantFormat::kNone:
      fn(PersistentDecodeKernel<QuantFormat::kNone>);
      return true;
    case QuantFormat::kFp8Tensor:
      fn(PersistentDecodeKernel<QuantFormat::kFp8Tensor>);
      return true;
    case QuantFormat::kFp8Channel:
      fn(PersistentDecodeKernel<QuantFormat::kFp8Channel>);
      return true;
    case QuantFormat::kNvfp4:
      fn(PersistentDecodeKernel<QuantFormat::kNvfp4>);
      return true;
    case QuantFormat::kMxfp4:
      fn(PersistentDecodeKernel<QuantFormat::kMxfp4>);
      return true;
    case QuantFormat::kFp8Block128:
      fn(PersistentDecodeKernel<QuantFormat::kFp8Block128>);
      return true;
    default:
      return false;
  }
}

// The kernel's build for the weights' format; null for a format it has none for.
const void* KernelFor(QuantFormat format) {
  const void* kernel = nullptr;
  WithKernelFor(format, [&](auto build) { kernel = reinterpret_cast<const void*>(build); });
  return kernel;
}

// Per-warp ring bytes left by the layer tables, the staged activations and the static shared
// memory.
int RingBytes(const PersistentDecodeShape& s) {
  int device = 0, optin = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaFuncAttributes attributes{};
  cudaFuncGetAttributes(&attributes, KernelFor(s.format));
  const int dynamic = optin - static_cast<int>(attributes.sharedSizeBytes) - TableBytes(s) -
                      StageFloats(s) * static_cast<int>(sizeof(float));
  return dynamic / kWarps / 128 * 128;
}

// One thread per (column i, tile group g): the kTileRows weights down[i, g * kTileRows + r]
// (32 contiguous bytes) into row g * kTileRows + i / cols of the tiles, column r * cols + i % cols.
__global__ void DownTilesKernel(const uint16_t* down, uint16_t* tiles, int hidden, int inter) {
  const int cols = hidden / kWarps;
  const int64_t n = static_cast<int64_t>(hidden) * (inter / kTileRows);
  for (int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; x < n;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(x % hidden), g = static_cast<int>(x / hidden);
    const uint16_t* src = down + static_cast<int64_t>(i) * inter + g * kTileRows;
    uint16_t* dst = tiles + static_cast<int64_t>(g * kTileRows + i / cols) * hidden + i % cols;
    for (int r = 0; r < kTileRows; ++r) dst[r * cols] = src[r];
  }
}

}  // namespace

void PersistentDownTiles(const uint16_t* down, uint16_t* tiles, int hidden, int inter,
                         cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(hidden) * (inter / kTileRows);
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 65536));
  LaunchPlain(DownTilesKernel, blocks, threads, 0, stream, down, tiles, hidden, inter);
}

std::string PersistentDownTilesUnsupported(int hidden, int inter) {
  const int groups = hidden / (8 * kWarps);  // DownTiles: 8-column chunks of a tile row
  if (hidden % (8 * kWarps) || groups > 32 || (groups & (groups - 1)))
    return absl::StrCat("bf16 weights: hidden (", hidden, ") must be ", 8 * kWarps,
                        " times a power of two up to 32 (the down projection's tiles)");
  if (inter % kTileRows)
    return absl::StrCat("bf16 weights: the MLP width (", inter, ") must be a multiple of ",
                        kTileRows, " (the down projection's tiles)");
  return "";
}

std::string PersistentDecodeUnsupported(const PersistentDecodeShape& s) {
  const int q_dim = s.q_heads * s.head_dim;
  if (!KernelFor(s.format))
    return absl::StrCat(
        "streams bf16, fp8 (tensor, channel, block-128), nvfp4 and mxfp4 weights, not ",
        QuantFormatName(s.format));
  // Quantized rows of codes must stay 16-byte aligned: fp8 one byte a weight, FP4 half.
  const int align = s.format == QuantFormat::kNone ? 8 : IsFp4(s.format) ? 32 : 16;
  if (s.hidden % align || q_dim % align || s.max_inter % align)
    return absl::StrCat(QuantFormatName(s.format), " weights: hidden (", s.hidden, "), q_dim (",
                        q_dim, ") and the MLP widths (", s.max_inter, ") must be multiples of ",
                        align, " (16-byte rows of codes)");
  if (s.hidden <= 0 || s.hidden % 8 || q_dim % 8 || s.max_inter % 8)
    return absl::StrCat("hidden (", s.hidden, "), q_dim (", q_dim, ") and the MLP widths (",
                        s.max_inter, ") must be multiples of 8 (16-byte rows)");
  if (s.head_dim % 32 || s.head_dim > 256)
    return absl::StrCat("head_dim ", s.head_dim, ": needs a multiple of 32 up to 256");
  if (s.kv_heads <= 0 || s.q_heads % s.kv_heads)
    return absl::StrCat("q_heads ", s.q_heads, " is not a multiple of kv_heads ", s.kv_heads);
  // Attention runs one (kv head, split) item a block, at least one split a kv head.
  if (const int blocks = PersistentDecodeBlocks(); s.kv_heads > blocks)
    return absl::StrCat(s.kv_heads, " kv heads: attention takes one a block, and the grid has ",
                        blocks, " blocks (one an SM)");
  if (s.num_experts > kMaxExperts || s.num_experts % 8)
    return absl::StrCat(s.num_experts, " experts: the in-kernel top-k takes up to ", kMaxExperts,
                        ", a multiple of 8 (16-byte router columns)");
  if (s.max_top_k > kMaxTopK)
    return absl::StrCat("top-k ", s.max_top_k, ": up to ", kMaxTopK);
  if (s.format == QuantFormat::kNone)
    if (const std::string why = PersistentDownTilesUnsupported(s.hidden, s.max_inter); !why.empty())
      return why;
  const int ring = RingBytes(s);
  if (ring < kMinRingBytes)
    return absl::StrCat("shared memory: ", ring, " bytes a warp ring after staging ",
                        StageFloats(s), " activations; needs ", kMinRingBytes);
  return "";
}

int PersistentDecodeRingBytes(const PersistentDecodeShape& s) { return RingBytes(s); }

size_t PersistentDecodePartialFloats(const PersistentDecodeShape& s) {
  const int splits = std::min(kMaxSplits, std::max(1, PersistentDecodeBlocks() / std::max(1, s.kv_heads)));
  return PartialAccOffset(s.q_heads, splits) + static_cast<size_t>(s.q_heads) * splits * s.head_dim;
}

int PersistentDecodeBlocks() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

void PersistentDecode(const PersistentDecodeArgs& args, cudaStream_t stream, bool counters_zeroed) {
  const int table_bytes = TableBytes(args.shape);
  const int stage_floats = StageFloats(args.shape);
  int ring_bytes = RingBytes(args.shape);
  // TEST ONLY knobs: INFERSWEEP_PERSISTENT_IN_FLIGHT=n caps the units in flight per ring;
  // INFERSWEEP_PERSISTENT_KNOBS: 32 skips the dot products (wrong results: timing only), 128
  // holds every block's o projection weights back until the layer's attention is done (an
  // attention block's wait for its attention's inputs in any case), 256 streams the
  // weights with the default L2 policy instead of evict-first, 512 takes the fenced grid
  // barrier, 2048 splits each kv head's keys over the most blocks, 262144 caps the rings at
  // 11,904 bytes (two 4 KB units); 524288 times n (1-3) lets at most n - 1
  // units be in flight while a ring's next is a q/k/v unit of a layer its block has not begun
  // (Ring::qkv_cap; the bf16 build's default is 3); 2097152 keeps the bf16 build's down sums out of
  // x (wrong results: timing only).
  static const int knobs = [] {
    const char* cap = std::getenv("INFERSWEEP_PERSISTENT_IN_FLIGHT");
    const char* bits = std::getenv("INFERSWEEP_PERSISTENT_KNOBS");
    return (cap ? std::atoi(cap) << 1 : 0) | (bits ? std::atoi(bits) : 0);
  }();
  if ((knobs >> 18) & 1) ring_bytes = std::min(ring_bytes, 11904);
  const size_t smem = table_bytes + static_cast<size_t>(stage_floats) * sizeof(float) +
                      static_cast<size_t>(kWarps) * ring_bytes;
  // Per call, not once: the size depends on the model (and the attribute is per device).
  cudaFuncSetAttribute(KernelFor(args.shape.format), cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(smem));
  const int sms = PersistentDecodeBlocks();
  if (!counters_zeroed)
    cudaMemsetAsync(args.barrier, 0, PersistentDecodeCounters(args.shape) * sizeof(unsigned),
                    stream);
  // Cooperative: every block resident at once, or the launch fails (the grid barriers need it).
  cudaLaunchAttribute cooperative[1];
  cooperative[0].id = cudaLaunchAttributeCooperative;
  cooperative[0].val.cooperative = 1;
  auto launch = [&](auto kernel) {
    LaunchWithAttributes(kernel, dim3(sms), dim3(kBlockThreads), smem, stream, cooperative, 1, args,
                         table_bytes, stage_floats, ring_bytes, knobs);
  };
  // PersistentDecodeUnsupported refused the formats without a build; the bf16 one otherwise.
  if (!WithKernelFor(args.shape.format, launch)) launch(PersistentDecodeKernel<QuantFormat::kNone>);
}

ProbeKernel PersistentDecodeProbeKernel() {
  return {"PersistentDecodeKernel<bf16>", KernelFor(QuantFormat::kNone)};
}

}  // namespace infersweep::cuda
