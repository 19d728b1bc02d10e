// Hopper bulk asynchronous copies (cp.async.bulk, the TMA engine's 1-D form) into shared memory,
// with completion tracked by mbarriers: the pieces the TMA-streamed kernels of this folder share.
#pragma once

#include <cstdint>

namespace infersweep::cuda {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void BarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)), "r"(count));
}
// Makes barrier initialisation visible to the async proxy (the copy engine); call once after the
// inits, before the block barrier that precedes the first copy.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Arms the barrier for `bytes` of transaction: the bulk copies that complete them follow
// (BulkCopyTx), one or several onto the same barrier.
__device__ __forceinline__ void ArmBarrier(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(bar)),
               "r"(bytes)
               : "memory");
}
// One bulk copy completing `bytes` of an armed barrier's transaction. dst and src 16-byte
// aligned, bytes a multiple of 16.
__device__ __forceinline__ void BulkCopyTx(void* dst, const void* src, uint32_t bytes,
                                           uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}
// BulkCopyTx with an L2 cache policy (EvictFirstPolicy) for the source's lines.
__device__ __forceinline__ void BulkCopyTx(void* dst, const void* src, uint32_t bytes,
                                           uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
      "[%1], %2, [%3], %4;" ::"r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar)), "l"(policy)
      : "memory");
}
// Arms the barrier for `bytes` and starts the one bulk copy that completes them.
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  ArmBarrier(bar, bytes);
  BulkCopyTx(dst, src, bytes, bar);
}
// An L2 policy that evicts what it covers first: for weights streamed once per step, so that they
// do not push out the activations other SMs are about to read (the streaming loads' __ldcs).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
// Asks L2 for the line holding p, to be kept past streamed (evict-first) lines.
__device__ __forceinline__ void PrefetchLineL2EvictLast(const void* p) {
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
}
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(parity)
        : "memory");
  }
}
#endif

}  // namespace infersweep::cuda
