// 8-bit block-wise AdamW (bitsandbytes' AdamW8bit) of one float32 leaf, block by block.
//
// m and v are stored as uint8 codes of the dynamic map with one float32 absmax per
// block of 256 values (Dettmers et al. 2022, arXiv:2110.02861). Per block:
//
//   m  = β1·map_s[cm]·am + (1-β1) g          v = β2·map_u[cv]·av + (1-β2) g²
//   u  = (m/c1) / (sqrt(v/c2) + ε) + λ θ      c1 = 1-β1^t, c2 = 1-β2^t
//   θ' = θ + u · (-η)
//   am' = max |m|,  cm' = #{k : T_s[k] <= m/am'}   (the nearest code; av', cv' alike)
//
// T: 255 thresholds (the least float32 above each midpoint of neighbouring codes,
// entrenar/optim/adam8bit.py), padded to 256 with +inf; the count comes from a table
// of 65026 cells of the float32 line (`Nearest`) and one comparison, 16 lanes at a
// time (AVX-512 gathers). The block's new m and v stay in 2 KB buffers between the
// update and the quantization: one pass over θ, g and the codes (12 bytes of traffic
// per parameter), where XLA runs the same math as several loops with gathers.
// Equal to the JAX path (adam8bit.py) to float32 rounding: the build's
// -ffp-contract=fast may place fused multiply-adds where XLA does not, which can move
// a value that lies within an ulp of a threshold to the neighbouring code.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 256;
// h: (1-β1, β1, 1-β2, β2, c1, c2, ε, λ, -η), float32.
constexpr int kHyper = 9;
constexpr int64_t kBlocksPerTask = 64;

// The first code to try for x: cells of the float32 line by sign, exponent and the
// top 8 mantissa bits (relative width 2^-8, under the maps' smallest relative gap
// between thresholds, 0.53%: a cell holds at most one threshold, which
// adam8bit.py's _kernel_cells checks). cells[c] counts the thresholds <= the cell's
// least value, so one comparison finishes the count.
constexpr int32_t kCellShift = 15;
constexpr int32_t kCell0 = 0x407FFFFF >> kCellShift;  // the cell of -1.0
constexpr int32_t kCells = (0xBF800000u >> kCellShift) - kCell0 + 1;  // to 1.0

inline int32_t Nearest(const float* t, const int32_t* cells, float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  const uint32_t key = (b & 0x80000000u) ? ~b : (b ^ 0x80000000u);  // ordered
  const int32_t c = static_cast<int32_t>(key >> kCellShift) - kCell0;
  const int32_t k = cells[std::min<int32_t>(std::max<int32_t>(c, 0), kCells - 1)];
  return k + (t[k] <= x ? 1 : 0);  // t[255] = +inf
}

struct Tables {
  const float* map_s;
  const float* map_u;
  const float* t_s;
  const float* t_u;
  const int32_t* cells_s;
  const int32_t* cells_u;
};

void Blocks(const float* __restrict__ p, const float* __restrict__ g,
            const uint8_t* __restrict__ cm, const float* __restrict__ am,
            const uint8_t* __restrict__ cv, const float* __restrict__ av,
            float* __restrict__ po, uint8_t* __restrict__ cmo, float* __restrict__ amo,
            uint8_t* __restrict__ cvo, float* __restrict__ avo, int64_t n,
            int64_t b_lo, int64_t b_hi, const float* h, const Tables& tab) {
  const float a1 = h[0], b1 = h[1], a2 = h[2], b2 = h[3], c1 = h[4], c2 = h[5];
  const float eps = h[6], wd = h[7], neg_lr = h[8];
  alignas(64) float mb[kBlock];
  alignas(64) float vb[kBlock];
  alignas(64) int32_t qm[kBlock];
  alignas(64) int32_t qv[kBlock];
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t len = std::min(kBlock, n - lo);
    const float sm = am[b], sv = av[b];
    float mmax = 0.0f, vmax = 0.0f;
#pragma omp simd reduction(max : mmax, vmax)
    for (int64_t i = 0; i < len; ++i) {
      const int64_t j = lo + i;
      const float gi = g[j], pi = p[j];
      const float mi = a1 * gi + b1 * (tab.map_s[cm[j]] * sm);
      const float vi = a2 * (gi * gi) + b2 * (tab.map_u[cv[j]] * sv);
      const float u = (mi / c1) / (std::sqrt(vi / c2) + eps) + wd * pi;
      po[j] = pi + u * neg_lr;
      mb[i] = mi;
      vb[i] = vi;
      mmax = std::max(mmax, std::fabs(mi));
      vmax = std::max(vmax, std::fabs(vi));
    }
    amo[b] = mmax;
    avo[b] = vmax;
    const float dm = mmax > 0.0f ? mmax : 1.0f, dv = vmax > 0.0f ? vmax : 1.0f;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      qm[i] = Nearest(tab.t_s, tab.cells_s, mb[i] / dm);
      qv[i] = Nearest(tab.t_u, tab.cells_u, vb[i] / dv);
    }
    for (int64_t i = 0; i < len; ++i) {
      cmo[lo + i] = static_cast<uint8_t>(qm[i]);
      cvo[lo + i] = static_cast<uint8_t>(qv[i]);
    }
  }
}

ffi::Error AdamW8bitImpl(ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> g,
                         ffi::Buffer<ffi::U8> cm, ffi::Buffer<ffi::F32> am,
                         ffi::Buffer<ffi::U8> cv, ffi::Buffer<ffi::F32> av,
                         ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> maps,
                         ffi::Buffer<ffi::S32> cells,
                         ffi::ResultBuffer<ffi::F32> p_out,
                         ffi::ResultBuffer<ffi::U8> cm_out,
                         ffi::ResultBuffer<ffi::F32> am_out,
                         ffi::ResultBuffer<ffi::U8> cv_out,
                         ffi::ResultBuffer<ffi::F32> av_out, ffi::ThreadPool pool) {
  const int64_t n = p.element_count();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (g.element_count() != n || cm.element_count() != n || cv.element_count() != n) {
    return ffi::Error::InvalidArgument("entrenar_adamw8bit: θ, g, codes differ in size");
  }
  if (am.element_count() != blocks || av.element_count() != blocks) {
    return ffi::Error::InvalidArgument("entrenar_adamw8bit: one absmax per 256 values");
  }
  if (h.element_count() != kHyper || maps.element_count() != 4 * 256 ||
      cells.element_count() != 2 * kCells) {
    return ffi::Error::InvalidArgument("entrenar_adamw8bit: 9 hyperparameters, 4 maps");
  }
  const float* m = maps.typed_data();  // map_s, map_u, T_s, T_u (256 each)
  const int32_t* c = cells.typed_data();  // signed, unsigned (kCells each)
  const Tables tab{m, m + 256, m + 512, m + 768, c, c + kCells};
  const int64_t chunks = std::max<int64_t>(
      1, std::min<int64_t>(4 * pool.num_threads(), blocks / kBlocksPerTask));
  entrenar::ParallelFor(
      pool, chunks,
      [&](int64_t t) {
        Blocks(p.typed_data(), g.typed_data(), cm.typed_data(), am.typed_data(),
               cv.typed_data(), av.typed_data(), p_out->typed_data(),
               cm_out->typed_data(), am_out->typed_data(), cv_out->typed_data(),
               av_out->typed_data(), n, blocks * t / chunks,
               blocks * (t + 1) / chunks, h.typed_data(), tab);
      },
      n * 16);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarAdamW8bit, AdamW8bitImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // θ
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::U8>>()   // m codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m absmax
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v absmax
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h
                                  .Arg<ffi::Buffer<ffi::F32>>()  // maps, thresholds
                                  .Arg<ffi::Buffer<ffi::S32>>()  // first codes by cell
                                  .Ret<ffi::Buffer<ffi::F32>>()  // θ'
                                  .Ret<ffi::Buffer<ffi::U8>>()   // m codes'
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m absmax'
                                  .Ret<ffi::Buffer<ffi::U8>>()   // v codes'
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v absmax'
                                  .Ctx<ffi::ThreadPool>());
