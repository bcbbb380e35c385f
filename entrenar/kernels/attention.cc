// Grouped-query attention, forward and backward, float32, for short sequences.
//
//   q: (B, T, H, d)   k: (B, S, KV, d)   v: (B, S, KV, dv)   mask: (Bm, T, S) uint8,
//   Bm = 1 or B, nonzero where allowed; params: (scale, round) float32. Query head h
//   reads key/value head h / (H / KV). With round != 0 the products take their
//   inputs rounded to bfloat16 (q, k, v and the probabilities; float32 accumulation),
//   as entrenar/nn/attention.py does with matmul_dtype="bfloat16"; the softmax and
//   its gradient stay float32.
//
//   z[t, s] = scale · q[t]·k[s] where allowed, -1e30 where not
//   lse[t]  = log Σ_s exp(z[t, s])        p[t, s] = exp(z[t, s] - lse[t])
//   o[t]    = Σ_s p[t, s] v[s]
//
// Backward (Dao et al., FlashAttention, 2022, Algorithm 4, with p recomputed from lse):
//   dp = do · vᵀ      D[t] = do[t]·o[t]      ds = p (dp - D)
//   dq = scale ds k   dk = scale dsᵀ q       dv = pᵀ do
//
// XLA:CPU runs attention at these sizes (d = 64, T = S = 128) as a dozen small
// batched products, transposes and softmax loops, each overhead-bound; here one task
// per (batch, key/value head) keeps that head's K and V in L1/L2 and walks the query
// rows eight at a time. A row only computes the columns from its first to its last
// allowed key (half the work under a causal mask); masked columns inside get p = 0.
// A fully masked row attends uniformly with zero score gradients, as the JAX path
// (entrenar/nn/attention.py) does with its finite -1e30.
//
// A forward call of at most eight query rows (decoding) reads keys and values where
// they lie instead: the rows of several query heads of one key/value head share a
// block, keys are transposed a tile of 32 at a time (the same products, in the same
// order, as over the whole copy: the same floats).
//
// entrenar_attention_cached is the forward pass with k, v the stacked caches
// (L, B, S, KV, d) of all layers and an int32 operand `layer`: it reads that layer's
// keys and values in place (a decoding step's layer loop would otherwise copy the
// layer's (B, S, KV, d) slices of both out of the stack before the call, every step).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fastmath.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 8;    // query rows per block
constexpr int kLanes = 16;  // floats per vector step (one AVX-512 register)

int64_t RoundUp(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

using entrenar::Exp;
using entrenar::RoundBf16;

void RoundAll(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = RoundBf16(x[i]);
}

struct Shape {
  int64_t b, t, s, h, kv, d, dv, mask_b;
  int64_t g() const { return h / kv; }
  int64_t dp() const { return RoundUp(d); }
  int64_t dvp() const { return RoundUp(dv); }
  int64_t sp() const { return RoundUp(s); }
  // multiply-adds of scores and values for all heads (ParallelFor's size hint)
  int64_t Work() const { return b * h * t * s * (d + dv); }
};

// The key range [lo, hi) a query row must compute; lo = hi = -1 when fully masked.
struct Range {
  int64_t lo, hi;
  bool none() const { return lo < 0; }
};

std::vector<Range> RowRanges(const uint8_t* mask, int64_t t, int64_t s) {
  std::vector<Range> out(t);
  for (int64_t i = 0; i < t; ++i) {
    const uint8_t* m = mask + i * s;
    int64_t lo = 0, hi = s;
    while (lo < s && !m[lo]) ++lo;
    while (hi > lo && !m[hi - 1]) --hi;
    out[i] = lo == s ? Range{-1, -1} : Range{lo, hi};
  }
  return out;
}

// Per-task copies of one (batch, key/value head): K and V transposed ((d, S) with
// rows padded to a whole number of vectors) and as rows ((S, d) padded).
struct HeadCopies {
  std::vector<float> kt, vt, kr, vr;
  void Fill(const Shape& sh, const float* k, const float* v, int64_t b, int64_t kvh,
            bool need_vt, bool need_kr, bool round) {
    const int64_t sp = sh.sp(), dp = sh.dp(), dvp = sh.dvp();
    kt.assign(sh.d * sp, 0.0f);
    vr.assign(sh.s * dvp, 0.0f);
    if (need_vt) vt.assign(sh.dv * sp, 0.0f);
    if (need_kr) kr.assign(sh.s * dp, 0.0f);
    for (int64_t s = 0; s < sh.s; ++s) {
      const float* ks = k + ((b * sh.s + s) * sh.kv + kvh) * sh.d;
      const float* vs = v + ((b * sh.s + s) * sh.kv + kvh) * sh.dv;
      for (int64_t j = 0; j < sh.d; ++j) kt[j * sp + s] = ks[j];
      std::memcpy(&vr[s * dvp], vs, sizeof(float) * sh.dv);
      if (need_vt) {
        for (int64_t j = 0; j < sh.dv; ++j) vt[j * sp + s] = vs[j];
      }
      if (need_kr) std::memcpy(&kr[s * dp], ks, sizeof(float) * sh.d);
    }
    if (round) {
      for (std::vector<float>* x : {&kt, &vt, &kr, &vr}) RoundAll(x->data(), x->size());
    }
  }
};

// out[r][c] = Σ_{k in [k0, k1)} a[r][k] m[k][c] for c in [c0, c1) (c0 a multiple of
// kLanes; whole vectors are written, so out and m rows are padded past c1), for
// nr <= kRows rows of a; a, m and out rows have strides as, ms and os. `a` always has
// kRows rows in memory (the rows past nr are computed and dropped: no branch in the
// loop). Each vector of m is loaded once for the kRows rows. Both the scores (q Kᵀ: k
// over d, c over keys) and the weighted sums (p V: k over keys, c over d) are this
// product. Columns go `kCols` vectors at a time: 8 rows x 2 vectors = 16 independent
// accumulators (two FMA units with a 4-cycle latency need at least 8), 2 vector
// loads and 8 broadcasts for 16 FMAs.
template <int kCols>
void RowsTimesCols(const float* __restrict__ a, int64_t as, int nr,
                   const float* __restrict__ m, int64_t ms, int64_t k0, int64_t k1,
                   int64_t c, float* __restrict__ out, int64_t os) {
  constexpr int kW = kCols * kLanes;
  float acc[kRows][kW] = {};
  for (int64_t k = k0; k < k1; ++k) {
    const float* mk = m + k * ms + c;
    for (int r = 0; r < kRows; ++r) {
      const float x = a[r * as + k];
#pragma omp simd
      for (int l = 0; l < kW; ++l) acc[r][l] += x * mk[l];
    }
  }
  for (int r = 0; r < nr; ++r) {
    float* o = out + r * os + c;
#pragma omp simd
    for (int l = 0; l < kW; ++l) o[l] = acc[r][l];
  }
}

void RowsTimes(const float* a, int64_t as, int nr, const float* m, int64_t ms,
               int64_t k0, int64_t k1, int64_t c0, int64_t c1, float* out, int64_t os) {
  int64_t c = c0;
  for (; c + 2 * kLanes <= c1; c += 2 * kLanes) {
    RowsTimesCols<2>(a, as, nr, m, ms, k0, k1, c, out, os);
  }
  for (; c < c1; c += kLanes) RowsTimesCols<1>(a, as, nr, m, ms, k0, k1, c, out, os);
}

// acc[s][:] += Σ_r w[r][s] x[r][:] for s in [lo, hi), nr <= kRows rows; x (kRows, np)
// and acc (S, np) with np a multiple of kLanes; w rows have stride sp. Each vector of
// acc is loaded and stored once for kRows FMAs (with 4 rows the loads bound it). The
// sums are written straight into acc (a copy through a stack vector made the
// compiler store 64 bytes and reload them as two halves: a store-forwarding stall).
template <int64_t kNp>  // kNp = np when it is known at compile time, else 0
void RankUpdateN(const float* __restrict__ w, int64_t sp, int nr,
                 const float* __restrict__ x, int64_t np_rt, int64_t lo, int64_t hi,
                 float* __restrict__ acc) {
  const int64_t np = kNp ? kNp : np_rt;
  for (int64_t s = lo; s < hi; ++s) {
    float ws[kRows];
    for (int r = 0; r < kRows; ++r) ws[r] = r < nr ? w[r * sp + s] : 0.0f;
    float* __restrict__ a = acc + s * np;
#pragma omp simd
    for (int64_t c = 0; c < np; ++c) {
      float sum = a[c];
      for (int r = 0; r < kRows; ++r) sum += ws[r] * x[r * np + c];
      a[c] = sum;
    }
  }
}

void RankUpdate(const float* w, int64_t sp, int nr, const float* x, int64_t np,
                int64_t lo, int64_t hi, float* acc) {
  if (np == 64) return RankUpdateN<64>(w, sp, nr, x, np, lo, hi, acc);  // d = 64
  RankUpdateN<0>(w, sp, nr, x, np, lo, hi, acc);
}

// z[lo:hi] = softmax(z[lo:hi]) in place; *mx and *sum get the max and Σ exp(z - max).
void Softmax(float* __restrict__ z, int64_t lo, int64_t hi, float* mx_out,
             float* sum_out) {
  float mx = -1e30f;
#pragma omp simd reduction(max : mx)
  for (int64_t s = lo; s < hi; ++s) mx = z[s] > mx ? z[s] : mx;
#pragma omp simd
  for (int64_t s = lo; s < hi; ++s) z[s] = Exp(z[s] - mx);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t s = lo; s < hi; ++s) sum += z[s];
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t s = lo; s < hi; ++s) z[s] *= inv;
  *mx_out = mx;
  *sum_out = sum;
}

// p[s] = exp(z[s] - lse) and ds[s] = p[s] (dp[s] - D) scale over [lo, hi); ds holds
// dp on entry.
void SoftmaxGrad(float* __restrict__ p, float* __restrict__ ds, int64_t lo, int64_t hi,
                 float lse, float d, float scale) {
#pragma omp simd
  for (int64_t s = lo; s < hi; ++s) p[s] = Exp(p[s] - lse);
#pragma omp simd
  for (int64_t s = lo; s < hi; ++s) ds[s] = p[s] * (ds[s] - d) * scale;
}

// A block of up to kRows query rows; its key range is the union of its rows' ranges
// (a fully masked row counts as [0, S)).
struct Block {
  int64_t t0;
  int nr;
  int64_t lo, hi;  // lo rounded down to a whole vector
};

Block MakeBlock(const std::vector<Range>& ranges, int64_t t0, int64_t t, int64_t s) {
  Block blk{t0, static_cast<int>(std::min<int64_t>(kRows, t - t0)), s, 0};
  for (int r = 0; r < blk.nr; ++r) {
    const Range rg = ranges[t0 + r];
    blk.lo = std::min(blk.lo, rg.none() ? 0 : rg.lo);
    blk.hi = std::max(blk.hi, rg.none() ? s : rg.hi);
  }
  blk.lo = blk.lo / kLanes * kLanes;
  return blk;
}

// z[r][s] = scale · z[r][s] where allowed, -1e30 where not, s in [lo, hi); row r
// is query row t0 + r % period (period kRows: row t0 + r; period T: the rows of
// several heads stacked in one block).
void MaskScores(const Shape& sh, const Block& blk, const uint8_t* mask, int period,
                float scale, float* z) {
  const int64_t sp = sh.sp();
  for (int r = 0; r < blk.nr; ++r) {
    const uint8_t* m = mask + (blk.t0 + r % period) * sh.s;
    float* zr = z + r * sp;
    for (int64_t s = blk.lo; s < blk.hi; ++s) {
      zr[s] = m[s] ? zr[s] * scale : -1e30f;
    }
  }
}

// Scores of a block: z[r][s] = scale · q·k where allowed, -1e30 where not, s in
// [lo, hi).
void Scores(const Shape& sh, const Block& blk, const float* qrows, const float* kt,
            const uint8_t* mask, float scale, float* z) {
  RowsTimes(qrows, sh.dp(), blk.nr, kt, sh.sp(), 0, sh.d, blk.lo, blk.hi, z, sh.sp());
  MaskScores(sh, blk, mask, kRows, scale, z);
}

// Scores as `Scores`, with the keys read where they lie (key s of this head at
// k + s * ks, d floats) instead of from a transposed copy of all S keys: tiles of
// kTile keys are transposed into `tile` (d, kTile), zero past S, and multiplied as
// RowsTimes multiplies the whole copy (the same operations in the same order on the
// same floats per score: the same result). For a block of few rows (decoding) the
// copy of all keys, not the products, was the cost.
constexpr int64_t kTile = 2 * kLanes;

void ScoresInPlace(const Shape& sh, const Block& blk, const float* qrows,
                   const float* k, int64_t ks, const uint8_t* mask, int period,
                   float scale, float* z, float* tile) {
  const int64_t sp = sh.sp(), dp = sh.dp();
  for (int64_t c = blk.lo; c < blk.hi; c += kTile) {
    const int64_t n = std::min(kTile, sh.s - c);  // keys of the tile that exist
    for (int64_t l = 0; l < n; ++l) {
      const float* kr = k + (c + l) * ks;
      for (int64_t j = 0; j < sh.d; ++j) tile[j * kTile + l] = kr[j];
    }
    for (int64_t l = n; l < kTile; ++l) {
      for (int64_t j = 0; j < sh.d; ++j) tile[j * kTile + l] = 0.0f;
    }
    if (c + kTile <= blk.hi) {
      RowsTimesCols<2>(qrows, dp, blk.nr, tile, kTile, 0, sh.d, 0, z + c, sp);
    } else {  // the last columns: one vector at a time, as RowsTimes ends (z rows
              // hold whole vectors up to sp only)
      for (int64_t c1 = 0; c + c1 < blk.hi; c1 += kLanes) {
        RowsTimesCols<1>(qrows, dp, blk.nr, tile, kTile, 0, sh.d, c1, z + c, sp);
      }
    }
  }
  MaskScores(sh, blk, mask, period, scale, z);
}

// Copy nr rows of x (row r at x + r * stride, n values) into a (nr, np) zero-padded
// buffer.
void GatherRows(const float* x, int64_t stride, int nr, int64_t n, int64_t np,
                float* out) {
  std::fill(out, out + kRows * np, 0.0f);
  for (int r = 0; r < nr; ++r) std::memcpy(out + r * np, x + r * stride, sizeof(float) * n);
}

ffi::Error CheckInputs(const Shape& sh, int64_t mask_elems, int64_t param_elems) {
  if (param_elems != 2) {
    return ffi::Error::InvalidArgument("entrenar_attention: params must be (scale, round)");
  }
  if (sh.kv <= 0 || sh.h % sh.kv) {
    return ffi::Error::InvalidArgument("entrenar_attention: H must be a multiple of KV");
  }
  if (mask_elems != sh.mask_b * sh.t * sh.s || (sh.mask_b != 1 && sh.mask_b != sh.b)) {
    return ffi::Error::InvalidArgument("entrenar_attention: mask must be (1|B, T, S)");
  }
  return ffi::Error::Success();
}

Shape ShapeOf(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k,
              const ffi::Buffer<ffi::F32>& v, const ffi::Buffer<ffi::U8>& mask) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto md = mask.dimensions();
  return Shape{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], vd[3], md[0]};
}

// The forward pass over k, v of shape (B, S, KV, d) / (B, S, KV, dv) at kp, vp (a
// layer's slice of a stacked cache, read in place, or a whole operand).
void Forward(const Shape& sh, const float* qp, const float* kp, const float* vp,
             const uint8_t* mask, const float* params, float* op, float* lp,
             ffi::ThreadPool& pool) {
  const float scale = params[0];
  const bool round = params[1] != 0.0f;
  entrenar::ParallelFor(pool, sh.b * sh.kv, [&](int64_t task) {
    const int64_t b = task / sh.kv, kvh = task % sh.kv;
    const int64_t sp = sh.sp(), dp = sh.dp(), dvp = sh.dvp();
    const uint8_t* m = mask + (sh.mask_b == 1 ? 0 : b) * sh.t * sh.s;
    const std::vector<Range> ranges = RowRanges(m, sh.t, sh.s);
    std::vector<float> qrows(kRows * dp), z(kRows * sp), out(kRows * dvp);
    if (sh.t <= kRows && !round && sh.dv % kLanes == 0) {
      // Few query rows (decoding): the rows of several query heads of this key/value
      // head go in one block (row r: head g0 + r / T, query row r % T), and keys and
      // values are read where they lie, once per block (a copy of the head's S keys
      // and values would be read once, and the 8-row products would compute one
      // useful row of 8). Each row's scores, softmax over the key range of all T rows
      // and weighted sum are the operations the path below does in the same order:
      // the same floats. Values are read as whole vectors (dv a multiple of kLanes).
      const float* k_head = kp + (b * sh.s * sh.kv + kvh) * sh.d;
      const float* v_head = vp + (b * sh.s * sh.kv + kvh) * sh.dv;
      const int64_t stride_k = sh.kv * sh.d, stride_v = sh.kv * sh.dv;  // key to key
      const int period = static_cast<int>(sh.t);
      const Block rows = MakeBlock(ranges, 0, sh.t, sh.s);  // the T rows' key range
      const int64_t per_block = std::max<int64_t>(1, kRows / sh.t);  // query heads
      std::vector<float> tile(sh.d * kTile);
      for (int64_t g0 = 0; g0 < sh.g(); g0 += per_block) {
        Block blk = rows;
        blk.nr = static_cast<int>(std::min(per_block, sh.g() - g0) * sh.t);
        std::fill(qrows.begin(), qrows.end(), 0.0f);
        for (int r = 0; r < blk.nr; ++r) {
          const int64_t h = kvh * sh.g() + g0 + r / period, ti = r % period;
          std::memcpy(&qrows[r * dp], qp + ((b * sh.t + ti) * sh.h + h) * sh.d,
                      sizeof(float) * sh.d);
        }
        ScoresInPlace(sh, blk, qrows.data(), k_head, stride_k, m, period, scale,
                      z.data(), tile.data());
        for (int r = 0; r < blk.nr; ++r) {
          const int64_t h = kvh * sh.g() + g0 + r / period, ti = r % period;
          float* zr = z.data() + r * sp;
          float mx = -1e30f, sum = 0.0f;
          if (ranges[ti].none()) {  // uniform over all S keys
            std::fill(zr + blk.lo, zr + blk.hi, 1.0f / static_cast<float>(sh.s));
            sum = static_cast<float>(sh.s);
          } else {
            Softmax(zr, blk.lo, blk.hi, &mx, &sum);
          }
          lp[(b * sh.h + h) * sh.t + ti] = mx + std::log(sum);
        }
        RowsTimes(z.data(), sp, blk.nr, v_head, stride_v, blk.lo, blk.hi, 0, dvp,
                  out.data(), dvp);
        for (int r = 0; r < blk.nr; ++r) {
          const int64_t h = kvh * sh.g() + g0 + r / period, ti = r % period;
          std::memcpy(op + ((b * sh.t + ti) * sh.h + h) * sh.dv, &out[r * dvp],
                      sizeof(float) * sh.dv);
        }
      }
      return;
    }
    HeadCopies hc;
    hc.Fill(sh, kp, vp, b, kvh, false, false, round);
    for (int64_t gi = 0; gi < sh.g(); ++gi) {
      const int64_t h = kvh * sh.g() + gi;
      for (int64_t t0 = 0; t0 < sh.t; t0 += kRows) {
        const Block blk = MakeBlock(ranges, t0, sh.t, sh.s);
        GatherRows(qp + ((b * sh.t + t0) * sh.h + h) * sh.d, sh.h * sh.d, blk.nr, sh.d,
                   dp, qrows.data());
        if (round) RoundAll(qrows.data(), qrows.size());
        Scores(sh, blk, qrows.data(), hc.kt.data(), m, scale, z.data());
        for (int r = 0; r < blk.nr; ++r) {
          float* zr = z.data() + r * sp;
          float mx = -1e30f, sum = 0.0f;
          if (ranges[t0 + r].none()) {  // uniform over all S keys
            std::fill(zr + blk.lo, zr + blk.hi, 1.0f / static_cast<float>(sh.s));
            sum = static_cast<float>(sh.s);
          } else {
            Softmax(zr, blk.lo, blk.hi, &mx, &sum);
          }
          lp[(b * sh.h + h) * sh.t + t0 + r] = mx + std::log(sum);
          if (round) RoundAll(zr + blk.lo, blk.hi - blk.lo);
        }
        RowsTimes(z.data(), sp, blk.nr, hc.vr.data(), dvp, blk.lo, blk.hi, 0, dvp,
                  out.data(), dvp);
        for (int r = 0; r < blk.nr; ++r) {
          std::memcpy(op + ((b * sh.t + t0 + r) * sh.h + h) * sh.dv, &out[r * dvp],
                      sizeof(float) * sh.dv);
        }
      }
    }
  }, sh.Work());
}

ffi::Error ForwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::U8> mask,
                       ffi::Buffer<ffi::F32> params, ffi::ResultBuffer<ffi::F32> o,
                       ffi::ResultBuffer<ffi::F32> lse, ffi::ThreadPool pool) {
  const Shape sh = ShapeOf(q, k, v, mask);
  const ffi::Error e = CheckInputs(sh, mask.element_count(), params.element_count());
  if (e.failure()) return e;
  Forward(sh, q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(),
          params.typed_data(), o->typed_data(), lse->typed_data(), pool);
  return ffi::Error::Success();
}

// The forward pass on layer `layer` of stacked caches k: (L, B, S, KV, d) and
// v: (L, B, S, KV, dv), read in place: a decoding step's layer loop would otherwise
// copy the layer's whole (B, S, KV, d) slice of both out before the call.
ffi::Error CachedImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                      ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::U8> mask,
                      ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse,
                      ffi::ThreadPool pool) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || md.size() != 3 ||
      layer.element_count() != 1 || kd[0] != vd[0] || kd[1] != qd[0] ||
      vd[1] != qd[0] || vd[2] != kd[2] || vd[3] != kd[3] || kd[4] != qd[3]) {
    return ffi::Error::InvalidArgument(
        "entrenar_attention_cached: q must be (B, T, H, d), k and v (L, B, S, KV, d)");
  }
  const int32_t at = *layer.typed_data();
  if (at < 0 || at >= kd[0]) {
    return ffi::Error::InvalidArgument("entrenar_attention_cached: layer out of range");
  }
  const Shape sh{qd[0], qd[1], kd[2], qd[2], kd[3], qd[3], vd[4], md[0]};
  const ffi::Error e = CheckInputs(sh, mask.element_count(), params.element_count());
  if (e.failure()) return e;
  const int64_t k_layer = sh.b * sh.s * sh.kv * sh.d;  // floats per layer
  const int64_t v_layer = sh.b * sh.s * sh.kv * sh.dv;
  Forward(sh, q.typed_data(), k.typed_data() + at * k_layer,
          v.typed_data() + at * v_layer, mask.typed_data(), params.typed_data(),
          o->typed_data(), lse->typed_data(), pool);
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::U8> mask,
                        ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::F32> o,
                        ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                        ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv, ffi::ThreadPool pool) {
  const Shape sh = ShapeOf(q, k, v, mask);
  const ffi::Error e = CheckInputs(sh, mask.element_count(), params.element_count());
  if (e.failure()) return e;
  const float scale = params.typed_data()[0];
  const bool round = params.typed_data()[1] != 0.0f;
  const float *qp = q.typed_data(), *opp = o.typed_data(), *dop = dout.typed_data();
  const float* lp = lse.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp_out = dv->typed_data();
  entrenar::ParallelFor(pool, sh.b * sh.kv, [&](int64_t task) {
    const int64_t b = task / sh.kv, kvh = task % sh.kv;
    const int64_t sp = sh.sp(), dp = sh.dp(), dvp = sh.dvp();
    const uint8_t* m = mask.typed_data() + (sh.mask_b == 1 ? 0 : b) * sh.t * sh.s;
    const std::vector<Range> ranges = RowRanges(m, sh.t, sh.s);
    HeadCopies hc;
    hc.Fill(sh, k.typed_data(), v.typed_data(), b, kvh, true, true, round);
    std::vector<float> dk_acc(sh.s * dp, 0.0f), dv_acc(sh.s * dvp, 0.0f);
    std::vector<float> qrows(kRows * dp), dorows(kRows * dvp), p(kRows * sp),
        ds(kRows * sp), dqrows(kRows * dp);
    for (int64_t gi = 0; gi < sh.g(); ++gi) {
      const int64_t h = kvh * sh.g() + gi;
      for (int64_t t0 = 0; t0 < sh.t; t0 += kRows) {
        const Block blk = MakeBlock(ranges, t0, sh.t, sh.s);
        const int64_t row0 = (b * sh.t + t0) * sh.h + h;
        GatherRows(qp + row0 * sh.d, sh.h * sh.d, blk.nr, sh.d, dp, qrows.data());
        if (round) RoundAll(qrows.data(), qrows.size());
        GatherRows(dop + row0 * sh.dv, sh.h * sh.dv, blk.nr, sh.dv, dvp, dorows.data());
        Scores(sh, blk, qrows.data(), hc.kt.data(), m, scale, p.data());
        RowsTimes(dorows.data(), dvp, blk.nr, hc.vt.data(), sp, 0, sh.dv, blk.lo, blk.hi,
                  ds.data(), sp);  // dp
        for (int r = 0; r < blk.nr; ++r) {
          float* pr = p.data() + r * sp;
          float* dsr = ds.data() + r * sp;
          const float* orow = opp + (row0 + r * sh.h) * sh.dv;
          float dd = 0.0f;  // D = do·o (a vector reduction, not a chain of scalar adds)
#pragma omp simd reduction(+ : dd)
          for (int64_t j = 0; j < sh.dv; ++j) dd += dorows[r * dvp + j] * orow[j];
          if (ranges[t0 + r].none()) {  // uniform; the scores get no gradient
            const float u0 = 1.0f / static_cast<float>(sh.s);
            const float u = round ? RoundBf16(u0) : u0;  // the forward's p
            for (int64_t s = blk.lo; s < blk.hi; ++s) pr[s] = u, dsr[s] = 0.0f;
            continue;
          }
          const float l = lp[(b * sh.h + h) * sh.t + t0 + r];
          SoftmaxGrad(pr, dsr, blk.lo, blk.hi, l, dd, scale);
          if (round) RoundAll(pr + blk.lo, blk.hi - blk.lo);  // dv's input
        }
        // dq = (scale ds) k
        RowsTimes(ds.data(), sp, blk.nr, hc.kr.data(), dp, blk.lo, blk.hi, 0, dp,
                  dqrows.data(), dp);
        for (int r = 0; r < blk.nr; ++r) {
          std::memcpy(dqp + (row0 + r * sh.h) * sh.d, &dqrows[r * dp],
                      sizeof(float) * sh.d);
        }
        // dk[s] += Σ_r (scale ds)[r][s] q[r];  dv[s] += Σ_r p[r][s] do[r]
        RankUpdate(ds.data(), sp, blk.nr, qrows.data(), dp, blk.lo, blk.hi,
                   dk_acc.data());
        RankUpdate(p.data(), sp, blk.nr, dorows.data(), dvp, blk.lo, blk.hi,
                   dv_acc.data());
      }
    }
    for (int64_t s = 0; s < sh.s; ++s) {
      const int64_t at = (b * sh.s + s) * sh.kv + kvh;
      std::memcpy(dkp + at * sh.d, &dk_acc[s * dp], sizeof(float) * sh.d);
      std::memcpy(dvp_out + at * sh.dv, &dv_acc[s * dvp], sizeof(float) * sh.dv);
    }
  }, sh.Work());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarAttentionForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::U8>>()   // mask
                                  .Arg<ffi::Buffer<ffi::F32>>()  // (scale, round)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarAttentionCached, CachedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (L, B, S, KV, d)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v (L, B, S, KV, dv)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // mask
                                  .Arg<ffi::Buffer<ffi::F32>>()  // (scale, round)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer ()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarAttentionBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::U8>>()   // mask
                                  .Arg<ffi::Buffer<ffi::F32>>()  // (scale, round)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // do
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Ctx<ffi::ThreadPool>());
