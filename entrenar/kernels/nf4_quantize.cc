// Quantize matrices to NF4 blocks, with or without double quantization (DQ): what
// entrenar.quant.nf4._nf4_blocks computes, for float32 or bfloat16 input.
//
//   x: (S, R, K) float32 or bfloat16, S matrices of R rows; blocks of B along K.
//   mid: (15,) float32, the midpoints between consecutive NF4 values (ascending).
//
// Per matrix, with nb = K / B and n = R · nb block scales:
//   s[r, b]  = max_j big(x[r, bB + j]),  big(v) = |v|, +inf for NaN
//   finite   = every s is finite (so every x is)
//   DQ:      μ = mean(s) (a float64 sum, rounded once), c = s - μ cut into groups
//            of 256 (the last one short), a_g = max |c| over group g,
//            q8 = clip(round_half_even(c · (a_g == 0 ? 0 : 127 / a_g)), -127, 127),
//            and the codes below are taken against s' = max(q8 · (a_g / 127) + μ, 0)
//   inv      = s == 0 ? 0 : 1 / s;  y = x · inv
//   code     = #{k : y > mid[k]}  (0..15; 0 for a NaN y)
//   codes[r, bB/2 + j] = code(bB + j) | code(bB + j + B/2) << 4  (pack_nibbles)
//
// Every output value depends only on its own row and its own matrix's scales, and
// μ is summed in one fixed order, so the results are the same bits whatever the
// number of threads. Two entries run this code: XLA FFI handlers (S matrices of one
// call spread over XLA's intra-op pool) and EntrenarNf4QuantizeHost, a C function
// for numpy buffers (ctypes), so a load quantizes with no XLA program and gets the
// node that entrenar.quant.quantize gives under the same kernel policy.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "fastmath.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 256;   // first-level scales per second-level scale
constexpr int kMidpoints = 15;

inline float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float Load(const float* x, int64_t i) { return x[i]; }
inline float Load(const uint16_t* x, int64_t i) { return entrenar::Bf16ToFloat(x[i]); }

// max over n values of |v| (+inf for NaN). For values >= 0 the order of IEEE bit
// patterns is the order of the values, so the maximum is taken on integers.
inline float BlockAbsMax(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    b &= 0x7FFFFFFFu;
    b = b > 0x7F800000u ? 0x7F800000u : b;  // NaN -> +inf
    m = m > b ? m : b;
  }
  return FromBits(m);
}
inline float BlockAbsMax(const uint16_t* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b = x[i] & 0x7FFFu;
    b = b > 0x7F80u ? 0x7F80u : b;
    m = m > b ? m : b;
  }
  return entrenar::Bf16ToFloat(static_cast<uint16_t>(m));
}

// Rows [r0, r1) of all S·R rows: s[row, b] = the block absmax.
template <typename T>
void AbsMaxRows(const T* x, int64_t r0, int64_t r1, int64_t k, int64_t block,
                float* s) {
  const int64_t nb = k / block;
  for (int64_t row = r0; row < r1; ++row) {
    for (int64_t b = 0; b < nb; ++b) {
      s[row * nb + b] = BlockAbsMax(x + row * k + b * block, block);
    }
  }
}

#if defined(__AVX512F__)
inline __m512 Load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 Load16(const uint16_t* x) {  // bfloat16 -> float32: the bits << 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// #{m : y > mid[m]} for 16 values, by a branchless binary search over the sorted
// midpoints (4 lookups with vpermps instead of 15 compares); 0 for NaN, as counting.
inline __m512i Codes16(__m512 y, __m512 table) {
  __m512i q = _mm512_setzero_si512();
  for (int step = 8; step >= 1; step /= 2) {
    const __m512i at = _mm512_add_epi32(q, _mm512_set1_epi32(step - 1));
    const __mmask16 above =
        _mm512_cmp_ps_mask(y, _mm512_permutexvar_ps(at, table), _CMP_GT_OQ);
    q = _mm512_mask_add_epi32(q, above, q, _mm512_set1_epi32(step));
  }
  return q;
}
#endif

// Rows [r0, r1): the packed codes of each block against its scale s[row, b].
template <typename T>
void CodeRows(const T* x, int64_t r0, int64_t r1, int64_t k, int64_t block,
              const float* s, const float* mid_in, uint8_t* codes) {
  float mid[kMidpoints + 1];
  for (int i = 0; i < kMidpoints; ++i) mid[i] = mid_in[i];
  mid[kMidpoints] = INFINITY;  // never looked up: the search reads mid[0..14]
  const int64_t nb = k / block, half = block / 2;
#if defined(__AVX512F__)
  const __m512 table = _mm512_loadu_ps(mid);
#endif
  for (int64_t row = r0; row < r1; ++row) {
    for (int64_t b = 0; b < nb; ++b) {
      const float scale = s[row * nb + b];
      const float inv = scale == 0.0f ? 0.0f : 1.0f / scale;
      const T* xb = x + row * k + b * block;
      uint8_t* out = codes + row * (k / 2) + b * half;
      int64_t j = 0;
#if defined(__AVX512F__)
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; j + 16 <= half; j += 16) {
        const __m512i lo = Codes16(_mm512_mul_ps(Load16(xb + j), vinv), table);
        const __m512i hi = Codes16(_mm512_mul_ps(Load16(xb + j + half), vinv), table);
        const __m512i both = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                         _mm512_cvtepi32_epi8(both));
      }
#endif
      for (; j < half; ++j) {
        const float lo = Load(xb, j) * inv, hi = Load(xb, j + half) * inv;
        int ql = 0, qh = 0;
        for (int m = 0; m < kMidpoints; ++m) {
          ql += lo > mid[m];
          qh += hi > mid[m];
        }
        out[j] = static_cast<uint8_t>(ql | (qh << 4));
      }
    }
  }
}

// One matrix's n scales s: its finite flag and, with DQ, the int8 codes q8, the
// group absmaxes a, the mean μ, and s replaced by the scales the codes are taken
// against (the order of the float64 sum is fixed: i = 0, 1, ...).
void MatrixScales(float* s, int64_t n, bool dq, int8_t* q8, float* a, float* mean,
                  uint8_t* finite) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(s[i]);
  *finite = ok ? 1 : 0;
  if (!dq) return;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += s[i];
  const float mu = static_cast<float>(sum / static_cast<double>(n));
  *mean = mu;
  for (int64_t g0 = 0, g = 0; g0 < n; g0 += kGroup, ++g) {
    const int64_t g1 = std::min(n, g0 + kGroup);
    float amax = 0.0f;
    for (int64_t i = g0; i < g1; ++i) {
      const float c = std::fabs(s[i] - mu);
      amax = (c > amax || std::isnan(c)) ? c : amax;  // NaN propagates, as jnp.max
    }
    a[g] = amax;
    const float inv = amax == 0.0f ? 0.0f : 127.0f / amax;
    const float step = amax / 127.0f;
    for (int64_t i = g0; i < g1; ++i) {
      float t = std::nearbyint((s[i] - mu) * inv);  // half to even (default mode)
      t = std::isnan(t) ? 0.0f : std::min(127.0f, std::max(-127.0f, t));
      q8[i] = static_cast<int8_t>(t);
    }
    // s' = max(q8 · step + μ, 0): a separate pass through memory, so that the
    // product is rounded before the sum, as XLA's computation of it.
    for (int64_t i = g0; i < g1; ++i) s[i] = static_cast<float>(q8[i]) * step;
    for (int64_t i = g0; i < g1; ++i) {
      const float v = s[i] + mu;
      s[i] = v > 0.0f ? v : (std::isnan(v) ? v : 0.0f);
    }
  }
}

using For = std::function<void(int64_t, std::function<void(int64_t)>, int64_t)>;

// The whole computation for S matrices (R, K); `scales` holds S·R·nb floats: the
// output without DQ, scratch with it. `parallel(chunks, body, work)` runs body(0..
// chunks-1), on several threads when `work` (values touched) is large enough.
template <typename T>
void Quantize(const T* x, int64_t stack, int64_t rows, int64_t k, int64_t block,
              bool dq, const float* mid, uint8_t* codes, float* scales, int8_t* q8,
              float* a, float* mean, uint8_t* finite, const For& parallel) {
  const int64_t all = stack * rows, nb = k / block, n = rows * nb;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(all, all * k >> 16));
  parallel(chunks, [&](int64_t t) {
    AbsMaxRows(x, all * t / chunks, all * (t + 1) / chunks, k, block, scales);
  }, all * k);
  parallel(stack, [&](int64_t m) {
    MatrixScales(scales + m * n, n, dq, dq ? q8 + m * n : nullptr,
                 dq ? a + m * groups : nullptr, dq ? mean + m : nullptr, finite + m);
  }, stack * n * 8);
  parallel(chunks, [&](int64_t t) {
    CodeRows(x, all * t / chunks, all * (t + 1) / chunks, k, block, scales, mid, codes);
  }, all * k * 16);
}

bool ShapesOk(int64_t stack, int64_t rows, int64_t k, int64_t block) {
  return stack >= 0 && rows >= 0 && block > 0 && block % 2 == 0 && k >= 0 &&
         k % block == 0;
}

// The FFI entries: x (S, R, K); scales (S, R, nb) float32 or int8 (DQ) give nb.
template <typename T>
ffi::Error Run(const void* x, ffi::Span<const int64_t> xd, ffi::Buffer<ffi::F32> mid, uint8_t* codes,
               int64_t code_count, ffi::Span<const int64_t> sd, float* scales_f32,
               int8_t* q8, float* absmax, int64_t absmax_count, float* mean,
               int64_t mean_count, uint8_t* finite, int64_t finite_count,
               ffi::ThreadPool& pool) {
  const bool dq = q8 != nullptr;
  if (xd.size() != 3 || sd.size() != 3 || mid.element_count() != kMidpoints) {
    return ffi::Error::InvalidArgument("entrenar_nf4_quantize: bad ranks");
  }
  const int64_t stack = xd[0], rows = xd[1], k = xd[2], nb = sd[2];
  const int64_t block = nb == 0 ? 0 : k / nb;
  const int64_t n = rows * nb, groups = (n + kGroup - 1) / kGroup;
  if (!ShapesOk(stack, rows, k, block) || block * nb != k || sd[0] != stack ||
      sd[1] != rows || code_count * 2 != stack * rows * k || finite_count != stack ||
      (dq && (absmax_count != stack * groups || mean_count != stack))) {
    return ffi::Error::InvalidArgument("entrenar_nf4_quantize: shapes disagree");
  }
  std::vector<float> scratch(dq ? stack * n : 0);
  float* s = dq ? scratch.data() : scales_f32;
  const For parallel = [&](int64_t chunks, std::function<void(int64_t)> body,
                           int64_t work) {
    entrenar::ParallelFor(pool, chunks, std::move(body), work);
  };
  Quantize(static_cast<const T*>(x), stack, rows, k, block, dq,
           mid.typed_data(), codes, s, q8, absmax, mean, finite, parallel);
  return ffi::Error::Success();
}

template <ffi::DataType D, typename T>
ffi::Error PlainImpl(ffi::Buffer<D> x, ffi::Buffer<ffi::F32> mid,
                     ffi::ResultBuffer<ffi::U8> codes, ffi::ResultBuffer<ffi::F32> scales,
                     ffi::ResultBuffer<ffi::U8> finite, ffi::ThreadPool pool) {
  return Run<T>(x.untyped_data(), x.dimensions(), mid, codes->typed_data(), codes->element_count(),
                scales->dimensions(), scales->typed_data(), nullptr, nullptr, 0,
                nullptr, 0, finite->typed_data(), finite->element_count(), pool);
}

template <ffi::DataType D, typename T>
ffi::Error DoubleImpl(ffi::Buffer<D> x, ffi::Buffer<ffi::F32> mid,
                      ffi::ResultBuffer<ffi::U8> codes, ffi::ResultBuffer<ffi::S8> q8,
                      ffi::ResultBuffer<ffi::F32> absmax, ffi::ResultBuffer<ffi::F32> mean,
                      ffi::ResultBuffer<ffi::U8> finite, ffi::ThreadPool pool) {
  return Run<T>(x.untyped_data(), x.dimensions(), mid, codes->typed_data(), codes->element_count(), q8->dimensions(),
                nullptr, q8->typed_data(), absmax->typed_data(),
                absmax->element_count(), mean->typed_data(), mean->element_count(),
                finite->typed_data(), finite->element_count(), pool);
}

}  // namespace

// Work (as ParallelFor counts it: 16 per value coded) below which the host entry
// runs on the caller's thread alone: a thread costs ~0.1 ms to start, and a load
// already quantizes two layers at once on its own workers (entrenar.nn.hf_names),
// where helpers for a SmolLM2 layer (<= 1M values) made each call twice as slow.
constexpr int64_t kHostMinWork = int64_t{1} << 26;  // 4M values coded

// Host entry (ctypes): the same computation on plain buffers, on up to `threads`
// threads for big matrices (1 or less: the caller's alone). x is float32 (bf16 == 0) or bfloat16 bits (bf16 != 0);
// without DQ `scales` receives the S·R·nb float32 scales and q8, absmax, mean may
// be null; with DQ q8 (S·R·nb int8), absmax (S·groups) and mean (S) receive DQ's
// outputs and `scales` is S·R·nb float32 of scratch. Returns 0, or 1 for bad shapes.
extern "C" int EntrenarNf4QuantizeHost(const void* x, int32_t bf16, int64_t stack,
                                       int64_t rows, int64_t k, int64_t block,
                                       int32_t dq, const float* mid, uint8_t* codes,
                                       float* scales, int8_t* q8, float* absmax,
                                       float* mean, uint8_t* finite, int32_t threads) {
  if (!ShapesOk(stack, rows, k, block)) return 1;
  const For parallel = [threads](int64_t chunks, std::function<void(int64_t)> body,
                                 int64_t work) {
    const int64_t helpers = std::min<int64_t>(threads - 1, chunks - 1);
    if (helpers <= 0 || work < kHostMinWork) {
      for (int64_t i = 0; i < chunks; ++i) body(i);
      return;
    }
    std::vector<std::thread> pool;
    for (int64_t h = 0; h <= helpers; ++h) {
      auto part = [&, h] {
        for (int64_t i = chunks * h / (helpers + 1); i < chunks * (h + 1) / (helpers + 1);
             ++i) {
          body(i);
        }
      };
      if (h == helpers) {
        part();
      } else {
        pool.emplace_back(part);
      }
    }
    for (auto& t : pool) t.join();
  };
  if (bf16) {
    Quantize(static_cast<const uint16_t*>(x), stack, rows, k, block, dq != 0, mid,
             codes, scales, q8, absmax, mean, finite, parallel);
  } else {
    Quantize(static_cast<const float*>(x), stack, rows, k, block, dq != 0, mid, codes,
             scales, q8, absmax, mean, finite, parallel);
  }
  return 0;
}

#define ENTRENAR_NF4_PLAIN(NAME, D, T)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, (PlainImpl<D, T>),                    \
                                ffi::Ffi::Bind()                            \
                                    .Arg<ffi::Buffer<D>>()        /* x */  \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* mid */ \
                                    .Ret<ffi::Buffer<ffi::U8>>()  /* codes */ \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* s */   \
                                    .Ret<ffi::Buffer<ffi::U8>>()  /* finite */ \
                                    .Ctx<ffi::ThreadPool>());

#define ENTRENAR_NF4_DOUBLE(NAME, D, T)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, (DoubleImpl<D, T>),                   \
                                ffi::Ffi::Bind()                            \
                                    .Arg<ffi::Buffer<D>>()                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()           \
                                    .Ret<ffi::Buffer<ffi::U8>>()  /* codes */ \
                                    .Ret<ffi::Buffer<ffi::S8>>()  /* q8 */  \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* a */   \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* mean */ \
                                    .Ret<ffi::Buffer<ffi::U8>>()  /* finite */ \
                                    .Ctx<ffi::ThreadPool>());

ENTRENAR_NF4_PLAIN(EntrenarNf4QuantizeF32, ffi::F32, float)
ENTRENAR_NF4_PLAIN(EntrenarNf4QuantizeBf16, ffi::BF16, uint16_t)
ENTRENAR_NF4_DOUBLE(EntrenarNf4QuantizeDqF32, ffi::F32, float)
ENTRENAR_NF4_DOUBLE(EntrenarNf4QuantizeDqBf16, ffi::BF16, uint16_t)
