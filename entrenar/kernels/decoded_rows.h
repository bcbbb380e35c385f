// Products of a few input rows with weight rows decoded a chunk of columns at a time:
//
//   y[r, row] = Σ_c x[r, c] Ŵ[row, c]      r < n (few), o0 <= row < o1
//
// `decode(row, c0, len, w)` writes Ŵ[row, c0 : c0 + len] as float32 into `w` (at most
// kChunk values, a whole number of the format's blocks); each decoded chunk is then
// multiplied by up to 8 input rows at once (8 x 16 float accumulators), so a weight
// value is decoded once per call whatever the number of input rows. Shared by
// nf4_matmul.cc and ggml_matvec.cc.
#ifndef ENTRENAR_KERNELS_DECODED_ROWS_H_
#define ENTRENAR_KERNELS_DECODED_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace entrenar {

// x: (n, k) float32 input rows; y: (n, o) float32 output.
struct RowsProblem {
  const float* x;
  float* y;
  int64_t n, k, o;
};

// y[r, row] += Σ_c x[r, c0 + c] w[c] for rows r0..r0+R-1 (R <= 8 accumulators).
template <int R>
inline void DotRows(const RowsProblem& p, int64_t row, int64_t r0, int64_t c0,
                    int64_t len, const float* w) {
  float acc[R][16] = {};
  const float* xs[R];
  for (int i = 0; i < R; ++i) xs[i] = p.x + (r0 + i) * p.k + c0;
  const int64_t whole = len / 16 * 16;
  for (int64_t c = 0; c < whole; c += 16) {
    for (int i = 0; i < R; ++i) {
#pragma omp simd
      for (int l = 0; l < 16; ++l) acc[i][l] += xs[i][c + l] * w[c + l];
    }
  }
  for (int i = 0; i < R; ++i) {
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += acc[i][l];
    for (int64_t c = whole; c < len; ++c) sum += xs[i][c] * w[c];  // blocks of 2-8
    p.y[(r0 + i) * p.o + row] += sum;
  }
}

// Output rows [o0, o1) of y, decoding kChunk columns of a weight row at a time.
template <int64_t kChunk, typename Decode>
inline void DecodedRows(const RowsProblem& p, int64_t o0, int64_t o1,
                        const Decode& decode) {
  alignas(64) float w[kChunk];
  for (int64_t r = 0; r < p.n; ++r) {
    std::memset(p.y + r * p.o + o0, 0, sizeof(float) * (o1 - o0));
  }
  for (int64_t c0 = 0; c0 < p.k; c0 += kChunk) {
    const int64_t len = std::min(kChunk, p.k - c0);
    for (int64_t row = o0; row < o1; ++row) {
      decode(row, c0, len, w);
      int64_t r = 0;
      for (; r + 8 <= p.n; r += 8) DotRows<8>(p, row, r, c0, len, w);
      for (; r + 4 <= p.n; r += 4) DotRows<4>(p, row, r, c0, len, w);
      for (; r < p.n; ++r) DotRows<1>(p, row, r, c0, len, w);
    }
  }
}

}  // namespace entrenar

#endif  // ENTRENAR_KERNELS_DECODED_ROWS_H_
