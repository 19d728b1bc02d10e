// Synthetic weights: a pure function of (seed, tensor name, element index), so every device can
// generate bit-identical weights in place without copying them. Header-only and free of Abseil:
// the host generator (engine/synthetic.cc) and the CUDA one (kernels/cuda/synthetic.cu) share it.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/dtype.h"

namespace infersweep {

// FNV-1a over the canonical tensor name.
constexpr uint64_t HashTensorName(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// splitmix64 finaliser: a bijective mix of one 64-bit counter.
INFERSWEEP_HD uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Element `index` of a tensor: offset + scale * u, u uniform in [-1, 1) on a 2^-23 grid.
// u is exact in fp32 and the result is one multiply and one add, each correctly rounded on every
// IEEE device (the CUDA side must not contract them into an fma: see __fmul_rn/__fadd_rn).
INFERSWEEP_HD float SyntheticUniform(uint64_t stream, uint64_t index) {
  const uint64_t bits = Mix64(stream + index * 0x9e3779b97f4a7c15ull);
  return static_cast<float>(static_cast<int32_t>(bits >> 40)) * (1.0f / 8388608.0f) - 1.0f;
}

INFERSWEEP_HD uint64_t SyntheticStream(uint64_t seed, uint64_t name_hash) {
  return Mix64(seed ^ Mix64(name_hash));
}

// Per-tensor affine parameters: value = offset + scale * u.
struct SyntheticInit {
  float scale = 0.f;
  float offset = 0.f;
};

}  // namespace infersweep
