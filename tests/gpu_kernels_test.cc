// CUDA kernels checked one by one against host math written independently here. Skipped (not
// failed) on machines without a GPU: CI compiles it, the GPU machine runs it (scripts/gpu.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/quant/codecs.h"
#include "engine/sampler.h"
#ifdef INFERSWEEP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/gated_delta.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sm90a/moe_wgmma.h"
#endif

namespace infersweep {
namespace {

#ifdef INFERSWEEP_HAVE_CUDA

class GpuKernels : public testing::Test {
 public:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no GPU on this machine";
    }
  }
  void TearDown() override {
    for (void* p : buffers_) cudaFree(p);
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(1, host.size()) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    buffers_.push_back(d);
    return static_cast<T*>(d);
  }
  template <typename T>
  std::vector<T> Download(const T* device, size_t count) {
    std::vector<T> host(count);
    EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  std::vector<void*> buffers_;
};

struct MoeCase {
  int rows, k, experts, hidden, inter;
  int crowded_expert;  // routed from every row (more pairs than one pass holds); -1: none
  int idle_expert;     // routed from no row
  int skip_expert;     // TEST ONLY zero-expert fault; -1: none
  bool wgmma = false;  // moe=wgmma's sm_90a expert GEMMs
  // The experts held, [held_begin, held_end) (held_end -1: all), as a rank at ep=on holds them:
  // the others' table entries are null and their pairs contribute nothing.
  int held_begin = 0, held_end = -1;
  bool per_pair = false;  // moe=fused's per-pair GEMVs (MoeGateUp + MoeDownCombine), fp32 x and h
};

float RoundBf16(float v) { return Bf16ToFloat(FloatToBf16(v)); }

// The grouped MoE against a host computation in double over the same bf16 roundings
// (x and h rounded to bf16, as the kernels document): y = y0 + sum_slot w * Wd (silu(Wg x) * Wu x)
// over the pairs of held experts other than the skipped one. Per-pair: the same sums over fp32 x
// and h.
void CheckMoe(GpuKernels& t, const MoeCase& c, std::vector<float>* y_out) {
  const int held_end = c.held_end < 0 ? c.experts : c.held_end;
  auto runs = [&](int e) { return e != c.skip_expert && e >= c.held_begin && e < held_end; };
  std::mt19937 rng(1234 + c.rows);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  const int pairs = c.rows * c.k;
  std::vector<float> x(static_cast<size_t>(c.rows) * c.hidden), y0(x.size());
  for (float& v : x) v = uni(rng);
  for (float& v : y0) v = uni(rng);
  std::vector<uint16_t> x_bf16(x.size());
  for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = FloatToBf16(x[i]);
  // Distinct experts per row; the crowded one in every row, the idle one in none.
  std::vector<int> ids(pairs);
  std::vector<float> weights(pairs);
  for (int r = 0; r < c.rows; ++r) {
    std::vector<int> pool;
    for (int e = 0; e < c.experts; ++e)
      if (e != c.idle_expert && e != c.crowded_expert) pool.push_back(e);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int s = 0; s < c.k; ++s) {
      ids[r * c.k + s] = (s == c.k / 2 && c.crowded_expert >= 0) ? c.crowded_expert : pool[s];
      weights[r * c.k + s] = 0.5f + 0.5f * uni(rng);
    }
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(c.hidden));
  auto random_bf16 = [&](size_t n, float s) {
    std::vector<uint16_t> w(n);
    for (uint16_t& v : w) v = FloatToBf16(s * uni(rng));
    return w;
  };
  std::vector<std::vector<uint16_t>> gate, up, down;
  std::vector<const uint16_t*> gate_ptr, up_ptr, down_ptr;
  for (int e = 0; e < c.experts; ++e) {
    gate.push_back(random_bf16(static_cast<size_t>(c.inter) * c.hidden, scale));
    up.push_back(random_bf16(static_cast<size_t>(c.inter) * c.hidden, scale));
    down.push_back(random_bf16(static_cast<size_t>(c.hidden) * c.inter, 1.f / std::sqrt(static_cast<float>(c.inter))));
    const bool held = e >= c.held_begin && e < held_end;
    gate_ptr.push_back(held ? t.Upload(gate.back()) : nullptr);
    up_ptr.push_back(held ? t.Upload(up.back()) : nullptr);
    down_ptr.push_back(held ? t.Upload(down.back()) : nullptr);
  }
  // Host reference.
  std::vector<double> y_ref(y0.begin(), y0.end());
  for (int p = 0; p < pairs; ++p) {
    const int r = p / c.k, e = ids[p];
    if (!runs(e)) continue;
    std::vector<double> h(c.inter);
    for (int f = 0; f < c.inter; ++f) {
      double g = 0, u = 0;
      for (int i = 0; i < c.hidden; ++i) {
        const size_t xi_at = static_cast<size_t>(r) * c.hidden + i;
        const double xi = c.per_pair ? x[xi_at] : Bf16ToFloat(x_bf16[xi_at]);
        g += Bf16ToFloat(gate[e][static_cast<size_t>(f) * c.hidden + i]) * xi;
        u += Bf16ToFloat(up[e][static_cast<size_t>(f) * c.hidden + i]) * xi;
      }
      const double silu_mul = g / (1 + std::exp(-g)) * u;
      h[f] = c.per_pair ? silu_mul : RoundBf16(static_cast<float>(silu_mul));
    }
    for (int j = 0; j < c.hidden; ++j) {
      double o = 0;
      for (int f = 0; f < c.inter; ++f) o += Bf16ToFloat(down[e][static_cast<size_t>(j) * c.inter + f]) * h[f];
      y_ref[static_cast<size_t>(r) * c.hidden + j] += weights[p] * o;
    }
  }
  if (c.per_pair) {
    // h starts as NaN: the pairs of experts not held must write their zeros, not leave it.
    float* h = t.Upload(std::vector<float>(static_cast<size_t>(pairs) * c.inter, NAN));
    float* y = t.Upload(y0);
    const int* d_ids = t.Upload(ids);
    cuda::MoeGateUp(t.Upload(x), c.rows, c.k, d_ids, c.held_begin, held_end, t.Upload(gate_ptr),
                    t.Upload(up_ptr), c.hidden, c.inter, h, nullptr);
    cuda::MoeDownCombine(h, c.rows, c.k, d_ids, t.Upload(weights), c.skip_expert, c.held_begin,
                         held_end, t.Upload(down_ptr), c.hidden, c.inter, y, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> y_got = t.Download(y, y0.size());
    double worst = 0, scale_ref = 0;
    for (size_t i = 0; i < y_got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y_got[i])) << "y[" << i << "]";
      worst = std::max(worst, std::fabs(y_got[i] - y_ref[i]));
      scale_ref = std::max(scale_ref, std::fabs(y_ref[i] - y0[i]));
    }
    // fp32 sums over bf16 weights in another order than the host's doubles; no pair run here:
    // y untouched.
    if (scale_ref == 0)
      EXPECT_EQ(worst, 0) << "rows " << c.rows;
    else
      EXPECT_LT(worst / scale_ref, 1e-4) << "rows " << c.rows << " max abs error " << worst;
    *y_out = y_got;
    return;
  }
  cuda::MoeGroupedArgs a;
  a.x_bf16 = t.Upload(x_bf16);
  a.rows = c.rows;
  a.k = c.k;
  a.num_experts = c.experts;
  a.hidden = c.hidden;
  a.inter = c.inter;
  a.expert_ids = t.Upload(ids);
  a.expert_weights = t.Upload(weights);
  a.skip_expert = c.skip_expert;
  a.expert_begin = c.held_begin;
  a.expert_end = held_end;
  a.gate = t.Upload(gate_ptr);
  a.up = t.Upload(up_ptr);
  a.down = t.Upload(down_ptr);
  a.offsets = t.Upload(std::vector<int>(c.experts + 1, -7));
  a.sorted_pairs = t.Upload(std::vector<int>(pairs, -7));
  a.h = t.Upload(std::vector<uint16_t>(static_cast<size_t>(pairs) * c.inter, 0));
  a.out = t.Upload(std::vector<float>(static_cast<size_t>(pairs) * c.hidden, NAN));
  a.y = t.Upload(y0);
  a.kernel = cuda::MoeGroupedKernelFor(/*quantized=*/false, c.wgmma, pairs, c.experts);
  cuda::MoeGrouped(a, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> y = t.Download(a.y, y0.size());
  // Offsets: counts per expert in expert order.
  const std::vector<int> offsets = t.Download(a.offsets, c.experts + 1);
  int expected_first = 0;
  for (int e = 0; e < c.experts; ++e) {
    int count = 0;
    for (int id : ids) count += id == e && runs(e);
    EXPECT_EQ(offsets[e], expected_first) << "expert " << e;
    expected_first += count;
  }
  EXPECT_EQ(offsets[c.experts], expected_first);
  double worst = 0, scale_ref = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << "y[" << i << "]";
    worst = std::max(worst, std::fabs(y[i] - y_ref[i]));
    scale_ref = std::max(scale_ref, std::fabs(y_ref[i] - y0[i]));
  }
  // fp32 accumulation in another order, and h rounding to bf16 that may land one ulp (2^-8)
  // apart where the sums differ in the last bits: far below 1e-2 of the MoE output's size. No
  // pair run here: y untouched.
  if (scale_ref == 0)
    EXPECT_EQ(worst, 0) << "rows " << c.rows;
  else
    EXPECT_LT(worst / scale_ref, 1e-2) << "rows " << c.rows << " max abs error " << worst;
  *y_out = y;
}

TEST_F(GpuKernels, MoeGroupedMatchesHostMath) {
  std::vector<float> y;
  // Decode batch (kernels with 32 pairs a pass): a crowded expert needs 2 passes, one is idle,
  // inter not a multiple of the 64-feature block.
  CheckMoe(*this, {64, 4, 16, 256, 96, 3, 7, -1}, &y);
  // Many pairs per expert (prefill kernels, 64 pairs a pass), a crowded expert of 320 pairs.
  CheckMoe(*this, {320, 8, 32, 128, 64, 5, 0, -1}, &y);
  // Fewer rows than a tile.
  CheckMoe(*this, {4, 2, 8, 64, 32, -1, 1, -1}, &y);
}

TEST_F(GpuKernels, MoeGroupedLeavesOutTheSkippedExpertAndIsDeterministic) {
  std::vector<float> first, second, with_all;
  const MoeCase c{64, 4, 16, 256, 96, 3, 7, 3};
  CheckMoe(*this, c, &first);
  CheckMoe(*this, c, &second);
  EXPECT_EQ(first, second) << "same inputs, different bits";
  MoeCase all = c;
  all.skip_expert = -1;
  CheckMoe(*this, all, &with_all);
  EXPECT_NE(first, with_all) << "skipping the crowded expert changed nothing";
}

// A rank's experts at ep=on: its tables hold [held_begin, held_end), the other experts' entries
// null, and every path (the per-pair GEMVs, the grouped mma.sync kernels at decode and prefill
// sizes, wgmma on sm_90a) leaves the other experts' pairs out, as the host math does. Two ranks'
// partials add up to the whole: (y_low - y0) + (y_high - y0) = y_all - y0 to fp32 rounding. A
// rank whose experts no pair reaches leaves y as it was.
TEST_F(GpuKernels, MoeKernelsRunOnlyTheHeldExperts) {
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  const bool sm90 = prop.major == 9 && prop.minor == 0;
  std::vector<MoeCase> cases = {
      {4, 2, 8, 256, 96, -1, 1, -1, false, 0, -1, /*per_pair=*/true},
      {64, 4, 16, 256, 96, 3, 7, -1},  // the crowded expert 3 in the lower half
      {320, 8, 32, 128, 64, 5, 0, -1},
  };
  if (sm90) cases.push_back({600, 4, 16, 256, 128, 3, 7, -1, /*wgmma=*/true});
  for (const MoeCase& all : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << all.rows << " experts " << all.experts
                                    << (all.per_pair ? " per-pair"
                                        : all.wgmma  ? " wgmma"
                                                     : ""));
    std::vector<float> y_all, y_low, y_high, y_idle;
    CheckMoe(*this, all, &y_all);
    MoeCase low = all, high = all, idle = all;
    low.held_end = high.held_begin = all.experts / 2;
    CheckMoe(*this, low, &y_low);
    CheckMoe(*this, high, &y_high);
    ASSERT_EQ(y_low.size(), y_all.size());
    ASSERT_EQ(y_high.size(), y_all.size());
    // The idle expert alone: no pair is routed to it.
    idle.held_begin = all.idle_expert;
    idle.held_end = all.idle_expert + 1;
    CheckMoe(*this, idle, &y_idle);
    // y_idle is y0 (CheckMoe checks it bit for bit); the halves' partials add up to the whole.
    double worst = 0, scale = 0;
    for (size_t i = 0; i < y_all.size(); ++i) {
      const double y0 = y_idle[i];
      const double sum = (y_low[i] - y0) + (y_high[i] - y0);
      worst = std::max(worst, std::fabs(sum - (y_all[i] - y0)));
      scale = std::max(scale, std::fabs(y_all[i] - y0));
    }
    ASSERT_GT(scale, 0);
    EXPECT_LT(worst / scale, 1e-5) << "max abs error " << worst;
    EXPECT_NE(y_low, y_all) << "the upper half's experts changed nothing";
    EXPECT_NE(y_high, y_all) << "the lower half's experts changed nothing";
  }
}

// moe=wgmma's kernels (sm_90a machine code: Hopper only). Experts of more than 128 pairs take
// several work items, the last one partial; every wgmma N (32, 64, 96, 128) is used; a
// decode-sized batch gives every expert a few pairs.
TEST_F(GpuKernels, MoeGroupedOnWgmmaMatchesHostMath) {
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  if (prop.major != 9 || prop.minor != 0) GTEST_SKIP() << "sm_90a kernels; this GPU is sm_" << prop.major << prop.minor;
  ASSERT_TRUE(cuda::MoeWgmmaSupports(256, 128));
  ASSERT_FALSE(cuda::MoeWgmmaSupports(256, 96));
  std::vector<float> y, again, skipped;
  // 600 pairs on expert 3: four tiles of 128 and one of 88; ~129 pairs on each of the others
  // (a full tile and a tile of a few).
  CheckMoe(*this, {600, 4, 16, 256, 128, 3, 7, -1, true}, &y);
  CheckMoe(*this, {600, 4, 16, 256, 128, 3, 7, -1, true}, &again);
  EXPECT_EQ(y, again) << "same inputs, different bits";
  CheckMoe(*this, {600, 4, 16, 256, 128, 3, 7, 3, true}, &skipped);
  EXPECT_NE(y, skipped) << "skipping the crowded expert changed nothing";
  // ~53 pairs an expert: wgmma N of 64 for most, 32 or 96 for some.
  CheckMoe(*this, {200, 4, 16, 128, 64, -1, 7, -1, true}, &y);
  CheckMoe(*this, {64, 8, 128, 512, 192, -1, 5, -1, true}, &y);
  CheckMoe(*this, {4, 2, 8, 128, 64, -1, 1, -1, true}, &y);
}

// The bucketing alone, exactly against a host counting sort: offsets, and every expert's pairs in
// pair order (later kernels sum in that order); slots past the placed pairs stay untouched.
struct BucketCase {
  int pairs, experts, skip_expert;
  int only_expert;  // every pair routed to it; -1: random ids
  int held_begin = 0, held_end = -1;  // the experts bucketed (held_end -1: all)
};

void CheckBucketPairs(GpuKernels& t, const BucketCase& c) {
  SCOPED_TRACE(testing::Message() << "pairs " << c.pairs << " experts " << c.experts << " skip "
                                  << c.skip_expert << " only " << c.only_expert << " held ["
                                  << c.held_begin << ", " << c.held_end << ")");
  const int held_end = c.held_end < 0 ? c.experts : c.held_end;
  std::mt19937 rng(77 + c.pairs + c.experts);
  std::uniform_int_distribution<int> pick(0, c.experts - 1);
  std::vector<int> ids(c.pairs);
  for (int p = 0; p < c.pairs; ++p) {
    ids[p] = c.only_expert >= 0 ? c.only_expert : pick(rng);
    if (c.skip_expert >= 0 && p % 7 == 0) ids[p] = c.skip_expert;
  }
  std::vector<int> want_offsets(c.experts + 1), want_sorted;
  for (int e = 0; e < c.experts; ++e) {
    want_offsets[e] = static_cast<int>(want_sorted.size());
    for (int p = 0; p < c.pairs; ++p)
      if (ids[p] == e && e != c.skip_expert && e >= c.held_begin && e < held_end)
        want_sorted.push_back(p);
  }
  want_offsets[c.experts] = static_cast<int>(want_sorted.size());
  want_sorted.resize(c.pairs, -7);
  int* offsets = t.Upload(std::vector<int>(c.experts + 1, -7));
  int* sorted = t.Upload(std::vector<int>(c.pairs, -7));
  cuda::BucketPairs(t.Upload(ids), c.pairs, c.experts, c.skip_expert, c.held_begin, held_end,
                    offsets, sorted, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(t.Download(offsets, c.experts + 1), want_offsets);
  EXPECT_EQ(t.Download(sorted, c.pairs), want_sorted);
}

TEST_F(GpuKernels, BucketPairsMatchesACountingSort) {
  const BucketCase cases[] = {
      {512, 128, -1, -1},   // batch 64, top-8: one chunk
      {2048, 128, -1, -1},  // two chunks (16 pairs per expert, the caller's limit)
      {300, 1000, -1, -1},  // many experts, pairs not a multiple of 32
      {512, 128, 5, -1},    // a skipped expert (every 7th pair and some random ones)
      {1000, 16, -1, 3},    // one expert takes every pair
      {3000, 8, -1, 7},     // ... across three chunks, the last one partial
      {3000, 8, 7, 7},      // every pair skipped
      {5000, 1024, 0, -1},  // the most experts, five chunks
      {0, 4, -1, -1},       // no pairs
      // A rank's experts at ep=on: the others' pairs left out, their counts 0.
      {512, 128, -1, -1, 32, 64},       // the second of four ranks
      {3000, 8, -1, -1, 4, 8},          // the upper half, across three chunks
      {512, 128, 40, -1, 32, 64},       // and a skipped expert among the held ones
      {1000, 16, -1, 3, 8, 16},         // every pair routed to another rank's expert
      {5000, 1024, -1, -1, 896, 1024},  // the last of eight ranks, five chunks
  };
  for (const BucketCase& c : cases) CheckBucketPairs(*this, c);
}

// The fp8 cache's scale for a head vector of absolute maximum amax (kv_cache.cuh's HeadScale):
// the power of two 2^e >= amax / 448, e in [-14, 15].
float Fp8HeadScale(float amax) {
  int e = 0;
  const float m = std::frexp(amax / 448, &e);
  if (m == 0.5f) --e;
  return std::ldexp(1.f, std::clamp(e, -14, 15));
}

// Causal GQA attention over a KV cache, in double: query i of batch row b at position pos0 + i
// sees keys [0, pos0 + i].
std::vector<double> HostAttention(const std::vector<float>& q, const std::vector<float>& kc,
                                  const std::vector<float>& vc, int batch, int n, int q_heads,
                                  int kv_heads, int d, int pos0, int capacity) {
  const int kv_dim = kv_heads * d, group = q_heads / kv_heads;
  std::vector<double> out(static_cast<size_t>(batch) * n * q_heads * d);
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < q_heads; ++h) {
        const float* qv = &q[((static_cast<size_t>(b) * n + i) * q_heads + h) * d];
        const int keys = pos0 + i + 1;
        std::vector<double> score(keys);
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < keys; ++j) {
          const float* kv = &kc[(static_cast<size_t>(b) * capacity + j) * kv_dim + (h / group) * d];
          double dot = 0;
          for (int x = 0; x < d; ++x) dot += static_cast<double>(qv[x]) * kv[x];
          score[j] = dot / std::sqrt(static_cast<double>(d));
          mx = std::max(mx, score[j]);
        }
        for (double& v : score) sum += (v = std::exp(v - mx));
        double* o = &out[((static_cast<size_t>(b) * n + i) * q_heads + h) * d];
        for (int j = 0; j < keys; ++j) {
          const float* vv = &vc[(static_cast<size_t>(b) * capacity + j) * kv_dim + (h / group) * d];
          for (int x = 0; x < d; ++x) o[x] += score[j] / sum * vv[x];
        }
      }
  return out;
}

// attention=flash: prefill chunks (tensor cores) and decode-sized chunks (split-KV, fp32) against
// the host, for chunk lengths that are not multiples of the 64-query tile and a chunk that starts
// after earlier tokens (pos0 > 0).
struct FlashCase {
  int batch, n, q_heads, kv_heads, d, pos0;
  double tolerance;  // of max |ref|: bf16 Q, K, V and P (2^-9 relative each) on tensor cores
};

void CheckFlashAttention(GpuKernels& t, const FlashCase& c, std::mt19937& rng) {
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  const int capacity = c.pos0 + c.n + 3, kv_dim = c.kv_heads * c.d;
  std::vector<float> q(static_cast<size_t>(c.batch) * c.n * c.q_heads * c.d);
  std::vector<float> kc(static_cast<size_t>(c.batch) * capacity * kv_dim), vc(kc.size());
  // The flash cache is bf16: the host sees the same rounded values.
  std::vector<uint16_t> kc_bf16(kc.size()), vc_bf16(vc.size());
  for (float& v : q) v = uni(rng);
  for (size_t i = 0; i < kc.size(); ++i) {
    kc_bf16[i] = FloatToBf16(uni(rng));
    vc_bf16[i] = FloatToBf16(uni(rng));
    kc[i] = Bf16ToFloat(kc_bf16[i]);
    vc[i] = Bf16ToFloat(vc_bf16[i]);
  }
  // The fp8 cache: each (token, kv head) row as E4M3 codes under its power-of-two scale; the
  // host sees the decoded values.
  const size_t head_rows = kc.size() / c.d;
  std::vector<uint8_t> kc_fp8(kc.size()), vc_fp8(vc.size());
  std::vector<float> k_scale(head_rows), v_scale(head_rows), kc8(kc.size()), vc8(vc.size());
  auto encode = [&](const std::vector<float>& x, size_t row, std::vector<uint8_t>& codes,
                    std::vector<float>& scales, std::vector<float>& decoded) {
    float amax = 0;
    for (int i = 0; i < c.d; ++i) amax = std::max(amax, std::fabs(x[row * c.d + i]));
    scales[row] = Fp8HeadScale(amax);
    for (int i = 0; i < c.d; ++i) {
      codes[row * c.d + i] = FloatToE4M3(x[row * c.d + i] / scales[row]);
      decoded[row * c.d + i] = E4M3ToFloat(codes[row * c.d + i]) * scales[row];
    }
  };
  for (size_t r = 0; r < head_rows; ++r) {
    encode(kc, r, kc_fp8, k_scale, kc8);
    encode(vc, r, vc_fp8, v_scale, vc8);
  }
  const std::vector<double> ref =
      HostAttention(q, kc, vc, c.batch, c.n, c.q_heads, c.kv_heads, c.d, c.pos0, capacity);
  const std::vector<double> ref8 =
      HostAttention(q, kc8, vc8, c.batch, c.n, c.q_heads, c.kv_heads, c.d, c.pos0, capacity);
  const int rows = c.batch * c.n;
  const int splits = cuda::FlashSplits(rows, c.kv_heads, capacity);
  float* partial = t.Upload(
      std::vector<float>(cuda::FlashPartialFloats(rows, c.q_heads, c.kv_heads, c.d), 0.f));
  // kv_cache=bf16 and kv_cache=fp32 (holding the same, bf16-representable values), and fp8 where
  // the tensor-core kernels read it (head_dim 32, 64, 128, 256).
  for (const cuda::KvDtype dtype :
       {cuda::KvDtype::kBf16, cuda::KvDtype::kFp32, cuda::KvDtype::kFp8}) {
    const bool fp8 = dtype == cuda::KvDtype::kFp8;
    if (fp8 && !cuda::FlashDecodeMmaSupports(c.d)) continue;
    const cuda::KvCache cache =
        dtype == cuda::KvDtype::kBf16
            ? cuda::KvCache{t.Upload(kc_bf16), t.Upload(vc_bf16), dtype, capacity}
        : fp8 ? cuda::KvCache{t.Upload(kc_fp8),   t.Upload(vc_fp8),   dtype,
                              capacity,           t.Upload(k_scale), t.Upload(v_scale)}
              : cuda::KvCache{t.Upload(kc), t.Upload(vc), dtype, capacity};
    const std::vector<double>& want = fp8 ? ref8 : ref;
    const char* name = fp8 ? "fp8" : dtype == cuda::KvDtype::kBf16 ? "bf16" : "fp32";
    float* out = t.Upload(std::vector<float>(q.size(), NAN));
    cuda::AttentionFlash(t.Upload(q), cache, rows, c.n, c.q_heads, c.kv_heads, c.d,
                         t.Upload(std::vector<int>{c.pos0}), splits, partial, out, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = t.Download(out, q.size());
    double worst = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "n " << c.n << " out[" << i << "]";
      worst = std::max(worst, std::fabs(got[i] - want[i]));
      scale = std::max(scale, std::fabs(want[i]));
    }
    EXPECT_LT(worst / scale, c.tolerance)
        << "n " << c.n << " d " << c.d << " pos0 " << c.pos0 << " " << name << " cache";
    std::printf("# flash n %d d %d pos0 %d, %s cache: max error %.3g of max |out| %.3g\n", c.n,
                c.d, c.pos0, name, worst, scale);
  }
}

TEST_F(GpuKernels, FlashAttentionMatchesHostMath) {
  std::mt19937 rng(99);
  // Decode chunks (n < 16) of head sizes 32/64/128 run the tensor-core split-KV kernel (GQA
  // groups of 8 and 16 as MMA rows, several splits and 64-key tiles, a split's last tile
  // partial); head size 96 keeps the fp32 CUDA-core kernel (tighter tolerance).
  for (const FlashCase& c :
       {FlashCase{2, 100, 8, 2, 128, 5, 2e-2}, FlashCase{1, 130, 4, 2, 64, 0, 2e-2},
        FlashCase{3, 16, 4, 2, 32, 40, 2e-2}, FlashCase{2, 8, 8, 2, 128, 5, 2e-2},
        FlashCase{3, 1, 16, 1, 128, 300, 2e-2}, FlashCase{4, 1, 8, 2, 64, 130, 2e-2},
        FlashCase{2, 2, 4, 2, 32, 70, 2e-2}, FlashCase{2, 3, 6, 2, 96, 50, 1e-4},
        FlashCase{64, 1, 8, 1, 128, 543, 2e-2},
        FlashCase{1, 1, 8, 1, 128, 1500, 2e-2}})  // 47 splits, a long context at batch 1
    CheckFlashAttention(*this, c, rng);
}

// Head size 256 (qwen3-next's and qwen3.5's gated attention), on every cache type. Decode chunks
// run the tensor-core split-KV kernel's two-warp build (32-key tiles, Q staged in shared memory):
// GQA groups of 16 (32 q / 2 kv heads, qwen3.5) and 8 (qwen3-next) as MMA rows, a batch-1 context
// of 4096 keys over 64 splits of two full tiles each, batch 64 with splits of a full tile and a
// partial one, a multi-token chunk and splits that end inside a tile. Prefill chunks run the
// tensor-core prefill kernel's 32-key build with Q staged in shared memory: chunk lengths that
// are not multiples of the 64-query tile, causal masks inside 32-key tiles, pos0 > 0. Head sizes
// above 128 that the tensor-core kernels are not built for (192, 248) take the CUDA-core kernel's
// eight-accumulator build, a group of 16 (512 threads, 78 KB of shared memory) among them.
TEST_F(GpuKernels, FlashAttentionAtHeadDim256MatchesHostMath) {
  std::mt19937 rng(256);
  for (const FlashCase& c :
       {FlashCase{1, 1, 32, 2, 256, 4095, 2e-2}, FlashCase{64, 1, 16, 2, 256, 543, 2e-2},
        FlashCase{4, 1, 16, 2, 256, 130, 2e-2}, FlashCase{2, 3, 32, 2, 256, 100, 2e-2},
        FlashCase{1, 1, 16, 2, 256, 1500, 2e-2}, FlashCase{3, 2, 8, 8, 256, 20, 2e-2},
        FlashCase{2, 100, 16, 2, 256, 5, 2e-2}, FlashCase{1, 130, 32, 2, 256, 0, 2e-2},
        FlashCase{3, 16, 8, 2, 256, 40, 2e-2}, FlashCase{1, 70, 16, 1, 256, 33, 2e-2},
        FlashCase{2, 3, 32, 2, 248, 50, 1e-4}, FlashCase{1, 20, 6, 2, 192, 30, 1e-4}})
    CheckFlashAttention(*this, c, rng);
}

// The decode GEMV (one segment, no norm) against host math in double: y = x . W^T.
void CheckGemv(GpuKernels& t, int rows, int k, int n) {
  std::mt19937 rng(5 + rows + k + n);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::vector<float> x(static_cast<size_t>(rows) * k);
  std::vector<uint16_t> w(static_cast<size_t>(n) * k);
  for (float& v : x) v = uni(rng);
  for (uint16_t& v : w) v = FloatToBf16(uni(rng));
  ASSERT_TRUE(cuda::GemvSupports(rows, k));
  cuda::GemvArgs a;
  a.x = t.Upload(x);
  a.rows = rows;
  a.k = k;
  a.seg[0].w = t.Upload(w);
  a.seg[0].y = t.Upload(std::vector<float>(static_cast<size_t>(rows) * n, NAN));
  a.seg[0].n = n;
  a.seg[0].ld = n;
  a.segments = 1;
  cuda::Gemv(a, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> y = t.Download(a.seg[0].y, static_cast<size_t>(rows) * n);
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < n; ++j) {
      double want = 0;
      for (int i = 0; i < k; ++i)
        want += static_cast<double>(x[static_cast<size_t>(r) * k + i]) *
                Bf16ToFloat(w[static_cast<size_t>(j) * k + i]);
      ASSERT_NEAR(y[static_cast<size_t>(r) * n + j], want, 1e-3 * std::sqrt(static_cast<double>(k)))
          << "row " << r << " output " << j;
    }
}

// A vocabulary-sized matrix is streamed (GemvStreams: a few blocks an SM walking the rows) with
// the final norm folded in, as the lm_head runs at decode: y = (x / rms(x) * gain) . W^T against
// host math in double, at 1 and 3 activation rows, a row count that leaves the last warps' rows
// short of a full pass, and k of 2048 (one 4 KB batch a row) and 3072 (two, the second partial).
TEST_F(GpuKernels, GemvStreamsVocabularySizedMatricesWithTheNorm) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (const auto& [rows, k] : {std::pair{1, 2048}, std::pair{3, 3072}}) {
    SCOPED_TRACE(testing::Message() << rows << " rows, k " << k);
    const int n = cuda::kGemvStreamRowsPerSm * sms + 1237;
    std::mt19937 rng(11 + rows);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    std::vector<float> x(static_cast<size_t>(rows) * k), gain(k);
    std::vector<uint16_t> w(static_cast<size_t>(n) * k);
    for (float& v : x) v = 3.f * uni(rng);
    for (float& v : gain) v = 1.f + 0.5f * uni(rng);
    for (uint16_t& v : w) v = FloatToBf16(uni(rng));
    ASSERT_TRUE(cuda::GemvSupports(rows, k));
    cuda::GemvArgs a;
    a.x = Upload(x);
    a.rows = rows;
    a.k = k;
    a.norm_gain = Upload(gain);
    a.norm_dtype = DType::kF32;
    a.norm_eps = 1e-6f;
    a.seg[0].w = Upload(w);
    a.seg[0].y = Upload(std::vector<float>(static_cast<size_t>(rows) * n, NAN));
    a.seg[0].n = n;
    a.seg[0].ld = n;
    a.segments = 1;
    ASSERT_TRUE(cuda::GemvStreams(a));
    cuda::Gemv(a, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> y = Download(a.seg[0].y, static_cast<size_t>(rows) * n);
    for (int r = 0; r < rows; ++r) {
      double sum_sq = 0;
      for (int i = 0; i < k; ++i) sum_sq += static_cast<double>(x[r * k + i]) * x[r * k + i];
      const double inv = 1.0 / std::sqrt(sum_sq / k + 1e-6);
      for (int j = 0; j < n; ++j) {
        double want = 0;
        for (int i = 0; i < k; ++i)
          want += x[static_cast<size_t>(r) * k + i] * inv * gain[i] *
                  Bf16ToFloat(w[static_cast<size_t>(j) * k + i]);
        ASSERT_NEAR(y[static_cast<size_t>(r) * n + j], want,
                    1e-3 * std::sqrt(static_cast<double>(k)))
            << "row " << r << " output " << j;
      }
    }
  }
}

// The greedy pick on the device is the host's Greedy, row by row: the lowest index among equal
// maxima (here in different blocks of the row), NaN and -inf never winning, a row with nothing
// else picking 0, -0 tying +0, and negative logits ranked right. Three launches on the same
// scratch, the maxima moved lower each time: a key or ticket left over from the previous launch
// would keep the old pick.
TEST_F(GpuKernels, GreedyTokensPickWhatTheHostPicks) {
  const int vocab = 100003, rows = 8;  // blocks of 2048: 49 a row, the last one partial
  std::vector<unsigned long long> zero_keys(rows, 0ull);
  cuda::GreedyScratch scratch{Upload(zero_keys), Upload(std::vector<unsigned>(rows, 0u))};
  int32_t* out = nullptr;
  ASSERT_EQ(cudaMallocHost(&out, rows * sizeof(int32_t)), cudaSuccess);
  for (int launch = 0; launch < 3; ++launch) {
    SCOPED_TRACE(testing::Message() << "launch " << launch);
    std::mt19937 rng(101 + launch);
    std::uniform_real_distribution<float> uni(-4.f, 4.f);
    std::vector<float> logits(static_cast<size_t>(rows) * vocab);
    for (float& v : logits) v = uni(rng);
    auto row = [&](int r) { return logits.data() + static_cast<size_t>(r) * vocab; };
    const float top = 10.f - launch;  // lower each launch
    row(0)[70001 - launch] = top;     // a tie across blocks: the lower index must win
    row(0)[5000 + launch] = top;
    std::fill(row(1), row(1) + vocab, NAN);  // nothing to pick: 0
    std::fill(row(2), row(2) + vocab, -INFINITY);
    row(2)[0] = NAN;
    row(2)[vocab - 1] = -1e30f;  // the only finite logit, in the last, partial block
    std::fill(row(3), row(3) + vocab, NAN);
    row(3)[77777 - launch] = INFINITY;
    std::fill(row(4), row(4) + vocab, -INFINITY);  // nothing above -inf: 0
    for (int i = 0; i < vocab; ++i) row(5)[i] = -1.f - std::fabs(uni(rng));  // all negative
    row(5)[33333 + launch] = -0.75f;
    std::fill(row(6), row(6) + vocab, -3.f);  // -0 before +0: equal, so the lower index
    row(6)[40000] = -0.f;
    row(6)[40001 + launch] = 0.f;
    for (int i = 0; i < vocab; ++i) row(7)[i] = static_cast<float>(i % 977);  // 976 many times
    const float* device_logits = Upload(logits);
    std::fill(out, out + rows, -7);
    cuda::GreedyTokens(device_logits, rows, vocab, scratch, out, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> want_named = {5000 + launch,  0,     vocab - 1, 77777 - launch, 0,
                                             33333 + launch, 40000, 976};
    for (int r = 0; r < rows; ++r) {
      const int32_t want = Greedy({row(r), static_cast<size_t>(vocab)});
      EXPECT_EQ(want, want_named[r]) << "row " << r << ": the host's Greedy";
      EXPECT_EQ(out[r], want) << "row " << r;
    }
  }
  cudaFreeHost(out);
}

// The step's input kernel reads the token ids and the position from pinned host memory when it
// runs, writes their device copies, gathers the bf16 embedding rows into fp32 x and zeroes the
// counters it is given.
TEST_F(GpuKernels, StepInputsReadTheHostsTokensAndZeroTheCounters) {
  const int vocab = 300, hidden = 264, rows = 3;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::vector<uint16_t> table(static_cast<size_t>(vocab) * hidden);
  for (uint16_t& v : table) v = FloatToBf16(uni(rng));
  int32_t* host_tokens = nullptr;
  int* host_position = nullptr;
  ASSERT_EQ(cudaMallocHost(&host_tokens, rows * sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&host_position, sizeof(int)), cudaSuccess);
  cuda::StepInputArgs a;
  a.host_tokens = host_tokens;
  a.host_position = host_position;
  a.rows = rows;
  a.tokens = Upload(std::vector<int32_t>(rows, -1));
  a.position = Upload(std::vector<int>{-1});
  a.embed = MatrixRef{Upload(table), DType::kBF16, vocab, hidden};
  a.x = Upload(std::vector<float>(static_cast<size_t>(rows) * hidden, NAN));
  a.zero = Upload(std::vector<unsigned>(1000, 7u));
  a.zero_count = 999;  // the last one stays
  for (const auto& [tokens, position] : {std::pair{std::vector<int32_t>{299, 0, 17}, 41},
                                         std::pair{std::vector<int32_t>{5, 5, 123}, 42}}) {
    std::copy(tokens.begin(), tokens.end(), host_tokens);
    *host_position = position;
    cuda::StepInputs(a, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(Download(a.tokens, rows), tokens);
    EXPECT_EQ(Download(a.position, 1)[0], position);
    const std::vector<float> x = Download(a.x, static_cast<size_t>(rows) * hidden);
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < hidden; ++i)
        ASSERT_EQ(x[static_cast<size_t>(r) * hidden + i],
                  Bf16ToFloat(table[static_cast<size_t>(tokens[r]) * hidden + i]))
            << "row " << r << " column " << i;
    const std::vector<unsigned> counters = Download(a.zero, 1000);
    EXPECT_EQ(std::count(counters.begin(), counters.end(), 0u), 999);
    EXPECT_EQ(counters[999], 7u);
  }
  cudaFreeHost(host_tokens);
  cudaFreeHost(host_position);
}

// Kernels whose dynamic shared memory is over the 48 KB default set their limit once per device
// (PerDeviceOnce): a once-per-process flag would leave every GPU but the first with the default
// and its launches failing, as tensor parallelism would find out. Each runs on every GPU of the
// machine in turn, checked against host math. Skipped with one GPU.
TEST_F(GpuKernels, LargeSharedMemoryKernelsRunOnEveryDevice) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  if (devices < 2) GTEST_SKIP() << "one GPU";
  std::mt19937 rng(3);
  for (int d = 0; d < devices; ++d) {
    SCOPED_TRACE(testing::Message() << "device " << d);
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    CheckGemv(*this, 4, 4096, 64);                                  // 64 KB of staged input
    CheckBucketPairs(*this, {5000, 1024, 0, -1});                   // 65 KB of count table
    CheckFlashAttention(*this, {2, 100, 8, 2, 128, 5, 2e-2}, rng);  // 64 KB of K/V stages
    CheckFlashAttention(*this, {2, 40, 16, 2, 256, 5, 2e-2}, rng);  // 99 KB: stages and Q
    CheckFlashAttention(*this, {2, 1, 16, 2, 256, 70, 2e-2}, rng);  // 75 KB: stages and Q
    CheckFlashAttention(*this, {1, 2, 32, 2, 248, 40, 1e-4}, rng);  // 78 KB of fp32 tiles and q
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, d), cudaSuccess);
    if (prop.major == 9 && prop.minor == 0) {  // moe=wgmma's 97 KB ring
      std::vector<float> y;
      CheckMoe(*this, {64, 8, 128, 256, 128, -1, 5, -1, true}, &y);
    }
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// q/k RMSNorm + RoPE + KV append against host math, into an fp32 cache, a bf16 one (the same
// values rounded once) and an fp8 one (E4M3 codes under each head's amax / 448), from separate q/k/v buffers and from the fused GEMM's [rows, q | k | v]
// rows, for head sizes below, at and above a warp's width and rows that land at position +
// row % n of their sequence.
TEST_F(GpuKernels, QkNormRopeAppendMatchesHostMath) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  struct Case {
    int batch, n, q_heads, kv_heads, d, pos0;
  };
  // d = 256: every pair held in registers, the largest head an fp8 cache takes; d = 512: pairs
  // past the 128 a warp holds in registers take the kernel's late-read path.
  for (const Case& c : {Case{2, 3, 8, 2, 128, 4}, Case{1, 1, 4, 4, 16, 0}, Case{3, 2, 6, 3, 64, 9},
                        Case{1, 2, 2, 1, 512, 3}, Case{2, 2, 8, 2, 256, 6}}) {
    for (const cuda::KvDtype dtype : {cuda::KvDtype::kFp32, cuda::KvDtype::kBf16, cuda::KvDtype::kFp8}) {
      // An fp8 cache holds a head's pairs in registers (kv_cache=fp8 is refused past 256).
      if (dtype == cuda::KvDtype::kFp8 && c.d > 256) continue;
      const bool bf16 = dtype == cuda::KvDtype::kBf16, fp8 = dtype == cuda::KvDtype::kFp8;
      SCOPED_TRACE(testing::Message() << "d " << c.d << " cache " << (fp8 ? "fp8" : bf16 ? "bf16" : "fp32"));
      const int rows = c.batch * c.n, half = c.d / 2, capacity = c.pos0 + c.n + 2;
      const int kv_dim = c.kv_heads * c.d;
      const float eps = 1e-6f;
      std::vector<float> q(static_cast<size_t>(rows) * c.q_heads * c.d), k(static_cast<size_t>(rows) * kv_dim), v(k.size());
      std::vector<uint16_t> q_gain(c.d), k_gain(c.d);
      for (float& x : q) x = uni(rng);
      for (float& x : k) x = uni(rng);
      for (float& x : v) x = uni(rng);
      for (uint16_t& g : q_gain) g = FloatToBf16(uni(rng));
      for (uint16_t& g : k_gain) g = FloatToBf16(uni(rng));
      std::vector<float2> rope(static_cast<size_t>(capacity) * half);
      for (int p = 0; p < capacity; ++p)
        for (int i = 0; i < half; ++i) {
          const double angle = p * std::pow(1e6, -2.0 * i / c.d);
          rope[static_cast<size_t>(p) * half + i] = {static_cast<float>(std::cos(angle)), static_cast<float>(std::sin(angle))};
        }
      // Host: normalise, rotate; expected q in place and the cache rows.
      auto rotate = [&](const float* in, const std::vector<uint16_t>& gain, int pos, double* out) {
        double sum_sq = 0;
        for (int i = 0; i < c.d; ++i) sum_sq += static_cast<double>(in[i]) * in[i];
        const double inv = 1.0 / std::sqrt(sum_sq / c.d + eps);
        for (int i = 0; i < half; ++i) {
          const double x1 = in[i] * inv * Bf16ToFloat(gain[i]), x2 = in[i + half] * inv * Bf16ToFloat(gain[i + half]);
          const float2 cs = rope[static_cast<size_t>(pos) * half + i];
          out[i] = x1 * cs.x - x2 * cs.y;
          out[i + half] = x2 * cs.x + x1 * cs.y;
        }
      };
      const size_t cache_elems = static_cast<size_t>(c.batch) * capacity * kv_dim;
      std::vector<double> want_q(q.size()), want_k(cache_elems, 0.0), want_v(cache_elems, 0.0);
      for (int r = 0; r < rows; ++r) {
        const int b = r / c.n, pos = c.pos0 + r % c.n;
        for (int h = 0; h < c.q_heads; ++h) {
          const size_t at = (static_cast<size_t>(r) * c.q_heads + h) * c.d;
          rotate(&q[at], q_gain, pos, &want_q[at]);
        }
        for (int h = 0; h < c.kv_heads; ++h) {
          const size_t slot = (static_cast<size_t>(b) * capacity + pos) * kv_dim + h * c.d;
          rotate(&k[static_cast<size_t>(r) * kv_dim + h * c.d], k_gain, pos, &want_k[slot]);
          for (int i = 0; i < c.d; ++i) want_v[slot + i] = v[static_cast<size_t>(r) * kv_dim + h * c.d + i];
        }
      }
      // Separate q, k, v buffers (q rotated in place) or, with the fused q/k/v GEMM, one
      // [rows, q | k | v] buffer and q rotated into its own.
      const bool fused = c.q_heads % 2 == 0 && dtype != cuda::KvDtype::kFp32;
      const int q_dim = c.q_heads * c.d, width = q_dim + 2 * kv_dim;
      float* dq = Upload(q);
      cuda::QkvRows in{dq, q_dim, Upload(k), Upload(v), kv_dim};
      if (fused) {
        std::vector<float> joint(static_cast<size_t>(rows) * width, NAN);
        for (int r = 0; r < rows; ++r) {
          std::copy_n(&q[static_cast<size_t>(r) * q_dim], q_dim, &joint[static_cast<size_t>(r) * width]);
          std::copy_n(&k[static_cast<size_t>(r) * kv_dim], kv_dim, &joint[static_cast<size_t>(r) * width + q_dim]);
          std::copy_n(&v[static_cast<size_t>(r) * kv_dim], kv_dim, &joint[static_cast<size_t>(r) * width + q_dim + kv_dim]);
        }
        const float* d_joint = Upload(joint);
        in = {d_joint, width, d_joint + q_dim, d_joint + q_dim + kv_dim, width};
        dq = Upload(std::vector<float>(q.size(), NAN));
      }
      const size_t bytes = cache_elems * cuda::KvBytesPerElement(dtype);
      void* kc = Upload(std::vector<char>(bytes, 0));
      void* vc = Upload(std::vector<char>(bytes, 0));
      const size_t scale_count = static_cast<size_t>(c.batch) * capacity * c.kv_heads;
      float* k_scale = fp8 ? Upload(std::vector<float>(scale_count, 0.f)) : nullptr;
      float* v_scale = fp8 ? Upload(std::vector<float>(scale_count, 0.f)) : nullptr;
      cuda::QkNormRopeAppend(in, dq, rows, c.n, c.q_heads, c.kv_heads, c.d,
                             MatrixRef{Upload(q_gain), DType::kBF16, 1, c.d},
                             MatrixRef{Upload(k_gain), DType::kBF16, 1, c.d}, eps, Upload(rope),
                             Upload(std::vector<int>{c.pos0}), cuda::KvCache{kc, vc, dtype, capacity, k_scale, v_scale},
                             nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> got_q = Download(dq, q.size());
      for (size_t i = 0; i < q.size(); ++i)
        ASSERT_NEAR(got_q[i], want_q[i], 1e-4 * (1 + std::fabs(want_q[i]))) << "q[" << i << "] d " << c.d;
      const std::vector<float> got_k_scale = fp8 ? Download(k_scale, scale_count) : std::vector<float>(scale_count, 1.f);
      const std::vector<float> got_v_scale = fp8 ? Download(v_scale, scale_count) : std::vector<float>(scale_count, 1.f);
      // Element i of the cache, decoded (fp8: code times its head's scale).
      auto cache_value = [&](const std::vector<char>& raw, const std::vector<float>& scales, size_t i) {
        if (fp8) return static_cast<double>(E4M3ToFloat(static_cast<uint8_t>(raw[i]))) * scales[i / c.d];
        if (!bf16) return static_cast<double>(reinterpret_cast<const float*>(raw.data())[i]);
        return static_cast<double>(Bf16ToFloat(reinterpret_cast<const uint16_t*>(raw.data())[i]));
      };
      const std::vector<char> got_k = Download(static_cast<char*>(kc), bytes);
      const std::vector<char> got_v = Download(static_cast<char*>(vc), bytes);
      // fp8: each written head's scale is the power of two at or above its amax / 448 (within
      // rounding of the amax), and each element one E4M3 rounding under it: 2^-4 relative, or
      // half the smallest subnormal (2^-10 x scale).
      if (fp8)
        for (size_t h = 0; h < scale_count; ++h) {
          double k_amax = 0, v_amax = 0;
          for (int i = 0; i < c.d; ++i) {
            k_amax = std::max(k_amax, std::fabs(want_k[h * c.d + i]));
            v_amax = std::max(v_amax, std::fabs(want_v[h * c.d + i]));
          }
          if (k_amax == 0) continue;  // a slot no row wrote
          for (const auto& [got, amax, name] : {std::tuple{got_k_scale[h], k_amax, "k"},
                                                std::tuple{got_v_scale[h], v_amax, "v"}}) {
            int e = 0;
            ASSERT_EQ(std::frexp(got, &e), 0.5f) << name << " scale " << h << " " << got;
            EXPECT_GE(got * (1 + 1e-6), amax / 448) << name << " scale " << h;
            EXPECT_LT(got, 2 * amax / 448 * (1 + 1e-6)) << name << " scale " << h;
          }
        }
      const double rel = fp8 ? 1.0 / 16 : bf16 ? 1.0 / 256 : 1e-4;  // bf16: 2^-9 relative
      for (size_t i = 0; i < cache_elems; ++i) {
        const double k_floor = fp8 ? got_k_scale[i / c.d] / 1024 : rel;
        const double v_floor = fp8 ? got_v_scale[i / c.d] / 1024 : rel;
        ASSERT_NEAR(cache_value(got_k, got_k_scale, i), want_k[i], rel * std::fabs(want_k[i]) + k_floor) << "k cache[" << i << "]";
        ASSERT_NEAR(cache_value(got_v, got_v_scale, i), want_v[i], rel * std::fabs(want_v[i]) + v_floor) << "v cache[" << i << "]";
      }
    }
  }
}

// Softmax + top-k against double math, under both selections (a scan up to 4 experts a lane, a
// tournament from 8): ids exactly (ties to the lower index), weights to fp32 rounding,
// renormalised or not; an all-NaN row (a NaN fault upstream) still yields k distinct,
// valid ids so that the expert kernels after it read nothing out of range.
TEST_F(GpuKernels, RouterTopKMatchesHostMath) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uni(-4.f, 4.f);
  for (auto [rows, experts, k] :
       {std::tuple{1, 128, 8}, std::tuple{5, 60, 4}, std::tuple{3, 256, 8}, std::tuple{3, 200, 10},
        std::tuple{3, 512, 10}, std::tuple{2, 1024, 32}, std::tuple{4, 8, 2}}) {
    for (const bool renormalize : {true, false}) {
      std::vector<float> logits(static_cast<size_t>(rows) * experts);
      for (float& v : logits) v = uni(rng);
      // Row 0: exact ties between its two largest logits and a tied block further down.
      float* r0 = logits.data();
      const int top = static_cast<int>(std::max_element(r0, r0 + experts) - r0);
      r0[(top + 3) % experts] = r0[top];
      if (experts > 20) r0[10] = r0[11] = r0[12] = r0[top] - 0.5f;
      // A tie within one lane (experts 8 and 40, both lane 8's): the lower index first.
      if (experts > 64 && top % 32 != 8) r0[8] = r0[40] = r0[top] - 0.25f;
      if (rows > 2)  // the last row NaN throughout
        std::fill(logits.end() - experts, logits.end(), NAN);
      int* ids = Upload(std::vector<int>(static_cast<size_t>(rows) * k, -1));
      float* weights = Upload(std::vector<float>(static_cast<size_t>(rows) * k, NAN));
      cuda::RouterTopK(Upload(logits), rows, experts, k, renormalize, ids, weights, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<int> got_ids = Download(ids, static_cast<size_t>(rows) * k);
      const std::vector<float> got_w = Download(weights, static_cast<size_t>(rows) * k);
      for (int r = 0; r < rows; ++r) {
        const float* l = &logits[static_cast<size_t>(r) * experts];
        const int* got = &got_ids[static_cast<size_t>(r) * k];
        if (std::isnan(l[0])) {
          std::vector<int> sorted(got, got + k);
          std::sort(sorted.begin(), sorted.end());
          EXPECT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) << "NaN row: repeated id";
          EXPECT_TRUE(sorted.front() >= 0 && sorted.back() < experts) << "NaN row: id out of range";
          continue;
        }
        const double m = *std::max_element(l, l + experts);
        std::vector<double> p(experts);
        double sum = 0;
        for (int e = 0; e < experts; ++e) sum += p[e] = std::exp(l[e] - m);
        std::vector<int> order(experts);
        for (int e = 0; e < experts; ++e) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
        double chosen = 0;
        for (int s = 0; s < k; ++s) chosen += p[order[s]] / sum;
        for (int s = 0; s < k; ++s) {
          ASSERT_EQ(got[s], order[s]) << "row " << r << " slot " << s << " of E " << experts << " k " << k;
          const double want = p[order[s]] / sum / (renormalize ? chosen : 1.0);
          ASSERT_NEAR(got_w[static_cast<size_t>(r) * k + s], want, 1e-6 * want + 1e-9)
              << "row " << r << " slot " << s;
        }
      }
    }
  }
}

// The router's GEMV with its top-k in the same launch (GemvTopK, moe=fused's decode rows): the
// logits are the plain GEMV's bit for bit, and the ids and weights RouterTopK's on those logits,
// at 1 and 4 rows, E = 128 (qwen3-30b-a3b), 512 (qwen3-next) and 60 (a last block short of
// warps), k 8, 10 and 4; three launches on one counter (each must leave it zero for the next).
TEST_F(GpuKernels, RouterGemvFusesTheTopK) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  unsigned* counter = Upload(std::vector<unsigned>{0u});
  for (const auto& [rows, experts, k] :
       {std::tuple{1, 128, 8}, std::tuple{4, 512, 10}, std::tuple{1, 60, 4}}) {
    SCOPED_TRACE(testing::Message() << rows << " rows, E " << experts << ", k " << k);
    const int hidden = 2048;
    std::vector<float> x(static_cast<size_t>(rows) * hidden), gain(hidden);
    std::vector<uint16_t> w(static_cast<size_t>(experts) * hidden);
    for (float& v : x) v = 3.f * uni(rng);
    for (float& v : gain) v = 1.f + 0.5f * uni(rng);
    for (uint16_t& v : w) v = FloatToBf16(0.05f * uni(rng));
    cuda::GemvArgs a;
    a.x = Upload(x);
    a.rows = rows;
    a.k = hidden;
    a.norm_gain = Upload(gain);
    a.norm_dtype = DType::kF32;
    a.norm_eps = 1e-6f;
    a.seg[0].w = Upload(w);
    a.seg[0].n = experts;
    a.seg[0].ld = experts;
    a.segments = 1;
    ASSERT_FALSE(cuda::GemvStreams(a));
    const size_t logits = static_cast<size_t>(rows) * experts, picks = static_cast<size_t>(rows) * k;
    // The plain GEMV, then RouterTopK on its logits: what the fused launch must equal.
    a.seg[0].y = Upload(std::vector<float>(logits, NAN));
    cuda::Gemv(a, nullptr);
    int* want_ids = Upload(std::vector<int>(picks, -1));
    float* want_w = Upload(std::vector<float>(picks, NAN));
    cuda::RouterTopK(a.seg[0].y, rows, experts, k, true, want_ids, want_w, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> want_logits = Download(a.seg[0].y, logits);
    for (int launch = 0; launch < 3; ++launch) {
      cuda::GemvArgs f = a;
      f.seg[0].y = Upload(std::vector<float>(logits, NAN));
      f.topk.counter = counter;
      f.topk.expert_ids = Upload(std::vector<int>(picks, -1));
      f.topk.expert_weights = Upload(std::vector<float>(picks, NAN));
      f.topk.num_experts = experts;
      f.topk.k = k;
      f.topk.renormalize = true;
      cuda::Gemv(f, nullptr);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(Download(f.seg[0].y, logits), want_logits) << "launch " << launch;
      EXPECT_EQ(Download(f.topk.expert_ids, picks), Download(want_ids, picks)) << "launch " << launch;
      EXPECT_EQ(Download(f.topk.expert_weights, picks), Download(want_w, picks))
          << "launch " << launch;
      EXPECT_EQ(Download(counter, 1)[0], 0u) << "launch " << launch << " left the count";
    }
  }
}

// The router GEMM stays fp32 (fp32 input, fp32 accumulate): it must match double math to fp32
// rounding, at shapes that are not multiples of its 8-row, 128-expert and 32-k tiles.
TEST_F(GpuKernels, RouterGemmIsFp32Exact) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  for (auto [m, n, k] : {std::tuple{37, 150, 96}, std::tuple{64, 128, 2048}, std::tuple{1, 8, 40}, std::tuple{300, 40, 160}}) {
    std::vector<float> x(static_cast<size_t>(m) * k);
    std::vector<uint16_t> w(static_cast<size_t>(n) * k);
    for (float& v : x) v = uni(rng);
    for (uint16_t& v : w) v = FloatToBf16(uni(rng));
    float* y = Upload(std::vector<float>(static_cast<size_t>(m) * n, NAN));
    cuda::RouterGemm(Upload(x), m, MatrixRef{Upload(w), DType::kBF16, n, k}, y, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = Download(y, static_cast<size_t>(m) * n);
    for (int r = 0; r < m; ++r)
      for (int e = 0; e < n; ++e) {
        double ref = 0, magnitude = 0;
        for (int i = 0; i < k; ++i) {
          const double term = static_cast<double>(x[static_cast<size_t>(r) * k + i]) * Bf16ToFloat(w[static_cast<size_t>(e) * k + i]);
          ref += term;
          magnitude += std::fabs(term);
        }
        ASSERT_NEAR(got[static_cast<size_t>(r) * n + e], ref, 1e-6 * magnitude + 1e-30)
            << "m " << m << " n " << n << " k " << k << " at (" << r << ", " << e << ")";
      }
  }
}

// Gated DeltaNet on the GPU against the CPU reference's kernels (kernels/cpu/gated_delta.h):
// conv (+ SiLU), gates, and both delta-rule kernels over a prefill chunk then a decode step with
// the states carried, on shapes that take every path: dk = dv = 32 (tiny-hybrid), 128
// (qwen3-next), a dv that is not a multiple of the fused kernel's 32 columns, and GQA-style
// value heads sharing a key head. Within 1e-5 of each output's largest magnitude.
double RelMax(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  return diff / std::max(scale, 1e-30);
}

// The CPU's recurrent rule over `seqs` sequences of n rows of `mixed` (as the gates leave them:
// q and k normalised, q scaled), g and beta [rows, Hv]; sequence b reads and advances slot
// slots[b] of `state` ([slots, Hv, dk, dv]), from zeros where `fresh`. Returns out [rows, Hv * dv].
struct HostDeltaShape {
  int key_heads, value_heads, dk, dv;
};
std::vector<float> HostDeltaRule(const std::vector<float>& mixed, const std::vector<float>& g,
                                 const std::vector<float>& beta, int seqs, int n,
                                 const HostDeltaShape& c, const std::vector<int>& slots,
                                 bool fresh, std::vector<float>& state) {
  const int hv = c.value_heads, key_width = c.key_heads * c.dk;
  const int channels = 2 * key_width + hv * c.dv;
  std::vector<float> out(static_cast<size_t>(seqs) * n * hv * c.dv);
  for (int seq = 0; seq < seqs; ++seq)
    for (int h = 0; h < hv; ++h) {
      const int kh = h / (hv / c.key_heads);
      std::vector<float> q(n * c.dk), k(n * c.dk), v(n * c.dv), gh(n), bh(n), o(n * c.dv);
      for (int t = 0; t < n; ++t) {
        const float* row = mixed.data() + (static_cast<size_t>(seq) * n + t) * channels;
        std::copy_n(row + kh * c.dk, c.dk, q.data() + t * c.dk);
        std::copy_n(row + key_width + kh * c.dk, c.dk, k.data() + t * c.dk);
        std::copy_n(row + 2 * key_width + h * c.dv, c.dv, v.data() + t * c.dv);
        gh[t] = g[(seq * n + t) * hv + h];
        bh[t] = beta[(seq * n + t) * hv + h];
      }
      float* st = state.data() + (static_cast<size_t>(slots[seq]) * hv + h) * c.dk * c.dv;
      if (fresh) std::fill_n(st, c.dk * c.dv, 0.f);
      cpu::GatedDeltaRecurrent(q.data(), k.data(), v.data(), gh.data(), bh.data(), n, c.dk, c.dv,
                               st, o.data());
      for (int t = 0; t < n; ++t)
        std::copy_n(o.data() + t * c.dv, c.dv,
                    out.data() + ((static_cast<size_t>(seq) * n + t) * hv + h) * c.dv);
    }
  return out;
}

TEST_F(GpuKernels, GatedDeltaMatchesTheCpuReference) {
  struct Case {
    int batch, key_heads, value_heads, dk, dv, taps;
  };
  for (const Case c : {Case{2, 2, 4, 32, 32, 2}, Case{1, 1, 2, 128, 128, 4},
                       Case{2, 2, 2, 64, 48, 3}}) {
    cuda::GatedDeltaShape s{c.batch, 0, c.key_heads, c.value_heads, c.dk, c.dv, c.taps};
    const int channels = s.conv_channels(), key_width = c.key_heads * c.dk, hv = c.value_heads;
    std::mt19937 rng(77 + c.dk);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    std::vector<uint16_t> conv_w(static_cast<size_t>(channels) * c.taps);
    for (auto& w : conv_w) w = FloatToBf16(0.5f * uni(rng));
    std::vector<float> a_log(hv), dt_bias(hv);
    for (int h = 0; h < hv; ++h) a_log[h] = 0.3f * uni(rng), dt_bias[h] = 0.5f * uni(rng);
    const MatrixRef conv_ref{conv_w.data(), DType::kBF16, channels, c.taps};
    const MatrixRef conv_dev{Upload(conv_w), DType::kBF16, channels, c.taps};
    const MatrixRef a_log_dev{Upload(a_log), DType::kF32, 1, hv},
        dt_dev{Upload(dt_bias), DType::kF32, 1, hv};
    // Host states and the device's, per variant (reference, fused).
    std::vector<float> conv_state(static_cast<size_t>(c.batch) * (c.taps - 1) * channels, 0.f);
    std::vector<float> rec_state(static_cast<size_t>(c.batch) * hv * c.dk * c.dv, 0.f);
    float* d_conv[2] = {Upload(conv_state), Upload(conv_state)};
    float* d_rec[2] = {Upload(rec_state), Upload(rec_state)};
    for (const int n : {70, 1}) {
      s.n = n;
      const int rows = s.rows();
      std::vector<float> in(static_cast<size_t>(rows) * channels), a(rows * hv), b(rows * hv);
      for (float& v : in) v = uni(rng);
      for (float& v : a) v = uni(rng);
      for (float& v : b) v = 2.f * uni(rng);
      // Host: conv + SiLU per sequence, normalised q/k, gates, the recurrent rule per head.
      std::vector<float> mixed(in.size());
      for (int seq = 0; seq < c.batch; ++seq)
        cpu::CausalConvSilu(in.data() + static_cast<size_t>(seq) * n * channels, n, channels,
                            conv_ref, conv_state.data() + static_cast<size_t>(seq) * (c.taps - 1) *
                                                              channels,
                            mixed.data() + static_cast<size_t>(seq) * n * channels);
      const std::vector<float> conv_out = mixed;
      for (int r = 0; r < rows; ++r) {
        float* row = mixed.data() + static_cast<size_t>(r) * channels;
        cpu::L2NormalizeRows(row, 2 * c.key_heads, c.dk);
        for (int i = 0; i < key_width; ++i) row[i] *= 1.f / std::sqrt(static_cast<float>(c.dk));
      }
      std::vector<float> g(rows * hv), beta(rows * hv);
      for (int r = 0; r < rows; ++r)
        for (int h = 0; h < hv; ++h) {
          beta[r * hv + h] = cpu::Sigmoid(b[r * hv + h]);
          g[r * hv + h] = -std::exp(a_log[h]) * cpu::Softplus(a[r * hv + h] + dt_bias[h]);
        }
      std::vector<int> slots(c.batch);
      for (int b = 0; b < c.batch; ++b) slots[b] = b;
      const std::vector<float> out =
          HostDeltaRule(mixed, g, beta, c.batch, n, {c.key_heads, hv, c.dk, c.dv}, slots,
                        /*fresh=*/false, rec_state);
      for (int fused = 0; fused < 2; ++fused) {
        const std::string what = std::string(fused ? "fused" : "reference") + " dk " +
                                 std::to_string(c.dk) + " dv " + std::to_string(c.dv) + " n " +
                                 std::to_string(n);
        float* d_in = Upload(in);
        float* d_mixed = Upload(std::vector<float>(in.size()));
        cuda::CausalConv(d_in, s, conv_dev, fused == 1, d_conv[fused], d_mixed, nullptr);
        if (!fused) cuda::SiluInPlace(d_mixed, static_cast<int64_t>(in.size()), nullptr);
        EXPECT_LE(RelMax(Download(d_mixed, in.size()), conv_out), 1e-6) << "conv, " << what;
        float* d_g = Upload(std::vector<float>(g.size()));
        float* d_beta = Upload(std::vector<float>(g.size()));
        cuda::GatedDeltaGates(d_mixed, Upload(a), Upload(b), a_log_dev, dt_dev, s, d_g, d_beta,
                              nullptr);
        EXPECT_LE(RelMax(Download(d_mixed, in.size()), mixed), 1e-6) << "q/k norm, " << what;
        EXPECT_LE(RelMax(Download(d_g, g.size()), g), 1e-6) << "g, " << what;
        EXPECT_LE(RelMax(Download(d_beta, g.size()), beta), 1e-6) << "beta, " << what;
        float* d_out = Upload(std::vector<float>(out.size()));
        if (fused)
          cuda::GatedDeltaFused(d_mixed, d_g, d_beta, s, d_rec[fused], d_out, nullptr);
        else
          cuda::GatedDeltaReference(d_mixed, d_g, d_beta, s, d_rec[fused], d_out, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
        const double out_err = RelMax(Download(d_out, out.size()), out);
        const double state_err = RelMax(Download(d_rec[fused], rec_state.size()), rec_state);
        const double conv_state_err = RelMax(Download(d_conv[fused], conv_state.size()), conv_state);
        std::printf("# gated delta %s: out %.2g, state %.2g, conv state %.2g\n", what.c_str(),
                    out_err, state_err, conv_state_err);
        EXPECT_LE(out_err, 1e-5) << what;
        EXPECT_LE(state_err, 1e-5) << what;
        EXPECT_EQ(conv_state_err, 0) << what;
      }
    }
  }
}

// linear_attn=chunked's kernels (GatedDeltaChunked) against the CPU's recurrent rule: lockstep
// sequences of 100 then 37 tokens (three and a partial 32-token chunks, then one and a partial)
// with the state carried between the calls, then a served sequence of 50 tokens whose slot holds
// another's state but whose first row sits at position 0 (it starts from zero). Head sizes of the
// hidden fixtures (16), tiny-hybrid (32), qwen3-next (128), dv 48 (16 state columns a block) and
// 16 sequences of qwen3-next's heads (64 heads x 4 blocks of 32 columns: the wide state pass),
// value heads sharing key heads. fp32 class: within 1e-5 of each output's largest magnitude.
TEST_F(GpuKernels, GatedDeltaChunkedMatchesTheRecurrentRule) {
  struct Case {
    int batch, key_heads, value_heads, dk, dv;
  };
  for (const Case c : {Case{2, 2, 4, 16, 16}, Case{2, 2, 4, 32, 32}, Case{1, 2, 4, 128, 128},
                       Case{2, 1, 2, 64, 48}, Case{16, 2, 4, 128, 128}}) {
    ASSERT_TRUE(cuda::GatedDeltaChunkedSupports(c.dk, c.dv));
    cuda::GatedDeltaShape s{c.batch, 0, c.key_heads, c.value_heads, c.dk, c.dv, 4};
    const int channels = s.conv_channels(), key_width = c.key_heads * c.dk, hv = c.value_heads;
    std::mt19937 rng(91 + c.dk + c.dv);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    std::vector<float> state(static_cast<size_t>(c.batch) * hv * c.dk * c.dv, 0.f);
    float* d_state = Upload(state);
    // One call: `seqs` sequences of n rows, sequence b on state slot slots[b].
    auto run = [&](int n, int seqs, const std::vector<int>& slots, const int2* ragged,
                   const std::string& what) {
      s.n = n;
      s.batch = seqs;
      s.ragged = ragged;
      const int rows = s.rows();
      // The rows as the gates leave them: q and k L2-normalised per key head, q times dk^-0.5.
      std::vector<float> mixed(static_cast<size_t>(rows) * channels), g(rows * hv),
          beta(rows * hv);
      for (float& v : mixed) v = uni(rng);
      for (int r = 0; r < rows; ++r) {
        float* row = mixed.data() + static_cast<size_t>(r) * channels;
        cpu::L2NormalizeRows(row, 2 * c.key_heads, c.dk);
        for (int i = 0; i < key_width; ++i) row[i] *= 1.f / std::sqrt(static_cast<float>(c.dk));
      }
      for (float& v : g) v = -0.02f - 0.6f * (uni(rng) + 1.f);
      for (float& v : beta) v = 0.5f * (uni(rng) + 1.f);
      // A served sequence's first row at position 0: it starts from zero states.
      const std::vector<float> out =
          HostDeltaRule(mixed, g, beta, seqs, n, {c.key_heads, hv, c.dk, c.dv}, slots,
                        /*fresh=*/ragged != nullptr, state);
      std::vector<float> terms(
          cuda::GatedDeltaChunkedScratchFloats(rows, hv, c.dk, c.dv), 0.f);
      float* d_terms = Upload(terms);
      cuda::GatedDeltaChunkScratch scratch;
      scratch.w = d_terms;
      scratch.q = scratch.w + static_cast<int64_t>(rows) * hv * c.dk;
      scratch.u = scratch.q + static_cast<int64_t>(rows) * hv * c.dk;
      scratch.g = scratch.u + static_cast<int64_t>(rows) * hv * c.dv;
      float* d_out = Upload(std::vector<float>(out.size(), 0.f));
      cuda::GatedDeltaChunked(Upload(mixed), Upload(g), Upload(beta), s, scratch, d_state, d_out,
                              nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
      const double out_err = RelMax(Download(d_out, out.size()), out);
      const double state_err = RelMax(Download(d_state, state.size()), state);
      std::printf("# chunked gated delta %s dk %d dv %d: out %.2g, state %.2g\n", what.c_str(),
                  c.dk, c.dv, out_err, state_err);
      EXPECT_LE(out_err, 1e-5) << what << " dk " << c.dk << " dv " << c.dv;
      EXPECT_LE(state_err, 1e-5) << what << " dk " << c.dk << " dv " << c.dv;
    };
    std::vector<int> lockstep(c.batch);
    for (int b = 0; b < c.batch; ++b) lockstep[b] = b;
    run(100, c.batch, lockstep, nullptr, "lockstep n 100");
    run(37, c.batch, lockstep, nullptr, "lockstep n 37, state carried");
    const int slot = c.batch - 1;
    std::vector<int2> rows(50);
    for (int t = 0; t < 50; ++t) rows[t] = make_int2(slot, t);
    run(50, 1, {slot}, reinterpret_cast<const int2*>(Upload(rows)), "served from position 0");
  }
}

// The fused decode kernel (GatedDeltaDecode) against the kernel chain it replaces (CausalConv
// with SiLU, GatedDeltaGates, GatedDeltaFused, RmsNormGated) over three consecutive decode steps,
// both starting from the same random conv and recurrent states and carrying them: lockstep
// batches and ragged rows (slots out of order, one row a fresh sequence at position 0 whose slot
// holds stale values), GQA ratios 1, 2 and 4, dv not a multiple of 32, qwen3-next's head shape.
// Outputs and recurrent states within 1e-5 of their largest magnitude, conv states exact, and
// the key-head arrival counts back at zero after every launch. Both state layouts (columns,
// rows), each case under each.
TEST_F(GpuKernels, GatedDeltaDecodeMatchesTheKernelChain) {
  struct Case {
    int batch, key_heads, value_heads, dk, dv, taps;
    bool ragged;
  };
  using Layout = cuda::GatedDeltaDecodeLayout;
  for (const Layout layout : {Layout::kColumns, Layout::kRows})
    for (const Case c : {Case{1, 2, 2, 32, 32, 2, false}, Case{3, 2, 4, 32, 32, 4, false},
                         Case{2, 1, 4, 64, 48, 3, false}, Case{1, 16, 32, 128, 128, 4, false},
                         Case{4, 2, 4, 32, 32, 4, true}, Case{3, 16, 32, 128, 128, 4, true},
                         Case{9, 16, 32, 128, 128, 4, true}}) {
      const std::string what = std::string(layout == Layout::kRows ? "rows" : "columns") +
                               " batch " + std::to_string(c.batch) + " Hk " +
                               std::to_string(c.key_heads) + " Hv " +
                               std::to_string(c.value_heads) + " dk " + std::to_string(c.dk) +
                               " dv " + std::to_string(c.dv) + (c.ragged ? " ragged" : " lockstep");
      ASSERT_TRUE(cuda::GatedDeltaDecodeSupports(c.dk, c.dv)) << what;
      cuda::GatedDeltaShape s{c.batch, 1, c.key_heads, c.value_heads, c.dk, c.dv, c.taps};
      const int channels = s.conv_channels(), hv = c.value_heads, value = hv * c.dv;
      // Ragged rows take slots in reverse order past two spare ones; the last row is fresh.
      const int slots = c.ragged ? c.batch + 2 : c.batch;
      std::vector<int2> rows(c.batch);
      for (int r = 0; r < c.batch; ++r)
        rows[r] = make_int2(slots - 1 - r, r + 1 == c.batch ? 0 : 7 + r);
      if (c.ragged) s.ragged = Upload(rows);
      std::mt19937 rng(31 + c.dk + c.batch);
      std::uniform_real_distribution<float> uni(-1.f, 1.f);
      std::vector<uint16_t> conv_w(static_cast<size_t>(channels) * c.taps);
      for (auto& w : conv_w) w = FloatToBf16(0.5f * uni(rng));
      std::vector<float> a_log(hv), dt_bias(hv), gain(c.dv);
      for (int h = 0; h < hv; ++h) a_log[h] = 0.3f * uni(rng), dt_bias[h] = 0.5f * uni(rng);
      for (float& v : gain) v = uni(rng);
      std::vector<float> conv_state(static_cast<size_t>(slots) * (c.taps - 1) * channels);
      std::vector<float> rec_state(static_cast<size_t>(slots) * hv * c.dk * c.dv);
      for (float& v : conv_state) v = uni(rng);
      for (float& v : rec_state) v = 0.2f * uni(rng);
      float* d_conv[2] = {Upload(conv_state), Upload(conv_state)};  // chain, fused
      float* d_rec[2] = {Upload(rec_state), Upload(rec_state)};
      const std::vector<unsigned> zeros(static_cast<size_t>(c.batch) * c.key_heads, 0u);
      unsigned* d_arrivals = Upload(zeros);
      cuda::GatedDeltaDecodeOperands ops;
      ops.conv = MatrixRef{Upload(conv_w), DType::kBF16, channels, c.taps};
      ops.a_log = MatrixRef{Upload(a_log), DType::kF32, 1, hv};
      ops.dt_bias = MatrixRef{Upload(dt_bias), DType::kF32, 1, hv};
      ops.norm = MatrixRef{Upload(gain), DType::kF32, 1, c.dv};
      ops.eps = 1e-6f;
      ops.key_head_arrivals = d_arrivals;
      for (int step = 0; step < 3; ++step) {
        const std::string at = what + " step " + std::to_string(step);
        std::vector<float> in(static_cast<size_t>(c.batch) * channels), z(c.batch * value),
            a(c.batch * hv), b(c.batch * hv);
        for (float& v : in) v = uni(rng);
        for (float& v : z) v = 2.f * uni(rng);
        for (float& v : a) v = uni(rng);
        for (float& v : b) v = 2.f * uni(rng);
        const float *d_in = Upload(in), *d_z = Upload(z), *d_a = Upload(a), *d_b = Upload(b);
        // The chain.
        float* d_mixed = Upload(std::vector<float>(in.size()));
        float* d_g = Upload(std::vector<float>(a.size()));
        float* d_beta = Upload(std::vector<float>(a.size()));
        float* d_chain = Upload(std::vector<float>(z.size()));
        cuda::CausalConv(d_in, s, ops.conv, /*fuse_silu=*/true, d_conv[0], d_mixed, nullptr);
        cuda::GatedDeltaGates(d_mixed, d_a, d_b, ops.a_log, ops.dt_bias, s, d_g, d_beta, nullptr);
        cuda::GatedDeltaFused(d_mixed, d_g, d_beta, s, d_rec[0], d_chain, nullptr);
        cuda::RmsNormGated(d_chain, d_z, static_cast<int64_t>(c.batch) * hv, c.dv, ops.norm,
                           ops.eps, d_chain, nullptr);
        // The fused kernel.
        ops.projected = d_in;
        ops.z = d_z;
        ops.a = d_a;
        ops.b = d_b;
        ops.conv_state = d_conv[1];
        ops.state = d_rec[1];
        ops.out = Upload(std::vector<float>(z.size(), NAN));
        cuda::GatedDeltaDecode(ops, s, nullptr, layout);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << at;
        const double out_err = RelMax(Download(ops.out, z.size()), Download(d_chain, z.size()));
        const double state_err =
            RelMax(Download(d_rec[1], rec_state.size()), Download(d_rec[0], rec_state.size()));
        const double conv_err =
            RelMax(Download(d_conv[1], conv_state.size()), Download(d_conv[0], conv_state.size()));
        std::printf("# gated delta decode %s: out %.2g, state %.2g, conv state %.2g\n", at.c_str(),
                    out_err, state_err, conv_err);
        EXPECT_LE(out_err, 1e-5) << at;
        EXPECT_LE(state_err, 1e-5) << at;
        EXPECT_EQ(conv_err, 0) << at;
        EXPECT_EQ(Download(d_arrivals, zeros.size()), zeros) << at;
      }
      // The states moved: the decode steps did not leave them as they started.
      EXPECT_GT(RelMax(Download(d_rec[1], rec_state.size()), rec_state), 1e-3) << what;
      EXPECT_GT(RelMax(Download(d_conv[1], conv_state.size()), conv_state), 1e-3) << what;
    }
}

// The gated RMSNorm and the gated attention's output gate against host math.
TEST_F(GpuKernels, GatedNormAndGatedQueryMatchHostMath) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  const int vectors = 24, dim = 128;
  std::vector<float> x(vectors * dim), z(x.size()), gain(dim);
  for (float& v : x) v = uni(rng);
  for (float& v : z) v = uni(rng);
  for (float& v : gain) v = uni(rng);
  std::vector<float> want(x.size());
  cpu::RmsNormGated(x.data(), z.data(), vectors, dim, MatrixRef{gain.data(), DType::kF32, 1, dim},
                    1e-6f, want.data());
  float* d_x = Upload(x);
  cuda::RmsNormGated(d_x, Upload(z), vectors, dim, MatrixRef{Upload(gain), DType::kF32, 1, dim},
                     1e-6f, d_x, nullptr);
  EXPECT_LE(RelMax(Download(d_x, x.size()), want), 1e-6);

  // The output gate, read in place from q_proj's [q_h | gate_h] rows (a padded stride).
  const int rows = 3, heads = 4, d = 16, stride = 2 * heads * d + 8;
  std::vector<float> src(rows * stride), attn(rows * heads * d);
  for (float& v : src) v = uni(rng);
  for (float& v : attn) v = uni(rng);
  float* d_attn = Upload(attn);
  cuda::SigmoidGateHeads(d_attn, Upload(src), stride, rows, heads, d, nullptr);
  const std::vector<float> got = Download(d_attn, attn.size());
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d; ++i) {
        const float gate = src[r * stride + h * 2 * d + d + i];
        const int at = (r * heads + h) * d + i;
        EXPECT_NEAR(got[at], attn[at] * cpu::Sigmoid(gate), 1e-6f)
            << "row " << r << " head " << h << " dim " << i;
      }
}

// Partial RoPE (qwen3-next: the norm over the whole head, RoPE over its first rotary_dim dims)
// against host math, q read from gated attention's [q_h | gate_h] rows (heads 2 d apart) and k,
// v appended to an fp32 cache: head sizes a warp holds in registers (64, 256) and one past them
// (320, the late-read path), positions after the prompt's start.
TEST_F(GpuKernels, QkNormPartialRopeAppendReadsGatedHeadsInPlace) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> uni(-2.f, 2.f);
  struct Case {
    int rows, q_heads, kv_heads, d, rotary, pos0;
  };
  for (const Case& c :
       {Case{2, 4, 2, 64, 16, 3}, Case{3, 8, 2, 256, 64, 5}, Case{1, 2, 1, 320, 80, 0}}) {
    SCOPED_TRACE(testing::Message() << "d " << c.d << " rotary " << c.rotary);
    const int half = c.rotary / 2, q_stride = 2 * c.q_heads * c.d + 4, kv_dim = c.kv_heads * c.d;
    const int capacity = c.pos0 + c.rows + 1;  // one sequence, rows at pos0, pos0 + 1, ...
    const float eps = 1e-6f;
    std::vector<float> q(static_cast<size_t>(c.rows) * q_stride), k(c.rows * kv_dim), v(k.size());
    std::vector<float> q_gain(c.d), k_gain(c.d);
    for (auto* vec : {&q, &k, &v, &q_gain, &k_gain})
      for (float& x : *vec) x = uni(rng);
    std::vector<float2> rope(static_cast<size_t>(capacity) * half);
    for (int p = 0; p < capacity; ++p)
      for (int i = 0; i < half; ++i) {
        const double angle = p * std::pow(1e4, -2.0 * i / c.rotary);
        rope[p * half + i] = {static_cast<float>(std::cos(angle)),
                              static_cast<float>(std::sin(angle))};
      }
    auto expect = [&](const float* in, const std::vector<float>& gain, int pos, int i) {
      double sum_sq = 0;
      for (int j = 0; j < c.d; ++j) sum_sq += static_cast<double>(in[j]) * in[j];
      const double inv = 1.0 / std::sqrt(sum_sq / c.d + eps);
      auto normed = [&](int j) { return in[j] * inv * gain[j]; };
      if (i >= c.rotary) return normed(i);
      const float2 cs = rope[pos * half + i % half];
      return i < half ? normed(i) * cs.x - normed(i + half) * cs.y
                      : normed(i) * cs.x + normed(i - half) * cs.y;
    };
    float* d_q_out = Upload(std::vector<float>(c.rows * c.q_heads * c.d, NAN));
    const size_t cache_elems = static_cast<size_t>(capacity) * kv_dim;
    float* kc = Upload(std::vector<float>(cache_elems, 0.f));
    float* vc = Upload(std::vector<float>(cache_elems, 0.f));
    cuda::QkvRows in{Upload(q), q_stride, Upload(k), Upload(v), kv_dim};
    in.q_head_stride = 2 * c.d;
    cuda::QkNormPartialRopeAppend(in, d_q_out, c.rows, c.rows, c.q_heads, c.kv_heads, c.d, c.rotary,
                                  MatrixRef{Upload(q_gain), DType::kF32, 1, c.d},
                                  MatrixRef{Upload(k_gain), DType::kF32, 1, c.d}, eps, Upload(rope),
                                  Upload(std::vector<int>{c.pos0}),
                                  cuda::KvCache{kc, vc, cuda::KvDtype::kFp32, capacity}, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got_q = Download(d_q_out, c.rows * c.q_heads * c.d);
    const std::vector<float> got_k = Download(kc, cache_elems), got_v = Download(vc, cache_elems);
    for (int r = 0; r < c.rows; ++r) {
      const int pos = c.pos0 + r;
      for (int h = 0; h < c.q_heads; ++h)
        for (int i = 0; i < c.d; ++i) {
          const double want = expect(&q[r * q_stride + h * 2 * c.d], q_gain, pos, i);
          ASSERT_NEAR(got_q[(r * c.q_heads + h) * c.d + i], want, 1e-4 * (1 + std::fabs(want)))
              << "q row " << r << " head " << h << " dim " << i;
        }
      for (int h = 0; h < c.kv_heads; ++h)
        for (int i = 0; i < c.d; ++i) {
          const size_t slot = static_cast<size_t>(pos) * kv_dim + h * c.d + i;
          const double want = expect(&k[r * kv_dim + h * c.d], k_gain, pos, i);
          ASSERT_NEAR(got_k[slot], want, 1e-4 * (1 + std::fabs(want)))
              << "k row " << r << " head " << h << " dim " << i;
          ASSERT_EQ(got_v[slot], v[r * kv_dim + h * c.d + i])
              << "v row " << r << " head " << h << " dim " << i;
        }
    }
  }
}

#else
TEST(GpuKernels, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }
#endif

}  // namespace
}  // namespace infersweep
