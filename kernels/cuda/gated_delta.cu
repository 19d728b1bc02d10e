#include <cooperative_groups.h>

#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/compute_capability.h"
#include "kernels/cuda/gated_delta.cuh"

namespace infersweep::cuda {
namespace {

constexpr int kMaxConvTaps = 8;

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Channel c's conv input at token t of the sequence whose rows start at first_row: from `in` for
// t >= 0, else (t in [-history, 0)) from the carried state st (oldest first), zeros for a fresh
// sequence.
__device__ __forceinline__ float ConvInputAt(const float* in, int64_t first_row, int t,
                                             int channels, int c, bool fresh, const float* st,
                                             int history) {
  if (t >= 0) return in[(first_row + t) * channels + c];
  return fresh ? 0.f : st[static_cast<int64_t>(t + history) * channels];
}

// grid (ceil(channels / 256), batch, segments), a thread a channel of one sequence's segment of
// `segment` tokens: its first taps - 1 inputs are the tokens before the segment (before the
// sequence: the carried state). Segments run side by side, so a long prompt is not one thread's
// chain of dependent loads a channel. With one segment the thread also writes the state; with
// more, ConvStateKernel does after them, since the first segment reads the state this would
// overwrite.
template <bool kSilu>
__global__ void CausalConvKernel(const float* in, int n, int channels, int taps, const void* w,
                                 DType w_dtype, const int2* ragged, int segment, float* state,
                                 float* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, seq = blockIdx.y;
  const int t0 = static_cast<int>(blockIdx.z) * segment;
  if (c >= channels) return;
  const int history = taps - 1;
  const SequenceState own = StateOf(ragged, seq, n);
  const int64_t first_row = static_cast<int64_t>(seq) * n;
  float weights[kMaxConvTaps], past[kMaxConvTaps];
  float* st = state + static_cast<int64_t>(own.slot) * history * channels + c;
#pragma unroll
  for (int j = 0; j < kMaxConvTaps; ++j) {
    weights[j] = j < taps ? LoadAsFloat(w, w_dtype, static_cast<int64_t>(c) * taps + j) : 0.f;
    // the token tap j reads before the segment's first
    past[j] = j < history ? ConvInputAt(in, first_row, t0 - history + j, channels, c, own.fresh, st,
                                        history)
                          : 0.f;
  }
  const int t_end = min(n, t0 + segment);
  for (int t = t0; t < t_end; ++t) {
    const int64_t r = first_row + t;
    const float x = in[r * channels + c];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxConvTaps - 1; ++j)
      if (j < history) acc += weights[j] * past[j];
    acc += weights[history] * x;
    out[r * channels + c] = kSilu ? acc * Sigmoid(acc) : acc;
#pragma unroll
    for (int j = 0; j < kMaxConvTaps - 1; ++j)
      if (j + 1 < history) past[j] = past[j + 1];
    if (history > 0) past[history - 1] = x;
  }
  if (gridDim.z == 1) {
#pragma unroll
    for (int j = 0; j < kMaxConvTaps; ++j)
      if (j < history) st[static_cast<int64_t>(j) * channels] = past[j];
  }
}

// grid (ceil(channels / 256), batch): the state after a segmented CausalConvKernel, each channel's
// last taps - 1 inputs (oldest first), from the sequence or, for a sequence shorter than that,
// partly from the state before it; each thread reads its old state before it writes.
__global__ void ConvStateKernel(const float* in, int n, int channels, int taps, const int2* ragged,
                                float* state) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, seq = blockIdx.y;
  if (c >= channels) return;
  const int history = taps - 1;
  const SequenceState own = StateOf(ragged, seq, n);
  float* st = state + static_cast<int64_t>(own.slot) * history * channels + c;
  float next[kMaxConvTaps];
#pragma unroll
  for (int j = 0; j < kMaxConvTaps; ++j) {
    next[j] = j < history ? ConvInputAt(in, static_cast<int64_t>(seq) * n, n - history + j,
                                        channels, c, own.fresh, st, history)
                          : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kMaxConvTaps; ++j)
    if (j < history) st[static_cast<int64_t>(j) * channels] = next[j];
}

__global__ void SiluKernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = x[i] * Sigmoid(x[i]);
}

// The log of a head's state decay: g = -exp(A_log) * softplus(a + dt_bias).
__device__ __forceinline__ float GatedDeltaLogDecay(float a, float dt_bias, float a_log) {
  const float x = a + dt_bias;
  const float softplus = x > 20.f ? x : log1pf(expf(x));
  return -expf(a_log) * softplus;
}

// grid (rows, ceil(2 Hk / 4)), 128 threads: a warp a q or k head vector (decode: the 32 vectors
// of qwen3-next over 8 blocks, one round each), then block y = 0's threads a value head's gates.
constexpr int kGatesWarps = 4;
__global__ void GatedDeltaGatesKernel(float* mixed, int channels, int key_heads, int dk,
                                      int value_heads, const float* a, const float* b,
                                      const void* a_log, DType a_log_dtype, const void* dt_bias,
                                      DType dt_bias_dtype, float* g, float* beta) {
  const int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* r = mixed + static_cast<int64_t>(row) * channels;
  const float q_scale = 1.f / sqrtf(static_cast<float>(dk));
  if (const int vec = blockIdx.y * kGatesWarps + warp; vec < 2 * key_heads) {
    float* x = r + static_cast<int64_t>(vec) * dk;
    float sum_sq = 0.f;
    for (int i = lane; i < dk; i += 32) sum_sq += x[i] * x[i];
    const float inv = 1.f / sqrtf(WarpSum(sum_sq) + 1e-6f);
    const bool is_q = vec < key_heads;
    for (int i = lane; i < dk; i += 32) x[i] = is_q ? x[i] * inv * q_scale : x[i] * inv;
  }
  if (blockIdx.y != 0) return;
  for (int h = threadIdx.x; h < value_heads; h += blockDim.x) {
    const int64_t i = static_cast<int64_t>(row) * value_heads + h;
    beta[i] = Sigmoid(b[i]);
    g[i] = GatedDeltaLogDecay(a[i], LoadAsFloat(dt_bias, dt_bias_dtype, h),
                              LoadAsFloat(a_log, a_log_dtype, h));
  }
}

// grid batch * Hv, dv threads: thread j walks column j of its head's state through the tokens.
__global__ void GatedDeltaReferenceKernel(const float* mixed, int channels, const float* g,
                                          const float* beta, int n, int key_heads, int dk,
                                          int value_heads, int dv, const int2* ragged, float* state,
                                          float* out) {
  const int seq = blockIdx.x / value_heads, h = blockIdx.x % value_heads, j = threadIdx.x;
  const int kh = h / (value_heads / key_heads);
  const int key_width = key_heads * dk;
  const SequenceState own = StateOf(ragged, seq, n);
  float* s = state + (static_cast<int64_t>(own.slot) * value_heads + h) * dk * dv + j;
  if (own.fresh)
    for (int i = 0; i < dk; ++i) s[static_cast<int64_t>(i) * dv] = 0.f;
  for (int t = 0; t < n; ++t) {
    const int64_t row = static_cast<int64_t>(seq) * n + t;
    const float* q = mixed + row * channels + kh * dk;
    const float* k = q + key_width;
    const float v = mixed[row * channels + 2 * key_width + h * dv + j];
    const float decay = expf(g[row * value_heads + h]);
    float kv = 0.f;
    for (int i = 0; i < dk; ++i) {
      s[static_cast<int64_t>(i) * dv] *= decay;
      kv += s[static_cast<int64_t>(i) * dv] * k[i];
    }
    const float d = beta[row * value_heads + h] * (v - kv);
    float o = 0.f;
    for (int i = 0; i < dk; ++i) {
      s[static_cast<int64_t>(i) * dv] += k[i] * d;
      o += s[static_cast<int64_t>(i) * dv] * q[i];
    }
    out[row * value_heads * dv + h * dv + j] = o;
  }
}

// One token of the gated delta rule on a state column held by kGatedDeltaLanesPerColumn lanes,
// rows part, part + 8, ... of it in `col` (per_lane of them): col *= decay; d = beta (v - col.k);
// col += k d; returns col.q summed over the column's lanes (each of them gets the sum). q and k
// point at the lane's first row; inactive lanes pass v = 0 and still take part in the shuffles.
template <int kRows>
__device__ __forceinline__ float DeltaRuleColumnStep(float (&col)[kRows], int per_lane,
                                                     const float* q, const float* k, float v,
                                                     float decay, float beta) {
  constexpr int kLanes = kGatedDeltaLanesPerColumn;
  float kv = 0.f;
#pragma unroll
  for (int m = 0; m < kRows; ++m)
    if (m < per_lane) {
      col[m] *= decay;
      kv += col[m] * k[kLanes * m];
    }
#pragma unroll
  for (int offset = 1; offset < kLanes; offset <<= 1)
    kv += __shfl_xor_sync(0xffffffffu, kv, offset);
  const float d = beta * (v - kv);
  float o = 0.f;
#pragma unroll
  for (int m = 0; m < kRows; ++m)
    if (m < per_lane) {
      col[m] += k[kLanes * m] * d;
      o += col[m] * q[kLanes * m];
    }
#pragma unroll
  for (int offset = 1; offset < kLanes; offset <<= 1) o += __shfl_xor_sync(0xffffffffu, o, offset);
  return o;
}

constexpr int kFusedColumns = 32;                                // state columns a block
constexpr int kFusedLanesPerColumn = kGatedDeltaLanesPerColumn;  // threads a column
constexpr int kFusedMaxRowsPerLane = kGatedDeltaMaxRowsPerLane;  // dk <= 256

// grid (batch * Hv, ceil(dv / 32)), 256 threads: lane group c (8 lanes) owns column
// blockIdx.y * 32 + c, lane p of it rows p, p + 8, ... of that column, in registers.
__global__ void __launch_bounds__(kFusedColumns* kFusedLanesPerColumn)
    GatedDeltaFusedKernel(const float* mixed, int channels, const float* g, const float* beta,
                          int n, int key_heads, int dk, int value_heads, int dv, const int2* ragged,
                          float* state, float* out) {
  const int seq = blockIdx.x / value_heads, h = blockIdx.x % value_heads;
  const SequenceState own = StateOf(ragged, seq, n);
  const int part = threadIdx.x % kFusedLanesPerColumn;
  const int j = blockIdx.y * kFusedColumns + threadIdx.x / kFusedLanesPerColumn;
  const bool active = j < dv;  // inactive lanes still take part in the shuffles
  const int kh = h / (value_heads / key_heads);
  const int key_width = key_heads * dk, per_lane = dk / kFusedLanesPerColumn;
  float* s =
      state + (static_cast<int64_t>(own.slot) * value_heads + h) * dk * dv + (active ? j : 0);
  float col[kFusedMaxRowsPerLane];
#pragma unroll
  for (int m = 0; m < kFusedMaxRowsPerLane; ++m)
    col[m] = m < per_lane && active && !own.fresh
                 ? s[static_cast<int64_t>(part + kFusedLanesPerColumn * m) * dv]
                 : 0.f;
  for (int t = 0; t < n; ++t) {
    const int64_t row = static_cast<int64_t>(seq) * n + t;
    const float* q = mixed + row * channels + kh * dk + part;
    const float* k = q + key_width;
    const float v = active ? mixed[row * channels + 2 * key_width + h * dv + j] : 0.f;
    const float o = DeltaRuleColumnStep(col, per_lane, q, k, v, expf(g[row * value_heads + h]),
                                        beta[row * value_heads + h]);
    if (active && part == 0) out[row * value_heads * dv + h * dv + j] = o;
  }
  if (!active) return;
#pragma unroll
  for (int m = 0; m < kFusedMaxRowsPerLane; ++m)
    if (m < per_lane) s[static_cast<int64_t>(part + kFusedLanesPerColumn * m) * dv] = col[m];
}

constexpr int kDecodeRows = kGatedDeltaDecodeMaxRowsPerLane;
constexpr int kDecodeLanes = kGatedDeltaLanesPerColumn;
constexpr int kDecodeMaxThreads = kDecodeLanes * kGatedDeltaDecodeMaxColumns;
constexpr int kDecodeMaxKeyDim = kDecodeLanes * kDecodeRows;  // dk <= 128

constexpr int kDecodeSplit = 4;  // blocks (one cluster) a value head on sm_90

// Threads a GatedDeltaDecodeKernel block holding `columns` of the head's state: 8 a column, and
// at least one a conv channel (the key head's 2 dk and the block's v channels).
int DecodeThreads(const GatedDeltaShape& s, int columns) {
  return std::max(kDecodeLanes * CeilDiv(columns, 32) * 32,
                  CeilDiv(2 * s.key_dim + columns, 32) * 32);
}

// The sum of `mine` over the kSplit blocks of this block's cluster, in rank order, so every
// block gets the same total: each block's value in its shared memory, read by the others
// through distributed shared memory (sm_90). Every thread of every block calls it.
template <int kSplit>
__device__ __forceinline__ float ClusterSum(float mine) {
  if constexpr (kSplit == 1) {
    return mine;
  } else {
#if __CUDA_ARCH__ >= 900
    __shared__ float value;
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    if (threadIdx.x == 0) value = mine;
    cluster.sync();
    float total = 0.f;
#pragma unroll
    for (int r = 0; r < kSplit; ++r) total += *cluster.map_shared_rank(&value, r);
    cluster.sync();  // no block leaves while another still reads its value
    return total;
#else
    return mine;  // never launched: GatedDeltaDecode splits heads only on sm_90 and later
#endif
  }
}

// ---- Pieces of both decode kernels: a block convolves key head kh's 2 dk q/k channels and
// some of value head h's v channels (its "conv channels": index i < 2 dk + the v channels it
// holds), from the conv state.

// The conv channel behind a block's index i: q (i < dk) or k of key head kh, else the v channel
// v_first + i - 2 dk.
__device__ __forceinline__ int DecodeConvChannel(int i, int dk, int kh, int key_width,
                                                 int v_first) {
  return i >= 2 * dk ? v_first + (i - 2 * dk)
                     : (i < dk ? kh * dk + i : key_width + kh * dk + (i - dk));
}

// One conv channel's taps and its earlier inputs past[i < taps - 1], oldest first (zeros for a
// fresh sequence); loaded before the PDL wait (weights, and history from earlier steps).
struct DecodeConvTaps {
  float w[kMaxConvTaps], past[kMaxConvTaps];
};
// Zeros where the thread convolves no channel (`convolves` false).
__device__ __forceinline__ DecodeConvTaps LoadDecodeConvTaps(bool convolves, const MatrixRef& conv,
                                                             const float* history, int channels,
                                                             int c, int taps, bool fresh) {
  DecodeConvTaps tap;
#pragma unroll
  for (int i = 0; i < kMaxConvTaps; ++i) {
    tap.w[i] = tap.past[i] = 0.f;
    if (!convolves || i >= taps) continue;
    tap.w[i] = LoadAsFloat(conv.data, conv.dtype, static_cast<int64_t>(c) * taps + i);
    if (i + 1 < taps && !fresh) tap.past[i] = history[static_cast<int64_t>(i) * channels + c];
  }
  return tap;
}

// Conv + SiLU of the new input x, summed in CausalConvKernel's order.
__device__ __forceinline__ float DecodeConvSilu(const DecodeConvTaps& tap, float x, int taps) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxConvTaps; ++i) {
    if (i + 1 < taps) acc += tap.w[i] * tap.past[i];
    if (i + 1 == taps) acc += tap.w[i] * x;
  }
  return acc * Sigmoid(acc);
}

// The channel's history advanced past x: [h1, ..., h(K-2), x].
__device__ __forceinline__ void AdvanceDecodeConvHistory(float* history, int channels, int c,
                                                         const DecodeConvTaps& tap, float x,
                                                         int taps) {
#pragma unroll
  for (int i = 0; i + 1 < kMaxConvTaps; ++i)
    if (i + 1 < taps)
      history[static_cast<int64_t>(i) * channels + c] = i + 2 < taps ? tap.past[i + 1] : x;
}

// Warp 0 normalises q (and scales it by dk^-0.5), warp 1 k; qk holds q then k.
__device__ __forceinline__ void NormaliseDecodeQk(float* qk, int dk, int warp, int lane) {
  float* vec = qk + warp * dk;
  float sum_sq = 0.f;
  for (int i = lane; i < dk; i += 32) sum_sq += vec[i] * vec[i];
  const float inv = 1.f / sqrtf(WarpSum(sum_sq) + 1e-6f);
  const float q_scale = 1.f / sqrtf(static_cast<float>(dk));
  for (int i = lane; i < dk; i += 32) vec[i] = warp == 0 ? vec[i] * inv * q_scale : vec[i] * inv;
}

// This block has read key head kh's q/k history for its sequence; whether it is the last of the
// `readers` blocks that do (it then advances that history: gated_delta.h). One thread calls it.
__device__ __forceinline__ bool LastKeyHeadReader(unsigned* arrivals, unsigned readers) {
  __threadfence();
  const bool last = atomicAdd(arrivals, 1u) == readers - 1;
  if (last) {
    atomicExch(arrivals, 0u);
    __threadfence();
  }
  return last;
}

template <int kSplit>
__global__ void __launch_bounds__(kDecodeMaxThreads)
    GatedDeltaDecodeKernel(GatedDeltaDecodeOperands ops, int key_heads, int dk, int value_heads,
                           int dv, int taps, const int2* ragged) {
  __shared__ float qk[2 * kDecodeMaxKeyDim];  // q then k, normalised
  __shared__ float vs[kGatedDeltaDecodeMaxColumns];
  __shared__ float scratch[32];
  __shared__ bool last_arrival;
  // Block (seq, h, slice) holds the head's state columns [slice * columns, +columns).
  const int head_block = blockIdx.x / kSplit, slice = blockIdx.x % kSplit;
  const int seq = head_block / value_heads, h = head_block % value_heads;
  const int ratio = value_heads / key_heads, kh = h / ratio;
  const int key_width = key_heads * dk, channels = 2 * key_width + value_heads * dv;
  const int columns = dv / kSplit;
  const SequenceState own = StateOf(ragged, seq, 1);
  const int t = threadIdx.x, part = t % kDecodeLanes, local = t / kDecodeLanes;
  const bool active = local < columns;  // inactive lanes still take part in the shuffles
  const int j = slice * columns + local;
  const int per_lane = dk / kDecodeLanes;

  float* s =
      ops.state + (static_cast<int64_t>(own.slot) * value_heads + h) * dk * dv + (active ? j : 0);
  float col[kDecodeRows];
#pragma unroll
  for (int m = 0; m < kDecodeRows; ++m)
    col[m] = m < per_lane && active && !own.fresh
                 ? s[static_cast<int64_t>(part + kDecodeLanes * m) * dv]
                 : 0.f;
  // Thread t convolves the block's conv channel t.
  const bool convolves = t < 2 * dk + columns, is_v = t >= 2 * dk;
  const int c = DecodeConvChannel(t, dk, kh, key_width, 2 * key_width + h * dv + slice * columns);
  float* history = ops.conv_state + static_cast<int64_t>(own.slot) * (taps - 1) * channels;
  const DecodeConvTaps tap =
      LoadDecodeConvTaps(convolves, ops.conv, history, channels, c, taps, own.fresh);
  const float norm_gain = active ? LoadAsFloat(ops.norm.data, ops.norm.dtype, j) : 0.f;
  const float dt_bias = LoadAsFloat(ops.dt_bias.data, ops.dt_bias.dtype, h);
  const float a_log = LoadAsFloat(ops.a_log.data, ops.a_log.dtype, h);

  WaitForPrerequisites();  // x, a, b and z are the in_proj GEMVs' outputs
  AllowDependentsToLaunch();
  const int64_t gate_at = static_cast<int64_t>(seq) * value_heads + h;
  const float x_c = convolves ? ops.projected[static_cast<int64_t>(seq) * channels + c] : 0.f;
  const float a_in = ops.a[gate_at], b_in = ops.b[gate_at];
  const float z = active ? ops.z[gate_at * dv + j] : 0.f;

  // The v history is this block's alone and advances at once.
  if (convolves) {
    const float y = DecodeConvSilu(tap, x_c, taps);
    if (is_v) {
      vs[t - 2 * dk] = y;
      AdvanceDecodeConvHistory(history, channels, c, tap, x_c, taps);
    } else {
      qk[t] = y;
    }
  }
  // g and beta, as GatedDeltaGatesKernel (every thread its own copy).
  const float decay = expf(GatedDeltaLogDecay(a_in, dt_bias, a_log));
  const float beta = Sigmoid(b_in);
  __syncthreads();  // every q/k history read of this block is done

  const int warp = t >> 5, lane = t & 31;
  if (warp < 2) {
    NormaliseDecodeQk(qk, dk, warp, lane);
  } else if (warp == 2 && lane == 0) {
    last_arrival = LastKeyHeadReader(
        ops.key_head_arrivals + static_cast<int64_t>(seq) * key_heads + kh, ratio * kSplit);
  }
  __syncthreads();
  if (last_arrival && convolves && !is_v)
    AdvanceDecodeConvHistory(history, channels, c, tap, x_c, taps);

  // The delta rule for the one token, as GatedDeltaFusedKernel: the column sums over the 8 lanes
  // as shuffles.
  const float* q = qk + part;
  const float* k = qk + dk + part;
  const float v = active ? vs[local] : 0.f;
  const float o = DeltaRuleColumnStep(col, per_lane, q, k, v, decay, beta);

  // The gated RMSNorm over the head's dv outputs (a column's o is in each of its 8 lanes), the
  // block's columns summed, then the cluster's blocks.
  const float sum_sq = ClusterSum<kSplit>(BlockSum(active && part == 0 ? o * o : 0.f, scratch));
  const float inv = 1.f / sqrtf(sum_sq / dv + ops.eps);
  if (active && part == 0) ops.out[gate_at * dv + j] = o * inv * norm_gain * (z * Sigmoid(z));
  if (!active) return;
#pragma unroll
  for (int m = 0; m < kDecodeRows; ++m)
    if (m < per_lane) s[static_cast<int64_t>(part + kDecodeLanes * m) * dv] = col[m];
}

constexpr int kRowsThreads = 256;
constexpr int kRowsWarps = kRowsThreads / 32;
constexpr int kRowsPerWarp = kDecodeMaxKeyDim / kRowsWarps;
// Conv channels a thread takes: 2 dk + dv <= 384.
constexpr int kRowsConvPerThread =
    (2 * kDecodeMaxKeyDim + kGatedDeltaDecodeMaxColumns + kRowsThreads - 1) / kRowsThreads;

// The row layout: grid batch * Hv, 256 threads; block (seq, h) holds the head's whole [dk, dv]
// state, warp w rows [w dk / 8, (w + 1) dk / 8), lane l columns [4 l, 4 l + 4) as float4s, so a
// warp reads and writes each state row as dv contiguous floats (512 bytes at dv 128) where the
// column layout touches 16 bytes of each of 8 rows a warp access. Both column sums come from one
// pass over the old state (k.S for the update; q.S, since o = decay q.S + d (k.q) once S takes
// k d), summed over the 8 warps through shared memory. dv % 4 == 0.
__global__ void __launch_bounds__(kRowsThreads, 2)
    GatedDeltaDecodeRowsKernel(GatedDeltaDecodeOperands ops, int key_heads, int dk, int value_heads,
                               int dv, int taps, const int2* ragged) {
  constexpr int kMaxDv = kGatedDeltaDecodeMaxColumns;
  __shared__ float qk[2 * kDecodeMaxKeyDim];  // q then k, normalised
  __shared__ float vs[kMaxDv];
  __shared__ __align__(16) float partial[2][kRowsWarps][kMaxDv];  // k.S, q.S per warp
  __shared__ __align__(16) float delta[kMaxDv];
  __shared__ float scratch[32];
  __shared__ float k_dot_q;
  __shared__ bool last_arrival;
  const int seq = blockIdx.x / value_heads, h = blockIdx.x % value_heads;
  const int ratio = value_heads / key_heads, kh = h / ratio;
  const int key_width = key_heads * dk, channels = 2 * key_width + value_heads * dv;
  const SequenceState own = StateOf(ragged, seq, 1);
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const int rows = dk / kRowsWarps, first_row = warp * rows;
  const bool holds = 4 * lane < dv;  // this lane holds state columns

  float* s = ops.state + (static_cast<int64_t>(own.slot) * value_heads + h) * dk * dv + 4 * lane;
  float4 st[kRowsPerWarp];
#pragma unroll
  for (int m = 0; m < kRowsPerWarp; ++m)
    st[m] = m < rows && holds && !own.fresh
                ? *reinterpret_cast<const float4*>(s + static_cast<int64_t>(first_row + m) * dv)
                : make_float4(0.f, 0.f, 0.f, 0.f);
  // Thread t convolves the block's conv channels t, t + 256, ...
  const int conv_channels = 2 * dk + dv, v_first = 2 * key_width + h * dv;
  float* history = ops.conv_state + static_cast<int64_t>(own.slot) * (taps - 1) * channels;
  DecodeConvTaps tap[kRowsConvPerThread];
#pragma unroll
  for (int u = 0; u < kRowsConvPerThread; ++u) {
    const int i = t + u * kRowsThreads;
    tap[u] = LoadDecodeConvTaps(i < conv_channels, ops.conv, history, channels,
                                DecodeConvChannel(i, dk, kh, key_width, v_first), taps, own.fresh);
  }
  const float norm_gain = t < dv ? LoadAsFloat(ops.norm.data, ops.norm.dtype, t) : 0.f;
  const float dt_bias = LoadAsFloat(ops.dt_bias.data, ops.dt_bias.dtype, h);
  const float a_log = LoadAsFloat(ops.a_log.data, ops.a_log.dtype, h);

  WaitForPrerequisites();  // x, a, b and z are the in_proj GEMVs' outputs
  AllowDependentsToLaunch();
  const int64_t gate_at = static_cast<int64_t>(seq) * value_heads + h;
  const float a_in = ops.a[gate_at], b_in = ops.b[gate_at];
  const float z = t < dv ? ops.z[gate_at * dv + t] : 0.f;
  float x_c[kRowsConvPerThread];
#pragma unroll
  for (int u = 0; u < kRowsConvPerThread; ++u) {
    const int i = t + u * kRowsThreads;
    if (i >= conv_channels) continue;
    const int c = DecodeConvChannel(i, dk, kh, key_width, v_first);
    x_c[u] = ops.projected[static_cast<int64_t>(seq) * channels + c];
    const float y = DecodeConvSilu(tap[u], x_c[u], taps);
    if (i >= 2 * dk) {  // the v history is this block's alone and advances at once
      vs[i - 2 * dk] = y;
      AdvanceDecodeConvHistory(history, channels, c, tap[u], x_c[u], taps);
    } else {
      qk[i] = y;
    }
  }
  const float decay = expf(GatedDeltaLogDecay(a_in, dt_bias, a_log));
  const float beta = Sigmoid(b_in);
  __syncthreads();  // every q/k history read of this block is done

  if (warp < 2) {
    NormaliseDecodeQk(qk, dk, warp, lane);
  } else if (warp == 2 && lane == 0) {
    last_arrival = LastKeyHeadReader(
        ops.key_head_arrivals + static_cast<int64_t>(seq) * key_heads + kh, ratio);
  }
  __syncthreads();
  if (last_arrival) {
#pragma unroll
    for (int u = 0; u < kRowsConvPerThread; ++u)
      if (const int i = t + u * kRowsThreads; i < 2 * dk)
        AdvanceDecodeConvHistory(history, channels, DecodeConvChannel(i, dk, kh, key_width, 0),
                                 tap[u], x_c[u], taps);
  }
  if (warp == 0) {
    float kq = 0.f;
    for (int i = lane; i < dk; i += 32) kq += qk[i] * qk[dk + i];
    kq = WarpSum(kq);
    if (lane == 0) k_dot_q = kq;
  }
  // The warp's share of the column sums over the old state.
  float4 ks = make_float4(0.f, 0.f, 0.f, 0.f), qs = ks;
#pragma unroll
  for (int m = 0; m < kRowsPerWarp; ++m) {
    if (m >= rows) break;
    const float kr = qk[dk + first_row + m], qr = qk[first_row + m];
    ks.x += st[m].x * kr, ks.y += st[m].y * kr, ks.z += st[m].z * kr, ks.w += st[m].w * kr;
    qs.x += st[m].x * qr, qs.y += st[m].y * qr, qs.z += st[m].z * qr, qs.w += st[m].w * qr;
  }
  if (holds) {
    *reinterpret_cast<float4*>(&partial[0][warp][4 * lane]) = ks;
    *reinterpret_cast<float4*>(&partial[1][warp][4 * lane]) = qs;
  }
  __syncthreads();

  // Thread j < dv: column j's delta d = beta (v - decay k.S) and output decay q.S + d (k.q),
  // then the gated RMSNorm over the head's dv outputs.
  float o = 0.f;
  if (t < dv) {
    float k_s = 0.f, q_s = 0.f;
#pragma unroll
    for (int w = 0; w < kRowsWarps; ++w) k_s += partial[0][w][t], q_s += partial[1][w][t];
    const float d = beta * (vs[t] - decay * k_s);
    delta[t] = d;
    o = decay * q_s + d * k_dot_q;
  }
  const float sum_sq = BlockSum(o * o, scratch);  // its barriers publish delta
  const float inv = 1.f / sqrtf(sum_sq / dv + ops.eps);
  if (t < dv) ops.out[gate_at * dv + t] = o * inv * norm_gain * (z * Sigmoid(z));
  if (!holds) return;
  // S = decay S + k d, row by row.
  const float4 d = *reinterpret_cast<const float4*>(&delta[4 * lane]);
#pragma unroll
  for (int m = 0; m < kRowsPerWarp; ++m) {
    if (m >= rows) break;
    const float kr = qk[dk + first_row + m];
    const float4 next = make_float4(fmaf(kr, d.x, st[m].x * decay), fmaf(kr, d.y, st[m].y * decay),
                                    fmaf(kr, d.z, st[m].z * decay), fmaf(kr, d.w, st[m].w * decay));
    *reinterpret_cast<float4*>(s + static_cast<int64_t>(first_row + m) * dv) = next;
  }
}

// grid vectors, 128 threads.
__global__ void RmsNormGatedKernel(const float* x, const float* z, int dim, const void* gain,
                                   DType gain_dtype, float eps, float* out) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * dim;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) sum_sq += x[base + i] * x[base + i];
  const float inv = 1.f / sqrtf(BlockSum(sum_sq, scratch) / dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float gate = z[base + i];
    out[base + i] = x[base + i] * inv * LoadAsFloat(gain, gain_dtype, i) * (gate * Sigmoid(gate));
  }
}

// grid (rows, ceil(heads * d / 256)), 256 threads, an element a thread: at batch 1 one round of
// loads (the gate before the wait: q_proj wrote it kernels ago), not a loop of L2 round trips.
__global__ void SigmoidGateHeadsKernel(float* x, const float* gated, int gated_stride, int heads,
                                       int head_dim) {
  const int width = heads * head_dim, i = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t row = blockIdx.x;
  const int h = i / head_dim, d = i % head_dim;
  const float gate =
      i < width ? gated[row * gated_stride + static_cast<int64_t>(h) * 2 * head_dim + head_dim + d]
                : 0.f;
  WaitForPrerequisites();  // x is the attention's output, the kernel before this one
  AllowDependentsToLaunch();
  if (i < width) x[row * width + i] *= Sigmoid(gate);
}

__global__ void ScaleKernel(float* x, float factor, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] *= factor;
}

__global__ void SwapKernel(float* a, float* b, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float t = a[i];
    a[i] = b[i];
    b[i] = t;
  }
}

int ElementwiseBlocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>(CeilDiv(n, 256), 4096));
}

}  // namespace

void CausalConv(const float* in, const GatedDeltaShape& s, const MatrixRef& weight, bool fuse_silu,
                float* state, float* out, cudaStream_t stream) {
  // Segments of 64 tokens: a 4096-token prompt of qwen3-next (8,192 channels) is 32 x 64 blocks
  // of 64 steps, 268 MB of fp32 in and out, ~60 us at an H200's 4.46 TB/s.
  constexpr int kSegment = 64;
  const int channels = s.conv_channels(), segments = CeilDiv(s.n, kSegment);
  const dim3 grid(CeilDiv(channels, 256), s.batch, segments);
  auto* kernel = fuse_silu ? CausalConvKernel<true> : CausalConvKernel<false>;
  LaunchPlain(kernel, grid, 256, 0, stream, in, s.n, channels, s.kernel, weight.data, weight.dtype,
              s.ragged, kSegment, state, out);
  if (segments > 1)
    LaunchPlain(ConvStateKernel, dim3(grid.x, grid.y), 256, 0, stream, in, s.n, channels, s.kernel,
                s.ragged, state);
}

void SiluInPlace(float* x, int64_t n, cudaStream_t stream) {
  LaunchPlain(SiluKernel, ElementwiseBlocks(n), 256, 0, stream, x, n);
}

void GatedDeltaGates(float* mixed, const float* a, const float* b, const MatrixRef& a_log,
                     const MatrixRef& dt_bias, const GatedDeltaShape& s, float* g, float* beta,
                     cudaStream_t stream) {
  const dim3 grid(s.rows(), CeilDiv(2 * s.key_heads, kGatesWarps));
  LaunchPlain(GatedDeltaGatesKernel, grid, kGatesWarps * 32, 0, stream, mixed, s.conv_channels(),
              s.key_heads, s.key_dim, s.value_heads, a, b, a_log.data, a_log.dtype, dt_bias.data,
              dt_bias.dtype, g, beta);
}

void GatedDeltaReference(const float* mixed, const float* g, const float* beta,
                         const GatedDeltaShape& s, float* state, float* out, cudaStream_t stream) {
  LaunchPlain(GatedDeltaReferenceKernel, s.batch * s.value_heads, s.value_dim, 0, stream, mixed,
              s.conv_channels(), g, beta, s.n, s.key_heads, s.key_dim, s.value_heads, s.value_dim,
              s.ragged, state, out);
}

void GatedDeltaFused(const float* mixed, const float* g, const float* beta,
                     const GatedDeltaShape& s, float* state, float* out, cudaStream_t stream) {
  const dim3 grid(s.batch * s.value_heads, CeilDiv(s.value_dim, kFusedColumns));
  LaunchPlain(GatedDeltaFusedKernel, grid, kFusedColumns * kFusedLanesPerColumn, 0, stream, mixed,
              s.conv_channels(), g, beta, s.n, s.key_heads, s.key_dim, s.value_heads, s.value_dim,
              s.ragged, state, out);
}

GatedDeltaDecodeLayout GatedDeltaDecodeLayoutFor(const GatedDeltaShape& s) {
  return s.value_dim % 4 == 0 ? GatedDeltaDecodeLayout::kRows : GatedDeltaDecodeLayout::kColumns;
}

void GatedDeltaDecode(const GatedDeltaDecodeOperands& ops, const GatedDeltaShape& s,
                      cudaStream_t stream, GatedDeltaDecodeLayout layout) {
  if (layout == GatedDeltaDecodeLayout::kAuto) layout = GatedDeltaDecodeLayoutFor(s);
  if (layout == GatedDeltaDecodeLayout::kRows && s.value_dim % 4 == 0) {
    Launch(GatedDeltaDecodeRowsKernel, s.batch * s.value_heads, kRowsThreads, 0, stream, ops,
           s.key_heads, s.key_dim, s.value_heads, s.value_dim, s.kernel, s.ragged);
    return;
  }
  // sm_90: a head's columns over a cluster of kDecodeSplit blocks, 4x the SMs (the kernel is a
  // chain of dependent rounds; one 1,024-thread block a head leaves 100 of 132 SMs idle at
  // batch 1).
  static const bool clusters = [] {
    const absl::StatusOr<int> sm = CurrentComputeCapability("Gated DeltaNet decode");
    return sm.ok() && *sm >= 90;
  }();
  if (clusters && s.value_dim % kDecodeSplit == 0) {
    cudaLaunchAttribute attributes[2];
    attributes[0].id = cudaLaunchAttributeClusterDimension;
    attributes[0].val.clusterDim.x = kDecodeSplit;
    attributes[0].val.clusterDim.y = 1;
    attributes[0].val.clusterDim.z = 1;
    attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[1].val.programmaticStreamSerializationAllowed = 1;
    LaunchWithAttributes(GatedDeltaDecodeKernel<kDecodeSplit>,
                         s.batch * s.value_heads * kDecodeSplit,
                         DecodeThreads(s, s.value_dim / kDecodeSplit), 0, stream, attributes,
                         ProgrammaticLaunchFlag() ? 2 : 1, ops, s.key_heads, s.key_dim,
                         s.value_heads, s.value_dim, s.kernel, s.ragged);
    return;
  }
  Launch(GatedDeltaDecodeKernel<1>, s.batch * s.value_heads, DecodeThreads(s, s.value_dim), 0,
         stream, ops, s.key_heads, s.key_dim, s.value_heads, s.value_dim, s.kernel, s.ragged);
}

void RmsNormGated(const float* x, const float* z, int64_t vectors, int dim, const MatrixRef& gain,
                  float eps, float* out, cudaStream_t stream) {
  LaunchPlain(RmsNormGatedKernel, static_cast<int>(vectors), 128, 0, stream, x, z, dim, gain.data,
              gain.dtype, eps, out);
}

void SigmoidGateHeads(float* x, const float* gated, int gated_stride, int rows, int heads,
                      int head_dim, cudaStream_t stream) {
  const dim3 grid(rows, CeilDiv(heads * head_dim, 256));
  Launch(SigmoidGateHeadsKernel, grid, 256, 0, stream, x, gated, gated_stride, heads, head_dim);
}

void ScaleInPlace(float* x, float factor, int64_t n, cudaStream_t stream) {
  LaunchPlain(ScaleKernel, ElementwiseBlocks(n), 256, 0, stream, x, factor, n);
}

void SwapInPlace(float* a, float* b, int64_t n, cudaStream_t stream) {
  LaunchPlain(SwapKernel, ElementwiseBlocks(n), 256, 0, stream, a, b, n);
}

}  // namespace infersweep::cuda
