// y = x · Ŵᵀ for a 2-d block-wise 4-bit weight with a 16-value code table (NF4),
// decoding the weight inside the product: the dense matrix is never written.
//
//   x: (n, K) float32        codes: (O, K/2) uint8, block b of row o holds in byte j
//   y: (n, O) float32        the code of column bB + j (low nibble) and bB + j + B/2
//   scales: (O, K/B) float32 (high nibble), entrenar.quant.weight.pack_nibbles
//   table: (16,) float32     Ŵ[o, k] = table[code(o, k)] · scales[o, k / B]
//
// For few input rows (generation, small batches) a matmul is bound by reading the
// weight: 4.1 bits a value here against 32 for float32. Each task takes a range of
// output rows; the columns are walked in chunks whose slice of x stays in L1, each
// row's chunk is decoded once (with AVX-512, 16 values per vpermps) into a small
// buffer and multiplied with eight input rows at a time.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// Columns per chunk (the decode buffer): 16 input rows' slice is 32 KiB (L1). Smaller
// chunks for more rows cost more in the per-chunk sums than they save (measured).
constexpr int64_t kChunk = 512;

struct Problem {
  const float* x;
  const uint8_t* codes;
  const float* scales;
  const float* table;
  float* y;
  int64_t n, k, o, block, chunk;
};

// Decode columns [c0, c0 + len) of row `row` into w (len values).
void DecodeScalar(const Problem& p, int64_t row, int64_t c0, int64_t len, float* w) {
  const uint8_t* codes = p.codes + row * (p.k / 2);
  const float* scales = p.scales + row * (p.k / p.block);
  const int64_t half = p.block / 2;
  for (int64_t c = c0; c < c0 + len; ++c) {
    const int64_t b = c / p.block, j = c % p.block;
    const uint8_t byte = codes[b * half + (j % half)];
    const int code = j < half ? (byte & 15) : (byte >> 4);
    w[c - c0] = p.table[code] * scales[b];
  }
}

#if defined(__AVX512F__)
void DecodeAvx512(const Problem& p, int64_t row, int64_t c0, int64_t len, float* w) {
  const uint8_t* codes = p.codes + row * (p.k / 2);
  const float* scales = p.scales + row * (p.k / p.block);
  const int64_t half = p.block / 2;
  const __m512 table = _mm512_loadu_ps(p.table);
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t b = c0 / p.block; b < (c0 + len) / p.block; ++b) {
    const __m512 s = _mm512_set1_ps(scales[b]);
    float* out = w + (b * p.block - c0);
    for (int64_t j = 0; j < half; j += 16) {  // 16 bytes: 16 low and 16 high codes
      const __m128i bytes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * half + j));
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4));
      const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
      _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_permutexvar_ps(lo, table), s));
      _mm512_storeu_ps(out + half + j,
                       _mm512_mul_ps(_mm512_permutexvar_ps(hi, table), s));
    }
  }
}
#endif

void Decode(const Problem& p, int64_t row, int64_t c0, int64_t len, float* w) {
#if defined(__AVX512F__)
  if (p.block % 32 == 0) return DecodeAvx512(p, row, c0, len, w);
#endif
  DecodeScalar(p, row, c0, len, w);
}

// y[r, row] += Σ_c x[r, c0 + c] w[c] for rows r0..r0+R-1 (R <= 8: 8 accumulators).
template <int R>
void Dot(const Problem& p, int64_t row, int64_t r0, int64_t c0, int64_t len,
         const float* w) {
  float acc[R][16] = {};
  const float* xs[R];
  for (int i = 0; i < R; ++i) xs[i] = p.x + (r0 + i) * p.k + c0;
  for (int64_t c = 0; c < len; c += 16) {
    for (int i = 0; i < R; ++i) {
#pragma omp simd
      for (int l = 0; l < 16; ++l) acc[i][l] += xs[i][c + l] * w[c + l];
    }
  }
  for (int i = 0; i < R; ++i) {
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += acc[i][l];
    p.y[(r0 + i) * p.o + row] += sum;
  }
}

void RunRows(const Problem& p, int64_t o0, int64_t o1) {
  alignas(64) float w[kChunk];
  for (int64_t r = 0; r < p.n; ++r) {
    std::memset(p.y + r * p.o + o0, 0, sizeof(float) * (o1 - o0));
  }
  for (int64_t c0 = 0; c0 < p.k; c0 += p.chunk) {
    const int64_t len = std::min(p.chunk, p.k - c0);
    for (int64_t row = o0; row < o1; ++row) {
      Decode(p, row, c0, len, w);
      int64_t r = 0;
      for (; r + 8 <= p.n; r += 8) Dot<8>(p, row, r, c0, len, w);
      for (; r + 4 <= p.n; r += 4) Dot<4>(p, row, r, c0, len, w);
      for (; r < p.n; ++r) Dot<1>(p, row, r, c0, len, w);
    }
  }
}

ffi::Error Nf4MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                         ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> table,
                         ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || table.element_count() != 16) {
    return ffi::Error::InvalidArgument("entrenar_nf4_matmul: bad ranks");
  }
  Problem p{x.typed_data(), codes.typed_data(), scales.typed_data(), table.typed_data(),
            y->typed_data(), xd[0], xd[1], cd[0], 0, 0};
  if (sd[0] != p.o || sd[1] == 0 || p.k % sd[1] != 0 || cd[1] * 2 != p.k) {
    return ffi::Error::InvalidArgument("entrenar_nf4_matmul: shapes disagree");
  }
  p.block = p.k / sd[1];
  if (p.block % 2 != 0 || kChunk % p.block != 0) {
    return ffi::Error::InvalidArgument("entrenar_nf4_matmul: unsupported block size");
  }
  p.chunk = kChunk;
  // Ranges of at least 16 output rows, a few per intra-op thread.
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>(4 * pool.num_threads(), p.o / 16));
  entrenar::ParallelFor(pool, chunks, [&](int64_t t) {
    RunRows(p, p.o * t / chunks, p.o * (t + 1) / chunks);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarNf4Matmul, Nf4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (n, K)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes (O, K/2)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales (O, K/B)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // table (16,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (n, O)
                                  .Ctx<ffi::ThreadPool>());
