// mxfp8_quantize_tiles (CUDA / ROCm): the 32x32-block quantize, one E8M0 scale per 32x32 tile.
// Operands, results and attributes as the CPU handler (cpu/quantize_tiles.cc):
//
// Operands: x [..., K] (f32 / bf16 / f16; leading axes are rows, M = their product; M and K
//           multiples of 32).
// Results:  q [M, K] e4m3, s [M/32, K/32] u8.
// Attributes: scale_rule i32 (0 rceil, 1 floor).
//
// One 32-lane group (a warp, or half an AMD wavefront) per tile, tiles numbered row-major. A
// tile row is S = 32 / V runs of 16 bytes (V elements: 8 for bf16/f16, 4 for f32); lane l reads
// run l % S of rows l / S, l / S + V, ..., so each load instruction of the group reads V rows of
// the tile, and every lane holds 32 elements. The lanes' maxima join in a 32-lane exchange; the
// cast is tile.cuh's: the hardware form on CUDA sm_89+ when the warp holds no NaN, else the
// exact integer form of numerics.h.
#include "gpu/tile.cuh"

namespace mxfp8::gpu {

// A lane's S runs of V elements, read from 16-byte words (tile.cuh's Elems).
template <InType T>
using Runs = uint4[kBlock / Elems<T>::kVec];

// The exact form: the codes of a lane's runs (w) for the tile's scale byte, stored at q (run j at
// q + j * V * K). Rolled over the runs: the fast form, where there is one, leaves this path to the
// rare warps that hold a NaN.
template <InType T>
__device__ __noinline__ void store_tile_exact(const Runs<T>& w, uint8_t scale, uint8_t* q,
                                              int64_t K) {
  constexpr int V = Elems<T>::kVec, S = kBlock / V;
#pragma unroll 1
  for (int j = 0; j < S; ++j) {
    uint32_t c[V / 4] = {};
#pragma unroll
    for (int i = 0; i < V; ++i)
      c[i / 4] |= static_cast<uint32_t>(e4m3_scaled(Elems<T>::at(w[j], i), scale)) << (8 * (i % 4));
    store_codes<V>(q + j * V * K, c);
  }
}

// The fast form (CUDA sm_89+): as store_tile_exact, unless a lane of the warp holds a NaN (whose
// sign the multiply would lose); then it writes nothing and returns false. Elsewhere it always
// returns false.
template <InType T>
__device__ __forceinline__ bool store_tile_fast(const Runs<T>& w, bool nan, uint8_t scale,
                                                uint8_t* q, int64_t K, bool active) {
#if MXFP8_HW_E4M3
  constexpr int V = Elems<T>::kVec, S = kBlock / V;
  if (any_lane(nan)) return false;
  const float m = inverse_scale(scale);
#pragma unroll
  for (int j = 0; j < S; ++j) {
    uint32_t c[V / 4];
#pragma unroll
    for (int k = 0; k < V / 4; ++k) c[k] = encode4_fast<T>(w[j], 4 * k, m, m, m, m);
    if (active) store_codes<V>(q + j * V * K, c);
  }
  return true;
#else
  (void)w, (void)nan, (void)scale, (void)q, (void)K, (void)active;
  return false;
#endif
}

template <InType T>
__global__ void __launch_bounds__(kBlockThreads)
    quantize_tiles_kernel(const uint8_t* x, int64_t M, int64_t K, uint8_t* q, uint8_t* s,
                          ScaleRule rule) {
  constexpr int V = Elems<T>::kVec, S = kBlock / V;
  constexpr int64_t kElemBytes = 16 / V;
  const int64_t t = global_thread(kBlockThreads);
  const int lane = static_cast<int>(t % kGroupLanes);
  const int64_t tile = t / kGroupLanes;
  const int64_t tiles_k = K / kBlock;
  const bool active = tile < (M / kBlock) * tiles_k;  // uniform across the group
  const int64_t tile_row = active ? tile / tiles_k : 0;
  const int64_t tile_col = active ? tile - tile_row * tiles_k : 0;
  // this lane's first element: row tile_row * 32 + lane / S, column tile_col * 32 + (lane % S) * V
  const int64_t e = (tile_row * kBlock + lane / S) * K + tile_col * kBlock + (lane % S) * V;

  Runs<T> w;
#pragma unroll
  for (int j = 0; j < S; ++j)
    w[j] = active ? *reinterpret_cast<const uint4*>(x + (e + j * V * K) * kElemBytes)
                  : make_uint4(0, 0, 0, 0);

  uint32_t amax = 0;
  bool nan = false;
#pragma unroll
  for (int j = 0; j < S; ++j)
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const uint32_t b = Elems<T>::at(w[j], i);
      amax = max(amax, abs_bits_or_zero_if_nan(b));
      nan |= (b & 0x7FFFFFFFu) > 0x7F800000u;
    }
#pragma unroll
  for (int m = 1; m < kGroupLanes; m <<= 1) amax = max(amax, shfl_xor(amax, m, kGroupLanes));
  const uint8_t scale = e8m0_scale(amax, rule);
  if (active && lane == 0) s[tile_row * tiles_k + tile_col] = scale;

  if (!store_tile_fast<T>(w, nan, scale, q + e, K, active) && active)
    store_tile_exact<T>(w, scale, q + e, K);
}

template <InType T>
static const char* launch_typed(cudaStream_t stream, const uint8_t* x, int64_t M, int64_t K,
                                uint8_t* q, uint8_t* s, ScaleRule rule) {
  const int64_t tiles = (M / kBlock) * (K / kBlock);
  const int64_t blocks = ceil_div(tiles * kGroupLanes, kBlockThreads);
  if (blocks == 0) return nullptr;
  if (!grid_fits(blocks)) return kGridTooLarge;
  clear_pending_error();
  launch_kernel(quantize_tiles_kernel<T>, blocks, stream, x, M, K, q, s, rule);
  return launch_error();
}

const char* launch_quantize_tiles(void* stream, InType t, const uint8_t* x, int64_t M, int64_t K,
                                  uint8_t* q, uint8_t* s, ScaleRule rule) {
  const auto st = static_cast<cudaStream_t>(stream);
  switch (t) {
    case InType::kF32: return launch_typed<InType::kF32>(st, x, M, K, q, s, rule);
    case InType::kBF16: return launch_typed<InType::kBF16>(st, x, M, K, q, s, rule);
    case InType::kF16: return launch_typed<InType::kF16>(st, x, M, K, q, s, rule);
  }
  return "unknown input type";
}

}  // namespace mxfp8::gpu
