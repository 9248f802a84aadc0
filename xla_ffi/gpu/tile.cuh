// Device building blocks of the GPU quantize kernels: a thread's tile of input, the block
// scales, and the E4M3 cast, for both planes in one pass.
//
// Work unit. A 32-lane group (a warp, or half an AMD wavefront) covers 32 rows x 16*V columns
// of a 32-row band: lane l reads V consecutive columns (16 bytes: V = 8 for bf16/f16, 4 for
// f32) of 16 rows, rows 0-15 for l < 16 and rows 16-31 for l >= 16 (its partner, l ^ 16,
// holds the other 16 rows of the same columns). So:
//   - a columnwise block (32 rows of one column) is split between a lane and its partner: one
//     exchange joins the two halves' amaxes;
//   - a rowwise block (32 columns of one row) is spread over G = 32 / V neighbouring lanes:
//     G-lane exchanges join their amaxes;
//   - each load instruction reads two runs of 16*16 = 256 contiguous bytes, each store writes
//     two runs of contiguous codes; the tile is 16 x 16 bytes = 64 registers per lane.
//
// Numerics. The scale rules are numerics.h's. The cast has two forms:
//   - exact form: numerics.h's amax (NaN ignored) and e4m3_scaled, integer code in compact
//     loops that read their values through a source functor; always correct. Used everywhere
//     on HIP and, on CUDA, for the (rare) tiles of a warp that holds a NaN;
//   - fast form (CUDA sm_89+, NaN-free warps): y = x * 2^(127 - byte) in fp32, then the
//     hardware RNE/satfinite E4M3 conversion, unrolled over the registers of the tile. The
//     product is exact unless it is an fp32 subnormal, and then |y| < 2^-126 rounds to a signed
//     zero either way; Inf gives +-448 and values past 448 saturate, as in e4m3_scaled. (A NaN
//     would lose its sign through the multiply: hence the exact form when there is one.)
// Requires IEEE fp32 (no flush-to-zero): never compile these kernels with fast-math.
#pragma once

#include "gpu/gpu.cuh"

namespace mxfp8::gpu {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MXFP8_HW_E4M3 1
#else
#define MXFP8_HW_E4M3 0
#endif

constexpr int kGroupLanes = 32;              // lanes that share a band's tiles
constexpr int kTileRows = kBlock / 2;        // rows per lane (the partner has the others)
constexpr int kTileCols = kGroupLanes / 2;   // lanes across the columns of one half
static_assert(kWarpLanes % kGroupLanes == 0, "a warp (or wavefront) holds whole 32-lane groups");

// ---------------------------------------------------------------------------------------------
// Elements of a 16-byte row segment, as fp32 bits.

__device__ __forceinline__ uint32_t word(const uint4& w, int j) {
  return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
}

// fp16 bits -> fp32 bits, exact and branch-free (the reference's formula): a subnormal half is
// man * 2^-24, and float(man) is exact, so its exponent is shifted by 24 in the bits.
__device__ __forceinline__ uint32_t f16_bits_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  const uint32_t normal = sign | ((exp + 112u) << 23) | (man << 13);
  const uint32_t special = sign | 0x7F800000u | (man << 13);
  const uint32_t sub = man == 0 ? sign : sign | (bits(static_cast<float>(man)) - (24u << 23));
  return exp == 0x1Fu ? special : (exp == 0 ? sub : normal);
}

template <InType T>
struct Elems;

template <>
struct Elems<InType::kF32> {
  static constexpr int kVec = 4;
  __device__ static uint32_t at(const uint4& w, int i) { return word(w, i); }
};

template <>
struct Elems<InType::kBF16> {
  static constexpr int kVec = 8;
  __device__ static uint32_t at(const uint4& w, int i) {
    const uint32_t v = word(w, i / 2);
    return (i & 1) ? (v & 0xFFFF0000u) : (v << 16);
  }
};

template <>
struct Elems<InType::kF16> {
  static constexpr int kVec = 8;
  __device__ static uint32_t at(const uint4& w, int i) {
    const uint32_t v = word(w, i / 2);
    return f16_bits_to_f32((i & 1) ? (v >> 16) : (v & 0xFFFFu));
  }
};

// ---------------------------------------------------------------------------------------------
// Cast.

// 2^(127 - byte) as an fp32 (byte 254 gives the subnormal 2^-127; 255 never occurs).
__device__ __forceinline__ float inverse_scale(uint8_t byte) {
  return f32(byte == 254 ? 0x00400000u : (254u - byte) << 23);
}

#if MXFP8_HW_E4M3
// The two instructions of the fast form, each behind a device function. Under HIP-CPU (tests
// only) they are emulated from their documented semantics by the shim (xla_ffi/hipcpu/cuda.h),
// so that the code around them runs there; the instructions themselves run only on a GPU.

// cvt.rn.satfinite.e4m3x2.f32: the E4M3 codes of lo and hi, lo in the low byte; round to
// nearest even, magnitudes past 448 (Inf too) saturate to +-448, NaN gives a NaN code.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
#if defined(MXFP8_HIPCPU)
  return hipcpu::cvt_e4m3x2_rn_satfinite(lo, hi);
#else
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// __vmaxu2: the larger of each unsigned 16-bit half of a and b.
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(MXFP8_HIPCPU)
  return hipcpu::vmaxu2(a, b);
#else
  return __vmaxu2(a, b);
#endif
}

// Codes of x0 * m0 and x1 * m1 (fp32 bits x), RNE, satfinite; the first in the low byte.
__device__ __forceinline__ uint32_t e4m3x2_fast(uint32_t x0, float m0, uint32_t x1, float m1) {
  return cvt_e4m3x2(__fmul_rn(f32(x0), m0), __fmul_rn(f32(x1), m1));
}
#endif

// V codes (V = 4 or 8, packed little-endian in V/4 words) stored at p (aligned to V bytes).
template <int V>
__device__ __forceinline__ void store_codes(uint8_t* p, const uint32_t (&c)[V / 4]) {
  if constexpr (V == 8) *reinterpret_cast<uint2*>(p) = make_uint2(c[0], c[1]);
  else *reinterpret_cast<uint32_t*>(p) = c[0];
}

// V scale bytes at p, which need not be aligned (a packed segment's pieces start on any
// multiple of 32 elements, so their scales on any byte).
template <int V>
__device__ __forceinline__ void store_scales(uint8_t* p, const uint32_t (&c)[V / 4]) {
  if ((reinterpret_cast<uintptr_t>(p) & (V - 1)) == 0) {
    store_codes<V>(p, c);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = static_cast<uint8_t>(c[i / 4] >> (8 * (i % 4)));
  }
}

// ---------------------------------------------------------------------------------------------
// A lane's tile: 16 rows x V columns. Pointers address the tile's first element (or, for
// rowwise scales, the scale of its first row's block); planes with null pointers are skipped.

struct TileDst {
  uint8_t* row_q = nullptr;  // rowwise codes at (row0, col0), row stride ld
  uint8_t* row_s = nullptr;  // rowwise scale of (row0, block of col0), row stride lds
  uint8_t* col_q = nullptr;  // columnwise codes at (row0, col0), row stride ld
  uint8_t* col_s = nullptr;  // the V columnwise scales of (band, col0..col0+V)
  int64_t ld = 0;
  int64_t lds = 0;
  int rows = 0;              // valid rows of this lane's 16; 0 for a lane with no tile
  int lane_in_group = 0;     // this lane's place among the G lanes of a 32-column block
  bool upper = false;        // rows 16-31 of the band (the lower lane writes column scales)
};

// Loads `rows` rows of 16 bytes (the others are zero), row stride ld_bytes.
__device__ __forceinline__ void load_tile(const uint8_t* p, int64_t ld_bytes, int rows,
                                          uint4 (&w)[kTileRows]) {
#pragma unroll
  for (int r = 0; r < kTileRows; ++r)
    w[r] = r < rows ? *reinterpret_cast<const uint4*>(p + r * ld_bytes) : make_uint4(0, 0, 0, 0);
}

#if MXFP8_HW_E4M3
// Magnitudes for the fast form, as fp32 bits (NaN compares above Inf): 16-bit formats take
// their maxima on packed halves (|x| bits order like |x| in every format) and widen once.
template <InType T>
__device__ __forceinline__ uint32_t widen(uint32_t h) {
  if constexpr (T == InType::kBF16) return h << 16;
  else return f16_bits_to_f32(h);
}

template <InType T>
__device__ __forceinline__ uint32_t row_amax(const uint4& w) {
  if constexpr (T == InType::kF32) {
    return max(max(w.x & 0x7FFFFFFFu, w.y & 0x7FFFFFFFu),
               max(w.z & 0x7FFFFFFFu, w.w & 0x7FFFFFFFu));
  } else {
    const uint32_t m = max_u16x2(max_u16x2(w.x & 0x7FFF7FFFu, w.y & 0x7FFF7FFFu),
                                 max_u16x2(w.z & 0x7FFF7FFFu, w.w & 0x7FFF7FFFu));
    return widen<T>(max(m & 0xFFFFu, m >> 16));
  }
}

// Column maxima of the tile: amax[i] for column i, as fp32 bits.
template <InType T, int V = Elems<T>::kVec>
__device__ __forceinline__ void col_amax(const uint4 (&w)[kTileRows], uint32_t (&amax)[V]) {
  uint32_t m[4] = {0, 0, 0, 0};
  if constexpr (T == InType::kF32) {
#pragma unroll
    for (int r = 0; r < kTileRows; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) m[j] = max(m[j], word(w[r], j) & 0x7FFFFFFFu);
#pragma unroll
    for (int j = 0; j < 4; ++j) amax[j] = m[j];
  } else {
#pragma unroll
    for (int r = 0; r < kTileRows; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) m[j] = max_u16x2(m[j], word(w[r], j) & 0x7FFF7FFFu);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      amax[2 * j] = widen<T>(m[j] & 0xFFFFu), amax[2 * j + 1] = widen<T>(m[j] >> 16);
  }
}

// Codes of the 4 values k..k+3 of a row segment, value i scaled by m[i].
template <InType T>
__device__ __forceinline__ uint32_t encode4_fast(const uint4& w, int k, float m0, float m1,
                                                 float m2, float m3) {
  return e4m3x2_fast(Elems<T>::at(w, k), m0, Elems<T>::at(w, k + 1), m1) |
         e4m3x2_fast(Elems<T>::at(w, k + 2), m2, Elems<T>::at(w, k + 3), m3) << 16;
}

// The fast form on a tile held in registers. Returns false, having written nothing, when a
// lane of the warp holds a NaN (the column maxima, which see every element, tell).
template <InType T>
__device__ __forceinline__ bool quantize_tile_fast(const uint4 (&w)[kTileRows], const TileDst& d,
                                                   ScaleRule rule) {
  constexpr int V = Elems<T>::kVec, G = kBlock / V;
  uint32_t camax[V];
  col_amax<T>(w, camax);
  bool nan = false;
#pragma unroll
  for (int i = 0; i < V; ++i) nan |= camax[i] > 0x7F800000u;
  if (any_lane(nan)) return false;

  if (d.row_q) {  // uniform
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      uint32_t amax = row_amax<T>(w[r]);
#pragma unroll
      for (int s = 1; s < G; s <<= 1) amax = max(amax, shfl_xor(amax, s, G));
      const uint8_t scale = e8m0_scale(amax, rule);
      const float m = inverse_scale(scale);
      uint32_t c[V / 4];
#pragma unroll
      for (int k = 0; k < V / 4; ++k) c[k] = encode4_fast<T>(w[r], 4 * k, m, m, m, m);
      if (r < d.rows) {
        store_codes<V>(d.row_q + r * d.ld, c);
        if (r % G == d.lane_in_group) d.row_s[r * d.lds] = scale;
      }
    }
  }
  if (d.col_q) {  // uniform
    float m[V];
    uint32_t packed[V / 4] = {};
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const uint32_t amax = max(camax[i], shfl_xor(camax[i], kTileCols, kGroupLanes));
      const uint8_t scale = e8m0_scale(amax, rule);
      m[i] = inverse_scale(scale);
      packed[i / 4] |= static_cast<uint32_t>(scale) << (8 * (i % 4));
    }
    if (d.rows && !d.upper) store_scales<V>(d.col_s, packed);
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      uint32_t c[V / 4];
#pragma unroll
      for (int k = 0; k < V / 4; ++k)
        c[k] = encode4_fast<T>(w[r], 4 * k, m[4 * k], m[4 * k + 1], m[4 * k + 2], m[4 * k + 3]);
      if (r < d.rows) store_codes<V>(d.col_q + r * d.ld, c);
    }
  }
  return true;
}
#endif

// The exact form: src(r, i) gives the fp32 bits of row r, column i of the lane's tile (called
// only for r < d.rows). Loops stay rolled so that this path (rare on CUDA) stays small.
template <int V, typename Src>
__device__ __noinline__ void quantize_tile_exact(const Src& src, const TileDst& d, ScaleRule rule) {
  constexpr int G = kBlock / V;
  if (d.row_q) {
#pragma unroll 1
    for (int r = 0; r < kTileRows; ++r) {
      uint32_t amax = 0;
      if (r < d.rows)
#pragma unroll 1
        for (int i = 0; i < V; ++i) amax = max(amax, abs_bits_or_zero_if_nan(src(r, i)));
#pragma unroll
      for (int s = 1; s < G; s <<= 1) amax = max(amax, shfl_xor(amax, s, G));
      const uint8_t scale = e8m0_scale(amax, rule);
      if (r < d.rows) {
#pragma unroll 1
        for (int i = 0; i < V; ++i) d.row_q[r * d.ld + i] = e4m3_scaled(src(r, i), scale);
        if (r % G == d.lane_in_group) d.row_s[r * d.lds] = scale;
      }
    }
  }
  if (d.col_q) {
#pragma unroll 1
    for (int i = 0; i < V; ++i) {
      uint32_t amax = 0;
#pragma unroll 1
      for (int r = 0; r < d.rows; ++r) amax = max(amax, abs_bits_or_zero_if_nan(src(r, i)));
      amax = max(amax, shfl_xor(amax, kTileCols, kGroupLanes));
      const uint8_t scale = e8m0_scale(amax, rule);
      if (d.rows && !d.upper) d.col_s[i] = scale;
#pragma unroll 1
      for (int r = 0; r < d.rows; ++r) d.col_q[r * d.ld + i] = e4m3_scaled(src(r, i), scale);
    }
  }
}

// Quantizes a lane's tile: from the registers w (16 bytes of each row, format T) in the fast
// form, or from src in the exact form (always without the hardware cast; else when a lane of
// the warp holds a NaN). Every lane of the warp must call this (lanes without a tile pass
// rows = 0: they still take part in the exchanges). The planes with null pointers in d are
// skipped: d.row_q and d.col_q must be null or not alike on every lane.
template <InType T, typename Src>
__device__ __forceinline__ void quantize_tile(const uint4 (&w)[kTileRows], const Src& src,
                                              const TileDst& d, ScaleRule rule) {
#if MXFP8_HW_E4M3
  if (quantize_tile_fast<T>(w, d, rule)) return;
#else
  (void)w;
#endif
  quantize_tile_exact<Elems<T>::kVec>(src, d, rule);
}

// Source functor of the exact form for a tile in memory: element (r, i) of the tile whose
// first element is at p, row stride ld elements.
template <InType T>
struct MemorySource {
  const uint8_t* p;
  int64_t ld;
  __device__ uint32_t operator()(int r, int i) const {
    const int64_t e = r * ld + i;
    if constexpr (T == InType::kF32) return reinterpret_cast<const uint32_t*>(p)[e];
    else if constexpr (T == InType::kBF16)
      return static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[e]) << 16;
    else return f16_bits_to_f32(reinterpret_cast<const uint16_t*>(p)[e]);
  }
};

// ---------------------------------------------------------------------------------------------
// One rowwise block spread over G = 32 / N lanes, each holding N values (fp32 bits) of it:
// returns the block's scale byte and this lane's N codes. Every lane of the warp must call it.

template <int N>
__device__ __noinline__ uint8_t encode_block_exact(const uint32_t (&src)[N], uint32_t (&c)[N / 4],
                                                   ScaleRule rule) {
  constexpr int G = kBlock / N;
  uint32_t amax = 0;
#pragma unroll 1
  for (int k = 0; k < N; ++k) amax = max(amax, abs_bits_or_zero_if_nan(src[k]));
#pragma unroll
  for (int s = 1; s < G; s <<= 1) amax = max(amax, shfl_xor(amax, s, G));
  const uint8_t scale = e8m0_scale(amax, rule);
#pragma unroll 1
  for (int k = 0; k < N / 4; ++k) c[k] = 0;
#pragma unroll 1
  for (int k = 0; k < N; ++k)
    c[k / 4] |= static_cast<uint32_t>(e4m3_scaled(src[k], scale)) << (8 * (k % 4));
  return scale;
}

template <int N>
__device__ __forceinline__ uint8_t encode_block(const uint32_t (&src)[N], uint32_t (&c)[N / 4],
                                                ScaleRule rule) {
#if MXFP8_HW_E4M3
  constexpr int G = kBlock / N;
  bool nan = false;
#pragma unroll
  for (int k = 0; k < N; ++k) nan |= (src[k] & 0x7FFFFFFFu) > 0x7F800000u;
  if (!any_lane(nan)) {
    uint32_t amax = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) amax = max(amax, src[k] & 0x7FFFFFFFu);
#pragma unroll
    for (int s = 1; s < G; s <<= 1) amax = max(amax, shfl_xor(amax, s, G));
    const uint8_t scale = e8m0_scale(amax, rule);
    const float m = inverse_scale(scale);
#pragma unroll
    for (int k = 0; k < N / 4; ++k)
      c[k] = e4m3x2_fast(src[4 * k], m, src[4 * k + 1], m) |
             e4m3x2_fast(src[4 * k + 2], m, src[4 * k + 3], m) << 16;
    return scale;
  }
#endif
  return encode_block_exact<N>(src, c, rule);
}

}  // namespace mxfp8::gpu
