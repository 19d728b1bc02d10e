// Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) on the GPU: the causal depthwise conv,
// the per-token gates, the gated delta rule over a per-sequence recurrent state, and the gated
// RMSNorm of its output; plus the gated full attention's q/gate split and sigmoid gate.
// Activations are fp32 row-major, rows sequence-major (row = sequence * n + token); states are
// fp32 and updated in place, so a captured decode graph replays them.
//
// Napkin math, qwen3-next-80b-a3b on an H200 (Hk 16, Hv 32, dk = dv = 128, conv 8192 x 4):
// a sequence's recurrent state is 32 x 128 x 128 x 4 B = 2 MiB a layer, read and written once a
// step: 36 linear layers move 151 MB a decode step (34 us at 4.4 TB/s) against 3 GB of fp8
// weights; a token costs 4 dk dv = 64K FLOPs a head, 2.1 MFLOP a layer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor_ref.h"
#include "kernels/cuda/limits.h"

namespace infersweep::cuda {

// A Gated DeltaNet layer's shapes.
struct GatedDeltaShape {
  int batch = 0;
  int n = 0;                                                       // tokens a sequence this step
  int key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0;  // head sizes dk, dv
  int kernel = 0;                                                  // conv taps (<= 8)
  // Served rows (device, null for a lockstep batch): each row's (slot, position). Sequence b's
  // conv and recurrent states are then slot ragged[b * n].x's, and a sequence whose first row
  // sits at position 0 starts from zero states (a new sequence, or a graph bucket's padding rows
  // in the spare slot). Null: sequence b's states are slot b's, carried in.
  const int2* ragged = nullptr;
  int conv_channels() const { return 2 * key_heads * key_dim + value_heads * value_dim; }
  int rows() const { return batch * n; }
};

// out[r, c] = (silu of) sum_j w[c, j] * in[r - (K-1) + j, c], per sequence, the K-1 inputs before
// a sequence's first new row taken from `state` ([batch, K-1, channels], oldest first), which is
// advanced to the last K-1 inputs. `weight` is [channels, K]. `fuse_silu` applies the SiLU in the
// same pass; otherwise `out` holds the conv alone. One thread a (sequence, channel), serial over
// the n tokens: 8192 channels x 4 taps, 64 KB in and out a decode row (~2 us).
void CausalConv(const float* in, const GatedDeltaShape& s, const MatrixRef& weight, bool fuse_silu,
                float* state, float* out, cudaStream_t stream);
// x = silu(x), n elements.
void SiluInPlace(float* x, int64_t n, cudaStream_t stream);

// Per row of `mixed` ([rows, q | k | v], conv_channels wide): q and k L2-normalised in place per
// key head (x / sqrt(sum x^2 + 1e-6)), q then scaled by dk^-0.5; and per value head
// g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), from a and b ([rows, Hv]) into
// g and beta ([rows, Hv]). One block a row.
void GatedDeltaGates(float* mixed, const float* a, const float* b, const MatrixRef& a_log,
                     const MatrixRef& dt_bias, const GatedDeltaShape& s, float* g, float* beta,
                     cudaStream_t stream);

// The gated delta rule over each sequence's n tokens, value head h reading key head
// h / (Hv / Hk): per token S *= exp(g); d = beta (v - S^T k); S += k d^T; o = S^T q. `state` is
// [batch, Hv, dk, dv], carried in and out; `out` is [rows, Hv * dv].
// Reference: one thread a state column, the column in global memory; any dk, dv <= 1024.
void GatedDeltaReference(const float* mixed, const float* g, const float* beta,
                         const GatedDeltaShape& s, float* state, float* out, cudaStream_t stream);
// Fast: a block of 256 threads holds a [dk, 32] slice of the state in registers (8 threads a
// column, dk / 8 rows each) for the whole step and writes it back once; the column sums are
// 3-step shuffles. dk % 8 == 0 and dk <= 256 (GatedDeltaFusedSupports). Decode at batch 1 on
// qwen3-next: 128 blocks, 2 MiB of state in and out a layer.
void GatedDeltaFused(const float* mixed, const float* g, const float* beta,
                     const GatedDeltaShape& s, float* state, float* out, cudaStream_t stream);

// The chunked form's per-row terms, written by its first pass and read by its second (fp32,
// GatedDeltaChunkedScratchFloats(rows, ...) floats in all).
struct GatedDeltaChunkScratch {
  float* w = nullptr;  // [rows, Hv, dk]: T (beta e^G k), what a row's update takes from the state
  float* q = nullptr;  // [rows, Hv, dk]: e^G q - P W, what its output takes from the state
  float* u = nullptr;  // [rows, Hv, dv]: T (beta v)
  float* g = nullptr;  // [rows, Hv]: G, the cumulative log decay within the row's chunk
};

// The gated delta rule over each sequence's n tokens as GatedDeltaFused computes it, in the
// chunked form (kernels/cpu/gated_delta.h's GatedDeltaChunked), kGatedDeltaChunk tokens a chunk,
// its products on tensor cores as 3xTF32 (fp32-class); GatedDeltaChunkedSupports(dk, dv).
//   Pass 1, grid (chunks, batch * Hv): per chunk and value head, A = beta_t e^(G_t - G_s)
//     k_t.k_s and P = e^(G_t - G_s) q_t.k_s on MMAs, T = (I + A)^-1 by forward substitution, then
//     W, U, Qeff = e^G Q - P W and G into `scratch`, and the chunk's own output P U into `out`.
//   Pass 2, grid (batch * Hv, dv / 32 or 16): the state's columns in shared memory through the
//     sequence's chunks in order: D = U - W S, out += Qeff S, S = e^(G_last) S +
//     (e^(G_last - G) K)^T D.
// Napkin math, qwen3-next on an H200, a 4096-token prompt, one layer (Hv 32, dk = dv = 128):
// pass 1 runs 4096 blocks of 0.8 M multiply-adds (x3 for the TF32 split): 20 GFLOP, ~0.1 ms at
// a third of the TF32 rate, and writes 200 MB of terms; pass 2 streams them back from L2/DRAM
// (~50 us) while 128 blocks walk 128 chunks each, ~1-2 us a chunk: 0.15-0.25 ms.
void GatedDeltaChunked(const float* mixed, const float* g, const float* beta,
                       const GatedDeltaShape& s, const GatedDeltaChunkScratch& scratch,
                       float* state, float* out, cudaStream_t stream);

// The weights and buffers of GatedDeltaDecode. Row b of the launch is sequence b (one token).
struct GatedDeltaDecodeOperands {
  const float* projected = nullptr;  // [batch, conv_channels]: in_proj_qkv's output, pre-conv
  const float* z = nullptr;          // [batch, Hv * dv]: the output gate
  const float* a = nullptr;          // [batch, Hv]
  const float* b = nullptr;          // [batch, Hv]
  MatrixRef conv;                    // [conv_channels, K]
  MatrixRef a_log, dt_bias;          // [Hv]
  MatrixRef norm;                    // [dv]: the gated RMSNorm's gain
  float eps = 0.f;
  float* conv_state = nullptr;  // [slots, K-1, conv_channels], carried in and out
  float* state = nullptr;       // [slots, Hv, dk, dv], carried in and out
  // [batch, Hk], zero before the launch and left zero after it: how many of a key head's value
  // heads have read its q/k conv state (GatedDeltaDecode's ordering of the conv-state update).
  unsigned* key_head_arrivals = nullptr;
  float* out = nullptr;  // [batch, Hv * dv]: the gated RMSNorm of the delta rule's output
};

// A decode step of one-row sequences (s.n == 1; lockstep or GatedDeltaShape::ragged rows) in one
// launch: what CausalConv (with SiLU), GatedDeltaGates, GatedDeltaFused and RmsNormGated compute
// for those rows. dk % 8 == 0, dk <= 128, dv <= 128 (GatedDeltaDecodeSupports).
// A head's block(s) convolve its key head's 2 dk q/k channels and its own dv v channels from the
// conv state, normalise q and k, compute g and beta, run the delta rule over the head's [dk, dv]
// state (in registers, loaded before the conv so that its DRAM latency overlaps it) and
// normalise the head's output with a block reduction.
// Conv state: head h's v channels are its block's alone, so the block writes them back at once.
// The q/k channels of key head kh are read by its Hv / Hk value heads' blocks, which run in no
// fixed order, so none may overwrite them before all have read them: each block, once its
// threads have read them (a barrier), counts itself in key_head_arrivals[b, kh] (a fence, then
// an atomic add), and the block that arrives last writes the advanced q/k history and resets the
// count to zero. Nothing waits on another block, so any number of blocks may be resident.
//
// Napkin math, qwen3-next-80b-a3b on an H200 (Hk 16, Hv 32, dk = dv = 128, conv 8192 x 4):
// a sequence moves its 2 MiB recurrent state in and out, its conv state (3 x 8192 x 4 B = 96 KB)
// in and out, 32 KB of conv input, 16 KB of z and 64 KB of conv weights (shared across the
// batch, from L2); ~7 dk dv = 115 KFLOP a head (decay, k.S, update, S.q), 3.7 MFLOP a sequence,
// negligible against the bytes. Batch 64: 268 MB of state traffic, ~61 us at 4.4 TB/s.
//
// Two layouts of a head's state over the threads (GatedDeltaDecodeLayout):
// - kRows (dv % 4 == 0; what kAuto takes): one 256-thread block a head, a warp dk / 8 whole
//   rows, a lane 4 columns as float4s, so every state access is a coalesced row; the column sums
//   k.S and q.S come from one pass over the old state and meet in shared memory. 2048 blocks at
//   batch 64, two resident an SM with 128 KB of state in flight.
// - kColumns (any dv): 8 lanes a column, dk / 8 rows a lane; a warp access touches 16 bytes of
//   each of 8 rows. On sm_90 a head's columns split over a cluster of 4 blocks (the gated norm's
//   sum through distributed shared memory).
// bench/gated_delta_probe times both at batches 1-128 (docs/PERFORMANCE.md).
enum class GatedDeltaDecodeLayout { kAuto, kColumns, kRows };
GatedDeltaDecodeLayout GatedDeltaDecodeLayoutFor(const GatedDeltaShape& s);
void GatedDeltaDecode(const GatedDeltaDecodeOperands& ops, const GatedDeltaShape& s,
                      cudaStream_t stream,
                      GatedDeltaDecodeLayout layout = GatedDeltaDecodeLayout::kAuto);

// out = x * rsqrt(mean(x^2) + eps) * gain * silu(z) over `vectors` vectors of `dim` (the plain
// gain: Qwen3-Next's RMSNormGated). In place allowed (out == x).
void RmsNormGated(const float* x, const float* z, int64_t vectors, int dim, const MatrixRef& gain,
                  float eps, float* out, cudaStream_t stream);

// Gated attention's output gate: x [rows, heads * d] *= sigmoid(gate), the gate read in place
// from q_proj's rows (`gated`, gated_stride floats apart), which hold [q_h | gate_h] per head.
void SigmoidGateHeads(float* x, const float* gated, int gated_stride, int rows, int heads,
                      int head_dim, cudaStream_t stream);
// x *= factor, n elements (TEST ONLY faults).
void ScaleInPlace(float* x, float factor, int64_t n, cudaStream_t stream);
// Swaps a[i] and b[i], n elements (TEST ONLY faults).
void SwapInPlace(float* a, float* b, int64_t n, cudaStream_t stream);

}  // namespace infersweep::cuda
