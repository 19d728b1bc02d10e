// Typed backend options: the normalized config's axis values (api/backend_config.h) parsed once
// into one enum per axis, with named predicates for the behaviours several values share. Each
// enum lists its axis's values in the registry's order: their names are the registry's.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "api/backend_config.h"

namespace infersweep {

// ---- CUDA axes (docs/BACKENDS.md).
enum class Gemm { kReference, kCublasLt, kFused, kTma };
enum class Attention { kNaive, kFlash, kCudnn };
enum class KvCache { kFp32, kBf16, kFp8 };
enum class Moe { kLoop, kGrouped, kFused, kWgmma };
enum class Graphs { kOff, kOn, kPersistent };
// The reference with its GEMM inputs rounded as a class of configs rounds them: none (the
// reference itself); every input to bf16 (the bf16 yardstick); the inputs of quantized weights
// to E4M3 with one scale a row, amax / 448, and the others to bf16, as qgemm=w8a8 and the E4M3
// scaled GEMMs quantize activations (the E4M3 yardstick).
enum class Yardstick { kNone, kBf16, kE4m3 };
const char* YardstickName(Yardstick y);

enum class QGemm {
  kReference,
  kDequantBf16,
  kW4A16,
  kW8A16,
  kFp8CublasLt,
  kCudnn,
  kNativeFp4,
  kW8A8
};
enum class LinearAttn { kReference, kFused, kFusedDecode, kChunked };
// TEST ONLY: sm100a launches a kernel built for sm_100a alone as the model is built, so the
// capability probe's refusal of a missing kernel image can be exercised on any GPU.
enum class TestKernel { kNone, kSm100a };
// ---- CPU axes.
enum class Matmul { kNaive, kBlocked };
// ---- Tensor-parallel axes (both devices): tp is a rank count, ep a switch.
// The CPU's reference is its fixed-rank-order sum; the CUDA values are auto (the default: nccl
// at tp > 1, nothing at tp=1), nccl, custom and fused.
enum class AllReduce { kReference, kAuto, kNccl, kCustom, kFused };

// The registry's spelling of each value ("cublaslt", "w4a16", ...); a C string, which this
// absl's StrCat takes (it predates std::string_view).
const char* AxisValueName(Gemm v);
const char* AxisValueName(Attention v);
const char* AxisValueName(KvCache v);
const char* AxisValueName(Moe v);
const char* AxisValueName(Graphs v);
const char* AxisValueName(QGemm v);
const char* AxisValueName(LinearAttn v);
const char* AxisValueName(TestKernel v);
const char* AxisValueName(Matmul v);
const char* AxisValueName(AllReduce v);

// gemm=cublaslt, fused and tma hold a cuBLASLt handle: the bf16 GEMMs of every row count the
// fused GEMV does not take, the fp32 router GEMM, bf16 staging of activations.
constexpr bool UsesCublasLt(Gemm g) { return g != Gemm::kReference; }
// gemm=fused and tma: decode rows take our GEMV with the norm, bias and residual fused in.
constexpr bool UsesFusedGemv(Gemm g) { return g == Gemm::kFused || g == Gemm::kTma; }
// gemm=tma: the attention projections' GEMV streams weight tiles through the TMA engine.
constexpr bool UsesTma(Gemm g) { return g == Gemm::kTma; }
// moe=fused and wgmma route on the device (no host sync): the step can be captured.
constexpr bool RoutesOnDevice(Moe m) { return m == Moe::kFused || m == Moe::kWgmma; }
// graphs=on and persistent capture the decode step once per batch size and replay it.
constexpr bool CapturesDecode(Graphs g) { return g != Graphs::kOff; }
// graphs=persistent: batch-1 decode steps as one cooperative kernel over every layer.
constexpr bool IsPersistent(Graphs g) { return g == Graphs::kPersistent; }
// qgemm=w4a16 and w8a16 dequantize the codes in registers inside the GEMV and expert kernels;
// w8a8 too on its GEMV rows (decode), its batches of rows taking E4M3 x E4M3 tensor cores.
constexpr bool DequantizesInRegisters(QGemm q) {
  return q == QGemm::kW4A16 || q == QGemm::kW8A16 || q == QGemm::kW8A8;
}
// qgemm=w8a8: batches of rows quantized to E4M3 (one scale a row) onto E4M3 x E4M3 mma.sync with
// the FP8 codes as loaded: dense linears at kQuantMmaMinRows rows and more, grouped experts.
constexpr bool QuantizesActivationsFp8(QGemm q) { return q == QGemm::kW8A8; }
// qgemm=fp8_cublaslt and native_fp4 run quantized linears as cuBLASLt scaled GEMMs, qgemm=cudnn
// as cuDNN's matmul graphs: a library reads the codes in place.
constexpr bool UsesScaledGemm(QGemm q) {
  return q == QGemm::kFp8CublasLt || q == QGemm::kNativeFp4 || q == QGemm::kCudnn;
}
// The quantized codes stay resident as uploaded (the reference dequantizes as it reads them);
// dequant_bf16 replaces them by bf16 copies, the scaled GEMMs by their own layouts.
constexpr bool KeepsQuantCodes(QGemm q) {
  return q == QGemm::kReference || DequantizesInRegisters(q);
}

// tp ranks, whole experts per rank (ep=on), and how the ranks' partial sums are reduced.
struct ParallelOptions {
  // Whether the step passes the blocks' outputs through a communicator (engine/cuda/
  // communicator.h): at tp > 1 always, at tp=1 only when an all-reduce is named (auto runs none,
  // so the default config launches nothing more).
  bool RunsCollective() const { return tp > 1 || allreduce != AllReduce::kAuto; }
  int tp = 1;
  bool expert_parallel = false;
  AllReduce allreduce = AllReduce::kReference;
};

struct CudaOptions {
  Gemm gemm = Gemm::kReference;
  Attention attention = Attention::kNaive;
  KvCache kv_cache = KvCache::kFp32;
  Moe moe = Moe::kLoop;
  Graphs graphs = Graphs::kOff;
  // How quantized linears run; dense models ignore it.
  QGemm qgemm = QGemm::kReference;
  // How Gated DeltaNet layers run; models without them ignore it.
  LinearAttn linear_attn = LinearAttn::kReference;
  TestKernel test_kernel = TestKernel::kNone;  // TEST ONLY
  ParallelOptions parallel = {1, false, AllReduce::kAuto};
  // A yardstick (CreateYardstick): the reference GEMM rounds its inputs as a class of configs
  // does and computes the rest as the reference does. Not an axis value: the harness builds it
  // to measure how far that rounding alone moves a model's logits.
  Yardstick yardstick = Yardstick::kNone;
};

struct CpuOptions {
  Matmul matmul = Matmul::kNaive;
  int threads = 0;  // 0: all cores (threads=all)
  ParallelOptions parallel;
};

// From a normalized config (NormalizeBackendConfig): an absent axis takes its device's default.
// InvalidArgument naming the axis for a value this build does not know, or another device's
// config.
absl::StatusOr<CudaOptions> ParseCudaOptions(const BackendConfig& normalized);
absl::StatusOr<CpuOptions> ParseCpuOptions(const BackendConfig& normalized);

}  // namespace infersweep
