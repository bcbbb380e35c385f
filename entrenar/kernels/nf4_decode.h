// Decoding one block of 4-bit codes against a 16-value table (NF4), shared by
// nf4_dequantize.cc and nf4_matmul.cc.
//
// A block of B values is B/2 bytes (entrenar.quant.weight.pack_nibbles): byte j holds
// value j in its low nibble and value j + B/2 in its high nibble. Value i decodes to
// table[code_i] · scale. When the build targets AVX-512 (entrenar.native's
// build_flags: -march=native on a CPU that has it) and B is a multiple of 32, 16 bytes
// are widened to two vectors of 16 codes, each looked up with one vpermps against the
// table held in a register; otherwise a scalar loop.
#ifndef ENTRENAR_KERNELS_NF4_DECODE_H_
#define ENTRENAR_KERNELS_NF4_DECODE_H_

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace entrenar {

// out[0, B) = table[code] · scale for the block's B/2 bytes.
inline void DecodeNf4Block(const uint8_t* bytes, int64_t block, float scale,
                           const float* table, float* out) {
  const int64_t half = block / 2;
#if defined(__AVX512F__)
  if (half % 16 == 0) {
    const __m512 tab = _mm512_loadu_ps(table);
    const __m512 s = _mm512_set1_ps(scale);
    const __m128i low4 = _mm_set1_epi8(15);
    for (int64_t j = 0; j < half; j += 16) {  // 16 bytes: 16 low and 16 high codes
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + j));
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(b, low4));
      const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low4));
      _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_permutexvar_ps(lo, tab), s));
      _mm512_storeu_ps(out + half + j, _mm512_mul_ps(_mm512_permutexvar_ps(hi, tab), s));
    }
    return;
  }
#endif
  for (int64_t j = 0; j < half; ++j) {
    out[j] = table[bytes[j] & 15] * scale;
    out[half + j] = table[bytes[j] >> 4] * scale;
  }
}

}  // namespace entrenar

#endif  // ENTRENAR_KERNELS_NF4_DECODE_H_
