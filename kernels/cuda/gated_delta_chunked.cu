// The chunked form of the gated delta rule (GatedDeltaChunked in gated_delta.h): a chunk-parallel
// pass that turns each chunk's tokens into the terms its state-dependent parts need, then a pass
// per (sequence, value head, state columns) that walks the chunks in order, carrying the state.
// The matrix products run on tensor cores as 3xTF32: each fp32 operand split into a TF32 high
// part and a TF32 remainder, a b = ah bh + ah bl + al bh (al bl, 2^-22 of the product, dropped),
// fp32 accumulate: products within a few fp32 ulps, so the value keeps the fp32 class.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gated_delta.cuh"

namespace infersweep::cuda {
namespace {

constexpr int kChunk = kGatedDeltaChunk;
static_assert(kChunk == 32, "the prepare kernel scans a chunk's decays across one warp's lanes");
constexpr int kPrepareThreads = 128;
constexpr int kStateThreads = 256;
constexpr int kRowPad = 4;  // [token][dim] and [dim][token] tiles: rows 4 floats longer

// ---- 3xTF32 products on mma.sync m16n8k8 (sm_80+). Fragment layouts are PTX's for
// mma.m16n8k8 .tf32 (.row.col): lane (g, t) = (lane / 4, lane % 4) holds A's (g, t), (g + 8, t),
// (g, t + 4), (g + 8, t + 4); B's (t, g), (t + 4, g); C's (g, 2t), (g, 2t + 1), (g + 8, 2t),
// (g + 8, 2t + 1).

struct Tf32Split {
  uint32_t hi, lo;
};
__device__ __forceinline__ Tf32Split SplitTf32(float x) {
  uint32_t hi, lo;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
  return {hi, lo};
}

__device__ __forceinline__ void MmaTf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += sum over k < depth of a(m0 + ., k) b(k, n0 + .), a 16 x 8 tile; depth % 8 == 0. The
// high-by-high products and the two corrections accumulate apart, two chains of MMAs, not one.
template <typename AFn, typename BFn>
__device__ __forceinline__ void MmaTile(float (&c)[4], int m0, int n0, int depth, const AFn& a,
                                        const BFn& b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float corr[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < depth; k0 += 8) {
    const Tf32Split a0 = SplitTf32(a(m0 + g, k0 + t)), a1 = SplitTf32(a(m0 + g + 8, k0 + t)),
                    a2 = SplitTf32(a(m0 + g, k0 + t + 4)),
                    a3 = SplitTf32(a(m0 + g + 8, k0 + t + 4));
    const Tf32Split b0 = SplitTf32(b(k0 + t, n0 + g)), b1 = SplitTf32(b(k0 + t + 4, n0 + g));
    const uint32_t hi[4] = {a0.hi, a1.hi, a2.hi, a3.hi}, lo[4] = {a0.lo, a1.lo, a2.lo, a3.lo};
    MmaTf32(corr, lo, b0.hi, b1.hi);
    MmaTf32(corr, hi, b0.lo, b1.lo);
    MmaTf32(c, hi, b0.hi, b1.hi);
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) c[r] += corr[r];
}

// out(m, n, sum over k < depth of a(m, k) b(k, n)) for every m < rows, n < cols, the block's
// warps taking the 16 x 8 output tiles in turn, warp `first_warp` the first tile (two products
// with no barrier between them can start on different warps); rows % 16 == 0, cols % 8 == 0,
// depth % 8 == 0. Each (m, n) is written by one lane. a and b read shared memory made ready.
template <typename AFn, typename BFn, typename OutFn>
__device__ __forceinline__ void BlockMatmul(int rows, int cols, int depth, const AFn& a,
                                            const BFn& b, const OutFn& out, int first_warp = 0) {
  const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  const int warp = ((threadIdx.x >> 5) + warps - first_warp) % warps;
  const int g = lane >> 2, t = lane & 3, tiles_n = cols / 8;
  for (int tile = warp; tile < rows / 16 * tiles_n; tile += warps) {
    const int m0 = tile / tiles_n * 16, n0 = tile % tiles_n * 8;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    MmaTile(c, m0, n0, depth, a, b);
    out(m0 + g, n0 + 2 * t, c[0]);
    out(m0 + g, n0 + 2 * t + 1, c[1]);
    out(m0 + g + 8, n0 + 2 * t, c[2]);
    out(m0 + g + 8, n0 + 2 * t + 1, c[3]);
  }
}

// 16-byte global load and shared store (offsets in whole 4-float units: dk, dv and the tiles'
// strides are multiples of 4).
__device__ __forceinline__ float4 Load4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void Store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

size_t PrepareSharedBytes(int dk, int dv) {
  const int tiles = 2 * kChunk * (dk + kRowPad) + kChunk * (dv + kRowPad) +
                    3 * kChunk * (kChunk + kRowPad) + 2 * kChunk;
  return static_cast<size_t>(tiles) * sizeof(float);
}
template <int kCols>
size_t StateSharedBytes(int dk) {
  const int tiles = dk * (kCols + 8) + 2 * kChunk * (dk + kRowPad) + dk * (kChunk + kRowPad) +
                    2 * kChunk * (kCols + 8);
  return static_cast<size_t>(tiles) * sizeof(float);
}

// grid (chunks, batch * Hv), 128 threads: chunk c of sequence seq, value head h. With G the
// chunk's cumulative log decay, A = beta_t e^(G_t - G_s) k_t.k_s (s < t), P = e^(G_t - G_s)
// q_t.k_s (s <= t) and T = (I + A)^-1, writes W = T (beta e^G K), U = T (beta V),
// Qeff = e^G Q - P W and G to the scratch, and the chunk's own output P U to `out`: the chunk's
// updates are then D = U - W S0 and its output Qeff S0 + P U, for the entering state S0.
__global__ void __launch_bounds__(kPrepareThreads)
    GatedDeltaChunkPrepareKernel(const float* mixed, int channels, const float* g,
                                 const float* beta, int n, int key_heads, int dk, int value_heads,
                                 int dv, GatedDeltaChunkScratch scratch, float* out) {
  extern __shared__ float smem[];
  const int seq = blockIdx.y / value_heads, h = blockIdx.y % value_heads;
  const int kh = h / (value_heads / key_heads), key_width = key_heads * dk;
  const int t0 = blockIdx.x * kChunk, len = min(kChunk, n - t0);
  const int ks = dk + kRowPad, vs = dv + kRowPad, cs = kChunk + kRowPad;
  float* k_s = smem;                                         // [kChunk][ks]: k, then beta e^G k
  float* q_s = k_s + kChunk * ks;                            // [kChunk][ks]
  float* v_s = q_s + kChunk * ks;                            // [kChunk][vs]: v, then beta v
  float* a_s = v_s + kChunk * vs;                            // [kChunk][cs]: A, then P T
  float* p_s = a_s + kChunk * cs;                            // [kChunk][cs]: P
  float* t_s = p_s + kChunk * cs;                            // [kChunk][cs]: T
  float* cum = t_s + kChunk * cs;                            // [kChunk]: G
  float* b_s = cum + kChunk;                                 // [kChunk]: beta
  const int64_t first = static_cast<int64_t>(seq) * n + t0;  // the chunk's first row
  // Tokens past the sequence's end are zeros (k, q, v, beta and g): their A, P, W and U rows are
  // zero and their G is the last token's, so they change nothing. A thread's 16-byte loads of
  // the three tiles are all issued before any store, so the block waits on memory about once.
  {
    constexpr int kLoads = kChunk * kGatedDeltaChunkedMaxHeadDim / 4 / kPrepareThreads;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    const int k_quads = dk / 4, v_quads = dv / 4;
    float4 kv[kLoads], qv[kLoads], vv[kLoads];
#pragma unroll
    for (int r = 0; r < kLoads; ++r) {
      const int idx = threadIdx.x + r * kPrepareThreads;
      const int tk = idx / k_quads, tv = idx / v_quads;
      const float* krow = mixed + (first + tk) * channels;
      const bool k_live = idx < kChunk * k_quads && tk < len,
                 v_live = idx < kChunk * v_quads && tv < len;
      kv[r] = k_live ? Load4(krow + key_width + kh * dk + idx % k_quads * 4) : zero;
      qv[r] = k_live ? Load4(krow + kh * dk + idx % k_quads * 4) : zero;
      vv[r] =
          v_live
              ? Load4(mixed + (first + tv) * channels + 2 * key_width + h * dv + idx % v_quads * 4)
              : zero;
    }
#pragma unroll
    for (int r = 0; r < kLoads; ++r) {
      const int idx = threadIdx.x + r * kPrepareThreads;
      if (idx < kChunk * k_quads) {
        const int t = idx / k_quads, i = idx % k_quads * 4;
        Store4(k_s + t * ks + i, kv[r]);
        Store4(q_s + t * ks + i, qv[r]);
      }
      if (idx < kChunk * v_quads) Store4(v_s + idx / v_quads * vs + idx % v_quads * 4, vv[r]);
    }
  }
  if (threadIdx.x < 32) {  // warp 0: G, the inclusive scan of g, a lane a token
    const int t = threadIdx.x;
    float x = t < len ? g[(first + t) * value_heads + h] : 0.f;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, offset);
      if (t >= offset) x += y;
    }
    cum[t] = x;
    b_s[t] = t < len ? beta[(first + t) * value_heads + h] : 0.f;
  }
  __syncthreads();

  // A below the diagonal, P on and below it (G_t - G_s <= 0 there: no overflow).
  BlockMatmul(
      kChunk, kChunk, dk, [&](int m, int k) { return k_s[m * ks + k]; },
      [&](int k, int s) { return k_s[s * ks + k]; },
      [&](int t, int s, float x) {
        a_s[t * cs + s] = s < t ? b_s[t] * expf(cum[t] - cum[s]) * x : 0.f;
      });
  BlockMatmul(
      kChunk, kChunk, dk, [&](int m, int k) { return q_s[m * ks + k]; },
      [&](int k, int s) { return k_s[s * ks + k]; },
      [&](int t, int s, float x) { p_s[t * cs + s] = s <= t ? expf(cum[t] - cum[s]) * x : 0.f; });
  __syncthreads();

  // T = (I + A)^-1, unit lower triangular: thread s solves column s by forward substitution,
  // T[t][s] = -sum over s <= m < t of A[t][m] T[m][s], in fp32 (a chunk's 5K FMAs).
  if (threadIdx.x < kChunk) {
    const int s = threadIdx.x;
    for (int t = 0; t < kChunk; ++t) {
      float x = t == s ? 1.f : 0.f;
      for (int m = s; m < t; ++m) x -= a_s[t * cs + m] * t_s[m * cs + s];
      t_s[t * cs + s] = x;
    }
  }
  __syncthreads();

  // beta e^G K and beta V in place; P T over A.
  for (int idx = threadIdx.x; idx < kChunk * dk; idx += blockDim.x) {
    const int t = idx / dk;
    k_s[t * ks + idx % dk] *= b_s[t] * expf(cum[t]);
  }
  for (int idx = threadIdx.x; idx < kChunk * dv; idx += blockDim.x) {
    const int t = idx / dv;
    v_s[t * vs + idx % dv] *= b_s[t];
  }
  BlockMatmul(
      kChunk, kChunk, kChunk, [&](int m, int k) { return p_s[m * cs + k]; },
      [&](int k, int s) { return t_s[k * cs + s]; },
      [&](int t, int s, float x) { a_s[t * cs + s] = x; });
  __syncthreads();

  auto at = [&](int t) { return (first + t) * value_heads + h; };  // row t's (row, head) index
  BlockMatmul(
      kChunk, dk, kChunk, [&](int t, int s) { return t_s[t * cs + s]; },
      [&](int s, int i) { return k_s[s * ks + i]; },
      [&](int t, int i, float x) {
        if (t < len) scratch.w[at(t) * dk + i] = x;
      });
  BlockMatmul(
      kChunk, dv, kChunk, [&](int t, int s) { return t_s[t * cs + s]; },
      [&](int s, int j) { return v_s[s * vs + j]; },
      [&](int t, int j, float x) {
        if (t < len) scratch.u[at(t) * dv + j] = x;
      });
  BlockMatmul(
      kChunk, dk, kChunk, [&](int t, int s) { return a_s[t * cs + s]; },
      [&](int s, int i) { return k_s[s * ks + i]; },
      [&](int t, int i, float x) {
        if (t < len) scratch.q[at(t) * dk + i] = expf(cum[t]) * q_s[t * ks + i] - x;
      });
  BlockMatmul(
      kChunk, dv, kChunk, [&](int t, int s) { return a_s[t * cs + s]; },
      [&](int s, int j) { return v_s[s * vs + j]; },
      [&](int t, int j, float x) {
        if (t < len) out[at(t) * dv + j] = x;
      });
  if (threadIdx.x < len) scratch.g[at(threadIdx.x)] = cum[threadIdx.x];
}

// One chunk's inputs to the state pass, held in registers from the chunk before: a thread's
// share of the W, Qeff and K tiles (16-byte loads, kLoads each), their decays' G and, for the
// first kChunk * kCols / 4 threads, four columns of one row of U and of the output so far.
template <int kCols>
struct ChunkInputs {
  static constexpr int kLoads = kChunk * kGatedDeltaChunkedMaxHeadDim / 4 / kStateThreads;
  static constexpr int kColQuads = kCols / 4, kRowQuads = kChunk * kColQuads;
  static_assert(kRowQuads <= kStateThreads, "a thread a quad of a chunk's U and output columns");
  float4 w[kLoads], q[kLoads], k[kLoads], u, out;
  float g[kLoads], g_last;
};

// grid (batch * Hv, dv / kCols), 256 threads: state columns j0 + [0, kCols) of sequence seq's
// value head h, in shared memory from the sequence's slot (zeros for a fresh sequence), through
// its chunks in order: D = U - W S, out += Qeff S, then S = e^(G_last) S +
// (e^(G_last - G) K)^T D; written back at the end. The chain is latency-bound (a chunk's
// products are 32 x kCols x 128 three times), so the next chunk's loads are issued before this
// chunk's products and land in registers while they run.
template <int kCols>
__global__ void __launch_bounds__(kStateThreads)
    GatedDeltaChunkStateKernel(const float* mixed, int channels, int n, int key_heads, int dk,
                               int value_heads, int dv, const int2* ragged,
                               GatedDeltaChunkScratch scratch, float* state, float* out) {
  using Inputs = ChunkInputs<kCols>;
  extern __shared__ float smem[];
  const int seq = blockIdx.x / value_heads, h = blockIdx.x % value_heads;
  const int j0 = blockIdx.y * kCols;
  const int kh = h / (value_heads / key_heads), key_width = key_heads * dk;
  const SequenceState own = StateOf(ragged, seq, n);
  // Row strides: 8 mod 32 floats for the tiles read as B fragments ((t, g) at t * stride + g),
  // 4 mod 32 for those read as A fragments ((g, t) at g * stride + t): 32 distinct banks.
  constexpr int ss = kCols + 8;
  const int ks = dk + kRowPad, cs = kChunk + kRowPad;
  float* s_s = smem;                // [dk][ss]: the state's columns
  float* w_s = s_s + dk * ss;       // [kChunk][ks]: W
  float* q_s = w_s + kChunk * ks;   // [kChunk][ks]: Qeff
  float* kt_s = q_s + kChunk * ks;  // [dk][cs]: e^(G_last - G_s) k_s, transposed
  float* d_s = kt_s + dk * cs;      // [kChunk][ss]: U, then D = U - W S
  float* o_s = d_s + kChunk * ss;   // [kChunk][ss]: Qeff S
  float* st = state + (static_cast<int64_t>(own.slot) * value_heads + h) * dk * dv + j0;
  for (int idx = threadIdx.x; idx < dk * kCols; idx += blockDim.x) {
    const int i = idx / kCols, j = idx % kCols;
    s_s[i * ss + j] = own.fresh ? 0.f : st[static_cast<int64_t>(i) * dv + j];
  }

  const int quads = dk / 4, items = kChunk * quads;  // a tile's 16-byte pieces
  const int row_t = threadIdx.x / Inputs::kColQuads, row_j = threadIdx.x % Inputs::kColQuads * 4;
  const bool row_thread = threadIdx.x < Inputs::kRowQuads;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  auto load = [&](int t0, Inputs& in) {
    const int len = min(kChunk, n - t0);
    const int64_t first = static_cast<int64_t>(seq) * n + t0;
    auto at = [&](int t) { return (first + t) * value_heads + h; };
    in.g_last = scratch.g[at(len - 1)];
#pragma unroll
    for (int r = 0; r < Inputs::kLoads; ++r) {
      const int idx = threadIdx.x + r * kStateThreads, t = idx / quads, i = idx % quads * 4;
      const bool live = idx < items && t < len;
      in.w[r] = live ? Load4(scratch.w + at(t) * dk + i) : zero;
      in.q[r] = live ? Load4(scratch.q + at(t) * dk + i) : zero;
      in.k[r] = live ? Load4(mixed + (first + t) * channels + key_width + kh * dk + i) : zero;
      in.g[r] = live ? scratch.g[at(t)] : 0.f;
    }
    const bool row_live = row_thread && row_t < len;
    in.u = row_live ? Load4(scratch.u + at(row_t) * dv + j0 + row_j) : zero;
    in.out = row_live ? Load4(out + at(row_t) * dv + j0 + row_j) : zero;
  };
  auto stash = [&](const Inputs& in) {  // registers to the tiles; dead tokens are zeros
#pragma unroll
    for (int r = 0; r < Inputs::kLoads; ++r) {
      const int idx = threadIdx.x + r * kStateThreads, t = idx / quads, i = idx % quads * 4;
      if (idx >= items) break;
      const float decay = expf(in.g_last - in.g[r]);  // G_last <= G: at most 1
      const float k4[4] = {in.k[r].x, in.k[r].y, in.k[r].z, in.k[r].w};
      Store4(w_s + t * ks + i, in.w[r]);
      Store4(q_s + t * ks + i, in.q[r]);
#pragma unroll
      for (int c = 0; c < 4; ++c) kt_s[(i + c) * cs + t] = decay * k4[c];
    }
    if (row_thread) Store4(d_s + row_t * ss + row_j, in.u);
  };

  Inputs next;
  load(0, next);
  for (int t0 = 0; t0 < n; t0 += kChunk) {
    const int len = min(kChunk, n - t0);
    stash(next);
    const float g_last = next.g_last;
    const float4 partial = next.out;  // this chunk's output so far (P U)
    if (t0 + kChunk < n) load(t0 + kChunk, next);
    __syncthreads();  // the tiles, and the state the previous chunk's update left
    BlockMatmul(
        kChunk, kCols, dk, [&](int t, int i) { return w_s[t * ks + i]; },
        [&](int i, int j) { return s_s[i * ss + j]; },
        [&](int t, int j, float x) { d_s[t * ss + j] -= x; });
    BlockMatmul(
        kChunk, kCols, dk, [&](int t, int i) { return q_s[t * ks + i]; },
        [&](int i, int j) { return s_s[i * ss + j]; },
        [&](int t, int j, float x) { o_s[t * ss + j] = x; }, kChunk / 16 * kCols / 8);
    __syncthreads();  // D and Qeff S are whole; nothing reads S until the update below is done
    if (row_thread && row_t < len) {
      const float4 o = Load4(o_s + row_t * ss + row_j);
      const int64_t row = (static_cast<int64_t>(seq) * n + t0 + row_t) * value_heads + h;
      Store4(out + row * dv + j0 + row_j,
             make_float4(partial.x + o.x, partial.y + o.y, partial.z + o.z, partial.w + o.w));
    }
    const float decay = expf(g_last);
    BlockMatmul(
        dk, kCols, kChunk, [&](int i, int s) { return kt_s[i * cs + s]; },
        [&](int s, int j) { return d_s[s * ss + j]; },
        [&](int i, int j, float x) { s_s[i * ss + j] = decay * s_s[i * ss + j] + x; });
    __syncthreads();  // the next chunk's tiles overwrite what this one read
  }
  for (int idx = threadIdx.x; idx < dk * kCols; idx += blockDim.x) {
    const int i = idx / kCols, j = idx % kCols;
    st[static_cast<int64_t>(i) * dv + j] = s_s[i * ss + j];
  }
}

}  // namespace

void GatedDeltaChunked(const float* mixed, const float* g, const float* beta,
                       const GatedDeltaShape& s, const GatedDeltaChunkScratch& scratch,
                       float* state, float* out, cudaStream_t stream) {
  static PerDeviceOnce configure;  // above the 48 KB default at the largest head sizes
  configure([] {
    constexpr int kMax = kGatedDeltaChunkedMaxHeadDim;
    cudaFuncSetAttribute(GatedDeltaChunkPrepareKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(PrepareSharedBytes(kMax, kMax)));
    cudaFuncSetAttribute(GatedDeltaChunkStateKernel<16>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(StateSharedBytes<16>(kMax)));
    cudaFuncSetAttribute(GatedDeltaChunkStateKernel<32>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(StateSharedBytes<32>(kMax)));
  });
  if (s.n <= 0 || s.batch <= 0) return;
  const int channels = s.conv_channels(), heads = s.batch * s.value_heads;
  LaunchPlain(GatedDeltaChunkPrepareKernel, dim3(CeilDiv(s.n, kChunk), heads), kPrepareThreads,
              PrepareSharedBytes(s.key_dim, s.value_dim), stream, mixed, channels, g, beta, s.n,
              s.key_heads, s.key_dim, s.value_heads, s.value_dim, scratch, out);
  // 32 state columns a block, or 16 where 32 would leave the GPU under two blocks an SM: the
  // chunk-to-chunk pass is a chain of dependent tiles, so its speed is the blocks side by side
  // (a 4096-token prompt of qwen3-next: 32 heads x 4 blocks of 128 chunks each, or x 8).
  const bool wide = s.value_dim % 32 == 0 && heads * (s.value_dim / 32) >= 256;
  if (wide)
    LaunchPlain(GatedDeltaChunkStateKernel<32>, dim3(heads, s.value_dim / 32), kStateThreads,
                StateSharedBytes<32>(s.key_dim), stream, mixed, channels, s.n, s.key_heads,
                s.key_dim, s.value_heads, s.value_dim, s.ragged, scratch, state, out);
  else
    LaunchPlain(GatedDeltaChunkStateKernel<16>, dim3(heads, s.value_dim / 16), kStateThreads,
                StateSharedBytes<16>(s.key_dim), stream, mixed, channels, s.n, s.key_heads,
                s.key_dim, s.value_heads, s.value_dim, s.ragged, scratch, state, out);
}

}  // namespace infersweep::cuda
