// The AVX2 band loop (IsaAvx2::band, and IsaAvx512's, which is the same): both planes of a
// 32-row band from its 32x32 chunks (avx2::chunk32 of quantize_avx2.h), with the blocks a chunk
// leaves redone by the generic loops.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "cpu/quantize_avx2.h"
#include "cpu/quantize_isa.h"
#include "cpu/quantize_loops.h"
#include "mxfp8/numerics.h"

namespace mxfp8::cpu {

#if MXFP8_X86_BUILDS
// A 64-byte aligned buffer of at least n 16-bit words, one per thread, kept between calls.
inline uint16_t* band_scratch(int64_t n) {
  struct Buf {
    uint16_t* p = nullptr;
    int64_t n = 0;
    ~Buf() { std::free(p); }
  };
  static thread_local Buf b;
  if (b.n < n) {
    std::free(b.p);
    b.p = static_cast<uint16_t*>(std::aligned_alloc(64, (n * 2 + 63) / 64 * 64));
    b.n = b.p ? n : 0;
  }
  return b.p;
}

// Columns of a chunk, out of 32, up to which avx2_band redoes them one by one (gathered into a
// block); more go through columns32_general together.
constexpr int kMaxGatheredColumns = 8;
// Columns of the output tiles of avx2_band: the codes of 32 rows x 512 columns (16 KiB per plane)
// are collected before they go out, so that each row of a plane is written 512 bytes at a time
// (measured against 256 and 1024 on an AVX2 machine: 3-6% faster than either).
constexpr int64_t kOutCols = 512;
// Columns of a band avx2_band stages at once: 32 rows of them are 1 MiB of 16-bit values.
constexpr int64_t kSlabCols = 16384;

// The AVX2 band loop. A 32-row band of a row-major matrix is one contiguous run of memory, and
// it is read as such: row after row, slab by slab (kSlabCols columns), into a scratch copy in
// lane order (fp32 as sticky bf16) whose rows are an odd number of cache lines apart, so that
// the 32 rows of a chunk fall in different cache sets. (Reading it tile by tile instead, 32 short
// pieces of rows far apart, leaves the hardware prefetchers nothing to follow.) Each 32x32 chunk
// then gives its blocks of both planes through avx2::chunk32; the blocks chunk32 leaves are
// redone from the source with the general code; the codes of a tile of kOutCols columns are
// collected and go out row by row (streamed when asked and the rows are 32-byte aligned).
template <InType Src, bool Row, bool Floor>
MXFP8_TARGET_AVX2 void avx2_band(const typename Input<Src>::Elem* x, int64_t K, uint8_t* row_q,
                                 uint8_t* row_s, uint8_t* col_q, uint8_t* col_s, bool stream) {
  constexpr ScaleRule rule = Floor ? ScaleRule::kFloor : ScaleRule::kRceil;
  constexpr int64_t kChunks = kOutCols / kBlock;
  alignas(64) uint8_t cq[kBlock * kOutCols];
  alignas(64) uint8_t rq[Row ? kBlock * kOutCols : 64];
  alignas(64) uint8_t rs[Row ? kBlock * kChunks : 64];  // [chunk][row]
  const int64_t nb = K / kBlock;
  stream = stream && K % 32 == 0 &&
           ((reinterpret_cast<uintptr_t>(col_q) | reinterpret_cast<uintptr_t>(row_q)) & 31) == 0;
  const vec::Cast16K c16 = vec::Cast16K::make();
  // scratch row stride: the widest slab's whole chunks, plus one line if that is even in lines
  const int64_t wmax = std::min(kSlabCols, K) / kBlock * kBlock;
  const int64_t ls = (wmax / 32) % 2 ? wmax : wmax + 32;
  uint16_t* const in = band_scratch(kBlock * ls);
  if (!in) {  // no memory for the scratch copy: the general band loop
    quantize_band<Src, IsaAvx2>(x, K, row_q, row_s, col_q, col_s, rule);
    return;
  }
  for (int64_t s0 = 0; s0 < K; s0 += kSlabCols) {
    const int64_t sw = std::min(kSlabCols, K - s0), swf = sw / kBlock * kBlock;
    for (int r = 0; r < kBlock; ++r) avx2::stage_row(x + r * K + s0, swf, in + r * ls);
    for (int64_t c0 = s0; c0 < s0 + sw; c0 += kOutCols) {
      const int64_t w = std::min(kOutCols, s0 + sw - c0), wf = w / kBlock * kBlock;
      for (int64_t j = 0; j < wf / kBlock; ++j) {
        const int64_t cj = j * kBlock;
        uint8_t* cs = col_s + c0 + cj;
        const avx2::Redo redo = avx2::chunk32<Row, true, Floor>(
            in + (c0 - s0) + cj, ls, rq + cj, kOutCols, rs + cj, cq + cj, kOutCols, cs);
        if (redo.rows)
          for (int r = 0; r < kBlock; ++r)
            if (redo.rows >> r & 1)
              IsaAvx2::block<Src>(x + r * K + c0 + cj, rq + r * kOutCols + cj, rs + cj + r, rule);
        if (__builtin_popcount(redo.cols) > kMaxGatheredColumns) {
          columns32_general<Src, IsaAvx2>(x + c0 + cj, K, cq + cj, kOutCols, cs, rule, c16);
        } else if (redo.cols) {  // each column gathered into a block of its own
          for (int c = 0; c < kBlock; ++c) {
            if (!(redo.cols >> c & 1)) continue;
            typename Input<Src>::Elem col[kBlock];
            alignas(32) uint8_t q[kBlock];
            for (int r = 0; r < kBlock; ++r) col[r] = x[r * K + c0 + cj + c];
            IsaAvx2::block<Src>(col, q, cs + c, rule);
            for (int r = 0; r < kBlock; ++r) cq[r * kOutCols + cj + c] = q[r];
          }
        }
      }
      avx2::copy_out(cq, kOutCols, kBlock, wf, col_q + c0, K, stream);
      if (wf < w)  // a columnwise tail narrower than 32 columns (K % 32 != 0: no rowwise plane)
        quantize_columns_scalar<Src>(x + c0 + wf, K, w - wf, col_q + c0 + wf, K, col_s + c0 + wf,
                                     rule);
      if constexpr (Row) {
        avx2::copy_out(rq, kOutCols, kBlock, wf, row_q + c0, K, stream);
        for (int r = 0; r < kBlock; ++r)
          for (int64_t j = 0; j < wf / kBlock; ++j)
            row_s[r * nb + c0 / kBlock + j] = rs[j * kBlock + r];
      }
    }
  }
  if (stream) _mm_sfence();  // the streamed lines are visible before the call returns
}

template <InType Src>
void IsaAvx2::band(const typename Input<Src>::Elem* x, int64_t K, uint8_t* row_q, uint8_t* row_s,
                   uint8_t* col_q, uint8_t* col_s, ScaleRule rule, bool stream) {
  if (row_q)
    rule == ScaleRule::kFloor
        ? avx2_band<Src, true, true>(x, K, row_q, row_s, col_q, col_s, stream)
        : avx2_band<Src, true, false>(x, K, row_q, row_s, col_q, col_s, stream);
  else
    rule == ScaleRule::kFloor
        ? avx2_band<Src, false, true>(x, K, row_q, row_s, col_q, col_s, stream)
        : avx2_band<Src, false, false>(x, K, row_q, row_s, col_q, col_s, stream);
}
#endif

}  // namespace mxfp8::cpu
