// Elementwise float helpers shared by attention.cc and softmax_xent.cc, written so
// that GCC and Clang vectorize the loops that call them: the rounding to an integer
// is the 1.5 * 2^23 trick (std::floor vectorizes only under -fno-trapping-math, which
// the build does not pass), the clamps are selects (std::min/max return references),
// the bit casts are memcpy.
#ifndef ENTRENAR_KERNELS_FASTMATH_H_
#define ENTRENAR_KERNELS_FASTMATH_H_

#include <cstdint>
#include <cstring>

namespace entrenar {

// exp(x) to within 1e-7 relative (Cephes' expf polynomial), 0 below -87.3.
inline float Exp(float x) {
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.3f ? 88.3f : xc;
  const float t = xc * 1.44269504088896341f + 12582912.0f;  // n + 1.5 * 2^23
  const float n = t - 12582912.0f;                           // round(x / ln 2)
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln 2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;  // exp(r), |r| <= ln 2 / 2
  int32_t yi, ti;
  std::memcpy(&yi, &y, 4);
  std::memcpy(&ti, &t, 4);
  const int32_t bits = yi + ((ti - 0x4B400000) << 23);  // y · 2^n
  float out;
  std::memcpy(&out, &bits, 4);
  return x < -87.3f ? 0.0f : out;
}

// The bfloat16 bits of x, rounded to nearest with ties to even; a NaN stays a NaN
// (rounding alone would carry a NaN whose payload sits in the low 16 bits into inf).
inline uint16_t Bf16Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// The float32 a bfloat16 stands for (its bits are a float32's high half): exact.
inline float Bf16ToFloat(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &b, 4);
  return out;
}

// x rounded to the nearest bfloat16 (ties to even), kept in a float.
inline float RoundBf16(float x) { return Bf16ToFloat(Bf16Bits(x)); }

}  // namespace entrenar

#endif  // ENTRENAR_KERNELS_FASTMATH_H_
