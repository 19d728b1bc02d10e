// The expert GEMMs of the grouped MoE on Hopper warpgroup MMAs (moe=wgmma). Machine code for
// sm_90a only (this folder's target): the registry gives moe=wgmma the SM range [90, 90].
//
// moe=fused's mma.sync kernels (moe_fused_mma.cu) stream an expert's weights through registers
// and re-read them for every 64 of its pairs, so there long prefill chunks go to cuBLAS's grouped
// GEMMs instead, with SiLU and a gather as separate kernels and a host sync per layer to learn
// the group sizes. These kernels keep MoeGrouped's device-side bucketing and compute
//   D[features, pairs] = W_e[features, K] . X[pairs, K]^T
// ("swap AB": the variable pair count of an expert is wgmma's N, 32 to 128 a tile, so an expert
// of up to 128 pairs costs one pass over its weights). A block owns 128 weight rows and up to 128
// of the expert's pairs; each warpgroup multiplies 64 of the rows. Gate and up rows interleave 8
// by 8, so a thread holds the gate and the up of the same feature and applies SiLU in registers.
// K goes in 64-wide chunks through a 3-stage cp.async ring of 128B-swizzled tiles (32 KB a stage)
// that wgmma reads through shared-memory descriptors, two chunks in flight ahead of the one being
// multiplied. 64 accumulator registers a thread and 97 KB of ring let two blocks share an SM, so
// one block's barriers, MMA waits, work-item lookup and epilogue hide under the other's
// streaming (one block an SM with 128 accumulators a thread is latency-bound). Work
// items (expert, 128-pair tile) are found from the offsets on the device: nothing reaches the
// host, and the launch is capturable.
//
// Quantized experts (qgemm=w8a16 / w4a16: FP8 tensor / channel, NVFP4, MXFP4) take the same
// tiles with the weights' codes in the ring instead of bf16 (half or a quarter of the bytes),
// their FP4 group scales beside them. Each K chunk the block decodes its codes into one bf16
// A tile (quant_decode.cuh's DecodeRun: exact; FP4 group scales multiply the weights, exactly),
// fences it for the async proxy, and multiplies it; what scales a whole row (FP8 tensor /
// channel, NVFP4's scale_2) multiplies the fp32 sums in the epilogue.
//
// Napkin math, qwen3-30b-a3b prefill of 2048 tokens (16,384 pairs, ~128 an expert): gate/up is
// 103 GFLOP over 805 MB of weights, down 52 GFLOP over 403 MB. 1.2 GB a layer is 270 us at
// 4.46 TB/s; 155 GFLOP is 157 us at 989 TFLOP/s: at ~128 pairs an expert the bound is bandwidth
// (a 128-pair warpgroup's 8 MMAs per K chunk take ~0.3 us on the SM's tensor cores, the chunk's
// 16 KB of weights ~0.55 us of the SM's share of DRAM bandwidth).
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/probe_kernels.h"
#include "kernels/cuda/quant_decode.cuh"
#include "kernels/cuda/sm90a/moe_wgmma.h"

namespace infersweep::cuda {
namespace {

constexpr int kThreads = 256;       // two warpgroups, 64 weight rows each
constexpr int kRowsPerTile = kMoeWgmmaRowsPerTile;  // weight rows a block owns (wgmma's A)
constexpr int kPairsPerTile = 128;  // pairs a block owns: wgmma's N (both groups)
constexpr int kChunk = kMoeWgmmaChunk;  // K elements a stage: one 128-byte row
constexpr int kStages = 3;
constexpr int kRowBytes = kChunk * 2;
constexpr int kATileBytes = kRowsPerTile * kRowBytes;   // 16 KB
constexpr int kBTileBytes = kPairsPerTile * kRowBytes;  // 16 KB

// The shared memory of format F's blocks. bf16 (kNone): stages of [A tile | B tile]. Quantized:
// stages of [B tile | the chunk's codes, row-major | FP4: each row's group scales, 4 bytes],
// then the one decoded bf16 A tile. Plus slack to align the ring to 1 KB; two blocks an SM
// (bf16 2 x 97 KB of the 227 KB, FP8 89 KB, FP4 81 KB).
// kE4M3 (qgemm=w8a8, FP8 tensor / channel): the codes go into the A tile as loaded, beside E4M3
// inputs in the B tile, 128 of them a 128-byte row: the bf16 layout, nothing decoded.
template <QuantFormat F, bool kE4M3 = false>
struct Layout {
  static constexpr bool kQuant = F != QuantFormat::kNone && !kE4M3;  // codes decoded to bf16
  static constexpr int kChunkElements = kE4M3 ? kMoeWgmmaFp8Chunk : kChunk;  // K a stage
  static constexpr int kCodeRowBytes = !kQuant ? 0 : IsFp4(F) ? kChunk / 2 : kChunk;
  static constexpr int kCodeTileBytes = kRowsPerTile * kCodeRowBytes;
  static constexpr int kScaleTileBytes = IsFp4(F) ? kRowsPerTile * 4 : 0;
  static constexpr int kStageBytes =
      kQuant ? (kBTileBytes + kCodeTileBytes + kScaleTileBytes + 1023) / 1024 * 1024
             : kATileBytes + kBTileBytes;
  static constexpr int kBOffset = kQuant ? 0 : kATileBytes;
  static constexpr int kSharedBytes = kStages * kStageBytes + (kQuant ? kATileBytes : 0) + 1024;
  static constexpr int DecodedOffset() { return kStages * kStageBytes; }  // quantized: the A tile
};

__device__ __forceinline__ int CeilDivDevice(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of 16-byte chunk c (0..7) of row r in a 128B-swizzled tile: the swizzle XORs the
// chunk index with the row's place in its 8-row (1 KB) group, as wgmma reads it back.
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

// wgmma's descriptor of a K-major, 128B-swizzled bf16 tile at shared `address` (its 8-row groups
// 1 KB apart; 1 KB aligned, plus 32 bytes per 16-wide K step inside the swizzle atom). The leading
// byte offset is unused by this layout (1 by convention).
__device__ __forceinline__ uint64_t TileDescriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CommitCopies() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// cp.async writes through the generic proxy and wgmma reads through the async proxy.
__device__ __forceinline__ void FenceSharedForAsyncProxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator reads and writes across the asynchronous MMAs.
__device__ __forceinline__ void PinAccumulators(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d[64 x N] += A[64 x K] . B[N x K]^T over one 32-byte K step: A and B K-major in shared memory
// (descriptors), bf16 (K 16) or, with kE4M3, E4M3 (K 32), fp32 accumulate, N in {32, 64, 96,
// 128}. Thread (warp w of the group, lane g * 4 + t) holds d[4j + 2h + q] = row 16w + g + 8h,
// column 8j + 2t + q (j < N / 8; the rest untouched).
// Every shape takes all 64 accumulators as operands %0-%63 (an N-column shape names the first
// N / 2 in its instruction; the rest stay untouched), the descriptors as %64 and %65, and the
// scale-d flag (1: accumulate) as %66. bf16 names its operands' (no) transposes; E4M3 has none.
#define INFERSWEEP_WGMMA(op, tail, accumulators)                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned." op    \
               " {" accumulators "}, %64, %65, p, 1, 1" tail ";\n}\n"                          \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),       \
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),     \
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
                 "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
                 "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
                 "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
                 "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                            \
               : "l"(a), "l"(b), "r"(1))
#define INFERSWEEP_ACC32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define INFERSWEEP_ACC64                                                     \
  INFERSWEEP_ACC32                                                           \
  ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, " \
  "%30, %31"
#define INFERSWEEP_ACC96                                                     \
  INFERSWEEP_ACC64                                                           \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
  "%46, %47"
#define INFERSWEEP_ACC128                                                    \
  INFERSWEEP_ACC96                                                           \
  ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
  "%62, %63"
#define INFERSWEEP_WGMMA_N(n, accumulators)                            \
  if constexpr (kE4M3)                                                 \
    INFERSWEEP_WGMMA("m64n" #n "k32.f32.e4m3.e4m3", "", accumulators); \
  else                                                                 \
    INFERSWEEP_WGMMA("m64n" #n "k16.f32.bf16.bf16", ", 0, 0", accumulators)
template <int kN, bool kE4M3>
__device__ __forceinline__ void WgmmaStep(float (&d)[64], uint64_t a, uint64_t b) {
  static_assert(kN == 32 || kN == 64 || kN == 96 || kN == 128, "wgmma N of this kernel");
  if constexpr (kN == 32) {
    INFERSWEEP_WGMMA_N(32, INFERSWEEP_ACC32);
  } else if constexpr (kN == 64) {
    INFERSWEEP_WGMMA_N(64, INFERSWEEP_ACC64);
  } else if constexpr (kN == 96) {
    INFERSWEEP_WGMMA_N(96, INFERSWEEP_ACC96);
  } else {
    INFERSWEEP_WGMMA_N(128, INFERSWEEP_ACC128);
  }
}
#undef INFERSWEEP_WGMMA_N
#undef INFERSWEEP_ACC128
#undef INFERSWEEP_ACC96
#undef INFERSWEEP_ACC64
#undef INFERSWEEP_ACC32
#undef INFERSWEEP_WGMMA

// One K chunk (one 128-byte row: 4 steps of 32 bytes, 16 bf16 or 32 E4M3 each): acc += the
// group's 64 rows of the A tile . kN pairs of the B tile.
template <int kN, bool kE4M3>
__device__ __forceinline__ void MmaChunk(float (&acc)[64], uint32_t a_rows, uint32_t b_tile) {
#pragma unroll
  for (int ks = 0; ks < kRowBytes / 32; ++ks)
    WgmmaStep<kN, kE4M3>(acc, TileDescriptor(a_rows + 32 * ks), TileDescriptor(b_tile + 32 * ks));
}

struct WorkItem {
  int expert;  // -1: past the last item
  int first;   // bucketed position of the tile's first pair
  int count;   // the tile's pairs, 1..kPairsPerTile
};

// Warp 0 finds work item `item`: the item-th (expert, 128-pair tile) in expert order. Each lane
// counts the tiles of its run of experts, a warp scan places the runs.
__device__ __forceinline__ void FindWorkItem(const int* offsets, int num_experts, int item,
                                             WorkItem* out) {
  const int lane = threadIdx.x & 31;
  const int per_lane = CeilDivDevice(num_experts, 32), e0 = lane * per_lane;
  int mine = 0;
  for (int i = 0; i < per_lane && e0 + i < num_experts; ++i)
    mine += CeilDivDevice(offsets[e0 + i + 1] - offsets[e0 + i], kPairsPerTile);
  int inclusive = mine;
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += u;
  }
  if (lane == 31 && item >= inclusive) out->expert = -1;
  int before = inclusive - mine;
  if (item < before || item >= inclusive) return;
  for (int i = 0; i < per_lane && e0 + i < num_experts; ++i) {
    const int e = e0 + i, first = offsets[e], pairs = offsets[e + 1] - first;
    const int tiles = CeilDivDevice(pairs, kPairsPerTile);
    if (item < before + tiles) {
      const int tile = item - before;
      *out = {e, first + tile * kPairsPerTile, min(kPairsPerTile, pairs - tile * kPairsPerTile)};
      return;
    }
    before += tiles;
  }
}

// One of the two GEMMs. Gate/up: input is the normalised x [rows, K] (pair p reads row p / k),
// w0/w1 gate/up [features = inter, K], result h [bucketed position, inter] in bf16. Down: input
// is that h, w0 down [features = hidden, K = inter], result out [pair index, hidden] in fp32.
struct ExpertGemm {
  const uint16_t* input = nullptr;
  int k = 1;
  const int* offsets = nullptr;
  const int* sorted_pairs = nullptr;
  int num_experts = 0;
  const uint16_t* const* w0 = nullptr;
  const uint16_t* const* w1 = nullptr;
  int features = 0, depth = 0;
  uint16_t* h = nullptr;
  float* out = nullptr;
  // Quantized: the codes and scales of w0 / w1 (which are then unused).
  QuantExpertTable q0, q1;
  // kE4M3: the input as E4M3 codes (rows as `input`'s) and a scale a row (input is unused).
  const uint8_t* input_fp8 = nullptr;
  const float* input_scale = nullptr;
  // A dense matrix (GemmFp8Wgmma), with offsets and sorted_pairs null: expert 0 over input rows
  // [0, dense_rows), block y the 128 rows from 128 y, each row's result at its own index.
  int dense_rows = 0;
};

__device__ __forceinline__ void CopyAsync4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// The cp.async copies of one thread. bf16 (and kE4M3's codes and inputs): 16-byte chunk `chunk` of
// tile rows r0 + 32 i, 4 rows of A (weights) and up to 4 of B (pairs; null past the tile's pairs,
// whose rows then stay stale). Quantized: B likewise, and 16-byte pieces of the codes (FP8 2 a
// thread, FP4 1), and for FP4 threads < 128 their row's 4 bytes of group scales.
template <QuantFormat F, bool kE4M3 = false>
struct TileCopies {
  using L = Layout<F, kE4M3>;
  static constexpr int kCodePiecesPerRow = L::kQuant ? L::kCodeRowBytes / 16 : 1;
  static constexpr int kCodeCopies = L::kQuant ? kRowsPerTile * kCodePiecesPerRow / kThreads : 0;
  const uint8_t* a_src[kRowsPerTile / 32];  // bf16 weights, or (kE4M3) codes
  const uint8_t* code_src[kCodeCopies > 0 ? kCodeCopies : 1];
  int code_dst[kCodeCopies > 0 ? kCodeCopies : 1];
  const uint8_t* scale_src = nullptr;
  const uint8_t* b_src[kPairsPerTile / 32];  // bf16 inputs, or (kE4M3) E4M3 codes
  uint32_t ring;  // the stage ring in shared memory, 1 KB aligned
  uint8_t* ring_generic;
  int chunk, r0;

  __device__ __forceinline__ void Issue(int step) const {  // K chunk `step` into its stage
    const uint32_t stage = ring + (step % kStages) * L::kStageBytes;
    const int64_t k0 = int64_t{step} * kRowBytes;  // byte offset: one 128-byte row a chunk
    if constexpr (L::kQuant) {
#pragma unroll
      for (int i = 0; i < kCodeCopies; ++i)
        CopyAsync16(stage + code_dst[i], code_src[i] + step * L::kCodeRowBytes);
      if constexpr (IsFp4(F)) {
        // NVFP4: groups 4 step .. 4 step + 3; MXFP4: the aligned pair of chunks' 2 + 2 bytes.
        if (scale_src)
          CopyAsync4(stage + kBTileBytes + L::kCodeTileBytes + 4 * threadIdx.x,
                     scale_src + (F == QuantFormat::kNvfp4 ? 4 * step : 2 * (step & ~1)));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kRowsPerTile / 32; ++i)
        CopyAsync16(stage + SwizzledOffset(r0 + 32 * i, chunk), a_src[i] + k0);
    }
#pragma unroll
    for (int j = 0; j < kPairsPerTile / 32; ++j)
      if (b_src[j])
        CopyAsync16(stage + L::kBOffset + SwizzledOffset(r0 + 32 * j, chunk), b_src[j] + k0);
  }

  // Quantized: the codes of K chunk `step` (landed in its stage) as exact bf16 weights into the
  // decoded A tile, 128B-swizzled as wgmma reads it; this thread's 8-weight pieces are chunk
  // `chunk` of rows r0 + 32 i, as the bf16 copies place them.
  __device__ __forceinline__ void Decode(int step) const {
    const uint8_t* stage = ring_generic + (step % kStages) * L::kStageBytes;
    const uint8_t* codes = stage + kBTileBytes;
    uint8_t* decoded = ring_generic + L::DecodedOffset();
#pragma unroll
    for (int i = 0; i < kRowsPerTile / 32; ++i) {
      const int row = r0 + 32 * i;
      uint4 run = make_uint4(0, 0, 0, 0);
      uint32_t scale_bits = 0;
      if constexpr (IsFp4(F)) {
        run.x = *reinterpret_cast<const uint32_t*>(codes + row * L::kCodeRowBytes + 4 * chunk);
        const uint8_t* scales = codes + L::kCodeTileBytes + 4 * row;
        scale_bits =
            F == QuantFormat::kNvfp4 ? scales[chunk / 2] : scales[2 * (step & 1) + chunk / 4];
      } else {
        const uint2 bytes =
            *reinterpret_cast<const uint2*>(codes + row * L::kCodeRowBytes + 8 * chunk);
        run.x = bytes.x;
        run.y = bytes.y;
      }
      *reinterpret_cast<uint4*>(decoded + SwizzledOffset(row, chunk)) =
          DecodeRun<F>(run, RunScalesOf<F>(scale_bits), 0);
    }
  }
};

// The K loop and epilogue of the block's tile, wgmma N = kN >= count. Warpgroup w multiplies A
// rows [64w, 64w + 64): for gate/up those interleave 8 gate and 8 up rows of the same features
// (the copies' row map), so a thread's accumulator rows 16q + g and 16q + g + 8 are the gate and
// the up of one feature, and SiLU(gate) * up happens in registers.
template <QuantFormat F, bool kGateUp, int kN, bool kE4M3>
__device__ __forceinline__ void ComputeTile(const ExpertGemm& a, const TileCopies<F, kE4M3>& copies,
                                            int e, int first, int count, int f0) {
  using L = Layout<F, kE4M3>;
  const int steps = a.depth / L::kChunkElements, group = threadIdx.x >> 7;
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  // kAhead chunks are in flight while one is multiplied; the other block on the SM covers this
  // block's barriers and MMA waits.
  constexpr int kAhead = kStages - 1;
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < steps) copies.Issue(s);
    CommitCopies();  // empty groups too: the wait below counts groups
  }
  for (int step = 0; step < steps; ++step) {
    WaitCopies<kAhead - 1>();  // this thread's copies of chunk `step` have landed
    if constexpr (!L::kQuant) FenceSharedForAsyncProxy();
    __syncthreads();  // everyone's have; every MMA on chunk step - 1 is done
    if (step + kAhead < steps) copies.Issue(step + kAhead);
    CommitCopies();
    const uint32_t stage = copies.ring + (step % kStages) * L::kStageBytes;
    uint32_t a_tile = stage;
    if constexpr (L::kQuant) {
      copies.Decode(step);  // into the decoded tile, free since the MMAs on step - 1 are done
      FenceSharedForAsyncProxy();  // the decoded tile and the landed B tile, for wgmma
      __syncthreads();
      a_tile = copies.ring + L::DecodedOffset();
    }
    WgmmaFence();
    MmaChunk<kN, kE4M3>(acc, a_tile + group * 64 * kRowBytes, stage + L::kBOffset);
    WgmmaCommit();
    WgmmaWait<0>();
  }
  WaitCopies<0>();
  PinAccumulators(acc);

  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
  // What scales a whole weight row (quantized; 1 for bf16): gate/up this thread's feature's
  // gate and up rows, down its two features. E4M3 codes were not decoded: their scale alone (not
  // the decode's 2^8), and each pair's input scale below.
  float factor[2] = {1.f, 1.f};
  if constexpr (L::kQuant || kE4M3) {
    const float decoded = kE4M3 ? 1.f / 256.f : 1.f;
    if constexpr (kGateUp) {
      const int feature = f0 + 32 * group + 8 * w + g;
      factor[0] = QuantRowFactor<F>(a.q0, e, feature) * decoded;
      factor[1] = QuantRowFactor<F>(a.q1, e, feature) * decoded;
    } else {
      const int feature = f0 + 64 * group + 16 * w + g;
      factor[0] = QuantRowFactor<F>(a.q0, e, feature) * decoded;
      factor[1] = QuantRowFactor<F>(a.q0, e, feature + 8) * decoded;
    }
  }
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int pair_in_tile = 8 * j + 2 * t + q;
      if (pair_in_tile >= count) continue;
      // kE4M3: the input row's scale (gate/up: the pair's row of x; down: its bucketed h row).
      float in_scale = 1.f;
      if constexpr (kE4M3)
        in_scale = a.input_scale[kGateUp ? a.sorted_pairs[first + pair_in_tile] / a.k
                                         : first + pair_in_tile];
      if constexpr (kGateUp) {
        const float gate = acc[4 * j + q] * factor[0] * in_scale,
                    up = acc[4 * j + 2 + q] * factor[1] * in_scale;
        a.h[static_cast<int64_t>(first + pair_in_tile) * a.features + f0 + 32 * group + 8 * w + g] =
            __bfloat16_as_ushort(__float2bfloat16_rn(gate / (1.f + expf(-gate)) * up));
      } else {
        const int64_t row =
            a.sorted_pairs ? a.sorted_pairs[first + pair_in_tile] : first + pair_in_tile;
        float* out = a.out + row * a.features + f0 + 64 * group + 16 * w + g;
        out[0] = acc[4 * j + q] * factor[0] * in_scale;
        out[8] = acc[4 * j + 2 + q] * factor[1] * in_scale;
      }
    }
  }
}

// grid (features / (kGateUp ? 64 : 128), work items), kThreads threads,
// Layout<F, kE4M3>::kSharedBytes.
template <QuantFormat F, bool kGateUp, bool kE4M3 = false>
__global__ void __launch_bounds__(kThreads, 2) ExpertGemmKernel(ExpertGemm a) {
  using L = Layout<F, kE4M3>;
  extern __shared__ uint8_t shared_raw[];
  __shared__ WorkItem item;
  WaitForPrerequisites();  // the offsets and the inputs are earlier kernels' outputs
  AllowDependentsToLaunch();
  if (a.offsets == nullptr) {  // dense: no lookup
    if (threadIdx.x == 0) {
      const int first = blockIdx.y * kPairsPerTile;
      item = {0, first, min(kPairsPerTile, a.dense_rows - first)};
    }
  } else if (threadIdx.x < 32) {
    FindWorkItem(a.offsets, a.num_experts, blockIdx.y, &item);
  }
  __syncthreads();
  if (item.expert < 0) return;
  const int e = item.expert, first = item.first, count = item.count;
  const int f0 = blockIdx.x * (kGateUp ? kRowsPerTile / 2 : kRowsPerTile);

  TileCopies<F, kE4M3> copies;
  copies.ring = (SharedAddress(shared_raw) + 1023) & ~1023u;
  copies.ring_generic = shared_raw + (copies.ring - SharedAddress(shared_raw));
  copies.chunk = threadIdx.x & 7;
  copies.r0 = threadIdx.x >> 3;
  // Gate/up: row r of the tile is gate (r % 16 < 8) or up of feature f0 + 32 (r / 64) +
  // 8 ((r % 64) / 16) + r % 8; down: row r is feature f0 + r.
  auto feature_of = [&](int r) {
    return kGateUp ? f0 + 32 * (r / 64) + 8 * ((r % 64) / 16) + r % 8 : f0 + r;
  };
  if constexpr (L::kQuant) {
    constexpr int kPieces = TileCopies<F>::kCodePiecesPerRow;
    const int64_t row_bytes = IsFp4(F) ? a.depth / 2 : a.depth;
#pragma unroll
    for (int i = 0; i < TileCopies<F>::kCodeCopies; ++i) {
      const int r = threadIdx.x / kPieces + i * (kThreads / kPieces), piece = threadIdx.x % kPieces;
      const QuantExpertTable& table = kGateUp && r % 16 >= 8 ? a.q1 : a.q0;
      copies.code_src[i] = static_cast<const uint8_t*>(TableCodes(table, e)) +
                           feature_of(r) * row_bytes + 16 * piece;
      copies.code_dst[i] = kBTileBytes + r * L::kCodeRowBytes + 16 * piece;
    }
    if (IsFp4(F) && threadIdx.x < kRowsPerTile) {
      const int r = threadIdx.x;
      const QuantExpertTable& table = kGateUp && r % 16 >= 8 ? a.q1 : a.q0;
      const int64_t scale_row_bytes = a.depth / (F == QuantFormat::kNvfp4 ? 16 : 32);
      copies.scale_src =
          static_cast<const uint8_t*>(TableScales(table, e)) + feature_of(r) * scale_row_bytes;
    }
  } else if constexpr (kE4M3) {  // a row of codes is a.depth bytes
#pragma unroll
    for (int i = 0; i < kRowsPerTile / 32; ++i) {
      const int r = copies.r0 + 32 * i;
      const QuantExpertTable& table = kGateUp && r % 16 >= 8 ? a.q1 : a.q0;
      copies.a_src[i] = static_cast<const uint8_t*>(TableCodes(table, e)) +
                        static_cast<int64_t>(feature_of(r)) * a.depth + copies.chunk * 16;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRowsPerTile / 32; ++i) {
      const int r = copies.r0 + 32 * i;
      const uint16_t* const* table = kGateUp && r % 16 >= 8 ? a.w1 : a.w0;
      copies.a_src[i] = reinterpret_cast<const uint8_t*>(
          table[e] + static_cast<int64_t>(feature_of(r)) * a.depth + copies.chunk * 8);
    }
  }
#pragma unroll
  for (int j = 0; j < kPairsPerTile / 32; ++j) {
    const int r = copies.r0 + 32 * j;
    const int64_t row = r >= count ? -1 : kGateUp ? a.sorted_pairs[first + r] / a.k : first + r;
    if (row < 0)
      copies.b_src[j] = nullptr;
    else if constexpr (kE4M3)
      copies.b_src[j] = a.input_fp8 + row * a.depth + copies.chunk * 16;
    else
      copies.b_src[j] =
          reinterpret_cast<const uint8_t*>(a.input + row * a.depth + copies.chunk * 8);
  }
  // The tile's pairs rounded up to wgmma's N in steps of 32 (stale B columns past `count` feed
  // only outputs that are never written). One instantiation per N keeps every wgmma of a loop
  // the same shape (mixed shapes on the same accumulators make ptxas serialize them).
  switch (CeilDivDevice(count, 32)) {
    case 1:
      return ComputeTile<F, kGateUp, 32, kE4M3>(a, copies, e, first, count, f0);
    case 2:
      return ComputeTile<F, kGateUp, 64, kE4M3>(a, copies, e, first, count, f0);
    case 3:
      return ComputeTile<F, kGateUp, 96, kE4M3>(a, copies, e, first, count, f0);
    default:
      return ComputeTile<F, kGateUp, 128, kE4M3>(a, copies, e, first, count, f0);
  }
}

// Format F's kernels take Layout<F, kE4M3>::kSharedBytes of dynamic shared memory.
template <QuantFormat F, bool kE4M3>
void ConfigureExpertGemms() {
  static PerDeviceOnce configure;  // the attribute is per device
  configure([] {
    for (const void* kernel : {reinterpret_cast<const void*>(ExpertGemmKernel<F, true, kE4M3>),
                               reinterpret_cast<const void*>(ExpertGemmKernel<F, false, kE4M3>)})
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Layout<F, kE4M3>::kSharedBytes);
  });
}

// kE4M3: x is quantized to E4M3 (a scale a row) before gate/up, and h (a scale a bucketed row)
// before down (QuantizeRowsE4M3).
template <QuantFormat F, bool kE4M3 = false>
void LaunchExpertGemms(const MoeGroupedArgs& m, cudaStream_t stream) {
  constexpr int kShared = Layout<F, kE4M3>::kSharedBytes;
  ConfigureExpertGemms<F, kE4M3>();
  const int pairs = m.rows * m.k;
  if (pairs == 0) return;
  // Items: sum over experts of ceil(pairs_e / 128) <= pairs / 128 + (experts with pairs); blocks
  // past the real count exit after the lookup.
  const int items = CeilDiv(pairs, kPairsPerTile) + std::min(m.num_experts, pairs);
  ExpertGemm gate_up;
  gate_up.input = m.x_bf16;
  gate_up.k = m.k;
  gate_up.offsets = m.offsets;
  gate_up.sorted_pairs = m.sorted_pairs;
  gate_up.num_experts = m.num_experts;
  gate_up.w0 = m.gate;
  gate_up.w1 = m.up;
  gate_up.features = m.inter;
  gate_up.depth = m.hidden;
  gate_up.h = m.h;
  if (m.quant) {
    gate_up.q0 = m.quant[0];
    gate_up.q1 = m.quant[1];
  }
  if constexpr (kE4M3) {
    QuantizeRowsE4M3(m.x_f32, DType::kF32, m.rows, m.hidden, m.x_fp8, m.x_scale, stream);
    gate_up.input_fp8 = m.x_fp8;
    gate_up.input_scale = m.x_scale;
  }
  Launch(ExpertGemmKernel<F, true, kE4M3>, dim3(m.inter / (kRowsPerTile / 2), items),
         dim3(kThreads), kShared, stream, gate_up);
  ExpertGemm down = gate_up;
  down.input = m.h;
  down.w0 = m.down;
  down.w1 = nullptr;
  down.features = m.hidden;
  down.depth = m.inter;
  down.h = nullptr;
  down.out = m.out;
  if (m.quant) down.q0 = m.quant[2];
  if constexpr (kE4M3) {
    // Rows past the bucketed pairs hold stale values: quantized too, never read.
    QuantizeRowsE4M3(m.h, DType::kBF16, pairs, m.inter, m.h_fp8, m.h_scale, stream);
    down.input_fp8 = m.h_fp8;
    down.input_scale = m.h_scale;
  }
  Launch(ExpertGemmKernel<F, false, kE4M3>, dim3(m.hidden / kRowsPerTile, items), dim3(kThreads),
         kShared, stream, down);
}

// y = x . W^T for one dense FP8 tensor / channel matrix W [features, K]: the down kernel's
// tiles over expert 0, with x quantized to E4M3 a row at a time first.
template <QuantFormat F>
void LaunchDenseFp8(const float* x, int rows, const QuantExpertTable& w, uint8_t* x_codes,
                    float* x_scales, float* y, cudaStream_t stream) {
  ConfigureExpertGemms<F, true>();
  QuantizeRowsE4M3(x, DType::kF32, rows, w.cols, x_codes, x_scales, stream);
  ExpertGemm g;
  g.num_experts = 1;
  g.features = w.rows;
  g.depth = w.cols;
  g.out = y;
  g.q0 = w;
  g.input_fp8 = x_codes;
  g.input_scale = x_scales;
  g.dense_rows = rows;
  Launch(ExpertGemmKernel<F, false, true>,
         dim3(w.rows / kRowsPerTile, CeilDiv(rows, kPairsPerTile)), dim3(kThreads),
         Layout<F, true>::kSharedBytes, stream, g);
}

}  // namespace

void GemmFp8Wgmma(const float* x, int rows, const MatrixRef& w, uint8_t* x_codes, float* x_scales,
                  float* y, cudaStream_t stream) {
  if (rows <= 0) return;
  const QuantExpertTable t = MatrixQuantTable(w);
  if (t.format == QuantFormat::kFp8Tensor)
    return LaunchDenseFp8<QuantFormat::kFp8Tensor>(x, rows, t, x_codes, x_scales, y, stream);
  // Fp8WgmmaShapeSupports admits no other format
  LaunchDenseFp8<QuantFormat::kFp8Channel>(x, rows, t, x_codes, x_scales, y, stream);
}

void MoeWgmmaExperts(const MoeGroupedArgs& m, cudaStream_t stream) {
  if (m.kernel == MoeGroupedKernel::kFp8Wgmma) {  // MoeWgmmaFp8Supports: FP8 tensor / channel
    if (m.quant[0].format == QuantFormat::kFp8Tensor)
      return LaunchExpertGemms<QuantFormat::kFp8Tensor, true>(m, stream);
    return LaunchExpertGemms<QuantFormat::kFp8Channel, true>(m, stream);
  }
  switch (m.quant ? m.quant[0].format : QuantFormat::kNone) {
    case QuantFormat::kNone:
      return LaunchExpertGemms<QuantFormat::kNone>(m, stream);
    case QuantFormat::kFp8Tensor:
      return LaunchExpertGemms<QuantFormat::kFp8Tensor>(m, stream);
    case QuantFormat::kFp8Channel:
      return LaunchExpertGemms<QuantFormat::kFp8Channel>(m, stream);
    case QuantFormat::kNvfp4:
      return LaunchExpertGemms<QuantFormat::kNvfp4>(m, stream);
    default:  // MoeWgmmaQuantSupports admits no other format
      return LaunchExpertGemms<QuantFormat::kMxfp4>(m, stream);
  }
}

ProbeKernel ExpertWgmmaProbeKernel() {
  return {"ExpertGemmKernel<gate_up>",
          reinterpret_cast<const void*>(ExpertGemmKernel<QuantFormat::kNone, true>)};
}

}  // namespace infersweep::cuda
