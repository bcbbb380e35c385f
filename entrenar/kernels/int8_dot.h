// Few-row products with Q8_0 / Q4_0 / Q4_1 weights from 8-bit activations (what
// llama.cpp's ggml_vec_dot_q*_q8_* do): each 32-value block of an input row x is
// rounded to signed 8-bit integers with its own scale,
//
//   e_b = max_j |x_bj| / 127,   q_bj = round(x_bj / e_b)  (ties to even; e_b = 0: 0),
//
// and a weight block (Ŵ_bj = d_b·w_bj + m_b: Q8_0 m = 0, Q4_0 w = nibble, m = −8·d,
// Q4_1 w = nibble) multiplies it by integer dot products:
//
//   y = Σ_b d_b·e_b·Σ_j w_bj q_bj + m_b·(e_b·Σ_j q_bj)
//
// which is x̂ · Ŵ exactly up to float32 rounding, x̂_bj = e_b·q_bj. Since
// |x_bj − x̂_bj| <= e_b / 2, |y − x·Ŵ| <= Σ_b (e_b / 2)·Σ_j |Ŵ_bj| (plus float32
// rounding): the activation rounding is the only approximation. The integer sums
// are exact (|w q| <= 128·127, 32 terms). With AVX-512 BW, 64 weight bytes (two
// blocks) go through one VNNI `vpdpbusd` (unsigned × signed bytes, four products
// summed into each 32-bit lane; `vpmaddubsw` + `vpmaddwd` without VNNI); elsewhere
// plain integer loops (auto-vectorized under AVX2). Many input rows with VNNI (a
// prompt): Int8Tiles, 16 input rows in the lanes of a register.
#ifndef ENTRENAR_KERNELS_INT8_DOT_H_
#define ENTRENAR_KERNELS_INT8_DOT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace entrenar {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ENTRENAR_INT8_AVX512 1
constexpr bool kInt8Paired = true;  // the AVX-512 path reads 4-bit pairs unpacked
#else
constexpr bool kInt8Paired = false;
#endif
#if defined(ENTRENAR_INT8_AVX512) && defined(__AVX512VNNI__)
#define ENTRENAR_INT8_VNNI 1  // Int8Tiles and Int8TileRange exist
#endif

// x (n, k) float32 rounded per 32-block: q (n, kp) int8 (kp: k rounded up to 64, the
// padding zeros), e and s = e·Σq (n, k/32). `paired`: each pair of blocks b, b + 1
// stored as [b 0-15, b+1 0-15, b 16-31, b+1 16-31], the order in which the AVX-512
// path unpacks a pair of 4-bit blocks (low nibbles of both, then high nibbles).
struct Int8Rows {
  int64_t n, k, kp;
  std::vector<int8_t> q;
  std::vector<float> e, s;

  Int8Rows(const float* x, int64_t n_, int64_t k_, bool paired)
      : n(n_), k(k_), kp((k_ + 63) / 64 * 64), q(n_ * kp), e(n_ * k_ / 32),
        s(n_ * k_ / 32) {
    const int64_t nb = k / 32;
    for (int64_t r = 0; r < n; ++r) {
      RoundRow(x + r * k, k, paired, q.data() + r * kp, e.data() + r * nb,
               s.data() + r * nb, nullptr);
    }
  }

  // One row xr (k) rounded: q (kp), e and s (k/32), and when `sums` is given the
  // integers Σ_j q_bj (k/32).
  static void RoundRow(const float* xr, int64_t k, bool paired, int8_t* q, float* e,
                       float* s, int32_t* sums) {
    const int64_t nb = k / 32;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xr + 32 * b;
#if defined(ENTRENAR_INT8_AVX512)
      // The loop below in registers, the same operations: |x| max, d = amax / 127,
      // x·(1/d) rounded in the current (nearest-even) mode as nearbyint.
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo),
                                                             _mm512_abs_ps(hi)));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      const __m512 vid = _mm512_set1_ps(id);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vid));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vid));
      int8_t* out = q + 32 * b;
      // paired: values 0-15 of block b at 64·(b/2) + 16·(b%2), 16-31 32 later
      const int64_t at_lo = paired ? (b / 2) * 64 - 32 * b + 16 * (b % 2) : 0;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + at_lo), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + at_lo + 32 - 16 * !paired),
                       _mm512_cvtepi32_epi8(qhi));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* out = q + 32 * b;
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * id));
        // paired: values 0-15 of block b at 64·(b/2) + 16·(b%2), 16-31 32 later
        const int64_t at = paired ? (b / 2) * 64 - 32 * b + 16 * (b % 2) + (j % 16) +
                                        32 * (j / 16)
                                  : j;
        out[at] = static_cast<int8_t>(v);
        sum += v;
      }
#endif
      e[b] = d;
      s[b] = d * static_cast<float>(sum);
      if (sums != nullptr) sums[b] = sum;
    }
  }
};

// Q8_0 / Q4_0 / Q4_1 rows as entrenar_q_matvec receives them (see ggml_matvec.cc).
struct Int8Weight {
  int type;  // 0 Q8_0, 1 Q4_0, 2 Q4_1
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* offsets;
  int64_t k;
};

// y[r0..r0+R, row]: the scalar form (any CPU), one block at a time.
template <int R, typename Half>
void Int8DotScalar(const Int8Weight& w, const Int8Rows& a, float* y, int64_t o,
                   int64_t row, int64_t r0, const Half& half) {
  const int64_t nb = w.k / 32;
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half(w.scales[row * nb + b]);
    const float m = w.type == 2 ? half(w.offsets[row * nb + b]) : -8.0f * d;
    int8_t wv[32];  // the block's integers w_bj
    if (w.type == 0) {
      const int8_t* c = reinterpret_cast<const int8_t*>(w.codes + row * w.k) + b * 32;
      for (int j = 0; j < 32; ++j) wv[j] = c[j];
    } else {
      const uint8_t* c = w.codes + row * (w.k / 2) + b * 16;
      for (int j = 0; j < 16; ++j) {
        wv[j] = static_cast<int8_t>(c[j] & 15);
        wv[j + 16] = static_cast<int8_t>(c[j] >> 4);
      }
    }
    for (int i = 0; i < R; ++i) {
      const int8_t* q = a.q.data() + (r0 + i) * a.kp + b * 32;
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) sum += static_cast<int32_t>(wv[j]) * q[j];
      const int64_t at = (r0 + i) * nb + b;
      acc[i] += d * a.e[at] * static_cast<float>(sum);
      if (w.type != 0) acc[i] += m * a.s[at];
    }
  }
  for (int i = 0; i < R; ++i) y[(r0 + i) * o + row] = acc[i];
}

#if defined(ENTRENAR_INT8_AVX512)
// 16 lanes of 32-bit sums, lane l = Σ of bytes 4l..4l+3 of w (unsigned) · q (signed).
inline __m512i DotBytes(__m512i w, __m512i q) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, q);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(w, q), _mm512_set1_epi16(1));
#endif
}

// y[r0..r0+R, row] with AVX-512: blocks in pairs (64 bytes of w, lanes 0-7 block b,
// 8-15 block b + 1), the scales of 16 blocks converted at once. A accumulators a row
// (independent chains of fused multiply-adds; the correction terms m·s go into the
// same accumulators, all lanes being summed at the end).
template <int R, int A>
void Int8Dot(const Int8Weight& w, const Int8Rows& a, float* y, int64_t o, int64_t row,
             int64_t r0) {
  const int64_t nb = w.k / 32;
  __m512 acc[R][A];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < A; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  // the block (of the pair) each 32-bit lane of a product belongs to
  const __m512i pair = w.type == 0
      ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
      : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < nb; g += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, nb - g));
    const __mmask16 hm = static_cast<__mmask16>((1u << cnt) - 1);
    const __m512 d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(hm, w.scales + row * nb + g));
    __m512 m16 = _mm512_mul_ps(d16, _mm512_set1_ps(-8.0f));
    if (w.type == 2) {
      m16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(hm, w.offsets + row * nb + g));
    }
    __m512 s16[R];  // d_b·e_b for the 16 blocks, per input row
    for (int i = 0; i < R; ++i) {
      const int64_t at = (r0 + i) * nb + g;
      s16[i] = _mm512_mul_ps(d16, _mm512_maskz_loadu_ps(hm, a.e.data() + at));
      if (w.type != 0) {
        acc[i][0] = _mm512_fmadd_ps(m16, _mm512_maskz_loadu_ps(hm, a.s.data() + at),
                                    acc[i][0]);
      }
    }
    // Blocks g + 2p and (`two`) g + 2p + 1 into accumulator `slot`. The rows of q
    // are padded with zeros to whole pairs; only the weights' last odd block is
    // read under a mask.
    auto step = [&](int p, int slot, bool two) {
      const int64_t b = g + 2 * p;
      __m512i wv;
      __mmask64 neg = 0;
      if (w.type == 0) {
        const uint8_t* c = w.codes + row * w.k + b * 32;
        const __m512i raw = two ? _mm512_loadu_si512(c)
                                : _mm512_maskz_loadu_epi8(0xffffffffull, c);
        neg = _mm512_movepi8_mask(raw);
        wv = _mm512_abs_epi8(raw);  // |w| as unsigned bytes (−128 -> 128)
      } else {  // [lo b, lo b+1, hi b, hi b+1]: the 32 bytes twice, the top half >> 4
        const uint8_t* c = w.codes + row * (w.k / 2) + b * 16;
        const __m256i raw = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c))
                                : _mm256_maskz_loadu_epi8(0xffffu, c);
        const __m512i v = _mm512_broadcast_i64x4(raw);
        wv = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xffff0000u, v, 4), low4);
      }
      const __m512i idx = _mm512_add_epi32(pair, _mm512_set1_epi32(2 * p));
      for (int i = 0; i < R; ++i) {
        __m512i q = _mm512_loadu_si512(a.q.data() + (r0 + i) * a.kp + b * 32);
        if (w.type == 0) q = _mm512_mask_sub_epi8(q, neg, _mm512_setzero_si512(), q);
        const __m512 sum = _mm512_cvtepi32_ps(DotBytes(wv, q));
        acc[i][slot] =
            _mm512_fmadd_ps(sum, _mm512_permutexvar_ps(idx, s16[i]), acc[i][slot]);
      }
    };
    if (cnt == 16) {
      for (int p = 0; p < 8; p += 2) {
        step(p, 0, true);
        step(p + 1, A - 1, true);
      }
    } else {
      for (int p = 0; 2 * p < cnt; ++p) step(p, 0, 2 * p + 1 < cnt);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 1; j < A; ++j) acc[i][0] = _mm512_add_ps(acc[i][0], acc[i][j]);
    y[(r0 + i) * o + row] = _mm512_reduce_add_ps(acc[i][0]);
  }
}
#endif

#if defined(ENTRENAR_INT8_VNNI)
// Many input rows (a prompt; ggml_matvec.cc: n >= kInt8TileRows), input rows in the
// lanes: a tile holds 16 rows' q (rows past n: zeros), 4 bytes of each row a 32-bit
// lane, so one `vpdpbusd` multiplies 4 values of 16 rows by the same 4 weights
// (a broadcast from memory), and after a block's 8 steps lane l holds the block's
// whole integer dot product S_lb = Σ_j w_bj·q_lbj. The float work (convert, scale
// by d_b·e_lb, add) is then once per block and tile instead of once per pair of
// blocks and row. The weights are the unsigned operand, unpacked once per weight
// row into bytes: 4-bit w as is; Q8_0 as w + 128 (w ^ 0x80), each lane starting at
// −128·Σ_j q_lbj (|lane| <= 32·255·127), so it ends at S_lb exactly. Then
//   Q8_0: y_l = Σ_b (d_b·e_lb)·S_lb
//   Q4_0: y_l = Σ_b (d_b·e_lb)·(S_lb − 8·Σ_j q_lbj)   (the lane starts at −8·Σ q)
//   Q4_1: y_l = Σ_b (d_b·e_lb)·S_lb + m_b·s_lb          (s = e·Σ q, as Int8Rows)
// the terms of Int8Dot with exact integer block sums (fewer float roundings).
constexpr int64_t kInt8Tile = 16;

struct Int8Tiles {
  int64_t n, k, tiles;
  std::vector<int32_t> q;     // (tiles, k/4, 16): 4 bytes of q, row 16t + lane
  std::vector<float> e, s;    // (tiles, k/32, 16): e_lb, s_lb = e_lb·Σ_j q_lbj
  std::vector<int32_t> sums;  // (tiles, k/32, 16): Σ_j q_lbj

  // Room for n rows of k values (all zeros); `Fill` rounds them.
  Int8Tiles(int64_t n_, int64_t k_)
      : n(n_), k(k_), tiles((n_ + kInt8Tile - 1) / kInt8Tile),
        q(tiles * (k_ / 4) * kInt8Tile), e(tiles * (k_ / 32) * kInt8Tile),
        s(e.size()), sums(e.size()) {}

  // Tiles [t0, t1) from x (n, k): each row rounded as Int8Rows does (RoundRow), its
  // bytes then spread over the tile's lanes. Tiles apart share no cache line, so
  // threads may fill disjoint ranges at once.
  void Fill(const float* x, int64_t t0, int64_t t1) {
    const int64_t kd = k / 4, nb = k / 32;
    std::vector<int8_t> qr((k + 63) / 64 * 64);
    std::vector<float> er(nb), sr(nb);
    std::vector<int32_t> sumr(nb);
    for (int64_t r = t0 * kInt8Tile; r < std::min(n, t1 * kInt8Tile); ++r) {
      Int8Rows::RoundRow(x + r * k, k, false, qr.data(), er.data(), sr.data(),
                         sumr.data());
      const int64_t t = r / kInt8Tile, l = r % kInt8Tile;
      int32_t* out = q.data() + t * kd * kInt8Tile + l;
      for (int64_t c = 0; c < kd; ++c) std::memcpy(out + c * kInt8Tile, &qr[4 * c], 4);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t at = (t * nb + b) * kInt8Tile + l;
        e[at] = er[b], s[at] = sr[b], sums[at] = sumr[b];
      }
    }
  }
};

// y[16t + l, row + v] for the tile's rows l (< n) and W weight rows v. wb: the W
// rows' weights as unsigned bytes (W, k) (Int8TileRange); d, m: their block scales
// and Q4_1 mins (W, nb) as float.
template <int W>
void Int8TileDot(int type, const uint8_t* wb, const float* d, const float* m,
                 const Int8Tiles& a, float* y, int64_t o, int64_t row, int64_t t) {
  const int64_t k = a.k, nb = k / 32, kd = k / 4;
  const int32_t* qt = a.q.data() + t * kd * kInt8Tile;
  const float* et = a.e.data() + t * nb * kInt8Tile;
  const float* st = a.s.data() + t * nb * kInt8Tile;
  const int32_t* sum_t = a.sums.data() + t * nb * kInt8Tile;
  const int shift = type == 0 ? 7 : 3;  // the lanes start at −128·Σq or −8·Σq
  __m512 acc[W];
  for (int v = 0; v < W; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s0 = _mm512_setzero_si512();
    if (type != 2) {
      s0 = _mm512_sub_epi32(
          s0, _mm512_slli_epi32(_mm512_loadu_si512(sum_t + b * kInt8Tile), shift));
    }
    __m512i sum[W];
    for (int v = 0; v < W; ++v) sum[v] = s0;
    for (int j = 0; j < 8; ++j) {
      const __m512i xq = _mm512_loadu_si512(qt + (8 * b + j) * kInt8Tile);
      for (int v = 0; v < W; ++v) {
        int32_t w4;
        std::memcpy(&w4, wb + v * k + 32 * b + 4 * j, 4);
        sum[v] = _mm512_dpbusd_epi32(sum[v], _mm512_set1_epi32(w4), xq);
      }
    }
    const __m512 e16 = _mm512_loadu_ps(et + b * kInt8Tile);
    for (int v = 0; v < W; ++v) {
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(d[v * nb + b]), e16);
      acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[v]), scale, acc[v]);
      if (type == 2) {
        acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(m[v * nb + b]),
                                 _mm512_loadu_ps(st + b * kInt8Tile), acc[v]);
      }
    }
  }
  const int64_t rows = std::min<int64_t>(kInt8Tile, a.n - t * kInt8Tile);
  for (int v = 0; v < W; ++v) {
    alignas(64) float out[kInt8Tile];
    _mm512_store_ps(out, acc[v]);
    for (int64_t l = 0; l < rows; ++l) y[(t * kInt8Tile + l) * o + row + v] = out[l];
  }
}

// Output rows [o0, o1) of y (n, o) from the tiles `a`: weight rows kW at a time,
// unpacked once (bytes, scales, mins) and multiplied with every tile.
template <typename Half>
void Int8TileRange(const Int8Weight& w, const Int8Tiles& a, float* y, int64_t o,
                   int64_t o0, int64_t o1, const Half& half) {
  constexpr int kW = 8;
  const int64_t k = w.k, nb = k / 32;
  std::vector<uint8_t> wb(kW * k);
  std::vector<float> d(kW * nb), m(kW * nb);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t row = o0; row < o1; row += kW) {
    const int rows = static_cast<int>(std::min<int64_t>(kW, o1 - row));
    for (int64_t i = 0; i < rows * nb; ++i) {
      d[i] = half(w.scales[row * nb + i]);
      m[i] = w.type == 2 ? half(w.offsets[row * nb + i]) : 0.0f;
    }
    for (int v = 0; v < rows; ++v) {
      uint8_t* out = wb.data() + v * k;
      if (w.type == 0) {  // w + 128: 64 bytes (two blocks) a step, k a multiple of 32
        const uint8_t* c = w.codes + (row + v) * k;
        for (int64_t j = 0; j < k; j += 64) {
          const __mmask64 in = k - j >= 64 ? ~0ull : (1ull << (k - j)) - 1;
          _mm512_mask_storeu_epi8(out + j, in,
                                  _mm512_xor_si512(_mm512_maskz_loadu_epi8(in, c + j), bias));
        }
      } else {  // block b's byte j: value j (low nibble), j + 16 (high)
        const uint8_t* c = w.codes + (row + v) * (k / 2);
        for (int64_t b = 0; b < nb; ++b) {
          const __m512i raw = _mm512_castsi128_si512(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * b)));
          const __m512i both = _mm512_inserti32x4(raw, _mm512_castsi512_si128(
                                                      _mm512_srli_epi16(raw, 4)), 1);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * b),
                              _mm512_castsi512_si256(_mm512_and_si512(both, low4)));
        }
      }
    }
    for (int64_t t = 0; t < a.tiles; ++t) {
      if (rows == kW) {
        Int8TileDot<kW>(w.type, wb.data(), d.data(), m.data(), a, y, o, row, t);
      } else {
        for (int v = 0; v < rows; ++v) {
          Int8TileDot<1>(w.type, wb.data() + v * k, d.data() + v * nb, m.data() + v * nb,
                         a, y, o, row + v, t);
        }
      }
    }
  }
}
#endif

// Decoding (few input rows) reads each weight once, from memory: a product is bound
// by memory bandwidth, not arithmetic. Asking for the bytes kPrefetchBytes ahead of
// row `row` (its codes' length of them, and the scales' line) before multiplying it
// keeps more reads in flight than the hardware prefetcher alone: measured in one
// process, alternating, SmolLM2's 30 layers at one input row on one core, Q8_0 1.08x,
// Q4_0 1.22x, Q4_1 1.18x; at 4 rows 1.17-1.27x (1024 bytes: 512 gained less, 2048 and
// more lost for Q8_0). Nothing read changes.
constexpr int64_t kPrefetchBytes = 1024;

inline void PrefetchAhead(const Int8Weight& w, int64_t row, int64_t o1) {
#if defined(__SSE__) || defined(__x86_64__)
  const int64_t row_bytes = w.type == 0 ? w.k : w.k / 2, nb = w.k / 32;
  const char* at = reinterpret_cast<const char*>(w.codes + row * row_bytes) + kPrefetchBytes;
  const char* end = reinterpret_cast<const char*>(w.codes + o1 * row_bytes);
  for (int64_t c = 0; c < row_bytes && at + c < end; c += 64) {
    _mm_prefetch(at + c, _MM_HINT_T0);
  }
  const char* scales = reinterpret_cast<const char*>(w.scales + row * nb) + kPrefetchBytes / 16;
  if (scales < reinterpret_cast<const char*>(w.scales + o1 * nb)) {
    _mm_prefetch(scales, _MM_HINT_T0);
  }
#else
  (void)w, (void)row, (void)o1;
#endif
}

// Output rows [o0, o1) of y (n, o) from the rounded rows `a`.
template <typename Half>
void Int8RowRange(const Int8Weight& w, const Int8Rows& a, float* y, int64_t o, int64_t o0,
               int64_t o1, const Half& half) {
#if defined(ENTRENAR_INT8_AVX512)
  (void)half;
#endif
  for (int64_t row = o0; row < o1; ++row) {
    int64_t r = 0;
    PrefetchAhead(w, row, o1);
#if defined(ENTRENAR_INT8_AVX512)
    for (; r + 8 <= a.n; r += 8) Int8Dot<8, 1>(w, a, y, o, row, r);
    for (; r + 4 <= a.n; r += 4) Int8Dot<4, 1>(w, a, y, o, row, r);
    for (; r + 2 <= a.n; r += 2) Int8Dot<2, 2>(w, a, y, o, row, r);
    for (; r < a.n; ++r) Int8Dot<1, 2>(w, a, y, o, row, r);
#else
    for (; r + 4 <= a.n; r += 4) Int8DotScalar<4>(w, a, y, o, row, r, half);
    for (; r < a.n; ++r) Int8DotScalar<1>(w, a, y, o, row, r, half);
#endif
  }
}

}  // namespace entrenar

#endif  // ENTRENAR_KERNELS_INT8_DOT_H_
