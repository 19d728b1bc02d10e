// Element types of checkpoint tensors and the exact conversions the reference needs. Header-only
// and free of Abseil: host code, CUDA kernels and every library below the engine include it.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

#if defined(__CUDACC__)
#define INFERSWEEP_HD __host__ __device__ __forceinline__
#else
#define INFERSWEEP_HD inline
#endif

namespace infersweep {

// kF8E4M3 is float8_e4m3fn; kF8E8M0 is the power-of-two scale type of MX formats (8 exponent bits).
enum class DType : uint8_t { kF32, kF16, kBF16, kF8E4M3, kF8E8M0, kU8, kI8, kI32, kI64, kBool };

// Size of one element in bytes.
constexpr int DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kI64:
      return 8;
    default:
      return 1;
  }
}

// Safetensors spelling ("F32", "BF16", ...).
constexpr std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E8M0:
      return "F8_E8M0";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

// Exact, case-sensitive match: the safetensors format only spells them in upper case.
constexpr std::optional<DType> DTypeFromSafetensorsName(std::string_view name) {
  constexpr DType kAll[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E8M0,
                            DType::kU8,  DType::kI8,  DType::kI32,  DType::kI64,    DType::kBool};
  for (DType t : kAll) {
    if (DTypeName(t) == name) return t;
  }
  return std::nullopt;
}

// The bits of a float and back (memcpy: no aliasing rules broken, compiled to a move).
INFERSWEEP_HD float FloatFromBits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

INFERSWEEP_HD uint32_t BitsFromFloat(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

INFERSWEEP_HD float Bf16ToFloat(uint16_t bits) { return FloatFromBits(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even, NaN stays NaN (quiet).
INFERSWEEP_HD uint16_t FloatToBf16(float f) {
  uint32_t u = BitsFromFloat(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half to float, exact for every input (subnormals included).
INFERSWEEP_HD float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace infersweep
