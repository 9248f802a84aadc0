// The CPU quantize loops, for every instruction-set tag (quantize_isa.h): groups of rowwise
// blocks, 32-column tiles of columnwise blocks, and the generic band loop, which gives both planes
// of a 32-row band from one read (tile by tile, from a copy in L1). The plain, packed-segment and
// fused RMSNorm kernels are all made of them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/quantize_isa.h"
#include "cpu/quantize_vec.h"
#include "mxfp8/numerics.h"

namespace mxfp8::cpu {

// The elements a band loop's fallbacks read: the input itself (Src == T), or the fp32 input that
// a 16-bit tile was staged from (T == kBF16, Src == kF32: sticky bf16, stage_f32).
template <InType T, InType Src>
constexpr bool kStagedF32 = T == InType::kBF16 && Src == InType::kF32;

// Up to eight consecutive rowwise blocks (n of them) of one row. Their maxima are reduced
// together (one lane per block), the scales computed lane-wise, and the blocks cast in a second
// sweep that rereads them from L1. A group holding an fp32 subnormal, an Inf or a NaN goes
// block by block. With Src = kF32, x is staged sticky bf16 and src the same elements in fp32:
// blocks the 16-bit cast cannot take are quantized from src.
template <InType T, class Isa, InType Src = T>
MXFP8_CPU_LOOP void quantize_row_group(const typename Input<T>::Elem* x, int n, uint8_t* q,
                                       uint8_t* s, ScaleRule rule, const vec::Cast16K& c16,
                                       const typename Input<Src>::Elem* src = nullptr) {
  static_assert(Src == T || kStagedF32<T, Src>);
  using namespace vec;
  if constexpr (T == InType::kBF16 && Isa::kWideBf16)
    if (n == 8 && Isa::bf16_row_group8(x, q, s, rule)) return;
  i32x8 m[8], mnb;  // mnb: per-block minimum statistic (bf16 only)
  bool subnormal;
  i32x8 amax;
  if constexpr (T == InType::kBF16) {
    i16x16 mx16[8], mn16[8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      i16x16 mx = i16x16{}, mn = i16x16{} + INT16_MAX;
      if (b < n) {
        accumulate16(load16(x + b * kBlock), mx, mn);
        accumulate16(load16(x + b * kBlock + 16), mx, mn);
      }
      mx16[kReduceSlot[b]] = mx;
      mn16[kReduceSlot[b]] = mn;
    }
    // |h| << 16 is the fp32 |x| bits (|h| <= 0x7FFF, so the sign extension leaves it alone)
    amax = reduce8x16<true>(mx16) << 16;
    mnb = reduce8x16<false>(mn16);
    subnormal = hmin(mnb) < kSubnormalBelow16;
  } else {
    i32x8 mn = splat(INT32_MAX);
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      i32x8 mx = splat(0);
      if (b < n) {
        u32x8 v[4];
        load32<T>(x + b * kBlock, v);
        for (int j = 0; j < 4; ++j) accumulate(v[j], mx, mn);
      }
      m[kReduceSlot[b]] = mx;
    }
    subnormal = hmin(mn) < kSubnormalBelow;
    amax = reduce8<true>(m);
  }
  if (hmax(amax) >= 0x7F800000 || subnormal) {
    for (int b = 0; b < n; ++b) {
      if constexpr (Src == T) Isa::template block<T>(x + b * kBlock, q + b * kBlock, s + b, rule);
      else Isa::template block<Src>(src + b * kBlock, q + b * kBlock, s + b, rule);
    }
    return;
  }
  const i32x8 sc = scales(amax, rule);
  if constexpr (T == InType::kBF16) {
    const i32x8 kv = 127 - sc;
    i32x8 f = normal_only(mnb, kv);
    if constexpr (Src != T)
      if (rule == ScaleRule::kRceil) f &= tiny_ok(amax);
    if (n == 8 && hmax(f) < 0) {  // every lane -1
      // The common case: eight blocks, all taking cast16. The scales go out as one 8-byte
      // store, and each block's k << 7 (|k| <= 127, so the low 16 bits of its int32 lane) is
      // broadcast from that lane.
      const u8x32 sb =
          __builtin_shuffle(reinterpret_cast<const u8x32&>(sc), u8x32{0, 4, 8, 12, 16, 20, 24, 28});
      __builtin_memcpy(s, &sb, 8);
      const i16x16 k2 = reinterpret_cast<i16x16>(kv << 7);
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const i16x16 kk16 = __builtin_shuffle(k2, i16x16{} + static_cast<int16_t>(2 * b));
        store16x2(cast16(load16(x + b * kBlock), kk16, c16),
                  cast16(load16(x + b * kBlock + 16), kk16, c16), q + b * kBlock);
      }
      return;
    }
    int32_t k[8], fast[8];
    __builtin_memcpy(k, &kv, sizeof k);
    __builtin_memcpy(fast, &f, sizeof fast);
    for (int b = 0; b < n; ++b) {
      if (!fast[b]) {
        if constexpr (Src == T) Isa::template block<T>(x + b * kBlock, q + b * kBlock, s + b, rule);
        else Isa::template block<Src>(src + b * kBlock, q + b * kBlock, s + b, rule);
        continue;
      }
      s[b] = static_cast<uint8_t>(sc[b]);
      const i16x16 kk16 = i16x16{} + static_cast<int16_t>(k[b] << 7);
      store16x2(cast16(load16(x + b * kBlock), kk16, c16),
                cast16(load16(x + b * kBlock + 16), kk16, c16), q + b * kBlock);
    }
  } else {
    const CastK ck(127 - sc);
    int32_t kk[8], thr_r[8];
    __builtin_memcpy(kk, &ck.kk, sizeof kk);
    __builtin_memcpy(thr_r, &ck.thr_r, sizeof thr_r);
    for (int b = 0; b < n; ++b) {
      s[b] = static_cast<uint8_t>(sc[b]);
      const CastK cb(splat(kk[b]), splat(thr_r[b]));
      u32x8 v[4], c[4];
      load32<T>(x + b * kBlock, v);
      for (int j = 0; j < 4; ++j) c[j] = cast(v[j], cb);
      store32<T>(c, q + b * kBlock);
    }
  }
}

// Rowwise blocks of `rows` rows of length K: q [rows, K], s [rows, K/32]. fp32 rows are staged
// as sticky bf16 eight blocks at a time.
template <InType T, class Isa>
MXFP8_CPU_LOOP void quantize_rowwise(const typename Input<T>::Elem* x, int64_t rows, int64_t K,
                                     uint8_t* q, uint8_t* s, ScaleRule rule) {
  const int64_t nb = K / kBlock;
  const vec::Cast16K c16 = vec::Cast16K::make();
  alignas(64) uint16_t h[8 * kBlock];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; b += 8) {
      const int n = nb - b < 8 ? static_cast<int>(nb - b) : 8;
      const auto* xg = x + r * K + b * kBlock;
      uint8_t* qg = q + r * K + b * kBlock;
      if constexpr (T == InType::kF32) {
        Isa::stage_f32(xg, n * kBlock, h);
        quantize_row_group<InType::kBF16, Isa, InType::kF32>(h, n, qg, s + r * nb + b, rule, c16,
                                                             xg);
      } else {
        quantize_row_group<T, Isa>(xg, n, qg, s + r * nb + b, rule, c16);
      }
    }
}

// The codes of 32 columns of a 32-row bf16 tile (x rows xs elements apart, q rows qs bytes
// apart) through cast16, with the columns' scale bytes sc in load32's lane order. A template on
// Isa like every loop here, so that each ISA's build keeps its own copy.
template <class Isa>
MXFP8_CPU_LOOP void cast_columns32(const uint16_t* x, int64_t xs, const vec::u32x8 sc[4],
                                   uint8_t* q, int64_t qs, const vec::Cast16K& c16) {
  using namespace vec;
  // k << 7 per column, back in column order: even columns in the low halves.
  i16x16 kk16[2];
  for (int h = 0; h < 2; ++h)
    kk16[h] = reinterpret_cast<i16x16>((((127u - sc[2 * h]) << 7) & 0xFFFFu) |
                                       ((127u - sc[2 * h + 1]) << 23));
  for (int r = 0; r < kBlock; ++r)
    store16x2(cast16(load16(x + r * xs), kk16[0], c16),
              cast16(load16(x + r * xs + 16), kk16[1], c16), q + r * qs);
}

// 32 columns of a 32-row tile in the general way: x rows xs elements apart, q rows qs bytes
// apart, s [32]. Each lane of the four vectors is one column.
template <InType T, class Isa>
MXFP8_CPU_LOOP void columns32_general(const typename Input<T>::Elem* x, int64_t xs, uint8_t* q,
                                      int64_t qs, uint8_t* s, ScaleRule rule,
                                      const vec::Cast16K& c16) {
  using namespace vec;
  i32x8 mx[4], mn[4];
  bool subnormal;
  if constexpr (T == InType::kBF16) {
    i16x16 mx16[2] = {}, mn16[2] = {i16x16{} + INT16_MAX, i16x16{} + INT16_MAX};
    for (int r = 0; r < kBlock; ++r)
      for (int h = 0; h < 2; ++h) accumulate16(load16(x + r * xs + 16 * h), mx16[h], mn16[h]);
    for (int h = 0; h < 2; ++h) {
      mx[2 * h] = even32(mx16[h]), mx[2 * h + 1] = odd32(mx16[h]);
      mn[2 * h] = even32s(mn16[h]), mn[2 * h + 1] = odd32s(mn16[h]);
    }
    subnormal = hmin16(vmin16(mn16[0], mn16[1])) < kSubnormalBelow16;
  } else {
    for (int j = 0; j < 4; ++j) mx[j] = splat(0), mn[j] = splat(INT32_MAX);
    for (int r = 0; r < kBlock; ++r) {
      u32x8 v[4];
      load32<T>(x + r * xs, v);
      for (int j = 0; j < 4; ++j) accumulate(v[j], mx[j], mn[j]);
    }
    subnormal = hmin(vmin(vmin(mn[0], mn[1]), vmin(mn[2], mn[3]))) < kSubnormalBelow;
  }
  const i32x8 mxa = vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]));
  if (hmax(mxa) >= 0x7F800000 || subnormal) {
    quantize_columns_scalar<T>(x, xs, kBlock, q, qs, s, rule);
    return;
  }
  u32x8 sc[4];
  for (int j = 0; j < 4; ++j) sc[j] = reinterpret_cast<u32x8>(scales(mx[j], rule));
  store32<T>(sc, s);
  if constexpr (T == InType::kBF16) {
    i32x8 ok = normal_only(mn[0], 127 - reinterpret_cast<i32x8>(sc[0]));
    for (int j = 1; j < 4; ++j) ok &= normal_only(mn[j], 127 - reinterpret_cast<i32x8>(sc[j]));
    if (hmax(ok) < 0) {  // every lane -1
      cast_columns32<Isa>(x, xs, sc, q, qs, c16);
      return;
    }
  }
  const CastK ck[4] = {
      CastK(127 - reinterpret_cast<i32x8>(sc[0])), CastK(127 - reinterpret_cast<i32x8>(sc[1])),
      CastK(127 - reinterpret_cast<i32x8>(sc[2])), CastK(127 - reinterpret_cast<i32x8>(sc[3]))};
  for (int r = 0; r < kBlock; ++r) {
    u32x8 v[4], c[4];
    load32<T>(x + r * xs, v);
    for (int j = 0; j < 4; ++j) c[j] = cast(v[j], ck[j]);
    store32<T>(c, q + r * qs);
  }
}

// Columns that the 16-bit cast cannot take, out of 32, up to which columns32_16bit still casts
// all 32 and then redoes those with the scalar loop (cheaper than the general path for a few).
constexpr int kMaxFixupColumns = 4;

// 32 columns of a 16-bit tile (bf16, or fp32 staged as sticky bf16 with src / ss the fp32
// elements) through cast16; false, with nothing written, when the tile holds a special value or
// a subnormal, or more than kMaxFixupColumns columns need the general path.
template <class Isa, InType Src>
MXFP8_CPU_LOOP bool columns32_16bit(const uint16_t* x, int64_t xs, uint8_t* q, int64_t qs,
                                    uint8_t* s, ScaleRule rule, const vec::Cast16K& c16,
                                    const typename Input<Src>::Elem* src, int64_t ss) {
  using namespace vec;
  i16x16 mx16[2] = {}, mn16[2] = {i16x16{} + INT16_MAX, i16x16{} + INT16_MAX};
  for (int r = 0; r < kBlock; ++r)
    for (int h = 0; h < 2; ++h) accumulate16(load16(x + r * xs + 16 * h), mx16[h], mn16[h]);
  i32x8 mx[4], mn[4];
  for (int h = 0; h < 2; ++h) {
    mx[2 * h] = even32(mx16[h]), mx[2 * h + 1] = odd32(mx16[h]);
    mn[2 * h] = even32s(mn16[h]), mn[2 * h + 1] = odd32s(mn16[h]);
  }
  const bool subnormal = hmin16(vmin16(mn16[0], mn16[1])) < kSubnormalBelow16;
  if (hmax(vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3]))) >= 0x7F800000 || subnormal) return false;
  // Lane j of vector v: column (v / 2) * 16 + 2 * j + v % 2 (load32's order for 16-bit input).
  u32x8 sc[4];
  i32x8 ok[4];
  for (int j = 0; j < 4; ++j) {
    const i32x8 sj = scales(mx[j], rule);
    ok[j] = normal_only(mn[j], 127 - sj);
    if constexpr (Src == InType::kF32)
      if (rule == ScaleRule::kRceil) ok[j] &= tiny_ok(mx[j]);
    // columns redone below take k = 0 here, so that the cast's arithmetic stays in range
    sc[j] = reinterpret_cast<u32x8>((sj & ok[j]) | (splat(127) & ~ok[j]));
  }
  alignas(32) uint8_t redo[kBlock];
  int nredo = 0;
  if (hmax(ok[0] & ok[1] & ok[2] & ok[3]) >= 0) {  // some lane is 0
    u32x8 flag[4];
    for (int j = 0; j < 4; ++j) flag[j] = reinterpret_cast<u32x8>(ok[j] + 1);  // 1: redo
    store32<InType::kBF16>(flag, redo);
    for (int c = 0; c < kBlock; ++c) nredo += redo[c];
    if (nredo > kMaxFixupColumns) return false;
  }
  store32<InType::kBF16>(sc, s);
  cast_columns32<Isa>(x, xs, sc, q, qs, c16);
  if (nredo)
    for (int c = 0; c < kBlock; ++c)
      if (redo[c]) quantize_columns_scalar<Src>(src + c, ss, 1, q + c, qs, s + c, rule);
  return true;
}

// Columnwise blocks of a 32-row tile of n columns: x rows xs elements apart, q rows qs bytes
// apart, s [n] (a piece of one row of the [M/32, K] scale plane). Columns go 32 at a time. With
// Src = kF32, x is staged sticky bf16 and src (rows ss elements apart) the fp32 elements, which
// the general and scalar paths read.
template <InType T, class Isa, InType Src = T>
MXFP8_CPU_LOOP void quantize_columnwise_tile(const typename Input<T>::Elem* x, int64_t xs,
                                             int64_t n, uint8_t* q, int64_t qs, uint8_t* s,
                                             ScaleRule rule,
                                             const typename Input<Src>::Elem* src = nullptr,
                                             int64_t ss = 0) {
  static_assert(Src == T || kStagedF32<T, Src>);
  if constexpr (Src == T) src = x, ss = xs;
  const vec::Cast16K c16 = vec::Cast16K::make();
  int64_t c0 = 0;
  for (; c0 + kBlock <= n; c0 += kBlock) {
    if constexpr (T == InType::kBF16) {
      if constexpr (Isa::kWideBf16)
        if (Isa::bf16_columns32(x + c0, xs, q + c0, qs, s + c0, rule)) continue;
      if (columns32_16bit<Isa, Src>(x + c0, xs, q + c0, qs, s + c0, rule, c16, src + c0, ss))
        continue;
    }
    columns32_general<Src, Isa>(src + c0, ss, q + c0, qs, s + c0, rule, c16);
  }
  if (c0 < n) quantize_columns_scalar<Src>(src + c0, ss, n - c0, q + c0, qs, s + c0, rule);
}

// Columns per tile of the band loop below: 32 rows of 256 columns are 16 KiB of 16-bit input
// (fp32 is staged as 16-bit), and the tile's columnwise codes 8 KiB, all held in L1.
constexpr int64_t kTileCols = 256;

// One 32-row band starting at x (row stride K): rowwise blocks into row_q [32, K] / row_s
// [32, K/32] when row_q is set, columnwise blocks into col_q [32, K] / col_s [K], tile by tile.
// Each tile is first copied into a small contiguous buffer (fp32: staged as sticky bf16) and both
// planes are computed from there; the columnwise codes are collected in a second one and written
// out row by row. Working on the band in place instead (32 rows K elements apart, read twice,
// written 32 bytes at a time K bytes apart) puts every row of a column chunk in the same few cache
// sets whenever K is a multiple of a large power of two, and the two output streams then evict each
// other's lines before they are complete.
template <InType T, class Isa>
MXFP8_CPU_LOOP void quantize_band(const typename Input<T>::Elem* x, int64_t K, uint8_t* row_q,
                                  uint8_t* row_s, uint8_t* col_q, uint8_t* col_s, ScaleRule rule) {
  constexpr bool kStaged = T == InType::kF32;
  constexpr InType TT = kStaged ? InType::kBF16 : T;  // the tile's element type
  using Tile = typename Input<TT>::Elem;
  using Elem = typename Input<T>::Elem;
  alignas(64) Tile in[kBlock * kTileCols];
  alignas(64) uint8_t out[kBlock * kTileCols];
  const int64_t nb = K / kBlock;
  const vec::Cast16K c16 = vec::Cast16K::make();
  for (int64_t c0 = 0; c0 < K; c0 += kTileCols) {
    const int64_t w = std::min(kTileCols, K - c0);
    // The band reads 32 rows K elements apart, more streams than the hardware prefetchers
    // follow: the next tile is fetched while this one is worked on.
    if (c0 + kTileCols < K) {
      const int64_t wn = std::min(kTileCols, K - c0 - kTileCols) * sizeof(Elem);
      for (int r = 0; r < kBlock; ++r) {
        const char* row = reinterpret_cast<const char*>(x + r * K + c0 + kTileCols);
        for (int64_t o = 0; o < wn; o += 64) __builtin_prefetch(row + o);
      }
    }
    if constexpr (kStaged) {
      if (w == kTileCols)
        for (int r = 0; r < kBlock; ++r)
          Isa::stage_f32(x + r * K + c0, kTileCols, in + r * kTileCols);
      else
        for (int r = 0; r < kBlock; ++r) Isa::stage_f32(x + r * K + c0, w, in + r * kTileCols);
    } else if (w == kTileCols) {  // a constant size: vector moves (not a string copy)
      for (int r = 0; r < kBlock; ++r)
        for (int64_t i = 0; i < kTileCols; i += 32 / sizeof(Tile)) {
          vec::u8x32 v;
          __builtin_memcpy(&v, x + r * K + c0 + i, sizeof v);
          __builtin_memcpy(in + r * kTileCols + i, &v, sizeof v);
        }
    } else {
      for (int r = 0; r < kBlock; ++r)
        std::memcpy(in + r * kTileCols, x + r * K + c0, static_cast<size_t>(w) * sizeof(Tile));
    }
    if (row_q) {  // K (so w) is a multiple of 32 here
      const int64_t wb = w / kBlock;
      for (int r = 0; r < kBlock; ++r)
        for (int64_t b = 0; b < wb; b += 8)
          quantize_row_group<TT, Isa, T>(
              in + r * kTileCols + b * kBlock, wb - b < 8 ? static_cast<int>(wb - b) : 8,
              row_q + r * K + c0 + b * kBlock, row_s + r * nb + c0 / kBlock + b, rule, c16,
              x + r * K + c0 + b * kBlock);
    }
    quantize_columnwise_tile<TT, Isa, T>(in, kTileCols, w, out, kTileCols, col_s + c0, rule, x + c0,
                                         K);
    if (w == kTileCols)
      for (int r = 0; r < kBlock; ++r)
        std::memcpy(col_q + r * K + c0, out + r * kTileCols, kTileCols);
    else
      for (int r = 0; r < kBlock; ++r)
        std::memcpy(col_q + r * K + c0, out + r * kTileCols, static_cast<size_t>(w));
  }
}

// Columnwise blocks of one 32-row band starting at x (row stride K): q [32, K] (same layout as
// the input), s [K] (this band's row of the [M/32, K] scale plane).
template <InType T, class Isa>
MXFP8_CPU_LOOP void quantize_columnwise_band(const typename Input<T>::Elem* x, int64_t K,
                                             uint8_t* q, uint8_t* s, ScaleRule rule) {
  quantize_band<T, Isa>(x, K, nullptr, nullptr, q, s, rule);
}

}  // namespace mxfp8::cpu
