// y = x · Ŵᵀ for a weight in one of llama.cpp's storage formats, decoding the weight
// inside the product: the dense matrix is never written. For decoding (one to a few
// dozen input rows) a product is bound by reading the weight, so it should read the
// bytes as stored: 4.5-8.5 bits a value here against 32 for float32.
//
//   x: (n, K) float32, y: (n, O) float32, Ŵ[o, k] decoded from row o's bytes.
//
// Two handlers share one loop (RunRows) and differ in how a row's chunk is decoded:
//
// entrenar_q_matvec: Q8_0 / Q4_0 / Q4_1 as entrenar.quant.QuantizedWeight holds them
//   (codes, scales, offsets apart); blocks of 32 values, float16 scale d (and min m):
//     type 0 Q8_0: codes (O, K) int8,    Ŵ = d·q
//     type 1 Q4_0: codes (O, K/2) uint8, Ŵ = d·(q − 8)
//     type 2 Q4_1: codes (O, K/2) uint8, Ŵ = d·q + m      (offsets: (O, K/32) float16)
//   4-bit byte j of a block holds value j (low nibble) and j + 16 (high nibble).
//   scales, offsets: (O, K/32) float16 (offsets unused but present for types 0, 1).
//
// entrenar_ggml_matvec: rows of bytes as GGUF stores them (entrenar.quant.GGMLWeight,
//   data (O, row_bytes) uint8), decoded as ggml's dequantize_row_* does:
//     type 0 Q4_K (144 B / 256), 1 Q5_K (176 B / 256), 2 Q6_K (210 B / 256),
//     3 BF16 (2 B / 1), 4 F16 (2 B / 1).
//
// Each task takes a range of output rows (row_pool.h's threads, as many as XLA's
// intra-op pool has; results bit-identical whatever their number); the columns are walked in chunks of kChunk
// whose slice of x stays in L1; each row's chunk is decoded once into a small buffer
// and multiplied with up to eight input rows at a time (nf4_matmul.cc's scheme).
// From kFloatTileRows input rows (a prompt) with AVX-512, 16 input rows go in a
// register's lanes instead (FloatTiles): weight rows decoded once into float32, one
// fused multiply-add of a broadcast weight by 16 rows' x at a time.
// The decoded values are the dequantizers' to the last bit (d·q + m may be one fused
// multiply-add: -ffp-contract=fast); the sums are in another order than XLA's dot,
// so results agree with the dequantized float32 product to float32 rounding.
//
// Attribute int8_x = 1 (entrenar_q_matvec): x rounded to 8 bits per 32-block and
// integer dot products instead (int8_dot.h; llama.cpp's scheme, an approximation
// bounded there); from kInt8TileRows input rows with 16 rows in a register's lanes
// (Int8Tiles). Operand `layer` (int32 scalar): with codes/scales/offsets or data
// stacked (L, O, ...), the product reads layer `layer` in place (a layer scan would
// otherwise copy each layer's slice out before the call); 0 for a 2-d weight.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decoded_rows.h"
#include "fastmath.h"
#include "int8_dot.h"
#include "row_pool.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// Columns per chunk: a multiple of 256 (K-quant super-blocks) and of 32.
constexpr int64_t kChunk = 512;

// Multiply-adds a range of rows takes at least (ForRowRanges): ~1-3 µs, where
// handing a range to a spinning helper costs well under one.
constexpr int64_t kMinWork = 1 << 15;

// IEEE half -> float, exact (subnormals, infinities and NaN included).
inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t Load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }

// ---------------------------------------------------------------- Q8_0 / Q4_0 / Q4_1
// The rows' fields (type, codes, scales, offsets, k) are int8_dot.h's Int8Weight.
struct QWeight : entrenar::Int8Weight {
  // Decode columns [c0, c0 + len) (whole 32-blocks) of row `row` into w.
  void Decode(int64_t row, int64_t c0, int64_t len, float* w) const {
    const int64_t nb = k / 32;
    const int64_t row_bytes = type == 0 ? k : k / 2;
    for (int64_t b = c0 / 32; b < (c0 + len) / 32; ++b) {
      const float d = HalfToFloat(scales[row * nb + b]);
      const float m = type == 2 ? HalfToFloat(offsets[row * nb + b]) : 0.0f;
      float* out = w + (b * 32 - c0);
      if (type == 0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(codes + row * row_bytes) + b * 32;
#if defined(__AVX512F__)
        const __m512 vd = _mm512_set1_ps(d);
        for (int j = 0; j < 32; j += 16) {
          const __m128i b8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j));
          const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b8));
          _mm512_storeu_ps(out + j, _mm512_mul_ps(vd, v));
        }
#else
        for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(q[j]);
#endif
      } else {
        const uint8_t* q = codes + row * row_bytes + b * 16;
        const float shift = type == 1 ? 8.0f : 0.0f;
#if defined(__AVX512F__)
        const __m128i b8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m128i low4 = _mm_set1_epi8(15);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b8, low4)));
        const __m512 hi = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b8, 4), low4)));
        const __m512 vd = _mm512_set1_ps(d), vs = _mm512_set1_ps(shift);
        if (type == 1) {
          _mm512_storeu_ps(out, _mm512_mul_ps(vd, _mm512_sub_ps(lo, vs)));
          _mm512_storeu_ps(out + 16, _mm512_mul_ps(vd, _mm512_sub_ps(hi, vs)));
        } else {
          const __m512 vm = _mm512_set1_ps(m);
          _mm512_storeu_ps(out, _mm512_fmadd_ps(vd, lo, vm));
          _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(vd, hi, vm));
        }
#else
        for (int j = 0; j < 16; ++j) {
          const float lo = static_cast<float>(q[j] & 15), hi = static_cast<float>(q[j] >> 4);
          if (type == 1) {
            out[j] = d * (lo - shift);
            out[j + 16] = d * (hi - shift);
          } else {
            out[j] = d * lo + m;
            out[j + 16] = d * hi + m;
          }
        }
#endif
      }
    }
  }
};

#if defined(__AVX512F__)
// Block b (32 values) of row `row` decoded into two registers, values 0-15 and 16-31.
inline void DecodeQBlock(const QWeight& w, int64_t row, int64_t b, __m512* lo,
                         __m512* hi) {
  const int64_t nb = w.k / 32;
  const __m512 vd = _mm512_set1_ps(HalfToFloat(w.scales[row * nb + b]));
  if (w.type == 0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.codes + row * w.k) + b * 32;
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    *lo = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0)));
    *hi = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1)));
    return;
  }
  const uint8_t* q = w.codes + row * (w.k / 2) + b * 16;
  const __m128i b8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low4 = _mm_set1_epi8(15);
  const __m512 l = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b8, low4)));
  const __m512 h = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b8, 4), low4)));
  if (w.type == 1) {
    const __m512 eight = _mm512_set1_ps(8.0f);
    *lo = _mm512_mul_ps(vd, _mm512_sub_ps(l, eight));
    *hi = _mm512_mul_ps(vd, _mm512_sub_ps(h, eight));
  } else {
    const __m512 vm = _mm512_set1_ps(HalfToFloat(w.offsets[row * nb + b]));
    *lo = _mm512_fmadd_ps(vd, l, vm);
    *hi = _mm512_fmadd_ps(vd, h, vm);
  }
}

// y[r0..r0+R, row] = x[r0..r0+R] · Ŵ[row]: each block decoded once, in registers,
// and multiplied with R input rows. U blocks are in flight per row, each half of a
// block into its own accumulator: 2U independent chains of fused multiply-adds (one
// chain would wait on the FMA latency, 4 cycles, at every step).
template <int R, int U>
void QDot(const float* x, float* y, int64_t k, int64_t o, const QWeight& w,
          int64_t row, int64_t r0) {
  __m512 acc[R][2 * U];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 2 * U; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  const float* xs = x + r0 * k;
  const int64_t nb = k / 32;
  int64_t b = 0;
  for (; b + U <= nb; b += U) {
    for (int u = 0; u < U; ++u) {
      __m512 lo, hi;
      DecodeQBlock(w, row, b + u, &lo, &hi);
      const float* xb = xs + (b + u) * 32;
      for (int i = 0; i < R; ++i) {
        acc[i][2 * u] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + i * k), acc[i][2 * u]);
        acc[i][2 * u + 1] =
            _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + i * k + 16), acc[i][2 * u + 1]);
      }
    }
  }
  for (; b < nb; ++b) {
    __m512 lo, hi;
    DecodeQBlock(w, row, b, &lo, &hi);
    for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xs + i * k + b * 32), acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xs + i * k + b * 32 + 16), acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 1; j < 2 * U; ++j) acc[i][0] = _mm512_add_ps(acc[i][0], acc[i][j]);
    y[(r0 + i) * o + row] = _mm512_reduce_add_ps(acc[i][0]);
  }
}
#endif

// ------------------------------------------------------------- K-quants, BF16, F16
// 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline void KScaleMin(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void DecodeQ4K(const uint8_t* b, float* y) {  // 144 bytes -> 256 values
  const float d = HalfToFloat(Load16(b)), dmin = HalfToFloat(Load16(b + 2));
  const uint8_t* s = b + 4;
  const uint8_t* q = b + 16;
  for (int c = 0; c < 4; ++c) {  // 64 values: sub-blocks 2c (low nibbles), 2c+1 (high)
    uint8_t sc, mn;
    KScaleMin(2 * c, s, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    KScaleMin(2 * c + 1, s, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 15) - m1;
    for (int l = 0; l < 32; ++l) y[32 + l] = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    y += 64;
  }
}

void DecodeQ5K(const uint8_t* b, float* y) {  // 176 bytes -> 256 values
  const float d = HalfToFloat(Load16(b)), dmin = HalfToFloat(Load16(b + 2));
  const uint8_t* s = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int c = 0; c < 4; ++c) {
    uint8_t sc, mn;
    KScaleMin(2 * c, s, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    KScaleMin(2 * c + 1, s, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    const int u1 = 2 * c, u2 = 2 * c + 1;  // the bit of qh each sub-block reads
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * static_cast<float>((ql[l] & 15) | (((qh[l] >> u1) & 1) << 4)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      y[32 + l] = d2 * static_cast<float>((ql[l] >> 4) | (((qh[l] >> u2) & 1) << 4)) - m2;
    }
    ql += 32;
    y += 64;
  }
}

void DecodeQ6K(const uint8_t* b, float* y) {  // 210 bytes -> 256 values
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = HalfToFloat(Load16(b + 208));
  for (int h = 0; h < 2; ++h) {  // 128 values each
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = static_cast<int>((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
      const int q2 = static_cast<int>((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = (d * sc[is]) * static_cast<float>(q1);
      y[l + 32] = (d * sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = (d * sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = (d * sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

struct GgmlWeight {
  int type;  // 0 Q4_K, 1 Q5_K, 2 Q6_K, 3 BF16, 4 F16
  const uint8_t* data;
  int64_t row_bytes;

  static int64_t BlockValues(int type) { return type <= 2 ? 256 : 1; }
  static int64_t BlockBytes(int type) {
    constexpr int64_t bytes[] = {144, 176, 210, 2, 2};
    return bytes[type];
  }

  void Decode(int64_t row, int64_t c0, int64_t len, float* w) const {
    const uint8_t* r = data + row * row_bytes;
    if (type == 3) {  // BF16: the high half of a float32
      const uint8_t* p = r + 2 * c0;
      for (int64_t j = 0; j < len; ++j) w[j] = entrenar::Bf16ToFloat(Load16(p + 2 * j));
      return;
    }
    if (type == 4) {
      const uint8_t* p = r + 2 * c0;
#if defined(__AVX512F__)
      int64_t j = 0;
      for (; j + 16 <= len; j += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * j));
        _mm512_storeu_ps(w + j, _mm512_cvtph_ps(h));
      }
      for (; j < len; ++j) w[j] = HalfToFloat(Load16(p + 2 * j));
#else
      for (int64_t j = 0; j < len; ++j) w[j] = HalfToFloat(Load16(p + 2 * j));
#endif
      return;
    }
    const int64_t bytes = BlockBytes(type);
    for (int64_t b = c0 / 256; b < (c0 + len) / 256; ++b) {
      float* out = w + (b * 256 - c0);
      const uint8_t* blk = r + b * bytes;
      if (type == 0) {
        DecodeQ4K(blk, out);
      } else if (type == 1) {
        DecodeQ5K(blk, out);
      } else {
        DecodeQ6K(blk, out);
      }
    }
  }
};

// ------------------------------------------------------------------- the product
using Io = entrenar::RowsProblem;

template <typename W>
void RunRows(const Io& p, const W& weight, int64_t o0, int64_t o1) {
  entrenar::DecodedRows<kChunk>(
      p, o0, o1,
      [&](int64_t row, int64_t c0, int64_t len, float* w) { weight.Decode(row, c0, len, w); });
}

#if defined(__AVX512F__)
// The Q formats with AVX-512: decoded in registers, no buffer.
template <>
void RunRows<QWeight>(const Io& p, const QWeight& w, int64_t o0, int64_t o1) {
  for (int64_t row = o0; row < o1; ++row) {
    int64_t r = 0;
    entrenar::PrefetchAhead(w, row, o1);  // bound by memory: int8_dot.h
    for (; r + 8 <= p.n; r += 8) QDot<8, 1>(p.x, p.y, p.k, p.o, w, row, r);
    for (; r + 4 <= p.n; r += 4) QDot<4, 1>(p.x, p.y, p.k, p.o, w, row, r);
    for (; r + 2 <= p.n; r += 2) QDot<2, 2>(p.x, p.y, p.k, p.o, w, row, r);
    for (; r < p.n; ++r) QDot<1, 4>(p.x, p.y, p.k, p.o, w, row, r);
  }
}
#endif

// Output rows in ranges over the threads XLA's intra-op pool has (the CPUs the process
// may use; one under `taskset -c 0`), run on row_pool.h's spinning helpers: about 4
// ranges a thread where each keeps kMinWork multiply-adds, one a thread where only
// that does, else one; ranges of at least 16 rows. A row is computed the same way in
// any range, so y does not depend on the number of threads, bit for bit.
template <typename Rows>
void ForRowRanges(ffi::ThreadPool& pool, const Io& p, const Rows& rows) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t work = p.n * p.o * p.k;
  int64_t chunks = work >= 4 * threads * kMinWork ? 4 * threads
                   : work >= threads * kMinWork   ? threads
                                                  : 1;
  chunks = std::max<int64_t>(1, std::min(chunks, p.o / 16));
  entrenar::RowPool::Shared().Run(static_cast<int>(threads), chunks, [&](int64_t t) {
    rows(p.o * t / chunks, p.o * (t + 1) / chunks);
  });
}

// Tiles [0, tiles) filled by fill(t0, t1) over the threads, a tile range each.
template <typename Fill>
void FillTiles(ffi::ThreadPool& pool, int64_t tiles, const Fill& fill) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::min(threads, tiles);
  entrenar::RowPool::Shared().Run(static_cast<int>(threads), parts, [&](int64_t t) {
    fill(tiles * t / parts, tiles * (t + 1) / parts);
  });
}

#if defined(__AVX512F__)
// ------------------------------------------- many input rows, float32 x: row tiles
// From kFloatTileRows input rows (a prompt), 16 input rows go in a register's lanes:
// x is rearranged into tiles xt (tiles, K, 16), xt[t, c, l] = x[16t + l, c] (rows
// past n: zeros), a group of kFloatW weight rows is decoded once into float32 (the
// dequantizers' values), and y[16t + l, row] = Σ_c Ŵ[row, c]·xt[t, c, l]: one fused
// multiply-add of a weight broadcast from memory by 16 rows' x, against one per 16
// multiply-adds plus the decoding in registers of QDot / DotRows at every tile of 8
// rows. Two tiles by four weight rows by two chains (even and odd c) are 16
// independent accumulators; a row's sum does not depend on the other rows of its
// tile. Equal to x·Ŵᵀ up to float32 summation order, as the other paths.
constexpr int64_t kFloatTileRows = 16;
constexpr int64_t kFloatTile = 16;
constexpr int kFloatW = 4;

struct FloatTiles {
  int64_t n, k, tiles;
  std::vector<float> x;  // (tiles, k, 16)

  FloatTiles(int64_t n_, int64_t k_)
      : n(n_), k(k_), tiles((n_ + kFloatTile - 1) / kFloatTile), x(tiles * k_ * kFloatTile) {}

  // Tiles [t0, t1) from xs (n, k): column c of 16 rows gathered into one register.
  void Fill(const float* xs, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rows = std::min(kFloatTile, n - t * kFloatTile);
      const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
      const __m512i at = _mm512_mullo_epi32(
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(static_cast<int32_t>(k)));
      const float* src = xs + t * kFloatTile * k;
      float* out = x.data() + t * k * kFloatTile;
      for (int64_t c = 0; c < k; ++c) {
        _mm512_storeu_ps(out + c * kFloatTile, _mm512_mask_i32gather_ps(
                                                   _mm512_setzero_ps(), live, at, src + c, 4));
      }
    }
  }
};

// y[16(t + i) + l, row + v] for T tiles and V weight rows wf (V, k).
template <int T, int V>
void FloatTileDot(const float* wf, const FloatTiles& a, float* y, int64_t o, int64_t row,
                  int64_t t) {
  const int64_t k = a.k;
  __m512 acc[T][V][2];
  for (int i = 0; i < T; ++i) {
    for (int v = 0; v < V; ++v) acc[i][v][0] = acc[i][v][1] = _mm512_setzero_ps();
  }
  const float* xt = a.x.data() + t * k * kFloatTile;
  for (int64_t c = 0; c < k; c += 2) {  // k: a multiple of 32
    for (int s = 0; s < 2; ++s) {
      __m512 xv[T];
      for (int i = 0; i < T; ++i) xv[i] = _mm512_loadu_ps(xt + (i * k + c + s) * kFloatTile);
      for (int v = 0; v < V; ++v) {
        const __m512 wv = _mm512_set1_ps(wf[v * k + c + s]);
        for (int i = 0; i < T; ++i) acc[i][v][s] = _mm512_fmadd_ps(wv, xv[i], acc[i][v][s]);
      }
    }
  }
  for (int i = 0; i < T; ++i) {
    const int64_t r0 = (t + i) * kFloatTile;
    const int64_t rows = std::min(kFloatTile, a.n - r0);
    for (int v = 0; v < V; ++v) {
      alignas(64) float out[kFloatTile];
      _mm512_store_ps(out, _mm512_add_ps(acc[i][v][0], acc[i][v][1]));
      for (int64_t l = 0; l < rows; ++l) y[(r0 + l) * o + row + v] = out[l];
    }
  }
}

// Output rows [o0, o1) from the tiles: kFloatW weight rows decoded at a time.
template <typename W>
void FloatTileRows(const Io& p, const W& weight, const FloatTiles& a, int64_t o0,
                   int64_t o1) {
  std::vector<float> wf(kFloatW * p.k);
  for (int64_t row = o0; row < o1; row += kFloatW) {
    const int rows = static_cast<int>(std::min<int64_t>(kFloatW, o1 - row));
    for (int v = 0; v < rows; ++v) weight.Decode(row + v, 0, p.k, wf.data() + v * p.k);
    if (rows < kFloatW) {
      for (int v = 0; v < rows; ++v) {
        for (int64_t t = 0; t < a.tiles; ++t) {
          FloatTileDot<1, 1>(wf.data() + v * p.k, a, p.y, p.o, row + v, t);
        }
      }
      continue;
    }
    int64_t t = 0;
    for (; t + 2 <= a.tiles; t += 2) FloatTileDot<2, kFloatW>(wf.data(), a, p.y, p.o, row, t);
    for (; t < a.tiles; ++t) FloatTileDot<1, kFloatW>(wf.data(), a, p.y, p.o, row, t);
  }
}
#endif

template <typename W>
void Run(ffi::ThreadPool& pool, const Io& p, const W& weight) {
#if defined(__AVX512F__)
  if (p.n >= kFloatTileRows) {
    FloatTiles a(p.n, p.k);
    FillTiles(pool, a.tiles, [&](int64_t t0, int64_t t1) { a.Fill(p.x, t0, t1); });
    ForRowRanges(pool, p, [&](int64_t o0, int64_t o1) { FloatTileRows(p, weight, a, o0, o1); });
    return;
  }
#endif
  ForRowRanges(pool, p, [&](int64_t o0, int64_t o1) { RunRows(p, weight, o0, o1); });
}

// Input rows from which a product puts 16 rows in a register's lanes (int8_dot.h's
// Int8Tiles, with AVX-512 VNNI): measured 1.1-1.5x Int8Dot's speed at 10-12 rows,
// 1.6-3x at 16-64 (a prompt); at 8, 0.86x for Q4_1 (the unused lanes and the
// weights' unpacking are not repaid).
constexpr int64_t kInt8TileRows = 10;

// The product from 8-bit activations (int8_dot.h): x rounded once, rows in parallel.
void RunInt8(ffi::ThreadPool& pool, const Io& p, const QWeight& q) {
  const entrenar::Int8Weight& w = q;
#if defined(ENTRENAR_INT8_VNNI)
  if (p.n >= kInt8TileRows) {
    entrenar::Int8Tiles a(p.n, p.k);  // rounded a tile range a thread
    FillTiles(pool, a.tiles, [&](int64_t t0, int64_t t1) { a.Fill(p.x, t0, t1); });
    ForRowRanges(pool, p, [&](int64_t o0, int64_t o1) {
      entrenar::Int8TileRange(w, a, p.y, p.o, o0, o1, HalfToFloat);
    });
    return;
  }
#endif
  const entrenar::Int8Rows a(p.x, p.n, p.k, entrenar::kInt8Paired && q.type != 0);
  ForRowRanges(pool, p, [&](int64_t o0, int64_t o1) {
    entrenar::Int8RowRange(w, a, p.y, p.o, o0, o1, HalfToFloat);
  });
}

// Layer `layer` of a stack (L, rows, cols) of `dims`, or the whole of a 2-d one: its
// (rows, cols) and the offset of its first element; false when out of range.
bool Layer(ffi::Span<const int64_t> dims, int32_t layer, int64_t* rows, int64_t* cols,
           int64_t* offset) {
  if (dims.size() == 2) {
    *rows = dims[0], *cols = dims[1], *offset = 0;
    return layer == 0;
  }
  if (dims.size() != 3 || layer < 0 || layer >= dims[0]) return false;
  *rows = dims[1], *cols = dims[2], *offset = layer * dims[1] * dims[2];
  return true;
}

ffi::Error QMatvecImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                       ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::F16> offsets,
                       ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                       ffi::ThreadPool pool, int32_t type, int32_t int8_x) {
  const auto xd = x.dimensions();
  const int32_t at = *layer.typed_data();
  int64_t o, cols, code_at, so, scols, scale_at;
  if (xd.size() != 2 || type < 0 || type > 2 || layer.element_count() != 1 ||
      !Layer(codes.dimensions(), at, &o, &cols, &code_at) ||
      !Layer(scales.dimensions(), at, &so, &scols, &scale_at)) {
    return ffi::Error::InvalidArgument("entrenar_q_matvec: bad ranks, type or layer");
  }
  Io p{x.typed_data(), y->typed_data(), xd[0], xd[1], o};
  const int64_t want = type == 0 ? p.k : p.k / 2;
  if (p.k % 32 != 0 || cols != want || so != p.o || scols != p.k / 32 ||
      (type == 2 && offsets.element_count() != scales.element_count())) {
    return ffi::Error::InvalidArgument("entrenar_q_matvec: shapes disagree");
  }
  QWeight w{{type, static_cast<const uint8_t*>(codes.untyped_data()) + code_at,
             reinterpret_cast<const uint16_t*>(scales.untyped_data()) + scale_at,
             reinterpret_cast<const uint16_t*>(offsets.untyped_data()) +
                 (type == 2 ? scale_at : 0),
             p.k}};
  if (int8_x != 0) {
    RunInt8(pool, p, w);
  } else {
    Run(pool, p, w);
  }
  return ffi::Error::Success();
}

ffi::Error GgmlMatvecImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> data,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                          ffi::ThreadPool pool, int32_t type) {
  const auto xd = x.dimensions();
  int64_t o, row_bytes, data_at;
  if (xd.size() != 2 || type < 0 || type > 4 || layer.element_count() != 1 ||
      !Layer(data.dimensions(), *layer.typed_data(), &o, &row_bytes, &data_at)) {
    return ffi::Error::InvalidArgument("entrenar_ggml_matvec: bad ranks, type or layer");
  }
  Io p{x.typed_data(), y->typed_data(), xd[0], xd[1], o};
  const int64_t bv = GgmlWeight::BlockValues(type), bb = GgmlWeight::BlockBytes(type);
  if (p.k % bv != 0 || row_bytes != p.k / bv * bb || kChunk % bv != 0) {
    return ffi::Error::InvalidArgument("entrenar_ggml_matvec: shapes disagree");
  }
  GgmlWeight w{type, data.typed_data() + data_at, row_bytes};
  Run(pool, p, w);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarQMatvec, QMatvecImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (n, K)
                                  .Arg<ffi::AnyBuffer>()         // codes (O, K or K/2)
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales (O, K/32)
                                  .Arg<ffi::Buffer<ffi::F16>>()  // offsets (O, K/32)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer () of (L, ...)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (n, O)
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int32_t>("type")
                                  .Attr<int32_t>("int8_x"));  // 1: int8_dot.h

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarGgmlMatvec, GgmlMatvecImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (n, K)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // data (O, row_bytes)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer () of (L, ...)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (n, O)
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int32_t>("type"));
