// Softmax cross-entropy of a block of logits and its gradient, in two passes over
// each row.
//
//   z: (N, V) float32 logits    y: (N,) int32 labels
//   lse[n] = log Σ_v exp(z[n, v])
//   nll[n] = lse[n] - z[n, y[n]]                  (NaN when y[n] is outside [0, V))
//   dz[n, v] = bf16(exp(z[n, v] - lse[n]) - [v == y[n]])   (to nearest, ties to even)
//
// entrenar/nn/losses.py's chunked LM loss forms one chunk's logits (chunk x 49,152
// for SmolLM2) and needs these three; XLA:CPU spends three loops on them (the max,
// the sum of exponentials, and the exponentials again for dz), each reading the
// whole chunk from memory. Here each row is read from memory once: the max, then
// exp(z - max) into a row buffer that stays in L2 while it is summed, then dz from
// the buffer. Rows are split over XLA's intra-op thread pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fastmath.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerTask = 8;

using entrenar::Bf16Bits;
using entrenar::Exp;

// One row: returns lse, fills dz (V bfloat16 bits); e is a V-float scratch row.
float Row(const float* __restrict__ z, int32_t y, int64_t v, float* __restrict__ e,
          uint16_t* __restrict__ dz) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < v; ++i) mx = z[i] > mx ? z[i] : mx;
  if (!std::isfinite(mx)) mx = 0.0f;  // all -inf, or inf/NaN: let them propagate
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < v; ++i) {
    e[i] = Exp(z[i] - mx);
    sum += e[i];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t i = 0; i < v; ++i) dz[i] = Bf16Bits(e[i] * inv);
  if (0 <= y && y < v) dz[y] = Bf16Bits(e[y] * inv - 1.0f);
  return mx + std::log(sum);
}

ffi::Error SoftmaxXentImpl(ffi::Buffer<ffi::F32> z, ffi::Buffer<ffi::S32> y,
                           ffi::ResultBuffer<ffi::F32> nll,
                           ffi::ResultBuffer<ffi::F32> lse,
                           ffi::ResultBuffer<ffi::BF16> dz, ffi::ThreadPool pool) {
  const auto zd = z.dimensions();
  if (zd.size() != 2 || y.element_count() != zd[0]) {
    return ffi::Error::InvalidArgument(
        "entrenar_softmax_xent: z must be (N, V) and y (N,)");
  }
  const int64_t n = zd[0], v = zd[1];
  const float* zp = z.typed_data();
  const int32_t* yp = y.typed_data();
  float *nllp = nll->typed_data(), *lsep = lse->typed_data();
  uint16_t* dzp = dz->typed_data();
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  entrenar::ParallelFor(pool, tasks, [&](int64_t task) {
    std::vector<float> e(v);
    const int64_t r1 = std::min(n, (task + 1) * kRowsPerTask);
    for (int64_t r = task * kRowsPerTask; r < r1; ++r) {
      const float* zr = zp + r * v;
      const int32_t label = yp[r];
      const float l = Row(zr, label, v, e.data(), dzp + r * v);
      lsep[r] = l;
      nllp[r] = 0 <= label && label < v ? l - zr[label]
                                         : std::numeric_limits<float>::quiet_NaN();
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EntrenarSoftmaxXent, SoftmaxXentImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // z
                                  .Arg<ffi::Buffer<ffi::S32>>()   // y
                                  .Ret<ffi::Buffer<ffi::F32>>()   // nll
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // dz
                                  .Ctx<ffi::ThreadPool>());
