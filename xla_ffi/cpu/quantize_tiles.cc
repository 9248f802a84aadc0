// mxfp8_quantize_tiles (CPU): the 32x32-block quantize, one E8M0 scale per 32x32 tile.
//
// Operands: x [..., K] (f32 / bf16 / f16; leading axes are rows, M = their product; M and K
//           multiples of 32).
// Results:  q [M, K] e4m3 (codes as float8_e4m3fn), s [M/32, K/32] u8 (the scale of tile (i, j):
//           rows 32i..32i+31, columns 32j..32j+31).
// Attributes: scale_rule i32 (0 rceil, 1 floor).
//
// Each tile is the 1x32 block grown to 32x32: its amax (NaN ignored) gives the scale by the rule
// of numerics.h, and every element is cast with it. A band of 32 rows is read twice, a chunk of
// its tiles at a time, row by row: for the tiles' statistics, then for the cast (the chunk's
// rows still in cache), so reads and writes stream along the rows. Tiles free of Inf, NaN and fp32
// subnormals take the 32-element vector cast of the 1x32 kernels (quantize_vec.h: its conditions
// hold for any block whose scale came from a maximum of its elements); the others take
// numerics.h's scalar cast. Both are exact in integers, or in float operations on normal operands
// only, so XLA:CPU's flush-to-zero changes nothing.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "cpu/quantize_vec.h"
#include "mxfp8/ffi_util.h"
#include "mxfp8/quantize_args.h"
#include "mxfp8/quantize_ffi.h"

namespace mxfp8::cpu {

namespace {

// A tile that holds an Inf, a NaN or an fp32 subnormal, from numerics.h's scalar rules: x, q its
// first element and code (rows K apart), s its scale byte.
template <InType T>
__attribute__((noinline)) void quantize_tile_scalar(const typename Input<T>::Elem* x, int64_t K,
                                                    uint8_t* q, uint8_t* s, ScaleRule rule) {
  uint32_t amax = 0;
  for (int r = 0; r < kBlock; ++r)
    for (int i = 0; i < kBlock; ++i)
      amax = std::max(amax, abs_bits_or_zero_if_nan(Input<T>::bits(x[r * K + i])));
  const uint8_t scale = e8m0_scale(amax, rule);
  *s = scale;
  for (int r = 0; r < kBlock; ++r)
    for (int i = 0; i < kBlock; ++i)
      q[r * K + i] = e4m3_scaled(Input<T>::bits(x[r * K + i]), scale);
}

// Tiles per chunk of a band that quantize_band handles at once: their running statistics (two
// vectors a tile) stay in L1, and the chunk's 32 rows (32 x 4 KiB of fp32 at most) in L2 for the
// second read.
constexpr int64_t kChunkTiles = 32;

// The tiles [j0, j1) of one 32-row band (x, q its first row; s its scale row), row by row:
// the statistics of every tile of the chunk in one sequential pass over its rows, then the cast
// in a second (each row's 32-element pieces in order, so reads and writes stream). A tile
// holding an Inf, a NaN or an fp32 subnormal takes the scalar path.
template <InType T>
MXFP8_CPU_LOOP void quantize_chunk(const typename Input<T>::Elem* x, int64_t K, int64_t j0,
                                   int64_t j1, uint8_t* q, uint8_t* s, ScaleRule rule) {
  using namespace vec;
  const int64_t n = j1 - j0;
  i32x8 mx[kChunkTiles], mn[kChunkTiles];
  for (int64_t j = 0; j < n; ++j) mx[j] = splat(0), mn[j] = splat(INT32_MAX);
  for (int r = 0; r < kBlock; ++r) {
    const auto* row = x + r * K + j0 * kBlock;
    for (int64_t j = 0; j < n; ++j) {
      u32x8 v[4];
      load32<T>(row + j * kBlock, v);
      for (int i = 0; i < 4; ++i) accumulate(v[i], mx[j], mn[j]);
    }
  }
  i32x8 kk[kChunkTiles], thr[kChunkTiles];
  bool vector[kChunkTiles];
  for (int64_t j = 0; j < n; ++j) {
    const int32_t amax = hmax(mx[j]);
    vector[j] = amax < 0x7F800000 && hmin(mn[j]) >= kSubnormalBelow;
    if (!vector[j]) {
      quantize_tile_scalar<T>(x + (j0 + j) * kBlock, K, q + (j0 + j) * kBlock, s + j0 + j, rule);
      continue;
    }
    const uint8_t scale = e8m0_scale_finite(static_cast<uint32_t>(amax), rule);
    s[j0 + j] = scale;
    const CastK ck(splat(127 - static_cast<int32_t>(scale)));
    kk[j] = ck.kk, thr[j] = ck.thr_r;
  }
  for (int r = 0; r < kBlock; ++r) {
    const auto* row = x + r * K + j0 * kBlock;
    uint8_t* out = q + r * K + j0 * kBlock;
    for (int64_t j = 0; j < n; ++j) {
      if (!vector[j]) continue;
      const CastK ck(kk[j], thr[j]);
      u32x8 v[4], c[4];
      load32<T>(row + j * kBlock, v);
      for (int i = 0; i < 4; ++i) c[i] = cast(v[i], ck);
      store32<T>(c, out + j * kBlock);
    }
  }
}

// The tiles of 32-row bands [b0, b1) of an [M, K] input: codes q [M, K], scales s [M/32, K/32].
template <InType T>
MXFP8_CPU_LOOP void quantize_bands(const typename Input<T>::Elem* x, int64_t b0, int64_t b1,
                                   int64_t K, uint8_t* q, uint8_t* s, ScaleRule rule) {
  const int64_t tiles = K / kBlock;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t j = 0; j < tiles; j += kChunkTiles) {
      const int64_t e = b * kBlock * K;
      quantize_chunk<T>(x + e, K, j, std::min(tiles, j + kChunkTiles), q + e, s + b * tiles, rule);
    }
}

MXFP8_CPU_LOOP void bands_typed(InType t, const void* x, int64_t b0, int64_t b1, int64_t K,
                                uint8_t* q, uint8_t* s, ScaleRule rule) {
  switch (t) {
    case InType::kF32:
      return quantize_bands<InType::kF32>(static_cast<const uint32_t*>(x), b0, b1, K, q, s, rule);
    case InType::kBF16:
      return quantize_bands<InType::kBF16>(static_cast<const uint16_t*>(x), b0, b1, K, q, s, rule);
    case InType::kF16:
      return quantize_bands<InType::kF16>(static_cast<const uint16_t*>(x), b0, b1, K, q, s, rule);
  }
}

// The loops compiled for each instruction set (target.h), run for the one isa.h selects.
void bands_baseline(InType t, const void* x, int64_t b0, int64_t b1, int64_t K, uint8_t* q,
                    uint8_t* s, ScaleRule rule) {
  bands_typed(t, x, b0, b1, K, q, s, rule);
}

#if MXFP8_X86_BUILDS
MXFP8_TARGET_AVX2 void bands_avx2(InType t, const void* x, int64_t b0, int64_t b1, int64_t K,
                                  uint8_t* q, uint8_t* s, ScaleRule rule) {
  bands_typed(t, x, b0, b1, K, q, s, rule);
}

MXFP8_TARGET_AVX512 void bands_avx512(InType t, const void* x, int64_t b0, int64_t b1, int64_t K,
                                      uint8_t* q, uint8_t* s, ScaleRule rule) {
  bands_typed(t, x, b0, b1, K, q, s, rule);
}
#endif

void quantize_bands_simd(InType t, const void* x, int64_t b0, int64_t b1, int64_t K, uint8_t* q,
                         uint8_t* s, ScaleRule rule) {
  switch (active_isa()) {
#if MXFP8_X86_BUILDS
    case CpuIsa::kAvx512: return bands_avx512(t, x, b0, b1, K, q, s, rule);
    case CpuIsa::kAvx2: return bands_avx2(t, x, b0, b1, K, q, s, rule);
#endif
    default: return bands_baseline(t, x, b0, b1, K, q, s, rule);
  }
}

}  // namespace

static ffi::Error QuantizeTiles(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> s,
                                int32_t scale_rule) {
  QuantizeTilesArgs a;
  ffi::Error e = check_quantize_tiles_args(x, q, s, &a);
  if (e.failure()) return e;
  const InType t = a.t;
  const int64_t K = a.K;
  const ScaleRule rule = static_cast<ScaleRule>(scale_rule);
  const void* xp = x.untyped_data();
  uint8_t* qp = bytes(q);
  uint8_t* sp = bytes(s);
  // About 64 KiB of input per item keeps scheduling overhead small (as quantize.cc).
  const int64_t min_bands = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, kBlock * K * 2));
  parallel_for(pool, a.M / kBlock, min_bands,
               [&](int64_t b) { quantize_bands_simd(t, xp, b, b + 1, K, qp, sp, rule); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeTilesHandler, QuantizeTiles,
                              quantize_tiles_binding<ffi::ThreadPool>());

}  // namespace mxfp8::cpu
