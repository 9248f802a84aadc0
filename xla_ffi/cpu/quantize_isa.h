// The instruction sets of the CPU quantize loops, as template tags (baseline, AVX2, AVX-512).
#pragma once

#include <cstdint>

#include "cpu/quantize_avx2.h"
#include "cpu/quantize_avx512.h"
#include "cpu/quantize_vec.h"
#include "mxfp8/numerics.h"

namespace mxfp8::cpu {

// Instruction sets of the band loops, as template tags: each entry point instantiates the loops
// with the tag of the target it is compiled for. A tag gives the out-of-line per-block function
// (for the rare groups that hold special values and bf16 blocks that cannot take cast16: kept
// out of the group loop so that its constants are not set up for every group; compiled for the
// same instructions as the loop that calls it) and says whether bf16 has the 512-bit paths of
// quantize_avx512.h, and stages fp32 tiles as sticky bf16 (stage_f32). The numerics are the
// same under every tag.
struct IsaBaseline {
  static constexpr bool kWideBf16 = false;
  static constexpr bool kBand = false;
  template <InType T>
  __attribute__((noinline)) static void block(const typename Input<T>::Elem* x, uint8_t* q,
                                              uint8_t* s, ScaleRule rule) {
    quantize_block<T>(x, q, s, rule);
  }
  MXFP8_CPU_LOOP static void stage_f32(const uint32_t* x, int64_t n, uint16_t* h) {
    stage_f32_generic(x, n, h);
  }
};

#if MXFP8_X86_BUILDS
struct IsaAvx2 {
  static constexpr bool kWideBf16 = false;
  // bf16 and fp32 bands with columnwise output go through avx2_band (quantize_band_avx2.h;
  // its 32x32 chunks are in quantize_avx2.h)
  static constexpr bool kBand = true;
  template <InType Src>
  static void band(const typename Input<Src>::Elem* x, int64_t K, uint8_t* row_q, uint8_t* row_s,
                   uint8_t* col_q, uint8_t* col_s, ScaleRule rule, bool stream);
  template <InType T>
  __attribute__((noinline, target("avx2"))) static void block(const typename Input<T>::Elem* x,
                                                              uint8_t* q, uint8_t* s,
                                                              ScaleRule rule) {
    quantize_block<T>(x, q, s, rule);
  }
  // vpackusdw packs per 128-bit lane (a0-3 b0-3 a4-7 b4-7); vpermq puts the 64-bit pieces back
  // in element order. Values are at most 0xFFFF: no saturation. (Not force-inlined: a target
  // function cannot be forced into the loops before they are inlined into theirs.)
  __attribute__((target("avx2"))) static void stage_f32(const uint32_t* x, int64_t n, uint16_t* h) {
    const __m256i low = _mm256_set1_epi32(0xFFFF), one = _mm256_set1_epi32(1);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8));
      const __m256i ha = _mm256_or_si256(_mm256_srli_epi32(a, 16),
                                         _mm256_min_epu32(_mm256_and_si256(a, low), one));
      const __m256i hb = _mm256_or_si256(_mm256_srli_epi32(b, 16),
                                         _mm256_min_epu32(_mm256_and_si256(b, low), one));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i),
                          _mm256_permute4x64_epi64(_mm256_packus_epi32(ha, hb), 0xD8));
    }
    for (; i < n; ++i) h[i] = sticky_bf16(x[i]);
  }
};

struct IsaAvx512 {
  static constexpr bool kWideBf16 = true;
  // The both-plane band kernel has no 512-bit form yet: AVX-512 CPUs run the AVX2 one, which
  // reads and writes memory the way that measured fastest (the 512-bit paths below serve the
  // rowwise-only loops and the fused RMSNorm kernel's columnwise bands).
  static constexpr bool kBand = true;
  template <InType Src>
  static void band(const typename Input<Src>::Elem* x, int64_t K, uint8_t* row_q, uint8_t* row_s,
                   uint8_t* col_q, uint8_t* col_s, ScaleRule rule, bool stream) {
    IsaAvx2::band<Src>(x, K, row_q, row_s, col_q, col_s, rule, stream);
  }
  template <InType T>
  __attribute__((noinline)) MXFP8_TARGET_AVX512 static void block(const typename Input<T>::Elem* x,
                                                                  uint8_t* q, uint8_t* s,
                                                                  ScaleRule rule) {
    quantize_block<T>(x, q, s, rule);
  }
  MXFP8_TARGET_AVX512 static bool bf16_row_group8(const uint16_t* x, uint8_t* q, uint8_t* s,
                                                  ScaleRule rule) {
    return avx512::bf16_row_group8(x, q, s, rule);
  }
  MXFP8_TARGET_AVX512 static bool bf16_columns32(const uint16_t* x, int64_t xs, uint8_t* q,
                                                 int64_t qs, uint8_t* s, ScaleRule rule) {
    return avx512::bf16_columns32(x, xs, q, qs, s, rule);
  }
  MXFP8_TARGET_AVX512 static void stage_f32(const uint32_t* x, int64_t n, uint16_t* h) {
    avx512::stage_f32(x, n, h);
  }
};
#endif

}  // namespace mxfp8::cpu
