// Exact scalar codecs of the low-precision element and scale types (host and device).
//
//   E2M1 (FP4): sign, 2 exponent bits (bias 1), 1 mantissa bit; magnitudes
//               {0, 0.5, 1, 1.5, 2, 3, 4, 6}; no Inf or NaN.
//   E4M3 (float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; max 448; no Inf;
//               S.1111.111 is NaN.
//   E8M0 (MX scale): 8 exponent bits, no sign or mantissa: 2^(byte - 127); 0xFF is NaN.
//
// Every decode is exact (each value is an fp32 number). Encoders round to nearest, ties to even,
// and saturate to the largest finite magnitude (E2M1: 6, E4M3: 448).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"

namespace infersweep {


// One 4-bit code (the low nibble of `code`).
INFERSWEEP_HD float E2M1ToFloat(uint8_t code) {
  const uint32_t exponent = (code >> 1) & 3u, mantissa = code & 1u;
  // Normal codes are (1 + m/2) * 2^(e-1): fp32 exponent e - 1 + 127, mantissa bit 22.
  const uint32_t magnitude = exponent == 0 ? (mantissa ? 0x3f000000u : 0u)  // 0.5 or 0
                                           : ((exponent + 126u) << 23) | (mantissa << 22);
  return FloatFromBits(magnitude | (static_cast<uint32_t>(code & 8u) << 28));
}

INFERSWEEP_HD float E4M3ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 15u, mantissa = code & 7u;
  if (exponent == 15 && mantissa == 7) return FloatFromBits(sign | 0x7fc00000u);
  if (exponent == 0) {  // subnormal: m * 2^-9, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);
    return FloatFromBits(sign | BitsFromFloat(magnitude));
  }
  return FloatFromBits(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

INFERSWEEP_HD float E8M0ToFloat(uint8_t code) {
  if (code == 0xff) return FloatFromBits(0x7fc00000u);
  if (code == 0) return FloatFromBits(0x00400000u);  // 2^-127 is an fp32 subnormal
  return FloatFromBits(static_cast<uint32_t>(code) << 23);
}

// Two E2M1 codes at once, as fp16 bit patterns, for in-register dequantization: the codes in
// bits [0, 4) and [16, 20) of `t` become the low and high halves of an f16x2 whose values are
// the codes' values times 2^-14 (exactly: the sign goes to bit 15, exponent and mantissa to
// bits [9, 12), where E2M1's subnormal 0.5 lands on fp16's subnormal 2^-15). Other bits of `t`
// are ignored. Four of these (t = w >> 0, 4, 8, 12) decode the 8 codes of a 32-bit word w:
// elements s and s + 4 from w >> 4s.
inline constexpr float kE2M1F16Scale = 16384.0f;  // 2^14: the f16 values times this are exact
INFERSWEEP_HD uint32_t E2M1PairToF16x2Bits(uint32_t t) {
  return ((t << 9) & 0x0E000E00u) | ((t << 12) & 0x80008000u);
}

// Nearest E2M1 code, ties to the even code (even mantissa); |x| > 6 saturates; NaN gives +-6
// (callers reject non-finite weights before encoding).
INFERSWEEP_HD uint8_t FloatToE2M1(float x) {
  const uint8_t sign = (BitsFromFloat(x) >> 28) & 8u;
  const float a = x < 0 ? -x : x;
  // The code is the number of midpoints between neighbours that a lies above: <= rounds a tie
  // down onto an even code, < rounds it up; written as negations so that NaN counts all 7.
  // Branch-free: the quantizer calls it once per weight (tens of billions for a large preset).
  const uint8_t code =
      static_cast<uint8_t>(!(a <= 0.25f) + !(a < 0.75f) + !(a <= 1.25f) + !(a < 1.75f) +
                           !(a <= 2.5f) + !(a < 3.5f) + !(a <= 5.0f));
  return static_cast<uint8_t>(sign | code);
}

// Nearest float8_e4m3fn code, ties to even; |x| > 448 saturates to 448; NaN stays NaN.
// Branch-free integer arithmetic on the bits (no dependence on the rounding mode): the host
// quantizer calls it once per weight, and a data-dependent rounding branch mispredicts on about
// half of them.
INFERSWEEP_HD uint8_t FloatToE4M3(float x) {
  const uint32_t u = BitsFromFloat(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t magnitude = u & 0x7fffffffu;
  const uint32_t exponent = magnitude >> 23, mantissa = magnitude & 0x7fffffu;
  // Normal (2^-6 <= |x| < 448): keep 3 of fp32's 23 mantissa bits, round half to even; a carry
  // bumps the exponent. E4M3's biased exponent is fp32's less 120.
  uint32_t normal = ((exponent - 120u) << 3) | (mantissa >> 20);
  const uint32_t dropped = mantissa & 0xfffffu;
  normal += static_cast<uint32_t>(dropped > 0x80000u) |
            (static_cast<uint32_t>(dropped == 0x80000u) & normal & 1u);
  // Subnormal (|x| < 2^-6): m = |x| * 2^9 rounded half to even, m = 0..8 (8 is the first normal),
  // from the integer significand: |x| * 2^9 = significand * 2^-(141 - exponent) (fp32's own
  // subnormals, exponent 0, are far below half a code and give 0 at the clamped shift).
  const uint32_t significand = exponent != 0 ? (mantissa | 0x800000u) : mantissa;
  const int wanted = 141 - static_cast<int>(exponent);
  const uint32_t shift = static_cast<uint32_t>(wanted < 1 ? 1 : (wanted > 31 ? 31 : wanted));
  const uint32_t whole = significand >> shift, rest = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t subnormal = whole + (static_cast<uint32_t>(rest > half) |
                                      (static_cast<uint32_t>(rest == half) & whole & 1u));
  uint32_t code = magnitude < 0x3c800000u ? subnormal : normal;  // 2^-6
  code = magnitude >= 0x43e00000u ? 0x7eu : code;                // 448 and above (and Inf)
  code = magnitude > 0x7f800000u ? 0x7fu : code;                 // NaN
  return static_cast<uint8_t>(sign | code);
}

// The MX scale exponent of a group whose largest magnitude is `amax`: the smallest e in
// [-127, 127] with 6 * 2^e >= amax, so no element saturates in E2M1 (largest magnitude 6);
// -127 for an all-zero or NaN group. In double: 6 * 2^127 overflows fp32. The global-namespace
// math functions are the ones both the host libm and CUDA's device library declare.
INFERSWEEP_HD int MxScaleExponent(float amax) {
  if (!(amax > 0)) return -127;
  int e = ::ilogbf(amax) - 2;
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  while (e < 127 && ::ldexp(6.0, e) < amax) ++e;
  while (e > -127 && ::ldexp(6.0, e - 1) >= amax) --e;
  return e;
}

}  // namespace infersweep
