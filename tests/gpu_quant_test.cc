// The CUDA quantized-weight kernels (kernels/cuda/quant.h) against the CPU's exact dequantization
// at several shapes, including ones that are not multiples of any tile. Skipped (not failed) on
// machines without a GPU: CI compiles it, the GPU machine runs it (scripts/gpu.sh).
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/quant/dequantize.h"
#include "engine/quant/layout.h"
#include "engine/quant/quantize.h"
#ifdef INFERSWEEP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/quant.h"
#endif

namespace infersweep {
namespace {

#ifdef INFERSWEEP_HAVE_CUDA

// Tests that need a device skip (not fail) where CUDA finds none.
class GpuQuant : public testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no GPU on this machine";
    }
  }
};

#define CUDA_EXPECT_OK(expr)                                               \
  do {                                                                     \
    const cudaError_t _e = (expr);                                         \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e); \
  } while (0)

// Device copies of a quantized matrix's parts, freed with the object.
struct DeviceMatrix {
  std::vector<void*> buffers;
  MatrixRef ref;

  explicit DeviceMatrix(const QuantizedMatrix& q) {
    ref = q.View();
    std::vector<const void*> host = {ref.data, ref.quant.scale, ref.quant.global_scale};
    std::vector<void*> device(host.size(), nullptr);
    for (size_t i = 0; i < q.parts.size(); ++i) {
      void* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, q.parts[i].size()), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d, q.parts[i].data(), q.parts[i].size(), cudaMemcpyHostToDevice),
                cudaSuccess);
      buffers.push_back(d);
      for (size_t h = 0; h < host.size(); ++h)
        if (host[h] == q.parts[i].data()) device[h] = d;
    }
    ref.data = device[0];
    ref.quant.scale = device[1];
    ref.quant.global_scale = device[2];
  }
  ~DeviceMatrix() {
    for (void* b : buffers) cudaFree(b);
  }
};

template <typename T>
std::vector<T> ToHost(const T* device, size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return d;
}

std::vector<float> RandomValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

struct Shape {
  int64_t rows, cols;
};

std::string Name(QuantFormat f, Shape s) {
  return QuantFormatName(f) + " [" + std::to_string(s.rows) + ", " + std::to_string(s.cols) + "]";
}

// The fp32 kernel is bit-identical to the CPU (same formula); the bf16 one is its rounding.
TEST_F(GpuQuant, DequantizeMatchesTheCpuExactly) {
  const Shape shapes[] = {{1, 32}, {37, 96}, {130, 160}, {768, 2048}, {2048, 768}};
  for (QuantFormat format : {QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel,
                             QuantFormat::kFp8Block128, QuantFormat::kNvfp4, QuantFormat::kMxfp4}) {
    for (Shape s : shapes) {
      SCOPED_TRACE(Name(format, s));
      const std::vector<float> w = RandomValues(s.rows * s.cols, 5);
      auto q = QuantizeMatrix(format, {w.data(), DType::kF32, s.rows, s.cols});
      ASSERT_TRUE(q.ok()) << q.status();
      const std::vector<float> cpu = DequantizeMatrix(q->View());
      DeviceMatrix dm(*q);
      float* f32 = nullptr;
      uint16_t* bf16 = nullptr;
      CUDA_EXPECT_OK(cudaMalloc(&f32, cpu.size() * sizeof(float)));
      CUDA_EXPECT_OK(cudaMalloc(&bf16, cpu.size() * sizeof(uint16_t)));
      cuda::DequantizeToF32(dm.ref, f32, nullptr);
      cuda::DequantizeToBf16(dm.ref, bf16, nullptr);
      CUDA_EXPECT_OK(cudaGetLastError());
      CUDA_EXPECT_OK(cudaDeviceSynchronize());
      const std::vector<float> got = ToHost(f32, cpu.size());
      const std::vector<uint16_t> got_bf16 = ToHost(bf16, cpu.size());
      cudaFree(f32);
      cudaFree(bf16);
      for (size_t i = 0; i < cpu.size(); ++i) {
        ASSERT_EQ(got[i], cpu[i]) << "element " << i;
        ASSERT_EQ(got_bf16[i], FloatToBf16(cpu[i])) << "element " << i;
      }
    }
  }
}

// y = x . W^T against a double-precision sum over the CPU's dequantized W.
TEST_F(GpuQuant, W4A16GemvMatchesTheExactDequantReference) {
  const Shape shapes[] = {{768, 2048}, {2048, 768}, {37, 96}, {5, 32}, {129, 1056}};
  for (QuantFormat format : {QuantFormat::kNvfp4, QuantFormat::kMxfp4}) {
    for (Shape s : shapes) {
      for (int rows : {1, 3, 9}) {
        SCOPED_TRACE(Name(format, s) + " rows " + std::to_string(rows));
        const std::vector<float> w = RandomValues(s.rows * s.cols, 9);
        auto q = QuantizeMatrix(format, {w.data(), DType::kF32, s.rows, s.cols});
        ASSERT_TRUE(q.ok()) << q.status();
        const std::vector<float> dq = DequantizeMatrix(q->View());
        std::vector<float> x = RandomValues(rows * s.cols, 17);
        std::vector<uint16_t> x_bf16(x.size());
        for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = FloatToBf16(x[i]);

        DeviceMatrix dm(*q);
        ASSERT_TRUE(cuda::W4A16Supports(dm.ref));
        float* dx = ToDevice(x);
        uint16_t* dx_bf16 = ToDevice(x_bf16);
        float *dy = nullptr, *dy_bf16 = nullptr;
        CUDA_EXPECT_OK(cudaMalloc(&dy, rows * s.rows * sizeof(float)));
        CUDA_EXPECT_OK(cudaMalloc(&dy_bf16, rows * s.rows * sizeof(float)));
        cuda::GemvW4A16(dx, rows, dm.ref, dy, nullptr);
        cuda::GemvW4A16Bf16(dx_bf16, rows, dm.ref, dy_bf16, nullptr);
        CUDA_EXPECT_OK(cudaGetLastError());
        CUDA_EXPECT_OK(cudaDeviceSynchronize());
        const std::vector<float> y = ToHost(dy, rows * s.rows);
        const std::vector<float> y_bf16 = ToHost(dy_bf16, rows * s.rows);
        for (void* p : {static_cast<void*>(dx), static_cast<void*>(dx_bf16), static_cast<void*>(dy),
                        static_cast<void*>(dy_bf16)})
          cudaFree(p);

        for (int m = 0; m < rows; ++m) {
          for (int64_t n = 0; n < s.rows; ++n) {
            double exact = 0, exact_bf16 = 0, magnitude = 0;
            for (int64_t k = 0; k < s.cols; ++k) {
              const double wk = dq[n * s.cols + k];
              exact += x[m * s.cols + k] * wk;
              exact_bf16 += Bf16ToFloat(x_bf16[m * s.cols + k]) * wk;
              magnitude += std::fabs(x[m * s.cols + k] * wk);
            }
            // fp32 accumulation in another order: a few ulps of the sum of magnitudes.
            const double tol = 2e-6 * magnitude + 1e-30;
            ASSERT_NEAR(y[m * s.rows + n], exact, tol) << "[" << m << ", " << n << "]";
            ASSERT_NEAR(y_bf16[m * s.rows + n], exact_bf16, tol) << "[" << m << ", " << n << "]";
          }
        }
      }
    }
  }
}

TEST(QuantW4A16, SupportsOnlyFp4WithWholeChunks) {
  const std::vector<float> w = RandomValues(4 * 48, 1);
  auto nvfp4_48 = QuantizeMatrix(QuantFormat::kNvfp4, {w.data(), DType::kF32, 4, 48});
  ASSERT_TRUE(nvfp4_48.ok());
  EXPECT_FALSE(cuda::W4A16Supports(nvfp4_48->View())) << "K=48 is not a whole 32-code chunk";
  auto fp8 = QuantizeMatrix(QuantFormat::kFp8Tensor, {w.data(), DType::kF32, 4, 48});
  ASSERT_TRUE(fp8.ok());
  EXPECT_FALSE(cuda::W4A16Supports(fp8->View()));
}

#else

TEST(GpuQuant, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace
}  // namespace infersweep
