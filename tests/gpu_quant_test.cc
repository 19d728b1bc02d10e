// The CUDA quantized-weight kernels (kernels/cuda/quant.h) against the CPU's exact dequantization
// at several shapes, including ones that are not multiples of any tile. Skipped (not failed) on
// machines without a GPU: CI compiles it, the GPU machine runs it (scripts/gpu.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/quant/codecs.h"
#include "core/quant/dequantize.h"
#include "engine/quant/layout.h"
#include "engine/quant/quantize.h"
#ifdef INFERSWEEP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.h"
#include "kernels/cuda/sm90a/moe_wgmma.h"
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

// One dense GEMM case of the w8a8 checks: a weight [n, k] times `rows` input rows.
struct DenseCase {
  int64_t n, k;
  int rows;
};
std::string DenseCaseName(QuantFormat format, const DenseCase& c) {
  return QuantFormatName(format) + " [" + std::to_string(c.n) + ", " + std::to_string(c.k) +
         "] rows " + std::to_string(c.rows);
}
// The case's weight: normal values (seed 71) quantized to `format`.
absl::StatusOr<QuantizedMatrix> RandomDenseWeight(QuantFormat format, const DenseCase& c) {
  const std::vector<float> w = RandomValues(c.n * c.k, 71);
  return QuantizeMatrix(format, {w.data(), DType::kF32, c.n, c.k});
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
      // Also: two copies in one DequantizeManyToBf16 launch (the quantized prefill's), and an
      // output 2 bytes off 16-byte alignment (the kernels' element-wise path).
      uint16_t *many = nullptr, *unaligned = nullptr;
      MatrixRef* refs = nullptr;
      CUDA_EXPECT_OK(cudaMalloc(&many, 2 * cpu.size() * sizeof(uint16_t)));
      CUDA_EXPECT_OK(cudaMalloc(&unaligned, (cpu.size() + 1) * sizeof(uint16_t)));
      CUDA_EXPECT_OK(cudaMalloc(&refs, 2 * sizeof(MatrixRef)));
      const MatrixRef pair[2] = {dm.ref, dm.ref};
      CUDA_EXPECT_OK(cudaMemcpy(refs, pair, sizeof(pair), cudaMemcpyHostToDevice));
      cuda::DequantizeToF32(dm.ref, f32, nullptr);
      cuda::DequantizeToBf16(dm.ref, bf16, nullptr);
      cuda::DequantizeManyToBf16(refs, 2, s.rows, s.cols, many, nullptr);
      cuda::DequantizeToBf16(dm.ref, unaligned + 1, nullptr);
      CUDA_EXPECT_OK(cudaGetLastError());
      CUDA_EXPECT_OK(cudaDeviceSynchronize());
      const std::vector<float> got = ToHost(f32, cpu.size());
      const std::vector<uint16_t> got_bf16 = ToHost(bf16, cpu.size());
      const std::vector<uint16_t> got_many = ToHost(many, 2 * cpu.size());
      const std::vector<uint16_t> got_unaligned = ToHost(unaligned, cpu.size() + 1);
      for (void* p : {static_cast<void*>(f32), static_cast<void*>(bf16), static_cast<void*>(many),
                      static_cast<void*>(unaligned), static_cast<void*>(refs)})
        cudaFree(p);
      for (size_t i = 0; i < cpu.size(); ++i) {
        ASSERT_EQ(got[i], cpu[i]) << "element " << i;
        ASSERT_EQ(got_bf16[i], FloatToBf16(cpu[i])) << "element " << i;
        ASSERT_EQ(got_many[i], FloatToBf16(cpu[i])) << "many, first copy, element " << i;
        ASSERT_EQ(got_many[cpu.size() + i], FloatToBf16(cpu[i]))
            << "many, second copy, element " << i;
        ASSERT_EQ(got_unaligned[i + 1], FloatToBf16(cpu[i])) << "unaligned, element " << i;
      }
    }
  }
}

// The tensor-core kernels' decode (DecodeRun, through the bf16 copy it makes) against the CPU bit
// for bit over every code and every finite scale. FP4: random codes (E2M1's subnormal 0.5 and
// both zeros among them) under group scales that run through all E4M3 codes but NaN (its
// subnormals, 448, negative ones) or all E8M0 codes but NaN (2^-127 .. 2^127: the largest
// overflow to infinity on both sides). FP8: every E4M3 code but NaN (subnormals included), in
// turn, under each row's channel scale.
TEST_F(GpuQuant, QuantDecodeIsExactForEveryCodeAndScale) {
  const Shape s{64, 1024};
  for (QuantFormat format : {QuantFormat::kNvfp4, QuantFormat::kMxfp4, QuantFormat::kFp8Channel}) {
    SCOPED_TRACE(Name(format, s));
    const std::vector<float> w = RandomValues(s.rows * s.cols, 5);
    auto q = QuantizeMatrix(format, {w.data(), DType::kF32, s.rows, s.cols});
    ASSERT_TRUE(q.ok()) << q.status();
    std::vector<uint8_t>& codes = q->parts[0];
    std::mt19937 rng(17);
    int subnormal_codes = 0;
    if (IsFp4(format)) {
      for (uint8_t& code : codes) {
        code = static_cast<uint8_t>(rng());
        subnormal_codes += (code & 7) == 1;
      }
      std::vector<uint8_t>& scales = q->parts[1];
      for (size_t i = 0; i < scales.size(); ++i) {
        const uint8_t c = static_cast<uint8_t>(i % 256);
        const bool nan = format == QuantFormat::kNvfp4 ? (c & 0x7f) == 0x7f : c == 0xff;
        scales[i] = nan ? static_cast<uint8_t>(c - 1) : c;
      }
    } else {
      for (size_t i = 0; i < codes.size(); ++i) {
        const uint8_t c = static_cast<uint8_t>(i % 256);
        codes[i] = (c & 0x7f) == 0x7f ? static_cast<uint8_t>(c - 1) : c;
        subnormal_codes += (c & 0x7f) != 0 && (c & 0x78) == 0;
      }
    }
    EXPECT_GT(subnormal_codes, 1000) << "the codes hold the format's subnormals";
    const std::vector<float> cpu = DequantizeMatrix(q->View());
    DeviceMatrix dm(*q);
    uint16_t* bf16 = nullptr;
    CUDA_EXPECT_OK(cudaMalloc(&bf16, cpu.size() * sizeof(uint16_t)));
    cuda::DequantizeToBf16(dm.ref, bf16, nullptr);
    CUDA_EXPECT_OK(cudaGetLastError());
    CUDA_EXPECT_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = ToHost(bf16, cpu.size());
    cudaFree(bf16);
    for (size_t i = 0; i < cpu.size(); ++i) {
      const size_t byte = IsFp4(format) ? i / 2 : i;
      ASSERT_EQ(got[i], FloatToBf16(cpu[i]))
          << "element " << i << " (cpu " << cpu[i] << ", code byte 0x" << std::hex
          << static_cast<int>(codes[byte]) << ")";
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

constexpr QuantFormat kAllFormats[] = {QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel,
                                       QuantFormat::kFp8Block128, QuantFormat::kNvfp4,
                                       QuantFormat::kMxfp4};

// sum_k x[k] * w[n, k] in double, and sum_k |x[k] * w[n, k]| (the scale of fp32 rounding).
std::pair<double, double> ExactDot(const float* x, const std::vector<float>& w, int64_t n,
                                   int64_t cols) {
  double dot = 0, magnitude = 0;
  for (int64_t k = 0; k < cols; ++k) {
    dot += static_cast<double>(x[k]) * w[n * cols + k];
    magnitude += std::fabs(static_cast<double>(x[k]) * w[n * cols + k]);
  }
  return {dot, magnitude};
}

// The fused quantized GEMV (gemm=fused's kernel for w4a16 / w8a16) with every fusion on: three
// segments of different heights, the RMSNorm of x, a bias, a residual add with a scale; and
// GemvW8A16 alone. Against double sums over the CPU's exact dequantization, at shapes whose
// rows and chunks do not fill a warp, a block or a pass, and at 1, 3 and 9 activation rows
// (9: two row blocks of 4 and one of 1 in grid.y).
TEST_F(GpuQuant, FusedQuantGemvMatchesTheExactDequantReference) {
  struct Case {
    int64_t k;
    int64_t n[3];
  };
  const Case cases[] = {{2048, {2048, 512, 512}}, {96, {37, 5, 1}},   {1056, {129, 64, 3}},
                        {32, {1, 2, 3}},          {4096, {33, 0, 0}}, {768, {2048, 0, 0}},
                        {48, {17, 3, 2}}};  // FP8 only: K = 3 chunks of 16
  for (QuantFormat format : kAllFormats) {
    for (const Case& c : cases) {
      if (IsFp4(format) && c.k % 32 != 0) continue;
      for (int rows : {1, 3, 9}) {
        const int segments = c.n[1] == 0 ? 1 : 3;
        SCOPED_TRACE(QuantFormatName(format) + " k " + std::to_string(c.k) + " n0 " +
                     std::to_string(c.n[0]) + " rows " + std::to_string(rows));
        std::vector<QuantizedMatrix> q;
        std::vector<std::vector<float>> dq;
        for (int s = 0; s < segments; ++s) {
          const std::vector<float> w = RandomValues(c.n[s] * c.k, 30 + s);
          auto made = QuantizeMatrix(format, {w.data(), DType::kF32, c.n[s], c.k});
          ASSERT_TRUE(made.ok()) << made.status();
          q.push_back(std::move(*made));
          dq.push_back(DequantizeMatrix(q.back().View()));
        }
        const std::vector<float> x = RandomValues(rows * c.k, 41);
        std::vector<float> gain = RandomValues(c.k, 43);
        std::vector<uint16_t> gain_bf16(c.k);
        for (int64_t i = 0; i < c.k; ++i) gain_bf16[i] = FloatToBf16(gain[i]);
        std::vector<float> bias = RandomValues(c.n[0], 47), y0 = RandomValues(rows * c.n[0], 53);
        const bool norm = segments == 3, accumulate = segments == 1 && rows != 3;
        const float scale = accumulate ? 0.75f : 1.f;

        std::vector<std::unique_ptr<DeviceMatrix>> dm;
        cuda::QuantGemvWeights qw;
        cuda::GemvArgs a;
        float* dx = ToDevice(x);
        uint16_t* dgain = ToDevice(gain_bf16);
        float* dbias = ToDevice(bias);
        std::vector<float*> dy;
        a.x = dx;
        a.rows = rows;
        a.k = static_cast<int>(c.k);
        if (norm) {
          a.norm_gain = dgain;
          a.norm_dtype = DType::kBF16;
          a.norm_eps = 1e-6f;
        }
        a.accumulate = accumulate;
        a.scale = scale;
        a.segments = segments;
        for (int s = 0; s < segments; ++s) {
          dm.push_back(std::make_unique<DeviceMatrix>(q[s]));
          ASSERT_TRUE(cuda::QuantGemvSupports(dm.back()->ref));
          qw.w[s] = dm.back()->ref;
          dy.push_back(ToDevice(s == 0 ? y0 : std::vector<float>(rows * c.n[s], 0.f)));
          a.seg[s].y = dy.back();
          a.seg[s].n = static_cast<int>(c.n[s]);
          a.seg[s].ld = static_cast<int>(c.n[s]);
        }
        a.seg[0].bias = dbias;
        a.seg[0].bias_dtype = DType::kF32;
        cuda::GemvQuant(a, qw, nullptr);
        CUDA_EXPECT_OK(cudaGetLastError());
        CUDA_EXPECT_OK(cudaDeviceSynchronize());

        for (int s = 0; s < segments; ++s) {
          const std::vector<float> y = ToHost(dy[s], rows * c.n[s]);
          for (int m = 0; m < rows; ++m) {
            std::vector<float> xin(x.begin() + m * c.k, x.begin() + (m + 1) * c.k);
            double inv = 1;
            if (norm) {
              double sum_sq = 0;
              for (float v : xin) sum_sq += static_cast<double>(v) * v;
              inv = 1 / std::sqrt(sum_sq / c.k + 1e-6);
              for (int64_t i = 0; i < c.k; ++i) xin[i] *= Bf16ToFloat(gain_bf16[i]);
            }
            for (int64_t n = 0; n < c.n[s]; ++n) {
              auto [dot, magnitude] = ExactDot(xin.data(), dq[s], n, c.k);
              double want = scale * dot * inv + (s == 0 ? bias[n] : 0);
              if (accumulate) want += y0[m * c.n[0] + n];
              const double tol = 4e-6 * (magnitude * inv + std::fabs(want)) + 1e-30;
              ASSERT_NEAR(y[m * c.n[s] + n], want, tol)
                  << "segment " << s << " [" << m << ", " << n << "]";
            }
          }
        }
        // GemvW8A16 is the same kernel without fusions (FP8 only).
        if (!IsFp4(format) && segments == 1) {
          float* dy_plain = nullptr;
          CUDA_EXPECT_OK(cudaMalloc(&dy_plain, rows * c.n[0] * sizeof(float)));
          cuda::GemvW8A16(dx, rows, dm[0]->ref, dy_plain, nullptr);
          CUDA_EXPECT_OK(cudaGetLastError());
          CUDA_EXPECT_OK(cudaDeviceSynchronize());
          const std::vector<float> y = ToHost(dy_plain, rows * c.n[0]);
          cudaFree(dy_plain);
          for (int m = 0; m < rows; ++m)
            for (int64_t n = 0; n < c.n[0]; ++n) {
              auto [dot, magnitude] = ExactDot(x.data() + m * c.k, dq[0], n, c.k);
              ASSERT_NEAR(y[m * c.n[0] + n], dot, 4e-6 * magnitude + 1e-30)
                  << "GemvW8A16 [" << m << ", " << n << "]";
            }
        }
        for (float* p : dy) cudaFree(p);
        cudaFree(dx);
        cudaFree(dgain);
        cudaFree(dbias);
      }
    }
  }
}

// Device tables for one projection of `experts` quantized matrices (MoE kernels).
struct DeviceExperts {
  std::vector<std::unique_ptr<DeviceMatrix>> matrices;
  std::vector<std::vector<float>> dequantized;
  void* table = nullptr;
  cuda::QuantExpertTable t;

  // The table holds the experts [held_begin, held_end) (held_end -1: all), as a rank at ep=on
  // holds them: the others' entries are null; `dequantized` has every expert.
  DeviceExperts(QuantFormat format, int count, int64_t rows, int64_t cols, uint32_t seed,
                int held_begin = 0, int held_end = -1) {
    if (held_end < 0) held_end = count;
    std::vector<const void*> pointers(3 * count, nullptr);
    for (int e = 0; e < count; ++e) {
      const std::vector<float> w = RandomValues(rows * cols, seed + e);
      auto q = QuantizeMatrix(format, {w.data(), DType::kF32, rows, cols});
      EXPECT_TRUE(q.ok()) << q.status();
      dequantized.push_back(DequantizeMatrix(q->View()));
      matrices.push_back(std::make_unique<DeviceMatrix>(*q));
      const MatrixRef& m = matrices.back()->ref;
      t.scale_dtype = m.quant.scale_dtype;
      if (e < held_begin || e >= held_end) continue;
      pointers[e] = m.data;
      pointers[count + e] = m.quant.scale;
      pointers[2 * count + e] = m.quant.global_scale;
    }
    EXPECT_EQ(cudaMalloc(&table, pointers.size() * sizeof(void*)), cudaSuccess);
    EXPECT_EQ(
        cudaMemcpy(table, pointers.data(), pointers.size() * sizeof(void*), cudaMemcpyHostToDevice),
        cudaSuccess);
    const auto* d = static_cast<const void* const*>(table);
    t.codes = d;
    t.scales = d + count;
    if (format == QuantFormat::kNvfp4) t.global_scales = d + 2 * count;
    t.format = format;
    t.rows = static_cast<int>(rows);
    t.cols = static_cast<int>(cols);
  }
  ~DeviceExperts() { cudaFree(table); }
};

// An MoE block's outputs against double sums over the CPU's exact dequantization: h[p] =
// silu(gate . x) * (up . x) for each pair p (routed to ids[p]; with h_in_bf16 the pairs of `skip`
// are not checked, as the grouped kernels never bucket them, and h may be off by its bf16
// rounding), and y = y0 + the routed, weighted down(h) over the pairs not routed to `skip`,
// against the kernel's own h (which isolates the down projection). `sum_tol` bounds the fp32
// rounding of a sum relative to the sum of its |terms|. Pairs of experts outside [held_begin,
// held_end) add nothing to y; the per-pair kernels (h in fp32) write their h as 0.
struct MoeOutputs {
  int hidden, inter, k, rows, skip;
  const std::vector<float>& x;
  const std::vector<int>& ids;
  const std::vector<float>& route;
  const std::vector<float>& y0;
  const std::vector<float>& h;
  const std::vector<float>& y;
  int held_begin = 0, held_end = std::numeric_limits<int>::max();
  // What the down projection read, where it is not h (qgemm=w8a8: h's E4M3 codes times scales).
  const std::vector<float>* down_input = nullptr;
  bool Held(int e) const { return e >= held_begin && e < held_end; }
};
void ExpectMoeMatchesExact(const MoeOutputs& m, const DeviceExperts& gate, const DeviceExperts& up,
                           const DeviceExperts& down, double sum_tol, bool h_in_bf16) {
  for (int p = 0; p < m.rows * m.k; ++p) {
    if (!m.Held(m.ids[p])) {
      if (!h_in_bf16) {
        for (int i = 0; i < m.inter; ++i) {
          ASSERT_EQ(m.h[static_cast<size_t>(p) * m.inter + i], 0.f)
              << "h pair " << p << " (expert not held) out " << i;
        }
      }
      continue;
    }
    if (h_in_bf16 && m.ids[p] == m.skip) continue;
    const float* xr = m.x.data() + (p / m.k) * m.hidden;
    for (int i = 0; i < m.inter; ++i) {
      auto [g, gm] = ExactDot(xr, gate.dequantized[m.ids[p]], i, m.hidden);
      auto [u, um] = ExactDot(xr, up.dequantized[m.ids[p]], i, m.hidden);
      const double want = g / (1 + std::exp(-g)) * u;
      // silu(g) * u with g and u each within fp32 rounding of their sums (then bf16's rounding)
      const double tol = sum_tol * (gm * std::fabs(u) + um * std::fabs(g) + std::fabs(want)) +
                         (h_in_bf16 ? std::ldexp(std::fabs(want), -8) : 0.0) + 1e-30;
      ASSERT_NEAR(m.h[static_cast<size_t>(p) * m.inter + i], want, tol)
          << "h pair " << p << " out " << i;
    }
  }
  for (int r = 0; r < m.rows; ++r)
    for (int j = 0; j < m.hidden; ++j) {
      double want = m.y0[r * m.hidden + j], magnitude = std::fabs(want);
      for (int slot = 0; slot < m.k; ++slot) {
        const int p = r * m.k + slot;
        if (m.ids[p] == m.skip || !m.Held(m.ids[p])) continue;
        const std::vector<float>& h = m.down_input ? *m.down_input : m.h;
        auto [d, dm] = ExactDot(h.data() + static_cast<size_t>(p) * m.inter,
                                down.dequantized[m.ids[p]], j, m.inter);
        want += m.route[p] * d;
        magnitude += m.route[p] * dm;
      }
      ASSERT_NEAR(m.y[r * m.hidden + j], want, sum_tol * magnitude + 1e-30)
          << "y row " << r << " out " << j;
    }
}

// moe=fused's quantized expert kernels: gate/up + SiLU, then down + weighted combine into the
// residual (with one expert skipped, as the zero-expert fault does), against double sums over
// the CPU's exact dequantization. Shapes: qwen3-30b-a3b's, tiny ones whose rows do not fill a
// pass, and FP8 ones with K not a multiple of 32.
TEST_F(GpuQuant, MoeExpertKernelsMatchTheExactDequantReference) {
  struct Case {
    int hidden, inter, experts, k, rows;
  };
  const Case cases[] = {{2048, 768, 16, 8, 1},
                        {128, 64, 8, 2, 3},
                        {96, 160, 5, 1, 2},
                        {1056, 96, 4, 3, 1},
                        {48, 80, 3, 2, 2}};  // the last: FP8 only
  for (QuantFormat format : kAllFormats) {
    for (Case c : cases) {
      if (IsFp4(format) && (c.hidden % 32 != 0 || c.inter % 32 != 0)) continue;
      SCOPED_TRACE(QuantFormatName(format) + " hidden " + std::to_string(c.hidden) + " inter " +
                   std::to_string(c.inter) + " k " + std::to_string(c.k));
      DeviceExperts gate(format, c.experts, c.inter, c.hidden, 100);
      DeviceExperts up(format, c.experts, c.inter, c.hidden, 200);
      DeviceExperts down(format, c.experts, c.hidden, c.inter, 300);
      ASSERT_TRUE(cuda::MoeQuantSupports(gate.t, 1));
      ASSERT_TRUE(cuda::MoeQuantSupports(down.t, c.k));
      const int pairs = c.rows * c.k;
      std::vector<int> ids(pairs);
      std::vector<float> route(pairs);
      std::mt19937 rng(7);
      for (int p = 0; p < pairs; ++p) {
        ids[p] = (p * 7 + 3 + static_cast<int>(rng() % 2)) % c.experts;
        route[p] = 0.1f + 0.8f * static_cast<float>(rng() % 1000) / 1000.f;
      }
      const int skip = ids[0];
      const std::vector<float> x = RandomValues(c.rows * c.hidden, 61);
      const std::vector<float> y0 = RandomValues(c.rows * c.hidden, 67);
      int* dids = ToDevice(ids);
      float* droute = ToDevice(route);
      float* dx = ToDevice(x);
      float* dy = ToDevice(y0);
      float* dh = nullptr;
      CUDA_EXPECT_OK(cudaMalloc(&dh, static_cast<size_t>(pairs) * c.inter * sizeof(float)));
      cuda::MoeGateUpQuant(dx, c.rows, c.k, dids, 0, c.experts, gate.t, up.t, dh, nullptr);
      cuda::MoeDownCombineQuant(dh, c.rows, c.k, dids, droute, skip, 0, c.experts, down.t, dy,
                                nullptr);
      CUDA_EXPECT_OK(cudaGetLastError());
      CUDA_EXPECT_OK(cudaDeviceSynchronize());
      const std::vector<float> h = ToHost(dh, static_cast<size_t>(pairs) * c.inter);
      const std::vector<float> y = ToHost(dy, static_cast<size_t>(c.rows) * c.hidden);
      for (void* p : {static_cast<void*>(dids), static_cast<void*>(droute), static_cast<void*>(dx),
                      static_cast<void*>(dy), static_cast<void*>(dh)})
        cudaFree(p);

      ExpectMoeMatchesExact({c.hidden, c.inter, c.k, c.rows, skip, x, ids, route, y0, h, y}, gate,
                            up, down, 4e-6, /*h_in_bf16=*/false);
    }
  }
}

// A rank's quantized experts at ep=on: the tables hold experts [2, 6) of 8, the others' entries
// null. The per-pair kernels write h = 0 for the other experts' pairs and leave them out of y
// (the grouped kernels' cases of held experts are among theirs below).
TEST_F(GpuQuant, QuantExpertKernelsRunOnlyTheHeldExperts) {
  const int hidden = 128, inter = 64, experts = 8, k = 2, rows = 6, begin = 2, end = 6;
  for (QuantFormat format : kAllFormats) {
    SCOPED_TRACE(QuantFormatName(format));
    DeviceExperts gate(format, experts, inter, hidden, 100, begin, end);
    DeviceExperts up(format, experts, inter, hidden, 200, begin, end);
    DeviceExperts down(format, experts, hidden, inter, 300, begin, end);
    const int pairs = rows * k;
    std::vector<int> ids(pairs);
    std::vector<float> route(pairs);
    for (int p = 0; p < pairs; ++p) {  // every expert, held or not, a few times
      ids[p] = (p * 3) % experts;
      route[p] = 0.2f + 0.05f * p;
    }
    const std::vector<float> x = RandomValues(rows * hidden, 61);
    const std::vector<float> y0 = RandomValues(rows * hidden, 67);
    int* dids = ToDevice(ids);
    float* droute = ToDevice(route);
    float* dx = ToDevice(x);
    float* dy = ToDevice(y0);
    // h starts as NaN: the pairs of experts not held must write their zeros, not leave it.
    float* dh = ToDevice(std::vector<float>(static_cast<size_t>(pairs) * inter, NAN));
    cuda::MoeGateUpQuant(dx, rows, k, dids, begin, end, gate.t, up.t, dh, nullptr);
    cuda::MoeDownCombineQuant(dh, rows, k, dids, droute, -1, begin, end, down.t, dy, nullptr);
    CUDA_EXPECT_OK(cudaGetLastError());
    CUDA_EXPECT_OK(cudaDeviceSynchronize());
    const std::vector<float> h = ToHost(dh, static_cast<size_t>(pairs) * inter);
    const std::vector<float> y = ToHost(dy, static_cast<size_t>(rows) * hidden);
    for (void* p : {static_cast<void*>(dids), static_cast<void*>(droute), static_cast<void*>(dx),
                    static_cast<void*>(dy), static_cast<void*>(dh)})
      cudaFree(p);
    ExpectMoeMatchesExact({hidden, inter, k, rows, -1, x, ids, route, y0, h, y, begin, end}, gate,
                          up, down, 4e-6, /*h_in_bf16=*/false);
  }
}

struct GroupedCase {
  int hidden, inter, experts, k, rows;
  int held_begin = 0, held_end = -1;  // the experts held (held_end -1: all)
};

// moe=wgmma's shapes: one tile an expert with N 32 (a few pairs), features that fill one block
// row, more than 128 pairs an expert (two tiles, the second a partial N), and (the last two) a
// rank's experts at ep=on (the others' table entries null, their pairs left out).
const GroupedCase kWgmmaCases[] = {{256, 128, 8, 2, 5},
                                   {128, 256, 4, 3, 40},
                                   {256, 128, 2, 2, 160},
                                   {128, 256, 4, 3, 40, 2, 4},
                                   {256, 128, 8, 2, 20, 4, 8}};

// check(format, case) for each format and case, the pair named in failures.
template <typename Formats, typename Cases, typename Check>
void ForEachGroupedCase(const Formats& formats, const Cases& cases, Check check) {
  for (QuantFormat format : formats) {
    for (const GroupedCase& c : cases) {
      SCOPED_TRACE(QuantFormatName(format) + " hidden " + std::to_string(c.hidden) + " inter " +
                   std::to_string(c.inter) + " rows " + std::to_string(c.rows) + " held " +
                   std::to_string(c.held_begin) + ".." + std::to_string(c.held_end));
      check(format, c);
    }
  }
}

// A grouped case's random routing (ids, route weights; the pairs of `skip` are left out) and the
// MoeGrouped arguments every variant shares (device buffers: the caller's).
struct GroupedRouting {
  std::vector<int> ids;
  std::vector<float> route;
  int skip = -1;
};
GroupedRouting RandomRouting(const GroupedCase& c) {
  GroupedRouting r;
  const int pairs = c.rows * c.k;
  r.ids.resize(pairs);
  r.route.resize(pairs);
  std::mt19937 rng(11);
  for (int p = 0; p < pairs; ++p) {
    r.ids[p] = static_cast<int>(rng() % c.experts);
    r.route[p] = 0.1f + 0.8f * static_cast<float>(rng() % 1000) / 1000.f;
  }
  r.skip = r.ids[1];
  return r;
}
cuda::MoeGroupedArgs GroupedArgs(const GroupedCase& c, int held_end, int skip, const int* ids,
                                 const float* route, int* offsets, int* sorted, uint16_t* h,
                                 float* out, float* y, const cuda::QuantExpertTable* tables) {
  cuda::MoeGroupedArgs a;
  a.rows = c.rows;
  a.k = c.k;
  a.num_experts = c.experts;
  a.hidden = c.hidden;
  a.inter = c.inter;
  a.expert_ids = ids;
  a.expert_weights = route;
  a.skip_expert = skip;
  a.expert_begin = c.held_begin;
  a.expert_end = held_end;
  a.offsets = offsets;
  a.sorted_pairs = sorted;
  a.h = h;
  a.out = out;
  a.y = y;
  a.quant = tables;
  return a;
}

// One case of the grouped quantized expert kernels (MoeGrouped with quant tables): h =
// silu(gate) * up rounded to bf16 and the weighted combine of down(h) into the residual (one
// expert skipped), against double sums over the CPU's exact dequantization with the
// bf16-rounded inputs the kernels read. `wgmma`: moe=wgmma's kernels (codes decoded into shared
// memory), whose h is in bucketed order; else moe=fused's mma.sync kernels. FP8 block-128 is
// refused by both.
void CheckGroupedQuantCase(QuantFormat format, const GroupedCase& c, bool wgmma) {
  const int held_end = c.held_end < 0 ? c.experts : c.held_end;
  DeviceExperts gate(format, c.experts, c.inter, c.hidden, 100, c.held_begin, held_end);
  DeviceExperts up(format, c.experts, c.inter, c.hidden, 200, c.held_begin, held_end);
  DeviceExperts down(format, c.experts, c.hidden, c.inter, 300, c.held_begin, held_end);
  const bool supported = cuda::MoeGroupedQuantSupports(gate.t, up.t, down.t);
  if (format == QuantFormat::kFp8Block128) {
    EXPECT_FALSE(supported);
    if (wgmma) {
      EXPECT_FALSE(cuda::MoeWgmmaQuantSupports(gate.t, up.t, down.t, c.hidden, c.inter));
    }
    return;
  }
  ASSERT_TRUE(supported);
  if (wgmma) {
    ASSERT_TRUE(cuda::MoeWgmmaQuantSupports(gate.t, up.t, down.t, c.hidden, c.inter));
  }
  const int pairs = c.rows * c.k;
  const auto [ids, route, skip] = RandomRouting(c);
  const std::vector<float> x_raw = RandomValues(c.rows * c.hidden, 61);
  std::vector<uint16_t> x_bf16(x_raw.size());
  std::vector<float> x(x_raw.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x_bf16[i] = FloatToBf16(x_raw[i]);
    x[i] = Bf16ToFloat(x_bf16[i]);
  }
  const std::vector<float> y0 = RandomValues(c.rows * c.hidden, 67);
  int* dids = ToDevice(ids);
  float* droute = ToDevice(route);
  uint16_t* dx = ToDevice(x_bf16);
  float* dy = ToDevice(y0);
  int *offsets = nullptr, *sorted = nullptr;
  uint16_t* dh = nullptr;
  float* dout = nullptr;
  CUDA_EXPECT_OK(cudaMalloc(&offsets, (c.experts + 1) * sizeof(int)));
  CUDA_EXPECT_OK(cudaMalloc(&sorted, pairs * sizeof(int)));
  CUDA_EXPECT_OK(cudaMalloc(&dh, static_cast<size_t>(pairs) * c.inter * sizeof(uint16_t)));
  CUDA_EXPECT_OK(cudaMalloc(&dout, static_cast<size_t>(pairs) * c.hidden * sizeof(float)));
  const cuda::QuantExpertTable tables[3] = {gate.t, up.t, down.t};
  cuda::MoeGroupedArgs a =
      GroupedArgs(c, held_end, skip, dids, droute, offsets, sorted, dh, dout, dy, tables);
  a.x_bf16 = dx;
  a.kernel = cuda::MoeGroupedKernelFor(/*quantized=*/true, wgmma, pairs, c.experts);
  cuda::MoeGrouped(a, nullptr);
  CUDA_EXPECT_OK(cudaGetLastError());
  CUDA_EXPECT_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> h_bits = ToHost(dh, static_cast<size_t>(pairs) * c.inter);
  if (wgmma) {  // bucketed position i holds pair sorted[i]: back to pair order
    const std::vector<int> order = ToHost(sorted, static_cast<size_t>(pairs));
    const int placed = ToHost(offsets, static_cast<size_t>(c.experts + 1))[c.experts];
    std::vector<uint16_t> by_pair(h_bits.size(), 0);
    for (int i = 0; i < placed; ++i)
      std::copy_n(h_bits.begin() + static_cast<size_t>(i) * c.inter, c.inter,
                  by_pair.begin() + static_cast<size_t>(order[i]) * c.inter);
    h_bits = std::move(by_pair);
  }
  const std::vector<float> y = ToHost(dy, static_cast<size_t>(c.rows) * c.hidden);
  for (void* p : {static_cast<void*>(dids), static_cast<void*>(droute), static_cast<void*>(dx),
                  static_cast<void*>(dy), static_cast<void*>(offsets), static_cast<void*>(sorted),
                  static_cast<void*>(dh), static_cast<void*>(dout)})
    cudaFree(p);
  std::vector<float> h(h_bits.size());
  for (size_t i = 0; i < h.size(); ++i) h[i] = Bf16ToFloat(h_bits[i]);

  ExpectMoeMatchesExact(
      {c.hidden, c.inter, c.k, c.rows, skip, x, ids, route, y0, h, y, c.held_begin, held_end}, gate,
      up, down, 1e-5, /*h_in_bf16=*/true);
}

// moe=fused's quantized grouped MMA kernels (qgemm=w8a16 / w4a16 at 4+ rows). Shapes:
// qwen3-30b-a3b's at batch 8 (the 4-tile kernels), a batch whose tiles and features do not fill
// a pass, and more than 24 pairs an expert (the 8-tile kernels).
TEST_F(GpuQuant, GroupedQuantExpertKernelsMatchTheExactDequantReference) {
  // The last two: a rank's experts at ep=on (the others' table entries null, their pairs left
  // out).
  const GroupedCase cases[] = {{2048, 768, 128, 8, 8},
                               {256, 128, 8, 2, 5},
                               {128, 256, 4, 3, 40},
                               {256, 128, 8, 2, 5, 2, 6},
                               {128, 256, 4, 3, 40, 0, 2}};
  for (QuantFormat format : kAllFormats) {
    for (const GroupedCase& c : cases) {
      SCOPED_TRACE(QuantFormatName(format) + " hidden " + std::to_string(c.hidden) + " inter " +
                   std::to_string(c.inter) + " rows " + std::to_string(c.rows) + " held " +
                   std::to_string(c.held_begin) + ".." + std::to_string(c.held_end));
      CheckGroupedQuantCase(format, c, /*wgmma=*/false);
    }
  }
}

// moe=wgmma's quantized expert kernels (sm_90a: prefill chunks' experts under moe=wgmma), the
// same check on kWgmmaCases; MXFP4's scales need inter % 128.
TEST_F(GpuQuant, GroupedWgmmaQuantExpertKernelsMatchTheExactDequantReference) {
  cudaDeviceProp props{};
  CUDA_EXPECT_OK(cudaGetDeviceProperties(&props, 0));
  if (props.major != 9 || props.minor != 0) GTEST_SKIP() << "moe=wgmma is sm_90a machine code";
  ForEachGroupedCase(kAllFormats, kWgmmaCases, [](QuantFormat format, const GroupedCase& c) {
    CheckGroupedQuantCase(format, c, /*wgmma=*/true);
  });
  // MXFP4 with inter % 128 != 0 is refused (its scale rows are read 4 bytes at a time).
  DeviceExperts gate(QuantFormat::kMxfp4, 2, 192, 256, 100),
      up(QuantFormat::kMxfp4, 2, 192, 256, 200), down(QuantFormat::kMxfp4, 2, 256, 192, 300);
  EXPECT_FALSE(cuda::MoeWgmmaQuantSupports(gate.t, up.t, down.t, 256, 192));
}

// GemmQuantMma (qgemm=w8a16 / w4a16 dense linears of decode batches): y = W . x with x rounded to
// bf16, against double sums over the CPU's exact dequantization; out features that do not fill a
// 16-row tile, 4- and 8-tile passes, rows in slabs, K split over the block's 8 warps unevenly
// (9 FP4 units: 2 a warp, the fifth warp 1, the last three none; 17: the last 1) or not at all
// (one unit). FP8 block-128 is refused.
TEST_F(GpuQuant, DenseQuantMmaMatchesTheExactDequantReference) {
  struct Case {
    int64_t n, k;
    int rows;
  };
  // 1000 rows: a long chunk split into row slabs (16 blocks of 64 rows, the last one 40)
  const Case cases[] = {{4096, 2048, 64}, {200, 256, 9},  {512, 128, 33}, {512, 256, 1000},
                        {2560, 2176, 16}, {96, 1152, 20}, {40, 4096, 16}};
  for (QuantFormat format : kAllFormats) {
    for (Case c : cases) {
      SCOPED_TRACE(QuantFormatName(format) + " [" + std::to_string(c.n) + ", " +
                   std::to_string(c.k) + "] rows " + std::to_string(c.rows));
      const std::vector<float> w = RandomValues(c.n * c.k, 71);
      auto q = QuantizeMatrix(format, {w.data(), DType::kF32, c.n, c.k});
      ASSERT_TRUE(q.ok()) << q.status();
      const std::vector<float> dq = DequantizeMatrix(q->View());
      DeviceMatrix dm(*q);
      if (format == QuantFormat::kFp8Block128) {
        EXPECT_FALSE(cuda::GemmQuantMmaSupports(dm.ref));
        continue;
      }
      ASSERT_TRUE(cuda::GemmQuantMmaSupports(dm.ref));
      const std::vector<float> x_raw = RandomValues(c.rows * c.k, 73);
      std::vector<uint16_t> x_bf16(x_raw.size());
      std::vector<float> x(x_raw.size());
      for (size_t i = 0; i < x.size(); ++i) {
        x_bf16[i] = FloatToBf16(x_raw[i]);
        x[i] = Bf16ToFloat(x_bf16[i]);
      }
      uint16_t* dx = ToDevice(x_bf16);
      float* dy = nullptr;
      CUDA_EXPECT_OK(cudaMalloc(&dy, c.rows * c.n * sizeof(float)));
      CUDA_EXPECT_OK(cudaMemset(dy, 0xff, c.rows * c.n * sizeof(float)));  // NaN
      cuda::GemmQuantMma(dx, c.rows, dm.ref, dy, nullptr);
      CUDA_EXPECT_OK(cudaGetLastError());
      CUDA_EXPECT_OK(cudaDeviceSynchronize());
      const std::vector<float> y = ToHost(dy, c.rows * c.n);
      cudaFree(dx);
      cudaFree(dy);
      for (int m = 0; m < c.rows; ++m)
        for (int64_t n = 0; n < c.n; ++n) {
          auto [want, magnitude] = ExactDot(x.data() + m * c.k, dq, n, c.k);
          ASSERT_NEAR(y[m * c.n + n], want, 1e-5 * magnitude + 1e-30)
              << "[" << m << ", " << n << "]";
        }
    }
  }
}

// ---- qgemm=w8a8: E4M3 activations onto E4M3 x E4M3 mma.sync.

// Rows quantized on the device (QuantizeRowsE4M3): each row's scale is max |x| / 448 and its codes
// are the host's E4M3 rounding of x / scale (ties to even, saturating), code for code. Returns
// the values the kernels multiplied: code times scale.
std::vector<float> ExpectE4m3Rows(const std::vector<float>& x, int rows, int cols,
                                  const uint8_t* codes, const float* scales) {
  const std::vector<uint8_t> c = ToHost(codes, static_cast<size_t>(rows) * cols);
  const std::vector<float> s = ToHost(scales, static_cast<size_t>(rows));
  std::vector<float> values(c.size());
  int mismatches = 0;
  for (int r = 0; r < rows; ++r) {
    float amax = 0.f;
    for (int i = 0; i < cols; ++i) amax = std::max(amax, std::fabs(x[r * cols + i]));
    const float scale = amax > 0.f ? amax / 448.f : 1.f;
    EXPECT_EQ(s[r], scale) << "row " << r;
    const float inv = 1.f / scale;
    for (int i = 0; i < cols; ++i) {
      const size_t at = static_cast<size_t>(r) * cols + i;
      mismatches += c[at] != FloatToE4M3(x[at] * inv);
      values[at] = E4M3ToFloat(c[at]) * s[r];
    }
  }
  EXPECT_EQ(mismatches, 0) << "E4M3 codes that differ from the host's rounding";
  return values;
}

// Hopper's FP8 MMAs add their products into the fp32 accumulator at reduced precision (about 14
// bits): the sums are judged at 2^-10 of the sum of their |terms|, not fp32's 1e-5.
constexpr double kFp8MmaSumTolerance = 1.0 / 1024;

using DenseFp8Gemm = void (*)(const float*, int, const MatrixRef&, uint8_t*, float*, float*,
                              cudaStream_t);

// One dense qgemm=w8a8 GEMM of `rows` rows through `gemm`: the rows' E4M3 codes and scales, then
// y against double sums over those values times the CPU's exact dequantization `dq` of W.
void CheckDenseFp8(DenseFp8Gemm gemm, const char* what, QuantFormat format, const DeviceMatrix& dm,
                   const std::vector<float>& dq, int64_t n, int64_t k, int rows) {
  const std::vector<float> x = RandomValues(rows * k, 73);
  float* dx = ToDevice(x);
  uint8_t* codes = nullptr;
  float *scales = nullptr, *dy = nullptr;
  CUDA_EXPECT_OK(cudaMalloc(&codes, rows * k));
  CUDA_EXPECT_OK(cudaMalloc(&scales, rows * sizeof(float)));
  CUDA_EXPECT_OK(cudaMalloc(&dy, rows * n * sizeof(float)));
  CUDA_EXPECT_OK(cudaMemset(dy, 0xFF, rows * n * sizeof(float)));  // NaN where nothing writes
  gemm(dx, rows, dm.ref, codes, scales, dy, nullptr);
  CUDA_EXPECT_OK(cudaGetLastError());
  CUDA_EXPECT_OK(cudaDeviceSynchronize());
  const std::vector<float> xq = ExpectE4m3Rows(x, rows, static_cast<int>(k), codes, scales);
  const std::vector<float> y = ToHost(dy, rows * n);
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(codes), static_cast<void*>(scales),
                  static_cast<void*>(dy)})
    cudaFree(p);
  double worst = 0;
  for (int m = 0; m < rows; ++m)
    for (int64_t f = 0; f < n; ++f) {
      auto [want, magnitude] = ExactDot(xq.data() + m * k, dq, f, k);
      worst = std::max(worst, std::fabs(y[m * n + f] - want) / (magnitude + 1e-30));
      ASSERT_NEAR(y[m * n + f], want, kFp8MmaSumTolerance * magnitude + 1e-30)
          << "[" << m << ", " << f << "]";
    }
  std::printf("# w8a8 dense %s %s rows %d: worst error %.3g of the sum of |terms|\n", what,
              Name(format, {n, k}).c_str(), rows, worst);
}

// check(format, case, the quantized weight, its device copy) for every format and case, each
// under its trace.
template <typename Check>
void ForEachDenseWeight(std::initializer_list<DenseCase> cases, Check check) {
  for (QuantFormat format : kAllFormats) {
    for (const DenseCase& c : cases) {
      SCOPED_TRACE(DenseCaseName(format, c));
      auto q = RandomDenseWeight(format, c);
      ASSERT_TRUE(q.ok()) << q.status();
      const DeviceMatrix dm(*q);
      check(format, c, *q, dm);
    }
  }
}

// GemmFp8Mma (qgemm=w8a8's dense linears): FP8 tensor, channel and block-128 scales, out
// features that do not fill a 16-row tile or a 64-feature block, 4- and 8-tile passes, rows in
// slabs. Block-128 with a K of no whole 128-block, and the FP4 formats, are refused.
TEST_F(GpuQuant, DenseFp8MmaMatchesTheExactE4m3Reference) {
  cudaDeviceProp props{};
  CUDA_EXPECT_OK(cudaGetDeviceProperties(&props, 0));
  if (props.major * 10 + props.minor < cuda::kFp8MmaMinSm)
    GTEST_SKIP() << "E4M3 mma.sync needs sm_89";
  ForEachDenseWeight(
      {{4096, 2048, 64}, {200, 256, 9}, {512, 128, 33}, {64, 64, 1}, {512, 256, 1000}},
      [](QuantFormat format, const DenseCase& c, const QuantizedMatrix& q, const DeviceMatrix& dm) {
        const bool e4m3 = format == QuantFormat::kFp8Tensor || format == QuantFormat::kFp8Channel ||
                          (format == QuantFormat::kFp8Block128 && c.k % 128 == 0);
        if (!e4m3) {
          EXPECT_FALSE(cuda::GemmFp8MmaSupports(dm.ref));
          return;
        }
        ASSERT_TRUE(cuda::GemmFp8MmaSupports(dm.ref));
        CheckDenseFp8(cuda::GemmFp8Mma, "mma.sync", format, dm, DequantizeMatrix(q.View()), c.n,
                      c.k, c.rows);
      });
}

// GemmFp8Wgmma (qgemm=w8a8's dense linears on sm_90a): FP8 tensor and channel scales, one and
// several 128-feature tiles, row tiles of 1 to 128 rows (wgmma N 32 to 128) and a last one part
// full; the other formats and shapes off the 128-row tiles or 128-element K chunks are refused.
TEST_F(GpuQuant, DenseFp8WgmmaMatchesTheExactE4m3Reference) {
  cudaDeviceProp props{};
  CUDA_EXPECT_OK(cudaGetDeviceProperties(&props, 0));
  if (props.major != 9 || props.minor != 0) GTEST_SKIP() << "the sm_90a kernels need sm_90";
  ForEachDenseWeight(
      {{4096, 2048, 64},
       {128, 128, 1},
       {256, 384, 130},
       {512, 256, 1000},
       {384, 128, 97},
       {192, 256, 8}},
      [](QuantFormat format, const DenseCase& c, const QuantizedMatrix& q, const DeviceMatrix& dm) {
        const bool takes =
            (format == QuantFormat::kFp8Tensor || format == QuantFormat::kFp8Channel) &&
            c.n % 128 == 0;
        EXPECT_EQ(cuda::Fp8WgmmaShapeSupports(format, c.n, c.k), takes);
        if (!takes) return;
        CheckDenseFp8(cuda::GemmFp8Wgmma, "wgmma", format, dm, DequantizeMatrix(q.View()), c.n, c.k,
                      c.rows);
      });
}

// One case of qgemm=w8a8's grouped expert kernels (MoeGrouped, kFp8Mma4 / kFp8Mma8, or with
// `wgmma` kFp8Wgmma, whose h is in bucketed order): the input rows' and the pairs' E4M3 codes and
// scales, h = silu(gate) * up in bf16 against double sums over the input's E4M3 values, and the
// weighted combine of down into the residual (one expert skipped) against the h codes' values:
// the exact dequantization of the weights throughout.
void CheckGroupedFp8Case(QuantFormat format, const GroupedCase& c, bool wgmma = false) {
  const int held_end = c.held_end < 0 ? c.experts : c.held_end;
  DeviceExperts gate(format, c.experts, c.inter, c.hidden, 100, c.held_begin, held_end);
  DeviceExperts up(format, c.experts, c.inter, c.hidden, 200, c.held_begin, held_end);
  DeviceExperts down(format, c.experts, c.hidden, c.inter, 300, c.held_begin, held_end);
  ASSERT_TRUE(cuda::MoeGroupedFp8Supports(cuda::ShapeOf(gate.t), cuda::ShapeOf(up.t),
                                          cuda::ShapeOf(down.t)));
  if (wgmma) {
    ASSERT_TRUE(cuda::MoeWgmmaFp8Supports(cuda::ShapeOf(gate.t), cuda::ShapeOf(up.t),
                                          cuda::ShapeOf(down.t), c.hidden, c.inter));
  }
  const int pairs = c.rows * c.k;
  const auto [ids, route, skip] = RandomRouting(c);
  const std::vector<float> x = RandomValues(c.rows * c.hidden, 61);
  const std::vector<float> y0 = RandomValues(c.rows * c.hidden, 67);
  int* dids = ToDevice(ids);
  float* droute = ToDevice(route);
  float* dx = ToDevice(x);
  float* dy = ToDevice(y0);
  int *offsets = nullptr, *sorted = nullptr;
  uint16_t* dh = nullptr;
  uint8_t *x_codes = nullptr, *h_codes = nullptr;
  float *dout = nullptr, *x_scales = nullptr, *h_scales = nullptr;
  CUDA_EXPECT_OK(cudaMalloc(&offsets, (c.experts + 1) * sizeof(int)));
  CUDA_EXPECT_OK(cudaMalloc(&sorted, pairs * sizeof(int)));
  // h starts as zeros: the pairs the kernels leave out (skipped, not held) quantize to zeros.
  CUDA_EXPECT_OK(cudaMalloc(&dh, static_cast<size_t>(pairs) * c.inter * sizeof(uint16_t)));
  CUDA_EXPECT_OK(cudaMemset(dh, 0, static_cast<size_t>(pairs) * c.inter * sizeof(uint16_t)));
  CUDA_EXPECT_OK(cudaMalloc(&dout, static_cast<size_t>(pairs) * c.hidden * sizeof(float)));
  CUDA_EXPECT_OK(cudaMalloc(&x_codes, static_cast<size_t>(c.rows) * c.hidden));
  CUDA_EXPECT_OK(cudaMalloc(&h_codes, static_cast<size_t>(pairs) * c.inter));
  CUDA_EXPECT_OK(cudaMalloc(&x_scales, c.rows * sizeof(float)));
  CUDA_EXPECT_OK(cudaMalloc(&h_scales, pairs * sizeof(float)));
  const cuda::QuantExpertTable tables[3] = {gate.t, up.t, down.t};
  cuda::MoeGroupedArgs a =
      GroupedArgs(c, held_end, skip, dids, droute, offsets, sorted, dh, dout, dy, tables);
  a.x_f32 = dx;
  a.x_fp8 = x_codes;
  a.x_scale = x_scales;
  a.h_fp8 = h_codes;
  a.h_scale = h_scales;
  a.kernel = wgmma                                              ? cuda::MoeGroupedKernel::kFp8Wgmma
             : pairs > cuda::kMoeWidePairsPerExpert * c.experts ? cuda::MoeGroupedKernel::kFp8Mma8
                                                                : cuda::MoeGroupedKernel::kFp8Mma4;
  cuda::MoeGrouped(a, nullptr);
  CUDA_EXPECT_OK(cudaGetLastError());
  CUDA_EXPECT_OK(cudaDeviceSynchronize());
  const std::vector<float> xq = ExpectE4m3Rows(x, c.rows, c.hidden, x_codes, x_scales);
  const std::vector<uint16_t> h_bits = ToHost(dh, static_cast<size_t>(pairs) * c.inter);
  std::vector<float> h(h_bits.size());
  for (size_t i = 0; i < h.size(); ++i) h[i] = Bf16ToFloat(h_bits[i]);
  std::vector<float> hq = ExpectE4m3Rows(h, pairs, c.inter, h_codes, h_scales);
  if (wgmma) {  // bucketed position i holds pair sorted[i]: h and its codes back to pair order
    const std::vector<int> order = ToHost(sorted, static_cast<size_t>(pairs));
    const int placed = ToHost(offsets, static_cast<size_t>(c.experts + 1))[c.experts];
    std::vector<float> h_by_pair(h.size(), 0.f), hq_by_pair(hq.size(), 0.f);
    for (int i = 0; i < placed; ++i) {
      const size_t from = static_cast<size_t>(i) * c.inter,
                   to = static_cast<size_t>(order[i]) * c.inter;
      std::copy_n(h.begin() + from, c.inter, h_by_pair.begin() + to);
      std::copy_n(hq.begin() + from, c.inter, hq_by_pair.begin() + to);
    }
    h = std::move(h_by_pair);
    hq = std::move(hq_by_pair);
  }
  const std::vector<float> y = ToHost(dy, static_cast<size_t>(c.rows) * c.hidden);
  for (void* p :
       {static_cast<void*>(dids), static_cast<void*>(droute), static_cast<void*>(dx),
        static_cast<void*>(dy), static_cast<void*>(offsets), static_cast<void*>(sorted),
        static_cast<void*>(dh), static_cast<void*>(dout), static_cast<void*>(x_codes),
        static_cast<void*>(h_codes), static_cast<void*>(x_scales), static_cast<void*>(h_scales)})
    cudaFree(p);
  MoeOutputs m{c.hidden, c.inter, c.k, c.rows, skip,         xq,      ids,
               route,    y0,      h,   y,      c.held_begin, held_end};
  m.down_input = &hq;
  ExpectMoeMatchesExact(m, gate, up, down, kFp8MmaSumTolerance, /*h_in_bf16=*/true);
}

// The E4M3 yardstick's GEMM (GemmReference, GemmInputs::kE4m3Rows): every quantized format's
// weights times each row rounded to E4M3 with its scale amax / 448, as qgemm=w8a8 rounds it
// (QuantizeRowsE4M3 gives the codes the host check reads), against the exact sum on the
// rounded rows; the same reference on exact inputs is farther than the tolerance from it.
void ReferenceE4m3Rows(const float* x, int rows, const MatrixRef& w, uint8_t* codes, float* scales,
                       float* y, cudaStream_t stream) {
  cuda::QuantizeRowsE4M3(x, DType::kF32, rows, static_cast<int>(w.cols), codes, scales, stream);
  cuda::GemmReference(x, rows, w, {}, y, stream, cuda::GemmInputs::kE4m3Rows);
}

TEST_F(GpuQuant, E4m3YardstickGemmRoundsEachRowAsW8a8Does) {
  ForEachDenseWeight({{256, 2048, 3}, {64, 64, 1}, {200, 256, 17}}, [](QuantFormat format,
                                                                       const DenseCase& c,
                                                                       const QuantizedMatrix& q,
                                                                       const DeviceMatrix& dm) {
    const std::vector<float> dq = DequantizeMatrix(q.View());
    CheckDenseFp8(ReferenceE4m3Rows, "reference", format, dm, dq, c.n, c.k, c.rows);

    // Exact inputs (the reference itself): some output misses the rounded rows' sum.
    const std::vector<float> x = RandomValues(c.rows * c.k, 73);  // CheckDenseFp8's rows
    float* dx = ToDevice(x);
    uint8_t* codes = nullptr;
    float *scales = nullptr, *dy = nullptr;
    CUDA_EXPECT_OK(cudaMalloc(&codes, c.rows * c.k));
    CUDA_EXPECT_OK(cudaMalloc(&scales, c.rows * sizeof(float)));
    CUDA_EXPECT_OK(cudaMalloc(&dy, c.rows * c.n * sizeof(float)));
    cuda::QuantizeRowsE4M3(dx, DType::kF32, c.rows, static_cast<int>(c.k), codes, scales, nullptr);
    cuda::GemmReference(dx, c.rows, dm.ref, {}, dy, nullptr, cuda::GemmInputs::kExact);
    CUDA_EXPECT_OK(cudaDeviceSynchronize());
    const std::vector<float> xq = ExpectE4m3Rows(x, c.rows, static_cast<int>(c.k), codes, scales);
    const std::vector<float> y = ToHost(dy, c.rows * c.n);
    for (void* p : {static_cast<void*>(dx), static_cast<void*>(codes), static_cast<void*>(scales),
                    static_cast<void*>(dy)})
      cudaFree(p);
    double farthest = 0;
    for (int m = 0; m < c.rows; ++m)
      for (int64_t f = 0; f < c.n; ++f) {
        auto [want, magnitude] = ExactDot(xq.data() + m * c.k, dq, f, c.k);
        farthest = std::max(farthest, std::fabs(y[m * c.n + f] - want) / (magnitude + 1e-30));
      }
    EXPECT_GT(farthest, kFp8MmaSumTolerance);
  });
}

// qgemm=w8a8's grouped expert kernels, FP8 tensor, channel and block-128 experts (every K here a
// whole number of 128-blocks): qwen3-30b-a3b's shapes at
// batch 8, tiles and features that do not fill a pass, more than 24 pairs an expert (64-pair
// passes), and a rank's experts at ep=on.
TEST_F(GpuQuant, GroupedFp8ExpertKernelsMatchTheExactE4m3Reference) {
  cudaDeviceProp props{};
  CUDA_EXPECT_OK(cudaGetDeviceProperties(&props, 0));
  if (props.major * 10 + props.minor < cuda::kFp8MmaMinSm)
    GTEST_SKIP() << "E4M3 mma.sync needs sm_89";
  const GroupedCase cases[] = {
      {2048, 768, 128, 8, 8}, {256, 128, 8, 2, 5}, {128, 256, 4, 3, 40}, {256, 128, 8, 2, 5, 2, 6}};
  for (QuantFormat format :
       {QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel, QuantFormat::kFp8Block128}) {
    for (const GroupedCase& c : cases) {
      SCOPED_TRACE(QuantFormatName(format) + " hidden " + std::to_string(c.hidden) + " inter " +
                   std::to_string(c.inter) + " rows " + std::to_string(c.rows) + " held " +
                   std::to_string(c.held_begin) + ".." + std::to_string(c.held_end));
      CheckGroupedFp8Case(format, c);
    }
  }
}

// qgemm=w8a8's experts on E4M3 wgmma (sm_90a: moe=wgmma's long prefill chunks), FP8 tensor and
// channel, on kWgmmaCases (every K a whole 128-element chunk). A K of no whole chunk is refused.
TEST_F(GpuQuant, GroupedWgmmaFp8ExpertKernelsMatchTheExactE4m3Reference) {
  cudaDeviceProp props{};
  CUDA_EXPECT_OK(cudaGetDeviceProperties(&props, 0));
  if (props.major != 9 || props.minor != 0) GTEST_SKIP() << "moe=wgmma is sm_90a machine code";
  const QuantFormat fp8[] = {QuantFormat::kFp8Tensor, QuantFormat::kFp8Channel};
  ForEachGroupedCase(fp8, kWgmmaCases, [](QuantFormat format, const GroupedCase& c) {
    CheckGroupedFp8Case(format, c, /*wgmma=*/true);
  });
  const cuda::QuantMatrixShape gate{QuantFormat::kFp8Channel, 192, 256},
      down{QuantFormat::kFp8Channel, 256, 192};
  EXPECT_FALSE(cuda::MoeWgmmaFp8Supports(gate, gate, down, 256, 192));
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
