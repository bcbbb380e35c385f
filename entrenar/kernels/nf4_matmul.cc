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

#include "decoded_rows.h"
#include "nf4_decode.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

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
  int64_t n, k, o, block;
};

// Decode columns [c0, c0 + len) of row `row` into w; c0 and len are whole blocks.
void Decode(const Problem& p, int64_t row, int64_t c0, int64_t len, float* w) {
  const int64_t nb = p.k / p.block, half = p.block / 2;
  for (int64_t b = c0 / p.block; b < (c0 + len) / p.block; ++b) {
    entrenar::DecodeNf4Block(p.codes + row * (p.k / 2) + b * half, p.block,
                             p.scales[row * nb + b], p.table, w + (b * p.block - c0));
  }
}

void RunRows(const Problem& p, int64_t o0, int64_t o1) {
  const entrenar::RowsProblem rows{p.x, p.y, p.n, p.k, p.o};
  entrenar::DecodedRows<kChunk>(
      rows, o0, o1,
      [&](int64_t row, int64_t c0, int64_t len, float* w) { Decode(p, row, c0, len, w); });
}

ffi::Error Nf4MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                         ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> table,
                         ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || table.element_count() != 16) {
    return ffi::Error::InvalidArgument("entrenar_nf4_matmul: bad ranks");
  }
  Problem p{x.typed_data(), codes.typed_data(), scales.typed_data(), table.typed_data(),
            y->typed_data(), xd[0], xd[1], cd[0], 0};
  if (sd[0] != p.o || sd[1] == 0 || p.k % sd[1] != 0 || cd[1] * 2 != p.k) {
    return ffi::Error::InvalidArgument("entrenar_nf4_matmul: shapes disagree");
  }
  p.block = p.k / sd[1];
  if (p.block % 2 != 0 || kChunk % p.block != 0) {
    return ffi::Error::InvalidArgument("entrenar_nf4_matmul: unsupported block size");
  }
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
