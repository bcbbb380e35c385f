// Dequantize a block-wise 4-bit weight with a 16-value code table (NF4) to float32
// or bfloat16:  Ŵ[o, k] = table[code(o, k)] · scales[o, k / B].
//
//   codes: (O, K/2) uint8, block b of row o holds in byte j the code of column
//          bB + j (low nibble) and bB + j + B/2 (high nibble) (pack_nibbles)
//   scales: (O, K/B) float32;  table: (16,) float32;  out: (O, K)
//
// XLA:CPU decodes through a gather at about 1 ns a value; with AVX-512 one vpermps
// looks up 16 codes, so the decode runs at the speed of writing the output. The
// float32 product is rounded to bfloat16 to nearest, ties to even, as XLA's convert.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ENTRENAR_AVX512 1
#endif

namespace ffi = xla::ffi;

namespace {

inline uint16_t ToBf16(float f) {  // round to nearest, ties to even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline void Store(float* out, int64_t i, float v) { out[i] = v; }
inline void Store(uint16_t* out, int64_t i, float v) { out[i] = ToBf16(v); }

#if ENTRENAR_AVX512
inline void Store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void Store16(uint16_t* out, __m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
#endif

template <typename T>
void Rows(const uint8_t* codes, const float* scales, const float* table, T* out,
          int64_t o0, int64_t o1, int64_t k, int64_t block) {
  const int64_t half = block / 2, nb = k / block;
#if ENTRENAR_AVX512
  if (block % 32 == 0) {
    const __m512 tab = _mm512_loadu_ps(table);
    const __m128i low4 = _mm_set1_epi8(15);
    for (int64_t row = o0; row < o1; ++row) {
      const uint8_t* c = codes + row * (k / 2);
      T* w = out + row * k;
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 s = _mm512_set1_ps(scales[row * nb + b]);
        for (int64_t j = 0; j < half; j += 16) {
          const __m128i bytes =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * half + j));
          const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4));
          const __m512i hi =
              _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
          Store16(w + b * block + j, _mm512_mul_ps(_mm512_permutexvar_ps(lo, tab), s));
          Store16(w + b * block + half + j,
                  _mm512_mul_ps(_mm512_permutexvar_ps(hi, tab), s));
        }
      }
    }
    return;
  }
#endif
  for (int64_t row = o0; row < o1; ++row) {
    for (int64_t b = 0; b < nb; ++b) {
      const float s = scales[row * nb + b];
      const uint8_t* c = codes + row * (k / 2) + b * half;
      for (int64_t j = 0; j < half; ++j) {
        Store(out + row * k, b * block + j, table[c[j] & 15] * s);
        Store(out + row * k, b * block + half + j, table[c[j] >> 4] * s);
      }
    }
  }
}

template <ffi::DataType D, typename T>
ffi::Error DequantizeImpl(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::F32> table, ffi::ResultBuffer<D> out,
                          ffi::ThreadPool pool) {
  const auto cd = codes.dimensions(), sd = scales.dimensions(), od = out->dimensions();
  if (cd.size() != 2 || sd.size() != 2 || od.size() != 2 || table.element_count() != 16) {
    return ffi::Error::InvalidArgument("entrenar_nf4_dequantize: bad ranks");
  }
  const int64_t o = od[0], k = od[1];
  if (cd[0] != o || sd[0] != o || cd[1] * 2 != k || sd[1] == 0 || k % sd[1] != 0 ||
      (k / sd[1]) % 2 != 0) {
    return ffi::Error::InvalidArgument("entrenar_nf4_dequantize: shapes disagree");
  }
  const int64_t block = k / sd[1];
  T* dst = reinterpret_cast<T*>(out->untyped_data());
  // Ranges of rows of at least 2^16 values, a few per intra-op thread.
  const int64_t chunks = std::max<int64_t>(
      1, std::min<int64_t>({4 * pool.num_threads(), o, o * k / (1 << 16)}));
  entrenar::ParallelFor(pool, chunks, [&](int64_t t) {
    Rows(codes.typed_data(), scales.typed_data(), table.typed_data(), dst,
         o * t / chunks, o * (t + 1) / chunks, k, block);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarNf4DequantizeF32,
                              (DequantizeImpl<ffi::F32, float>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes (O, K/2)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales (O, K/B)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // table (16,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // (O, K)
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarNf4DequantizeBf16,
                              (DequantizeImpl<ffi::BF16, uint16_t>),
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ctx<ffi::ThreadPool>());
