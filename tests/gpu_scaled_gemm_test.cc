// The scaled tensor-core GEMMs (kernels/cuda/gemm_scaled.h) on a GPU: the device activation
// quantizers against their host formulas bit for bit, the weight scales in cuBLASLt's layouts,
// the FP8 GEMM against the exact-dequant fp32 reference in all three FP8 scale modes, and
// qgemm=fp8_cublaslt / native_fp4 as trials. Skipped (not failed) on machines without a GPU: CI
// compiles it, the GPU machine runs it (scripts/gpu.sh). The CPU side: scaled_gemm_test.cc.
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/backends.h"
#include "core/quant/dequantize.h"
#include "engine/quant/layout.h"
#include "engine/quant/quantize.h"
#include "harness/executor.h"
#include "kernels/cuda/scaled_layout.h"
#include "tests/gpu_trial.h"
#include "tests/scaled_reference.h"
#ifdef INFERSWEEP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/gemm_scaled.h"
#include "kernels/cuda/scaled_quant.h"
#endif

namespace infersweep {
namespace {

#ifdef INFERSWEEP_HAVE_CUDA

using ::testing::HasSubstr;

int DeviceSm() {
  int devices = 0, major = 0, minor = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return 10 * major + minor;
}

class GpuScaled : public testing::Test {
 protected:
  void SetUp() override {
    sm_ = DeviceSm();
    if (sm_ == 0) GTEST_SKIP() << "no GPU on this machine";
  }
  int sm_ = 0;
};

#define CUDA_ASSERT_OK(expr)                                               \
  do {                                                                     \
    const cudaError_t _e = (expr);                                         \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e); \
  } while (0)

// A device copy of a host vector (or `n` uninitialised elements), freed with the object.
template <typename T>
struct DeviceVector {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceVector(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)), cudaSuccess);
  }
  explicit DeviceVector(const std::vector<T>& host) : DeviceVector(host.size()) {
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(p); }
  std::vector<T> ToHost() const {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

// Device copies of a quantized matrix's parts, and the view of them.
struct DeviceMatrix {
  std::vector<std::unique_ptr<DeviceVector<uint8_t>>> parts;
  MatrixRef ref;
  explicit DeviceMatrix(const QuantizedMatrix& q) : ref(q.View()) {
    const void* host[] = {ref.data, ref.quant.scale, ref.quant.global_scale};
    const void* device[] = {nullptr, nullptr, nullptr};
    for (const std::vector<uint8_t>& part : q.parts) {
      parts.push_back(std::make_unique<DeviceVector<uint8_t>>(part));
      for (int i = 0; i < 3; ++i)
        if (host[i] == part.data()) device[i] = parts.back()->p;
    }
    ref.data = device[0];
    ref.quant.scale = device[1];
    ref.quant.global_scale = device[2];
  }
};

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

std::string Name(QuantFormat f, int64_t n, int64_t k, int rows) {
  return QuantFormatName(f) + " [" + std::to_string(n) + ", " + std::to_string(k) + "] x " +
         std::to_string(rows) + " rows";
}

// ---- the activation quantizers: bit for bit the host formulas (they run on sm_90 too)

TEST_F(GpuScaled, ActivationQuantizersMatchTheHostFormulasBitForBit) {
  struct Case {
    int rows, cols;
    bool nan;  // one NaN in row 0: it must reach the output, not vanish into a scale
  };
  for (const Case c : {Case{1, 96, false}, Case{4, 320, false}, Case{64, 2048, false},
                       Case{512, 256, false}, Case{3, 160, true}}) {
    SCOPED_TRACE(std::to_string(c.rows) + " x " + std::to_string(c.cols) + (c.nan ? " NaN" : ""));
    std::vector<float> x = Random(static_cast<size_t>(c.rows) * c.cols, 11);
    if (c.nan) x[5] = NAN;
    DeviceVector<float> dx(x);
    const size_t n = x.size();

    // FP8, one scale per tensor, per 1 x 128, per row.
    for (const int group : {0, 128, c.cols}) {
      SCOPED_TRACE("fp8 group " + std::to_string(group));
      const HostQuantized want = HostQuantizeFp8(x.data(), c.rows, c.cols, group);
      DeviceVector<uint8_t> codes(n);
      DeviceVector<float> scales(static_cast<size_t>(c.rows) * want.groups());
      DeviceVector<uint32_t> amax(1);
      if (group == 0)
        cuda::QuantizeFp8PerTensor(dx.p, c.rows, c.cols, codes.p, scales.p, amax.p, nullptr);
      else
        cuda::QuantizeFp8RowGroups(dx.p, c.rows, c.cols, group, codes.p, scales.p, nullptr);
      CUDA_ASSERT_OK(cudaGetLastError());
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      EXPECT_EQ(codes.ToHost(), want.codes);
      const std::vector<float> got = scales.ToHost();
      if (group == 0) {
        EXPECT_EQ(got[0], want.scales[0]);
      } else {
        for (int m = 0; m < c.rows; ++m)
          for (int g = 0; g < want.groups(); ++g)
            ASSERT_EQ(got[cuda::Fp8ActivationScaleIndex(c.rows, m, g)],
                      want.scales[m * want.groups() + g])
                << m << ", " << g;
      }
    }

    // FP4: codes, and the scales in the tiled layout with zeroed padding.
    for (const QuantFormat format : {QuantFormat::kNvfp4, QuantFormat::kMxfp4}) {
      SCOPED_TRACE(QuantFormatName(format));
      const bool nv = format == QuantFormat::kNvfp4;
      const HostQuantized want = nv ? HostQuantizeNvfp4(x.data(), c.rows, c.cols)
                                    : HostQuantizeMxfp4(x.data(), c.rows, c.cols);
      const int groups = want.groups();
      DeviceVector<uint8_t> codes(n / 2), tiled(cuda::TiledScaleCount(c.rows, groups));
      DeviceVector<float> global(1);
      DeviceVector<uint32_t> amax(1);
      if (nv)
        cuda::QuantizeNvfp4(dx.p, c.rows, c.cols, codes.p, tiled.p, global.p, amax.p, nullptr);
      else
        cuda::QuantizeMxfp4(dx.p, c.rows, c.cols, codes.p, tiled.p, nullptr);
      CUDA_ASSERT_OK(cudaGetLastError());
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      EXPECT_EQ(codes.ToHost(), want.codes);
      std::vector<uint8_t> want_tiled(tiled.n, 0);
      for (int m = 0; m < c.rows; ++m)
        for (int g = 0; g < groups; ++g)
          want_tiled[cuda::TiledScaleIndex(groups, m, g)] = want.scale_codes[m * groups + g];
      EXPECT_EQ(tiled.ToHost(), want_tiled);
      if (nv) {
        EXPECT_EQ(global.ToHost()[0], want.global);
      }
    }
  }
}

// ---- weight scales in cuBLASLt's layouts

TEST_F(GpuScaled, WeightScalesInCublasLtLayouts) {
  const int64_t N = 320, K = 640;  // 3 x 5 blocks of 128: the block rows padded to 8 columns
  const std::vector<float> w = Random(N * K, 21);
  for (const QuantFormat format :
       {QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel, QuantFormat::kFp8Block128}) {
    SCOPED_TRACE(QuantFormatName(format));
    auto q = QuantizeMatrix(format, {w.data(), DType::kF32, N, K});
    ASSERT_TRUE(q.ok()) << q.status();
    const MatrixRef host = q->View();
    DeviceMatrix dm(*q);
    DeviceVector<float> per_row(N), blocks(cuda::Fp8BlockScaleCount(N, K));
    cuda::PrepareFp8WeightScales(dm.ref, cuda::Fp8ScaleLayout::kPerRow, per_row.p, nullptr);
    cuda::PrepareFp8WeightScales(dm.ref, cuda::Fp8ScaleLayout::kBlocks, blocks.p, nullptr);
    CUDA_ASSERT_OK(cudaGetLastError());
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    const std::vector<float> rows = per_row.ToHost();
    for (int64_t n = 0; n < N; ++n)
      ASSERT_EQ(rows[n], LoadAsFloat(host.quant.scale, host.quant.scale_dtype,
                                     QuantScaleIndex(format, K, n, 0)))
          << n;
    if (format != QuantFormat::kFp8Block128) continue;
    const std::vector<float> got = blocks.ToHost();
    const int64_t ld = cuda::Fp8BlockScaleLd(K);
    ASSERT_EQ(ld, 8);
    for (int64_t nb = 0; nb < 3; ++nb)
      for (int64_t kb = 0; kb < ld; ++kb)
        ASSERT_EQ(got[nb * ld + kb],
                  kb < 5 ? static_cast<const float*>(host.quant.scale)[nb * 5 + kb] : 0.f)
            << nb << ", " << kb;
  }
  for (const QuantFormat format : {QuantFormat::kNvfp4, QuantFormat::kMxfp4}) {
    SCOPED_TRACE(QuantFormatName(format));
    auto q = QuantizeMatrix(format, {w.data(), DType::kF32, N, K});
    ASSERT_TRUE(q.ok()) << q.status();
    const int64_t groups = K / (format == QuantFormat::kNvfp4 ? 16 : 32);
    DeviceMatrix dm(*q);
    DeviceVector<uint8_t> tiled(cuda::TiledScaleCount(N, groups));
    cuda::TileFp4WeightScales(dm.ref, tiled.p, nullptr);
    CUDA_ASSERT_OK(cudaGetLastError());
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> want(tiled.n, 0);
    const auto* scales = static_cast<const uint8_t*>(q->View().quant.scale);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < groups; ++g)
        want[cuda::TiledScaleIndex(groups, n, g)] = scales[n * groups + g];
    EXPECT_EQ(tiled.ToHost(), want);
  }
}

// ---- the GEMMs

struct GemmCheck {
  double emulated_share = 0;  // max |y - y_emulated| as a share of its bound
  double norm_error = 0;      // ||y - y_exact|| / ||y_exact||
};

// Holds y = x . W^T from the device to two references:
//  - the emulation: the host-quantized x (the formulas the device uses, bit for bit) times the
//    exact-dequant W, in double. The products of codes are exact in the tensor cores and the
//    sums fp32; Hopper's FP8 MMA keeps ~14 bits in its accumulator between the promotions
//    cuBLASLt makes to fp32 (DeepSeek-V3, sec. 3.3.2), 2^-14 of the sum of |products|. Bound:
//    2^-10 of that sum, 16x headroom, while a wrong scale or layout is off by the whole sum.
//  - the exact reference: fp32 x times the exact-dequant W (core/quant/dequantize.h), in
//    double, which the quantized activations miss by their rounding. E4M3 keeps 3 mantissa bits:
//    a normal value rounds to within half an ulp, 2^-4 of itself at worst (the bottom of a
//    binade); below 2^-6 (subnormal) the step is 2^-9, so within 2^-10 absolute, both in units
//    of the group's scale s. Hence, per output, the bound
//      |y - y_exact| <= sum_k (2^-4 |x_k w_k| + 2^-10 s_k |w_k|) + the accumulation's 2^-10.
//    That worst case always holds but is loose (every rounding erring the same way); the errors
//    are independent and about uniform, RMS 2^-4 / sqrt(3) relative at worst, so over all
//    outputs ||y - y_exact|| <= 2^-4 ||y_exact|| (checked by the caller) leaves >= 1.7x, while a
//    factor-2 scale error (relative error 1) fails it.
void CheckGemm(const HostQuantized& xq, const std::vector<float>& x, const std::vector<float>& wdq,
               int64_t N, const std::vector<float>& y, bool fp4, GemmCheck* check) {
  const int rows = xq.rows, K = xq.cols;
  double err2 = 0, ref2 = 0;
  std::vector<double> q(K), s(K);
  for (int m = 0; m < rows; ++m) {
    const float* xm = x.data() + static_cast<size_t>(m) * K;
    for (int k = 0; k < K; ++k) {
      q[k] = xq.Value(m, k);
      s[k] = xq.scales[static_cast<size_t>(m) * xq.groups() + k / xq.group];
    }
    for (int64_t n = 0; n < N; ++n) {
      const float* wn = wdq.data() + n * K;
      double exact = 0, emulated = 0, magnitude = 0, rounding = 0;
      for (int k = 0; k < K; ++k) {
        const double w = wn[k];
        exact += xm[k] * w;
        emulated += q[k] * w;
        magnitude += std::fabs(q[k] * w);
        rounding += std::fabs(xm[k] * w) / 16 + s[k] * std::fabs(w) / 1024;
      }
      const double got = y[static_cast<size_t>(m) * N + n];
      const double tol = magnitude / 1024 + 1e-30;
      ASSERT_NEAR(got, emulated, tol) << "[" << m << ", " << n << "] against the emulation";
      check->emulated_share = std::max(check->emulated_share, std::fabs(got - emulated) / tol);
      if (!fp4) {
        ASSERT_NEAR(got, exact, rounding + tol) << "[" << m << ", " << n << "] against the exact";
      }
      err2 += (got - exact) * (got - exact);
      ref2 += exact * exact;
    }
  }
  check->norm_error = std::sqrt(err2 / std::max(ref2, 1e-300));
}

struct GemmShape {
  int64_t n, k;
};

// Quantizes W, runs the scaled GEMM for each row count, checks it. Unimplemented is allowed only
// where `may_be_unimplemented` says so, and printed.
void RunScaledGemm(cuda::ScaledGemmKind kind, QuantFormat format, GemmShape s,
                   bool may_be_unimplemented) {
  const std::vector<float> w = Random(s.n * s.k, 31);
  auto q = QuantizeMatrix(format, {w.data(), DType::kF32, s.n, s.k});
  ASSERT_TRUE(q.ok()) << q.status();
  const std::vector<float> wdq = DequantizeMatrix(q->View());
  DeviceMatrix dm(*q);
  auto gemm = cuda::ScaledGemm::Create(kind);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  absl::Status prepared = (*gemm)->Prepare(dm.ref);
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  for (const int rows : {1, 4, 64, 512}) {
    SCOPED_TRACE(Name(format, s.n, s.k, rows));
    const std::vector<float> x = Random(static_cast<size_t>(rows) * s.k, 41 + rows);
    DeviceVector<float> dx(x), dy(static_cast<size_t>(rows) * s.n);
    absl::Status status = prepared;
    if (status.ok()) status = (*gemm)->Run(dx.p, rows, dm.ref, dy.p, nullptr);
    CUDA_ASSERT_OK(cudaGetLastError());
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    if (!status.ok()) {
      EXPECT_TRUE(may_be_unimplemented && absl::IsUnimplemented(status)) << status;
      EXPECT_THAT(std::string(status.message()),
                  HasSubstr("[" + std::to_string(s.n) + ", " + std::to_string(s.k) + "]"));
      std::printf("# %-45s %s\n", Name(format, s.n, s.k, rows).c_str(),
                  std::string(status.message()).c_str());
      continue;
    }
    // The activation recipe of each weight format (kernels/cuda/gemm_scaled.h).
    HostQuantized xq;
    if (format == QuantFormat::kFp8Tensor || format == QuantFormat::kFp8Channel ||
               (format == QuantFormat::kFp8Block128 && s.k <= 128)) {
      xq = HostQuantizeFp8(x.data(), rows, s.k, s.k);
    } else if (format == QuantFormat::kFp8Block128) {
      xq = HostQuantizeFp8(x.data(), rows, s.k, 128);
    } else if (format == QuantFormat::kNvfp4) {
      xq = HostQuantizeNvfp4(x.data(), rows, s.k);
    } else {
      xq = HostQuantizeMxfp4(x.data(), rows, s.k);
    }
    const bool fp4 = kind == cuda::ScaledGemmKind::kFp4;
    GemmCheck check;
    CheckGemm(xq, x, wdq, s.n, dy.ToHost(), fp4, &check);
    if (testing::Test::HasFatalFailure()) return;
    // FP4 activations keep 1 mantissa bit: no bound this tight holds for them (the emulation
    // carries that check).
    if (!fp4) {
      EXPECT_LE(check.norm_error, std::ldexp(1.0, -4));
    }
    std::printf("# %-45s ||y - exact|| / ||exact|| %.4f; |y - emulated| <= %.2g of its bound\n",
                Name(format, s.n, s.k, rows).c_str(), check.norm_error, check.emulated_share);
  }
}

// Shapes: a plain one; N not a multiple of 128 (a partial block row); K not a multiple of 128 (a
// partial block along K: cuBLASLt may not take it for fp8_block128, and then it must say so);
// Qwen3-30B-A3B's expert gate/up; K <= 128 (fp8_block128 through the per-row path); a down-like
// one with K = 64.
constexpr GemmShape kFp8Shapes[] = {{256, 512},  {320, 256}, {256, 320},
                                    {768, 2048}, {64, 128},  {128, 64}};

TEST_F(GpuScaled, Fp8GemmMatchesTheExactDequantReference) {
  if (sm_ < 90) GTEST_SKIP() << "qgemm=fp8_cublaslt needs sm_90";
  for (const QuantFormat format :
       {QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel, QuantFormat::kFp8Block128})
    for (const GemmShape s : kFp8Shapes) {
      const bool partial_k_block = format == QuantFormat::kFp8Block128 && s.k > 128 && s.k % 128;
      // Off Hopper, cuBLASLt has no 128-block scale modes at all.
      const bool blocks_elsewhere = format == QuantFormat::kFp8Block128 && s.k > 128 && sm_ != 90;
      RunScaledGemm(cuda::ScaledGemmKind::kFp8, format, s, partial_k_block || blocks_elsewhere);
    }
}

TEST_F(GpuScaled, Fp8ShapesItCannotTakeAreUnimplementedNamingTheShape) {
  const std::vector<float> w = Random(64 * 40, 51);
  auto q = QuantizeMatrix(QuantFormat::kFp8Tensor, {w.data(), DType::kF32, 64, 40});
  ASSERT_TRUE(q.ok());
  DeviceMatrix dm(*q);
  auto gemm = cuda::ScaledGemm::Create(cuda::ScaledGemmKind::kFp8);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  const absl::Status s = (*gemm)->Prepare(dm.ref);
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("[64, 40]"));
  auto fp4 = QuantizeMatrix(QuantFormat::kNvfp4, {w.data(), DType::kF32, 64, 32});
  ASSERT_TRUE(fp4.ok());
  DeviceMatrix dm4(*fp4);
  EXPECT_TRUE(absl::IsInvalidArgument((*gemm)->Prepare(dm4.ref)));
  float* y = nullptr;
  EXPECT_TRUE(absl::IsFailedPrecondition((*gemm)->Run(nullptr, 1, dm4.ref, y, nullptr)))
      << "an unprepared weight";
}

// Block-scaled FP4 tensor cores exist on sm_100 / sm_120 only. There the GEMM is held to the
// emulation; on Hopper cuBLASLt must answer Unimplemented (an ERROR verdict, never a crash).
TEST_F(GpuScaled, NativeFp4GemmOrUnimplemented) {
  constexpr GemmShape kShapes[] = {{256, 512}, {320, 256}, {768, 2048}, {64, 128}};
  for (const QuantFormat format : {QuantFormat::kNvfp4, QuantFormat::kMxfp4})
    for (const GemmShape s : kShapes)
      RunScaledGemm(cuda::ScaledGemmKind::kFp4, format, s, sm_ < 100);
}

// ---- as trials


// qgemm=fp8_cublaslt is OK against the GPU reference on the same FP8 weights, in the fp8 class,
// and a corrupted weight scale is INCORRECT. The fault multiplies layer 0's first q_proj scale
// by 16. On tiny-moe (Qwen3) q passes through a per-head RMSNorm that undoes a scale on the whole
// of q_proj (fp8_tensor, and fp8_block128 at these sizes: one block), so the fault is judged on
// tiny-qwen2-moe, which has no q_norm (CPU emulation: KL >= 0.18 there, the fp8 class allows 0.05).
TEST_F(GpuScaled, Fp8CublasLtConfigsAreOkAndBadScaleIsIncorrect) {
  if (sm_ < 90) GTEST_SKIP() << "qgemm=fp8_cublaslt needs sm_90";
  TrialExecutor executor;
  for (const char* format : {"fp8_tensor", "fp8_channel", "fp8_block128"}) {
    for (const char* preset : {"preset:tiny-moe", "preset:tiny-qwen2-moe"}) {
      const std::string model = std::string(preset) + "@" + format;
      for (const char* config : {"device=cuda,gemm=cublaslt,qgemm=fp8_cublaslt",
                                 "device=cuda,attention=flash,qgemm=fp8_cublaslt"}) {
        const TrialResult ok = executor.Execute(GpuRequest(model, config));
        EXPECT_EQ(ok.status, TrialStatus::kOk) << model << " " << config << ": " << ok.reason;
        EXPECT_EQ(ok.verdict.precision_class, "fp8");
        std::printf("# %-32s %-48s %s (top1 %.3f, kl_mean %.2g, kl_max %.2g)\n", model.c_str(),
                    config, std::string(TrialStatusName(ok.status)).c_str(),
                    ok.verdict.top1_agreement, ok.verdict.kl_mean, ok.verdict.kl_max);
      }
      if (std::string(preset) != "preset:tiny-qwen2-moe") continue;
      const char* config = "device=cuda,gemm=cublaslt,qgemm=fp8_cublaslt";
      const TrialResult bad = executor.Execute(GpuRequest(model, config, "bad-quant-scale:16"));
      EXPECT_EQ(bad.status, TrialStatus::kIncorrect) << model << ": " << bad.reason;
      std::printf("# %-32s bad-quant-scale:16 %s (top1 %.3f, kl_mean %.2g)\n", model.c_str(),
                  std::string(TrialStatusName(bad.status)).c_str(), bad.verdict.top1_agreement,
                  bad.verdict.kl_mean);
    }
  }
}

TEST_F(GpuScaled, NativeFp4IsUnsupportedOnHopper) {
  TrialExecutor executor;
  for (const char* format : {"nvfp4", "mxfp4"}) {
    const std::string model = std::string("preset:tiny-moe@") + format;
    const TrialResult r =
        executor.Execute(GpuRequest(model, "device=cuda,gemm=cublaslt,qgemm=native_fp4"));
    std::printf("# %s qgemm=native_fp4 on sm_%d: %s %s\n", format, sm_,
                std::string(TrialStatusName(r.status)).c_str(), r.reason.c_str());
    if (sm_ < 100) {
      EXPECT_EQ(r.status, TrialStatus::kUnsupported) << r.reason;
      EXPECT_EQ(r.reason,
                "qgemm=native_fp4 needs sm_100 or newer; the GPU is sm_" + std::to_string(sm_));
    } else {
      EXPECT_EQ(r.status, TrialStatus::kOk) << r.reason;  // unverified: no such GPU here yet
    }
  }
}

#else

TEST(GpuScaled, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace
}  // namespace infersweep
