// The custom all-reduce's kernels: tensor-parallel ranks sum a buffer through each other's peer
// buffers (CUDA IPC mappings between rank processes, or peer access between devices of one
// process; on one device, plain device pointers).
//
// Every rank owns one peer buffer: per-block signal flags, then a staging area. A call copies the
// rank's data into its own staging area, and the ranks' blocks meet at flags: block b of each rank
// writes a flag into every peer's signals (a release store, never a peer atomic) and waits for
// every peer's block b to write into its own. Block b of every rank handles the same elements, so
// one flag a (block, rank) orders the staging writes before the peers' reads; a last barrier
// keeps the staging areas until every peer has read them. Peers are summed in rank order
// 0..ranks-1 in fp32 by whichever rank sums an element, so every rank's result is bitwise the
// same. The flags count calls: a CUDA graph replays the kernel with the same arguments.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor_ref.h"

namespace infersweep::cuda {

constexpr int kAllReduceMaxRanks = 8;
// Blocks of the one-shot and two-shot kernels (and at most of the fused one): each (block, peer)
// has its own flags. 64 blocks of 512 threads keep ~16 KB of loads in flight a block, enough to
// cover NVLink's latency. A block waits only on the same block of its peers, so ranks on
// separate GPUs need no co-residency; ranks as streams of one GPU (the tests) need every rank's
// grid resident at once: two blocks an SM (<= 64 registers a thread) hold 4 ranks' on an H200.
constexpr int kAllReduceBlocks = 64;

// The element types the custom kernels sum (fp32 accumulation either way).
enum class ReduceDType { kFp32, kBf16 };
inline size_t ReduceDTypeBytes(ReduceDType t) { return t == ReduceDType::kFp32 ? 4 : 2; }

// The ranks' peer buffers as this rank maps them.
struct PeerBuffers {
  int ranks = 1;
  int rank = 0;
  void* base[kAllReduceMaxRanks] = {};  // rank r's peer buffer (signals, then staging)
  int64_t staging_bytes = 0;            // each peer buffer's staging area
};

// Bytes of one peer buffer with `staging_bytes` of staging (zeroed once before the first call).
size_t PeerBufferBytes(int64_t staging_bytes);

enum class CustomAlgorithm { kOneShot, kTwoShot };

// Whether a message of `bytes` takes the one-shot kernel: at or under this size latency dominates
// (one barrier fewer, the whole message read from every peer); above it the two-shot kernel reads
// 2 (ranks - 1) / ranks of it in all instead of ranks - 1.
constexpr int64_t kOneShotMaxBytes = 512 << 10;
inline CustomAlgorithm PickCustomAlgorithm(int ranks, int64_t bytes) {
  return ranks <= 2 || bytes <= kOneShotMaxBytes ? CustomAlgorithm::kOneShot
                                                 : CustomAlgorithm::kTwoShot;
}

// data[count] (this rank's, any device memory) summed over the ranks in place. count *
// ReduceDTypeBytes(dtype) must be a multiple of 16 and fit peers.staging_bytes (callers check).
// Napkin math on an H200 over NVLink 4 (~450 GB/s a direction a GPU), S bytes a rank, n ranks:
// one-shot reads (n - 1) S from peers, e.g. 7 x 256 KB = 1.8 MB at 8 ranks: ~4 us plus two
// barriers (~2 us each over NVLink); two-shot reads and writes 2 (n - 1) / n S: 64 MB at 8 ranks
// moves 112 MB, ~250 us, busbw close to the link's 450 GB/s. At one rank both copy S to staging
// and back: a local copy (S / 2.1 TB/s each way).
void CustomAllReduce(const PeerBuffers& peers, void* data, int64_t count, ReduceDType dtype,
                     CustomAlgorithm algorithm, cudaStream_t stream);

// The all-reduce, the residual add and the next RMSNorm in one kernel, rows [rows, n] fp32:
// residual += sum over ranks of partial (rank order); out = RMSNorm(residual) * gain. partial is
// left as it was. One-shot: rows * n * 4 bytes must fit peers.staging_bytes and n % 4 == 0.
// Napkin math, decode at batch 1, hidden 4096, 8 ranks: 7 x 16 KB read over NVLink (~0.3 us) and
// two barriers, in place of the all-reduce, an add and a norm kernel (three launches, ~2 us each).
void FusedAllReduceAddNorm(const PeerBuffers& peers, const float* partial, int rows, int n,
                           float* residual, const MatrixRef& gain, float eps, float* out,
                           cudaStream_t stream);

}  // namespace infersweep::cuda
