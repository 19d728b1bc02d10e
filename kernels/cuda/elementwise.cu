#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/probe_kernels.h"

namespace infersweep::cuda {
namespace {

// out_bf16 (optional): the same values rounded to bf16, the cuBLASLt GEMMs' input (one launch
// fewer than a separate conversion).
__global__ void RmsNormKernel(const float* x, int n, const void* gain, DType gain_dtype, float eps,
                              float* out, __nv_bfloat16* out_bf16) {
  __shared__ float scratch[32];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * n;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) sum_sq += xr[i] * xr[i];
  sum_sq = BlockSum(sum_sq, scratch);
  const float inv = rsqrtf(sum_sq / n + eps);
  float* o = out + static_cast<int64_t>(blockIdx.x) * n;
  __nv_bfloat16* ob = out_bf16 ? out_bf16 + static_cast<int64_t>(blockIdx.x) * n : nullptr;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = xr[i] * inv * LoadAsFloat(gain, gain_dtype, i);
    o[i] = v;
    if (ob) ob[i] = __float2bfloat16_rn(v);
  }
}

__global__ void UpcastKernel(const void* src, DType dtype, int64_t n, float offset, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = offset + LoadAsFloat(src, dtype, i);
}

__global__ void AddScaledKernel(float* x, const float* y, float scale, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] += scale * y[i];
}

__global__ void AddBiasKernel(float* y, int64_t total, int n, const void* bias, DType dtype) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] += LoadAsFloat(bias, dtype, i % n);
}

__global__ void SiluMulKernel(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.f + expf(-g)) * up[i];
  }
}

__global__ void ToBf16Kernel(const float* x, int64_t n, __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(x[i]);
}

__global__ void SequenceLengthsKernel(const int* position, int n, int batch, int32_t* seq_q,
                                      int32_t* seq_kv) {
  for (int b = threadIdx.x; b < batch; b += blockDim.x) {
    seq_q[b] = n;
    seq_kv[b] = *position + n;
  }
}

// One block: every slot a one-token query over one key, then each decode row's slot over its
// position's keys.
__global__ void SlotLengthsKernel(const int2* ragged, int rows, int slots, int32_t* seq_q,
                                  int32_t* seq_kv) {
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    seq_q[s] = 1;
    seq_kv[s] = 1;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += blockDim.x) seq_kv[ragged[r].x] = ragged[r].y + 1;
}

// grid rows: row r's `width` values to (to_slots) or from its slot's row.
template <bool kToSlots>
__global__ void SlotRowsKernel(const void* in, int width, const int2* ragged, void* out) {
  const int64_t row = blockIdx.x, slot = ragged[blockIdx.x].x;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    if constexpr (kToSlots)
      static_cast<__nv_bfloat16*>(out)[slot * width + i] =
          __float2bfloat16(static_cast<const float*>(in)[row * width + i]);
    else
      static_cast<float*>(out)[row * width + i] =
          __bfloat162float(static_cast<const __nv_bfloat16*>(in)[slot * width + i]);
  }
}

__global__ void SetNanKernel(float* x) { x[0] = __int_as_float(0x7fc00000); }

__global__ void ForceTokenKernel(float* logits, int vocab, int stuck) {
  __shared__ float scratch[32];
  float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  float m = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, row[i]);
  m = BlockMax(m, scratch);
  if (threadIdx.x == 0) row[stuck] = m + 1.f;
}

int GridFor(int64_t n) { return static_cast<int>(std::min<int64_t>(CeilDiv(n, 256), 132 * 16)); }

}  // namespace

void RmsNorm(const float* x, int rows, int n, const MatrixRef& gain, float eps, float* out,
             cudaStream_t stream, uint16_t* out_bf16) {
  LaunchPlain(RmsNormKernel, rows, n >= 1024 ? 512 : 128, 0, stream, x, n, gain.data, gain.dtype,
              eps, out, reinterpret_cast<__nv_bfloat16*>(out_bf16));
}

void UpcastToF32(const MatrixRef& m, float* out, cudaStream_t stream, float offset) {
  const int64_t n = m.rows * m.cols;
  LaunchPlain(UpcastKernel, GridFor(n), 256, 0, stream, m.data, m.dtype, n, offset, out);
}

void AddScaled(float* x, const float* y, float scale, int64_t n, cudaStream_t stream) {
  LaunchPlain(AddScaledKernel, GridFor(n), 256, 0, stream, x, y, scale, n);
}

void AddBias(float* y, int rows, const MatrixRef& bias, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(rows) * bias.cols;
  LaunchPlain(AddBiasKernel, GridFor(total), 256, 0, stream, y, total, static_cast<int>(bias.cols),
              bias.data, bias.dtype);
}

void SiluMul(const float* gate, const float* up, int64_t n, float* out, cudaStream_t stream) {
  LaunchPlain(SiluMulKernel, GridFor(n), 256, 0, stream, gate, up, n, out);
}

void ToBf16(const float* x, int64_t n, uint16_t* out, cudaStream_t stream) {
  LaunchPlain(ToBf16Kernel, GridFor(n), 256, 0, stream, x, n,
              reinterpret_cast<__nv_bfloat16*>(out));
}

void SequenceLengths(const int* position, int n, int batch, int32_t* seq_q, int32_t* seq_kv,
                     cudaStream_t stream) {
  LaunchPlain(SequenceLengthsKernel, 1, 256, 0, stream, position, n, batch, seq_q, seq_kv);
}

void SlotLengths(const int2* ragged, int rows, int slots, int32_t* seq_q, int32_t* seq_kv,
                 cudaStream_t stream) {
  LaunchPlain(SlotLengthsKernel, 1, 1024, 0, stream, ragged, rows, slots, seq_q, seq_kv);
}

void RowsToSlotsBf16(const float* rows_in, int rows, int width, const int2* ragged,
                     uint16_t* slots_out, cudaStream_t stream) {
  LaunchPlain(SlotRowsKernel<true>, rows, 256, 0, stream, static_cast<const void*>(rows_in), width,
              ragged, static_cast<void*>(slots_out));
}

void SlotsToRowsF32(const uint16_t* slots_in, int rows, int width, const int2* ragged,
                    float* rows_out, cudaStream_t stream) {
  LaunchPlain(SlotRowsKernel<false>, rows, 256, 0, stream, static_cast<const void*>(slots_in),
              width, ragged, static_cast<void*>(rows_out));
}

void SetNan(float* x, cudaStream_t stream) { LaunchPlain(SetNanKernel, 1, 1, 0, stream, x); }

void ForceToken(float* logits, int rows, int vocab, int stuck, cudaStream_t stream) {
  LaunchPlain(ForceTokenKernel, rows, 256, 0, stream, logits, vocab, stuck);
}

ProbeKernel RmsNormProbeKernel() {
  return {"RmsNormKernel", reinterpret_cast<const void*>(RmsNormKernel)};
}

}  // namespace infersweep::cuda
