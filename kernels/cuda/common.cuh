// Shared device helpers for the CUDA kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>

#include "kernels/cuda/kernel_name.h"

namespace infersweep::cuda {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

// The KV-cache sequence and the position of a step's row: lockstep rows are n a sequence, from
// *position; ragged rows (serving: decode rows of sequences at different positions) carry their
// own (sequence, position) pair.
__device__ __forceinline__ int2 RowSequencePosition(int row, int n, const int* position,
                                                    const int2* ragged) {
  return ragged ? ragged[row] : make_int2(row / n, *position + row % n);
}

// Two floats as one register of two bf16 or two f16, rounded to nearest; lo in the low half.
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t PackF16x2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// The default barrier of the block reductions: the whole block.
struct WholeBlock {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
  __device__ __forceinline__ int warps() const { return blockDim.x >> 5; }
};

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); `scratch` holds 32 floats. `group`
// names the warps taking part and their barrier (warps 0..group.warps() - 1; the persistent
// decode kernel's consumer warps use a named barrier that its producer warp never joins).
template <typename Group = WholeBlock>
__device__ __forceinline__ float BlockSum(float v, float* scratch, Group group = {}) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpSum(v);
  group();
  if (lane == 0) scratch[warp] = v;
  group();
  v = lane < group.warps() ? scratch[lane] : 0.f;  // every warp sums all partials: a broadcast
  return WarpSum(v);
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// Eight floats from a 16-byte-aligned address through the read-only path (two 16-byte loads).
__device__ __forceinline__ void LoadFloat8(const float* p, float* v) {
  const float4 lo = __ldg(reinterpret_cast<const float4*>(p));
  const float4 hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z,
  v[7] = hi.w;
}

// Copies n floats (n % 4 == 0, 16-byte aligned) into shared memory with 16-byte loads, unrolled
// so that a block's loads are all in flight together: one L2 round trip, not one per element.
__device__ __forceinline__ void StageFloats(const float* src, int n, float* dst) {
#pragma unroll 4
  for (int q = threadIdx.x; q < n / 4; q += blockDim.x)
    reinterpret_cast<float4*>(dst)[q] = __ldg(reinterpret_cast<const float4*>(src) + q);
}

// Dot product of 8 bf16 weights (one 16-byte load) with 8 floats, fp32 accumulate.
__device__ __forceinline__ float Dot8Bf16(const uint4 packed, const float* x) {
  const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(&packed);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(w[i]);
    acc += f.x * x[2 * i] + f.y * x[2 * i + 1];
  }
  return acc;
}

// ---- Programmatic dependent launch (sm_90). With it on, a kernel's blocks may start while the
// previous kernel in the stream is still running; they must call WaitForPrerequisites() before
// touching anything that kernel writes (and before any global write), and may read before it only
// data from earlier kernels and the weights. A kernel calls AllowDependentsToLaunch() right after
// its own wait, so when the next kernel starts, every kernel but the one before it has finished.
// Both are no-ops when the kernel was launched without the attribute, and compile to nothing
// for GPUs before sm_90, where SetProgrammaticLaunch leaves launches plain.
__device__ __forceinline__ void WaitForPrerequisites() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void AllowDependentsToLaunch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether this thread's launches use programmatic dependent launch (SetProgrammaticLaunch).
inline bool& ProgrammaticLaunchFlag() {
  static thread_local bool on = false;
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...) with launch attributes (attrs[0, count)).
// Every launch through here is recorded in the launch log when something records
// (core/launch_log.h), under the kernel's demangled name.
template <typename... KernelArgs, typename... Args>
void LaunchWithAttributes(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, cudaLaunchAttribute* attrs, int count,
                          Args&&... args) {
  RecordKernelLaunch(kernel);
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when the
// thread's flag is on.
template <typename... KernelArgs, typename... Args>
void Launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  LaunchWithAttributes(kernel, grid, block, smem, stream, attribute,
                       ProgrammaticLaunchFlag() ? 1 : 0, std::forward<Args>(args)...);
}

// kernel<<<grid, block, smem, stream>>>(args...) exactly, recorded: no launch attributes, so
// never a programmatic dependent launch (for kernels that do not wait for their prerequisites).
template <typename... KernelArgs, typename... Args>
void LaunchPlain(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                 cudaStream_t stream, Args&&... args) {
  LaunchWithAttributes(kernel, grid, block, smem, stream, nullptr, 0, std::forward<Args>(args)...);
}

// Runs a setup step once per device. cudaFuncSetAttribute (a kernel's dynamic shared memory
// limit) applies to the current device only, so a process that launches on several GPUs (tensor
// parallelism) has to repeat it on each; a once-per-process flag left every GPU but the first
// with the 48 KB default and its launches failing. After the first call on a device a call costs
// a cudaGetDevice and an atomic load. Devices 0-63.
class PerDeviceOnce {
 public:
  template <typename Setup>
  void operator()(Setup&& setup) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) device = 0;
    const uint64_t bit = uint64_t{1} << (device & 63);
    if (done_.load(std::memory_order_acquire) & bit) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_.load(std::memory_order_relaxed) & bit) return;
    setup();
    done_.fetch_or(bit, std::memory_order_release);
  }

 private:
  std::atomic<uint64_t> done_{0};
  std::mutex mutex_;
};

inline int CeilDiv(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

// The current device's SM count (host side), read once: launchers size their grids
// by it (the shape only, never correctness).
inline int MultiprocessorCount() {
  static const int count = [] {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms > 0 ? sms : 1;
  }();
  return count;
}

}  // namespace infersweep::cuda
