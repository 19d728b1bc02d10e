// The persistent decode step (graphs=persistent): one cooperative kernel runs every layer of a
// batch-1 decode step, phase after phase, with grid-wide barriers between phases:
//   q/k/v GEMV (input RMSNorm) | attention (q/k norm, RoPE, KV append) | o GEMV + residual |
//   router GEMV (post-attention RMSNorm) | top-k | expert gate/up + SiLU | expert down + combine
// Why: at batch 1 a layer's weights (113.8 MB on qwen3-30b-a3b, 25.5 us at 4.46 TB/s) were
// streamed by 9 kernels, each paying its own ramp and tail, and the latency-bound kernels in
// between (RoPE, attention, router, top-k) left DRAM idle: 62 us a layer (docs/PERFORMANCE.md).
//
// How: every warp owns a fixed share of every phase's weight rows, and a private ring in shared
// memory that its lane 0 keeps filled with bulk asynchronous copies (cp.async.bulk, mbarrier
// completion) of its next units of weights, in the order the warp will consume them, across phase
// and layer boundaries: while a few blocks run attention, the others' rings already hold their
// o rows; while the barrier after the down projection is pending, the next layer's q/k/v rows are
// in flight. Only the experts wait for the routing (their rows are unknown until top-k).
// The activations a phase reads (x, RMS-normalised; attention's output; the experts' h) are
// staged in shared memory once per block after each barrier.
//
// Napkin math, qwen3-30b-a3b, one layer: weights 113.8 MB -> 25.5 us at 4.46 TB/s; 132 SMs x 16
// warps x ~12.5 KB rings = 26 MB in flight (the bandwidth-latency product is ~9 MB); K/V 1 MB at
// context 512; 6 grid barriers at ~1 us. FLOPs are 2 per weight: bandwidth-bound.
//
// Numerics follow gemm=fused + attention=flash + moe=fused: fp32 activations and accumulation,
// bf16 weights, K and V rounded to bf16 as they are cached; the router and top-k are fp32 and the
// same top-k code (routing.cuh). Attention here runs on CUDA cores in fp32 (the flash decode
// kernel rounds q to bf16 for its MMAs): results agree to fp32 rounding, not bit for bit.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/tensor_ref.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/routing.cuh"
#include "kernels/cuda/sm90a/bulk_copy.cuh"
#include "kernels/cuda/sm90a/decode_persistent.h"

namespace infersweep::cuda {
namespace {

constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kUnitElems = 2048;  // a weight unit: up to 2048 bf16 (4 KB) of one row
constexpr int kInFlight = 8;      // units in flight per warp: its mbarriers
constexpr int kMaxTopK = 32;
constexpr int kMaxExperts = 128;  // WarpTopK<4>
constexpr int kMinRingBytes = 2 * kUnitElems * 2;

enum Phase : int { kQkv, kAttention, kO, kRouter, kGateUp, kDown, kPhaseCount };
static_assert(kPhaseCount == kPersistentPhases);

struct Dims {
  int hidden, q_dim, kv_dim, head_dim;
  int gw, warps;  // this warp's global index, and the grid's warp count
};

__device__ __forceinline__ int TasksOf(int items, const Dims& d) {
  return items > d.gw ? (items - 1 - d.gw) / d.warps + 1 : 0;
}
__device__ __forceinline__ int UnitsOfRow(int k) { return (k + kUnitElems - 1) / kUnitElems; }
__device__ __forceinline__ int UnitElems(int k, int unit) {
  return min(kUnitElems, k - unit * kUnitElems);
}

// Work items of a phase (rows, or gate/up pairs), spread over the grid's warps round robin.
__device__ __forceinline__ int PhaseItems(const PersistentLayer& L, int phase, const Dims& d,
                                          int num_experts) {
  switch (phase) {
    case kQkv:
      return d.q_dim + 2 * d.kv_dim;
    case kO:
    case kDown:
      return d.hidden;
    case kRouter:
      return L.router ? num_experts : 0;
    case kGateUp:
      return L.top_k * L.inter;
    default:  // attention streams no weights
      return 0;
  }
}
__device__ __forceinline__ int TaskUnits(const PersistentLayer& L, int phase, const Dims& d) {
  switch (phase) {
    case kO:
      return UnitsOfRow(d.q_dim);
    case kGateUp:
      return 2 * UnitsOfRow(d.hidden);
    case kDown:
      return L.top_k * UnitsOfRow(L.inter);
    default:
      return UnitsOfRow(d.hidden);
  }
}

// The experts chosen for the layer being computed, set by each block after its top-k.
struct Routing {
  const uint16_t* gate[kMaxTopK];
  const uint16_t* up[kMaxTopK];
  const uint16_t* down[kMaxTopK];
  float weight[kMaxTopK];
  int layer;  // the layer these are for; -1 before the first
};

// Where a warp's producer is in the sequence of units it will consume.
struct Cursor {
  int layer, phase, task, unit;
};

// The producer side of a warp's ring: lane 0 issues, every lane keeps the same (uniform) state.
struct Ring {
  unsigned char* base;
  uint64_t* full;  // kInFlight mbarriers
  int bytes;       // ring size, a multiple of 16
  Cursor next;     // the next unit to issue
  int issued = 0, consumed = 0;
  unsigned issue_pos = 0, free_pos = 0;  // byte positions, monotonic; [free_pos, issue_pos) busy
};

// Byte offset of a unit of `size` bytes starting at monotonic position *pos; a unit never wraps
// (the tail is skipped). Advances *pos past it. The producer and the consumer call it in the
// same order with the same sizes, so they agree on every unit's place.
__device__ __forceinline__ int Place(unsigned* pos, int size, int ring_bytes) {
  int off = static_cast<int>(*pos % ring_bytes);
  if (off + size > ring_bytes) {
    *pos += ring_bytes - off;
    off = 0;
  }
  *pos += size;
  return off;
}

// Moves c past phases (and layers) in which this warp has no task left.
__device__ __forceinline__ void Settle(Cursor& c, const PersistentLayer* layers, int num_layers,
                                       const Dims& d, int num_experts) {
  while (c.layer < num_layers &&
         c.task >= TasksOf(PhaseItems(layers[c.layer], c.phase, d, num_experts), d)) {
    c.task = 0;
    if (++c.phase == kPhaseCount) {
      c.phase = 0;
      ++c.layer;
    }
  }
}

__device__ __forceinline__ void Advance(Cursor& c, const PersistentLayer* layers, int num_layers,
                                        const Dims& d, int num_experts) {
  if (++c.unit < TaskUnits(layers[c.layer], c.phase, d)) return;
  c.unit = 0;
  ++c.task;
  Settle(c, layers, num_layers, d, num_experts);
}

// The global source and length (bf16 elements) of the unit at cursor c.
__device__ __forceinline__ const uint16_t* UnitSource(const Cursor& c, const PersistentLayer& L,
                                                      const Dims& d, const Routing& routing,
                                                      int* elems) {
  const int item = d.gw + c.task * d.warps;
  const int64_t H = d.hidden;
  const uint16_t* row;
  int k = d.hidden, unit = c.unit;
  switch (c.phase) {
    case kQkv:
      row = item < d.q_dim             ? L.q + item * H
            : item < d.q_dim + d.kv_dim ? L.k + (item - d.q_dim) * H
                                        : L.v + (item - d.q_dim - d.kv_dim) * H;
      break;
    case kO:
      k = d.q_dim;
      row = L.o + static_cast<int64_t>(item) * d.q_dim;
      break;
    case kRouter:
      row = L.router + item * H;
      break;
    case kGateUp: {
      const int slot = item / L.inter, j = item % L.inter, per_row = UnitsOfRow(d.hidden);
      row = (unit < per_row ? routing.gate[slot] : routing.up[slot]) + j * H;
      unit %= per_row;
      break;
    }
    default: {  // kDown
      const int per_row = UnitsOfRow(L.inter);
      k = L.inter;
      row = routing.down[unit / per_row] + static_cast<int64_t>(item) * L.inter;
      unit %= per_row;
      break;
    }
  }
  *elems = UnitElems(k, unit);
  return row + static_cast<int64_t>(unit) * kUnitElems;
}

#if defined(__CUDA_ARCH__)
// Issues units into the ring until it is full, kInFlight are in flight, the sequence ends, or the
// next unit is an expert's whose routing this block has not computed yet.
__device__ __forceinline__ void Pump(Ring& r, const PersistentLayer* layers, int num_layers,
                                     const Dims& d, int num_experts, const Routing& routing) {
  const int lane = threadIdx.x & 31;
  while (r.next.layer < num_layers && r.issued - r.consumed < kInFlight) {
    if (r.next.phase >= kGateUp && *reinterpret_cast<const volatile int*>(&routing.layer) != r.next.layer)
      break;
    int elems;
    const uint16_t* src = UnitSource(r.next, layers[r.next.layer], d, routing, &elems);
    const int size = elems * 2;
    unsigned pos = r.issue_pos;
    const int off = Place(&pos, size, r.bytes);
    if (pos - r.free_pos > static_cast<unsigned>(r.bytes)) break;
    if (lane == 0) BulkCopy(r.base + off, src, size, &r.full[r.issued % kInFlight]);
    r.issue_pos = pos;
    ++r.issued;
    Advance(r.next, layers, num_layers, d, num_experts);
  }
}

// The warp's share of a dot product over one unit: w (the unit in shared memory) . x[0, elems).
__device__ __forceinline__ float UnitDot(const uint4* w, const float* x, int elems) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
#pragma unroll 4
  for (int c = lane; c < elems / 8; c += 32) {
    const float4 lo = *reinterpret_cast<const float4*>(x + c * 8);
    const float4 hi = *reinterpret_cast<const float4*>(x + c * 8 + 4);
    const float xv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    acc += Dot8Bf16(w[c], xv);
  }
  return acc;
}

// Waits for the warp's oldest unit (issuing more first), returns its dot with x, frees it.
__device__ __forceinline__ float ConsumeUnit(Ring& r, const PersistentLayer* layers,
                                             int num_layers, const Dims& d, int num_experts,
                                             const Routing& routing, int elems, const float* x) {
  Pump(r, layers, num_layers, d, num_experts, routing);
  BarrierWait(&r.full[r.consumed % kInFlight], (r.consumed / kInFlight) & 1);
  unsigned pos = r.free_pos;
  const int off = Place(&pos, elems * 2, r.bytes);
  const float acc = UnitDot(reinterpret_cast<const uint4*>(r.base + off), x, elems);
  __syncwarp();  // every lane has read the unit before lane 0 may overwrite it
  r.free_pos = pos;
  ++r.consumed;
  return acc;
}

// Grid-wide barrier number *count (counted from 1) on a counter zeroed before the launch.
__device__ __forceinline__ void GridSync(unsigned* counter, unsigned* count) {
  __syncthreads();
  ++*count;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    const unsigned target = *count * gridDim.x;
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
    __threadfence();
  }
  __syncthreads();
}

// xs[i] = x[i] * gain[i] for i < n; returns 1 / rms(x). Reads x through L2 (other SMs wrote it in
// this launch). Ends with every thread past a block barrier.
__device__ __forceinline__ float StageNormed(const float* x, const void* gain, DType gain_dtype,
                                             int n, float eps, float* xs, float* scratch) {
  float sum_sq = 0.f;
  for (int q = threadIdx.x; q < n / 4; q += kThreads) {
    float4 v = __ldcg(reinterpret_cast<const float4*>(x) + q);
    sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    v.x *= LoadAsFloat(gain, gain_dtype, 4 * q);
    v.y *= LoadAsFloat(gain, gain_dtype, 4 * q + 1);
    v.z *= LoadAsFloat(gain, gain_dtype, 4 * q + 2);
    v.w *= LoadAsFloat(gain, gain_dtype, 4 * q + 3);
    reinterpret_cast<float4*>(xs)[q] = v;
  }
  return rsqrtf(BlockSum(sum_sq, scratch) / n + eps);  // BlockSum's barriers publish xs
}

__device__ __forceinline__ void Stage(const float* src, int n, float* xs) {
  for (int q = threadIdx.x; q < n / 4; q += kThreads)
    reinterpret_cast<float4*>(xs)[q] = __ldcg(reinterpret_cast<const float4*>(src) + q);
  __syncthreads();
}

__device__ __forceinline__ float RoundBf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// One q head's attention for the new token, by the whole block: q/k RMSNorm and RoPE (the same
// formulas as QkNormRopeAppendKernel), the new K and V appended to the cache by the first head
// of each GQA group, then softmax(q K^T / sqrt(d)) V over positions [0, pos] in chunks of
// kThreads keys: a thread per key for the scores, 16-byte V loads spread over (key group, 8 dims)
// for the weighted sum. The new key and value are used as rounded for the cache. Shared memory:
// xs (3 d + 9 kThreads floats).
__device__ void AttendHead(const PersistentDecodeArgs& a, const PersistentLayer& L, int layer,
                           int head, int pos, float* xs, float* scratch) {
  const int hd = a.shape.head_dim, half = hd / 2;
  const int group = a.shape.q_heads / a.shape.kv_heads, kv_head = head / group;
  const int q_dim = a.shape.q_heads * hd, kv_dim = a.shape.kv_heads * hd;
  const int t = threadIdx.x, warp = t / 32, lane = t & 31;
  float* qs = xs;
  float* kn = xs + hd;
  float* vn = xs + 2 * hd;
  float* weights = xs + 3 * hd;        // [kThreads]
  float* partial = weights + kThreads;  // [kThreads * 8]
  // Threads [0, hd) read q, [hd, 2 hd) the new k (whole warps: hd % 32 == 0).
  float raw = 0.f;
  if (t < hd)
    raw = __ldcg(a.qkv + head * hd + t);
  else if (t < 2 * hd)
    raw = __ldcg(a.qkv + q_dim + kv_head * hd + (t - hd));
  const float sum_sq = WarpSum(raw * raw);
  if (lane == 0) scratch[warp] = sum_sq;
  if (t < hd) {
    qs[t] = raw;
    vn[t] = RoundBf16(__ldcg(a.qkv + q_dim + kv_dim + kv_head * hd + t));
  } else if (t < 2 * hd) {
    kn[t - hd] = raw;
  }
  __syncthreads();
  float q_ss = 0.f, k_ss = 0.f;
  for (int w = 0; w < hd / 32; ++w) q_ss += scratch[w], k_ss += scratch[hd / 32 + w];
  const float q_inv = L.q_norm ? rsqrtf(q_ss / hd + a.eps) : 1.f;
  const float k_inv = L.k_norm ? rsqrtf(k_ss / hd + a.eps) : 1.f;
  if (t < hd) {  // threads [0, half): q's pairs (i, i + half); [half, hd): k's
    const bool is_q = t < half;
    const int i = is_q ? t : t - half;
    float* vec = is_q ? qs : kn;
    const void* gain = is_q ? L.q_norm : L.k_norm;
    const float inv = is_q ? q_inv : k_inv;
    const float g1 = gain ? LoadAsFloat(gain, a.norm_dtype, i) : 1.f;
    const float g2 = gain ? LoadAsFloat(gain, a.norm_dtype, i + half) : 1.f;
    const float x1 = vec[i] * inv * g1, x2 = vec[i + half] * inv * g2;
    const float2 c = a.rope[static_cast<int64_t>(pos) * half + i];
    const float r1 = x1 * c.x - x2 * c.y, r2 = x2 * c.x + x1 * c.y;
    vec[i] = is_q ? r1 : RoundBf16(r1);
    vec[i + half] = is_q ? r2 : RoundBf16(r2);
  }
  __syncthreads();
  const int64_t layer_offset = static_cast<int64_t>(layer) * a.capacity * kv_dim + kv_head * hd;
  const __nv_bfloat16* keys = reinterpret_cast<const __nv_bfloat16*>(a.k_cache) + layer_offset;
  const __nv_bfloat16* values = reinterpret_cast<const __nv_bfloat16*>(a.v_cache) + layer_offset;
  if (head % group == 0 && t < hd) {  // the group's first head appends this step's K and V
    const int64_t slot = static_cast<int64_t>(pos) * kv_dim + t;
    reinterpret_cast<__nv_bfloat16*>(a.k_cache)[layer_offset + slot] = __float2bfloat16_rn(kn[t]);
    reinterpret_cast<__nv_bfloat16*>(a.v_cache)[layer_offset + slot] = __float2bfloat16_rn(vn[t]);
  }
  const float scale = rsqrtf(static_cast<float>(hd));
  const int count = pos + 1;
  const int lanes_per_row = hd / 8, key_groups = kThreads / lanes_per_row;
  const int d0 = 8 * (t % lanes_per_row), key_group = t / lanes_per_row;
  float run_max = -INFINITY, run_sum = 0.f, acc[8] = {};
  for (int c0 = 0; c0 < count; c0 += kThreads) {
    const int p = c0 + t;
    float s = -INFINITY;
    if (p < count) {
      float dot = 0.f;
      if (p == pos) {
        for (int i = 0; i < hd; ++i) dot += qs[i] * kn[i];
      } else {
        const uint4* kr = reinterpret_cast<const uint4*>(keys + static_cast<int64_t>(p) * kv_dim);
#pragma unroll 4
        for (int c = 0; c < hd / 8; ++c) {
          const float4 lo = *reinterpret_cast<const float4*>(qs + 8 * c);
          const float4 hi = *reinterpret_cast<const float4*>(qs + 8 * c + 4);
          const float qv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          dot += Dot8Bf16(__ldcg(kr + c), qv);
        }
      }
      s = dot * scale;
    }
    const float new_max = fmaxf(run_max, BlockMax(s, scratch));
    const float e = p < count ? expf(s - new_max) : 0.f;
    weights[t] = e;
    const float chunk_sum = BlockSum(e, scratch);  // its barriers publish weights[]
    const float rescale = run_max == -INFINITY ? 0.f : expf(run_max - new_max);
    run_sum = run_sum * rescale + chunk_sum;
    run_max = new_max;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= rescale;
    const int in_chunk = min(kThreads, count - c0);
#pragma unroll 4
    for (int j = key_group; j < in_chunk; j += key_groups) {
      const int pp = c0 + j;
      const float w = weights[j];
      if (pp == pos) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += w * vn[d0 + i];
      } else {
        const uint4 raw_v = __ldcg(reinterpret_cast<const uint4*>(values + static_cast<int64_t>(pp) * kv_dim + d0));
        const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&raw_v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(v2[i]);
          acc[2 * i] += w * f.x;
          acc[2 * i + 1] += w * f.y;
        }
      }
    }
    __syncthreads();  // weights[] is rewritten by the next chunk
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) partial[key_group * hd + d0 + i] = acc[i];
  __syncthreads();
  if (t < hd) {
    float out = 0.f;
    for (int g = 0; g < key_groups; ++g) out += partial[g * hd + t];
    a.attn[head * hd + t] = out / run_sum;
  }
  __syncthreads();  // xs is reused by the block's next head
}
#endif

// Shared memory: [staged activations][16 warp rings]; the mbarriers and the routing are static.
__global__ void __launch_bounds__(kThreads, 1)
    PersistentDecodeKernel(PersistentDecodeArgs a, int stage_floats, int ring_bytes) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kWarps][kInFlight];
  __shared__ Routing routing;
  __shared__ float scratch[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const PersistentLayer* layers = a.layers;
  const int num_layers = a.num_layers, num_experts = a.shape.num_experts;
  Dims d;
  d.hidden = a.shape.hidden;
  d.head_dim = a.shape.head_dim;
  d.q_dim = a.shape.q_heads * d.head_dim;
  d.kv_dim = a.shape.kv_heads * d.head_dim;
  d.gw = blockIdx.x * kWarps + warp;
  d.warps = gridDim.x * kWarps;
  float* xs = reinterpret_cast<float*>(smem);
  Ring r;
  r.base = smem + static_cast<size_t>(stage_floats) * sizeof(float) + static_cast<size_t>(warp) * ring_bytes;
  r.full = full[warp];
  r.bytes = ring_bytes;
  r.next = {0, kQkv, 0, 0};
  if (lane == 0) {
    for (int i = 0; i < kInFlight; ++i) BarrierInit(&full[warp][i], 1);
    FenceBarrierInit();
  }
  if (threadIdx.x == 0) routing.layer = -1;
  __syncthreads();
  Settle(r.next, layers, num_layers, d, num_experts);  // a warp with no q/k/v row starts later
  Pump(r, layers, num_layers, d, num_experts, routing);
  auto consume = [&](int elems, const float* x) {
    return ConsumeUnit(r, layers, num_layers, d, num_experts, routing, elems, x);
  };
  auto stamp = [&](int event) {  // TEST ONLY timeline
    if (a.timeline && threadIdx.x == 0) {
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      a.timeline[static_cast<int64_t>(blockIdx.x) * PersistentTimelineEvents(num_layers) + event] = now;
    }
  };
  stamp(0);
  // The barrier ending phase `phase` of layer `layer`, stamped on both sides.
  auto sync = [&](unsigned* count, int layer, int phase) {
    Pump(r, layers, num_layers, d, num_experts, routing);
    stamp(1 + (layer * kPhaseCount + phase) * 2);
    GridSync(a.barrier, count);
    stamp(2 + (layer * kPhaseCount + phase) * 2);
  };
  const int pos = *a.position;
  unsigned barriers = 0;
  for (int l = 0; l < num_layers; ++l) {
    const PersistentLayer& L = layers[l];
    if (l > 0) sync(&barriers, l - 1, kDown);  // the previous layer's down projection is in x
    // q, k, v = RMSNorm(x) . [Wq | Wk | Wv]^T
    float inv = StageNormed(a.x, L.input_norm, a.norm_dtype, d.hidden, a.eps, xs, scratch);
    for (int t = 0, n = TasksOf(d.q_dim + 2 * d.kv_dim, d); t < n; ++t) {
      float acc = 0.f;
      for (int u = 0; u < UnitsOfRow(d.hidden); ++u)
        acc += consume(UnitElems(d.hidden, u), xs + u * kUnitElems);
      acc = WarpSum(acc) * inv;
      if (lane == 0) a.qkv[d.gw + t * d.warps] = acc;
    }
    sync(&barriers, l, kQkv);
    for (int head = blockIdx.x; head < a.shape.q_heads; head += gridDim.x)
      AttendHead(a, L, l, head, pos, xs, scratch);
    sync(&barriers, l, kAttention);
    // x += o_scale * attn . Wo^T
    Stage(a.attn, d.q_dim, xs);
    for (int t = 0, n = TasksOf(d.hidden, d); t < n; ++t) {
      float acc = 0.f;
      for (int u = 0; u < UnitsOfRow(d.q_dim); ++u)
        acc += consume(UnitElems(d.q_dim, u), xs + u * kUnitElems);
      acc = WarpSum(acc);
      const int row = d.gw + t * d.warps;
      if (lane == 0) a.x[row] = __ldcg(a.x + row) + L.o_scale * acc;
    }
    sync(&barriers, l, kO);
    inv = StageNormed(a.x, L.post_norm, a.norm_dtype, d.hidden, a.eps, xs, scratch);
    if (L.router) {  // logits = RMSNorm(x) . Wr^T, then every block picks the same top-k
      for (int t = 0, n = TasksOf(num_experts, d); t < n; ++t) {
        float acc = 0.f;
        for (int u = 0; u < UnitsOfRow(d.hidden); ++u)
          acc += consume(UnitElems(d.hidden, u), xs + u * kUnitElems);
        acc = WarpSum(acc) * inv;
        if (lane == 0) a.logits[d.gw + t * d.warps] = acc;
      }
      sync(&barriers, l, kRouter);
      if (warp == 0) {
        int id;
        float weight;
        WarpTopK<kMaxExperts / 32>(a.logits, num_experts, L.top_k, a.renormalize, &id, &weight);
        if (lane < L.top_k) {
          routing.gate[lane] = L.gate[id];
          routing.up[lane] = L.up[id];
          routing.down[lane] = L.down[id];
          routing.weight[lane] = id == L.skip_expert ? 0.f : weight;
        }
      }
    } else if (threadIdx.x == 0) {  // a dense MLP: one "expert" of weight 1
      routing.gate[0] = L.gate[0];
      routing.up[0] = L.up[0];
      routing.down[0] = L.down[0];
      routing.weight[0] = 1.f;
    }
    __syncthreads();
    if (threadIdx.x == 0) routing.layer = l;
    __syncthreads();
    // h[slot, j] = silu(gate_slot[j] . xn) * (up_slot[j] . xn)
    const int per_row = UnitsOfRow(d.hidden);
    for (int t = 0, n = TasksOf(L.top_k * L.inter, d); t < n; ++t) {
      float gate = 0.f, up = 0.f;
      for (int u = 0; u < per_row; ++u) gate += consume(UnitElems(d.hidden, u), xs + u * kUnitElems);
      for (int u = 0; u < per_row; ++u) up += consume(UnitElems(d.hidden, u), xs + u * kUnitElems);
      gate = WarpSum(gate) * inv;
      up = WarpSum(up) * inv;
      if (lane == 0) a.h[d.gw + t * d.warps] = gate / (1.f + expf(-gate)) * up;
    }
    sync(&barriers, l, kGateUp);
    // x += sum_slot weight_slot * (Wd_slot . h_slot)
    Stage(a.h, L.top_k * L.inter, xs);
    for (int t = 0, n = TasksOf(d.hidden, d); t < n; ++t) {
      float acc = 0.f;
      for (int slot = 0; slot < L.top_k; ++slot) {
        float part = 0.f;
        for (int u = 0; u < UnitsOfRow(L.inter); ++u)
          part += consume(UnitElems(L.inter, u), xs + slot * L.inter + u * kUnitElems);
        acc += routing.weight[slot] * part;
      }
      acc = WarpSum(acc);
      const int row = d.gw + t * d.warps;
      if (lane == 0)
        a.x[row] = L.nan_after && row == 0 ? __int_as_float(0x7fc00000) : __ldcg(a.x + row) + acc;
    }
  }
  stamp(1 + ((num_layers - 1) * kPhaseCount + kDown) * 2);
#endif
}

int StageFloats(const PersistentDecodeShape& s) {
  const int q_dim = s.q_heads * s.head_dim;
  return std::max({s.hidden, q_dim, s.max_top_k * s.max_inter, 3 * s.head_dim + 9 * kThreads});
}

// Per-warp ring bytes left by the staged activations and the static shared memory.
int RingBytes(const PersistentDecodeShape& s) {
  int device = 0, optin = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaFuncAttributes attributes{};
  cudaFuncGetAttributes(&attributes, PersistentDecodeKernel);
  const int dynamic = optin - static_cast<int>(attributes.sharedSizeBytes) -
                      StageFloats(s) * static_cast<int>(sizeof(float));
  return dynamic / kWarps / 128 * 128;
}

}  // namespace

std::string PersistentDecodeUnsupported(const PersistentDecodeShape& s) {
  const int q_dim = s.q_heads * s.head_dim;
  if (s.hidden <= 0 || s.hidden % 8 || q_dim % 8 || s.max_inter % 8)
    return absl::StrCat("hidden (", s.hidden, "), q_dim (", q_dim, ") and the MLP widths (",
                        s.max_inter, ") must be multiples of 8 (16-byte rows)");
  if (s.head_dim % 32 || s.head_dim > 256)
    return absl::StrCat("head_dim ", s.head_dim, ": needs a multiple of 32 up to 256");
  if (s.kv_heads <= 0 || s.q_heads % s.kv_heads)
    return absl::StrCat("q_heads ", s.q_heads, " is not a multiple of kv_heads ", s.kv_heads);
  if (s.num_experts > kMaxExperts)
    return absl::StrCat(s.num_experts, " experts: the in-kernel top-k takes up to ", kMaxExperts);
  if (s.max_top_k > kMaxTopK)
    return absl::StrCat("top-k ", s.max_top_k, ": up to ", kMaxTopK);
  const int ring = RingBytes(s);
  if (ring < kMinRingBytes)
    return absl::StrCat("shared memory: ", ring, " bytes a warp ring after staging ",
                        StageFloats(s), " activations; needs ", kMinRingBytes);
  return "";
}

int PersistentDecodeBlocks() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

void PersistentDecode(const PersistentDecodeArgs& args, cudaStream_t stream) {
  const int stage_floats = StageFloats(args.shape), ring_bytes = RingBytes(args.shape);
  const size_t smem = static_cast<size_t>(stage_floats) * sizeof(float) +
                      static_cast<size_t>(kWarps) * ring_bytes;
  // Per call, not once: the size depends on the model (and the attribute is per device).
  cudaFuncSetAttribute(PersistentDecodeKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(smem));
  const int sms = PersistentDecodeBlocks();
  cudaMemsetAsync(args.barrier, 0, sizeof(unsigned), stream);
  // Cooperative: every block resident at once, or the launch fails (the grid barriers need it).
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(sms);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative;
  attribute[0].val.cooperative = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, PersistentDecodeKernel, args, stage_floats, ring_bytes);
}

}  // namespace infersweep::cuda
