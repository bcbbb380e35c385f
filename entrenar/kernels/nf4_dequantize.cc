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
#include <type_traits>
#include <vector>

#include "nf4_decode.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline uint16_t ToBf16(float f) {  // round to nearest, ties to even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// out[0, n) = bfloat16(in[0, n)), rounded to nearest, ties to even.
void ToBf16Span(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  for (; i + 16 <= n; i += 16) {
    __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(in + i));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, bias));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
#endif
  for (; i < n; ++i) out[i] = ToBf16(in[i]);
}

// Rows [o0, o1): float32 straight into `out`; bfloat16 through a one-block buffer.
template <typename T>
void Rows(const uint8_t* codes, const float* scales, const float* table, T* out,
          int64_t o0, int64_t o1, int64_t k, int64_t block) {
  const int64_t half = block / 2, nb = k / block;
  std::vector<float> buffer(std::is_same_v<T, float> ? 0 : block);
  for (int64_t row = o0; row < o1; ++row) {
    for (int64_t b = 0; b < nb; ++b) {
      T* dst = out + row * k + b * block;
      float* w = buffer.data();
      if constexpr (std::is_same_v<T, float>) w = dst;
      entrenar::DecodeNf4Block(codes + row * (k / 2) + b * half, block,
                               scales[row * nb + b], table, w);
      if constexpr (!std::is_same_v<T, float>) ToBf16Span(w, dst, block);
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
