// The GPU RMSNorm + MXFP8 kernels. They read their rows through a table of ranks (RowTable), so
// that the local op (one rank: rows of one buffer) and the in-process all-gather (rows of the
// group's devices, read over peer access) are the same kernels, compiled once
// (rmsnorm_quantize.cu). When o.residual is set the rows read are also an output, copied bit
// for bit to o.residual ([R, H]).
//
// Two kernels:
//   - rows (rowwise planes only): 32 lanes per row; rows up to 8192 wide stay in registers
//     between the sum of squares and the output pass (a cache of 4, 8, 16 or 32 steps of 256
//     elements, the smallest that holds the row; AMD GPUs cache up to 2048), so x is read once
//     (wider rows are read again, from cache).
//   - bands (columnwise planes too): one thread block per 32-row band; its 32-lane groups first
//     compute the band's 32 inverse RMS values, then every thread quantizes a 32 x V tile of
//     the normed band in both directions (tile.cuh).
#pragma once

#include "gpu/rmsnorm.cuh"

namespace mxfp8::gpu {

// Row r of the [R, H] input (every row 16-byte aligned: H % 32 == 0): from the rank whose range
// [start[k], start[k+1]) holds it (ranks with no rows have an empty range and are skipped).
struct RowTable {
  GatherRows table;
  int64_t H;
  __device__ const uint16_t* operator()(int64_t r) const {
    int k = 0;
    while (k + 1 < table.ranks && r >= table.start[k + 1]) ++k;
    return table.base[k] + (r - table.start[k]) * H;
  }
};

// Quantization source of the exact form for a band quantized from fp32: the unrounded
// normed value recomputed from x (same formula, same bits).
struct NormFp32Source {
  const uint16_t* const* rows;  // the tile's rows (first element of each)
  const uint16_t* gamma;        // gamma at the tile's first column
  const float* inv;             // the tile's inverse RMS values
  int64_t col0;                 // the tile's first column
  float weight_offset;
  __device__ uint32_t operator()(int r, int i) const {
    const uint32_t xb = bf16_to_f32_bits(rows[r][col0 + i]);
    return norm_bits(xb, inv[r], gamma_value(bf16_to_f32_bits(gamma[i]), weight_offset));
  }
};

// One output step of a row (elements i * 256 + 8 * lane ..): normed, codes and scale of the
// lane's 8 values v (x's bits; zeros when not valid).
template <bool kFromFp32>
__device__ __forceinline__ void rows_output_step(const uint4& v, const uint16_t* gamma, int64_t e,
                                                 bool valid, int64_t row, int lane, float inv,
                                                 const NormParams& prm, const NormOut& o) {
  uint4 gv = make_uint4(0, 0, 0, 0);
  if (valid) gv = *reinterpret_cast<const uint4*>(gamma + e);
  uint32_t xb[kNormVec], gb[kNormVec], normed[kNormVec / 2], src[kNormVec];
#pragma unroll
  for (int k = 0; k < kNormVec; ++k)
    xb[k] = Elems<InType::kBF16>::at(v, k), gb[k] = Elems<InType::kBF16>::at(gv, k);
  normalize<kFromFp32>(xb, gb, inv, prm.weight_offset, normed, src);
  if (!valid)
#pragma unroll
    for (int k = 0; k < kNormVec; ++k) src[k] = 0;
  uint32_t c[kNormVec / 4];
  const uint8_t scale = encode_block<kNormVec>(src, c, prm.rule);
  if (valid) {
    const int64_t at = row * prm.H + e;
    *reinterpret_cast<uint4*>(o.normed + at) =
        make_uint4(normed[0], normed[1], normed[2], normed[3]);
    store_codes<kNormVec>(o.row_q + at, c);
    if (lane % (kBlock / kNormVec) == 0) o.row_s[at / kBlock] = scale;
    if (o.residual) *reinterpret_cast<uint4*>(o.residual + at) = v;
  }
}

// kSteps > 0: rows of up to kSteps * 256 elements, held in registers; 0: any length, re-read.
// The cached loops run exactly kSteps times with the steps past the row predicated off (an
// early exit would keep the loop rolled and the cache in scratch memory on AMD GPUs).
template <int kSteps, bool kFromFp32, typename Rows>
__global__ void __launch_bounds__(kBlockThreads)
    rmsnorm_rows_kernel(Rows rows, const uint16_t* gamma, int64_t R, NormParams prm, NormOut o) {
  const int64_t t = global_thread(kBlockThreads);
  const int64_t row = t / kNormLanes;
  const int lane = static_cast<int>(t % kNormLanes);
  const bool active = row < R;
  const int64_t H = prm.H;
  const uint16_t* xr = rows(active ? row : 0);

  if constexpr (kSteps > 0) {
    uint4 cached[kSteps];
    float p = 0.f;
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int64_t e = i * kNormStep + lane * kNormVec;
      cached[i] =
          active && e < H ? *reinterpret_cast<const uint4*>(xr + e) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i)
      if (active && i * kNormStep + lane * kNormVec < H) p = add_squares(p, cached[i]);
    const float inv = rms_inverse(lane_tree(p), H, prm.eps);
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int64_t e = i * kNormStep + lane * kNormVec;
      if (i * kNormStep < H)  // uniform across the warp
        rows_output_step<kFromFp32>(cached[i], gamma, e, active && e < H, row, lane, inv, prm, o);
    }
  } else {
    const float inv = rms_inverse(row_sum_of_squares(xr, H, lane, active), H, prm.eps);
    const int64_t steps = (H + kNormStep - 1) / kNormStep;
    for (int64_t i = 0; i < steps; ++i) {
      const int64_t e = i * kNormStep + lane * kNormVec;
      const bool valid = active && e < H;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (valid) v = *reinterpret_cast<const uint4*>(xr + e);
      rows_output_step<kFromFp32>(v, gamma, e, valid, row, lane, inv, prm, o);
    }
  }
}

template <bool kFromFp32, typename Rows>
__global__ void __launch_bounds__(kBlockThreads)
    rmsnorm_bands_kernel(Rows rows, const uint16_t* gamma, NormParams prm, NormOut o) {
  constexpr InType T = kFromFp32 ? InType::kF32 : InType::kBF16;
  constexpr int V = Elems<T>::kVec, G = kBlock / V;
  constexpr int kGroups = kBlockThreads / kNormLanes;
  __shared__ float inv[kBlock];
  // The band's row addresses, looked up once (a gathered band may span several devices).
  __shared__ const uint16_t* band_rows[kBlock];

  const int64_t H = prm.H;
  const int tid = thread_in_block();
  const int64_t band = block_index();
  const int lane = tid % kGroupLanes;
  if (tid < kBlock) band_rows[tid] = rows(band * kBlock + tid);
  for (int k = tid / kNormLanes; k < kBlock; k += kGroups) {
    const float s = row_sum_of_squares(rows(band * kBlock + k), H, lane, true);
    if (lane == 0) inv[k] = rms_inverse(s, H, prm.eps);
  }
  block_sync();

  // Column groups of the band (32 rows x V columns, two lanes each: tile.cuh).
  const bool upper = lane >= kTileCols;
  const int half = upper ? kTileRows : 0;
  const int64_t row0 = band * kBlock + half;
  const int64_t per_band = H / V;
  for (int64_t base = 0; base < per_band; base += kBlockThreads / 2) {  // uniform trip count
    const int64_t cg = base + (tid / kGroupLanes) * kTileCols + lane % kTileCols;
    const bool active = cg < per_band;
    const int64_t col0 = active ? cg * V : 0;
    const int64_t e0 = row0 * H + col0;

    uint32_t gb[V];
    uint4 gv = make_uint4(0, 0, 0, 0);
    if (active) {
      if constexpr (V == 8) gv = *reinterpret_cast<const uint4*>(gamma + col0);
      else
        gv.x = reinterpret_cast<const uint2*>(gamma + col0)->x,
        gv.y = reinterpret_cast<const uint2*>(gamma + col0)->y;
    }
#pragma unroll
    for (int k = 0; k < V; ++k) gb[k] = Elems<InType::kBF16>::at(gv, k);

    uint4 w[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      const uint16_t* xp = band_rows[half + r] + col0;
      uint4 xv = make_uint4(0, 0, 0, 0);
      if (active) {
        if constexpr (V == 8) {
          xv = *reinterpret_cast<const uint4*>(xp);
          if (o.residual) *reinterpret_cast<uint4*>(o.residual + e0 + r * H) = xv;
        } else {
          const uint2 h = *reinterpret_cast<const uint2*>(xp);
          xv.x = h.x, xv.y = h.y;
          if (o.residual) *reinterpret_cast<uint2*>(o.residual + e0 + r * H) = h;
        }
      }
      uint32_t xb[V], normed[V / 2], src[V];
#pragma unroll
      for (int k = 0; k < V; ++k) xb[k] = Elems<InType::kBF16>::at(xv, k);
      normalize<kFromFp32>(xb, gb, inv[half + r], prm.weight_offset, normed, src);
      if constexpr (V == 8) {
        if (active)
          *reinterpret_cast<uint4*>(o.normed + e0 + r * H) =
              make_uint4(normed[0], normed[1], normed[2], normed[3]);
        w[r] = make_uint4(normed[0], normed[1], normed[2], normed[3]);  // bf16 tile
      } else {
        if (active)
          *reinterpret_cast<uint2*>(o.normed + e0 + r * H) = make_uint2(normed[0], normed[1]);
        w[r] = make_uint4(src[0], src[1], src[2], src[3]);  // fp32 tile
      }
    }

    TileDst d;
    d.upper = upper;
    d.rows = active ? kTileRows : 0;
    d.ld = H;
    d.lds = H / kBlock;
    d.lane_in_group = static_cast<int>(cg % G);
    d.row_q = o.row_q + e0;
    d.row_s = o.row_s + row0 * d.lds + col0 / kBlock;
    d.col_q = o.col_q + e0;
    d.col_s = o.col_s + band * H + col0;
    if constexpr (kFromFp32)
      quantize_tile<T>(
          w, NormFp32Source{band_rows + half, gamma + col0, inv + half, col0, prm.weight_offset}, d,
          prm.rule);
    else
      quantize_tile<T>(w, MemorySource<T>{reinterpret_cast<const uint8_t*>(o.normed + e0), H}, d,
                       prm.rule);
  }
}

// The largest row cache of the rows kernel, in steps of 256 elements. On AMD GPUs a cache of 16
// or 32 steps does not fit the registers (gfx942: 16 steps take 255 VGPRs + 43 AGPRs, one wave
// per SIMD; 32 steps spill 528 bytes per lane to scratch), so rows past 8 steps (H > 2048) are
// read twice, the second time from cache. On NVIDIA GPUs 32 steps take 168 registers (sm_90).
#if defined(__HIPCC__)
constexpr int kMaxCachedSteps = 8;
#else
constexpr int kMaxCachedSteps = 32;
#endif

// The rows kernel with the smallest cache (4, 8, 16, 32 steps) that holds a row of `steps`
// steps: registers grow with it, and most rows are far narrower than 8192.
template <int kSteps, bool kFromFp32, typename Rows>
void enqueue_rows(cudaStream_t stream, int64_t blocks, int64_t steps, const Rows& rows,
                  const uint16_t* gamma, int64_t R, const NormParams& prm, const NormOut& o) {
  if constexpr (kSteps > kMaxCachedSteps)
    launch_kernel(rmsnorm_rows_kernel<0, kFromFp32, Rows>, blocks, stream, rows, gamma, R, prm, o);
  else if (steps <= kSteps)
    launch_kernel(rmsnorm_rows_kernel<kSteps, kFromFp32, Rows>, blocks, stream, rows, gamma, R, prm,
                  o);
  else enqueue_rows<kSteps * 2, kFromFp32>(stream, blocks, steps, rows, gamma, R, prm, o);
}

template <bool kFromFp32, typename Rows>
void enqueue_rmsnorm(cudaStream_t stream, const Rows& rows, const uint16_t* gamma, int64_t R,
                     const NormParams& prm, const NormOut& o) {
  if (prm.columnwise) {
    launch_kernel(rmsnorm_bands_kernel<kFromFp32, Rows>, R / kBlock, stream, rows, gamma, prm, o);
    return;
  }
  const int64_t blocks = ceil_div(R * kNormLanes, kBlockThreads);
  enqueue_rows<4, kFromFp32>(stream, blocks, ceil_div(prm.H, kNormStep), rows, gamma, R, prm, o);
}

// Enqueues RMSNorm + MXFP8 of the R rows of `rows` on `stream`; nullptr, or the launch error.
template <typename Rows>
const char* enqueue_rmsnorm_quantize(void* stream, const Rows& rows, const uint16_t* gamma,
                                     int64_t R, const NormParams& prm, const NormOut& o) {
  const int64_t blocks = prm.columnwise ? R / kBlock : ceil_div(R * kNormLanes, kBlockThreads);
  if (blocks == 0) return nullptr;
  if (!grid_fits(blocks)) return kGridTooLarge;
  const auto st = static_cast<cudaStream_t>(stream);
  clear_pending_error();
  if (prm.quantize_from_fp32) enqueue_rmsnorm<true>(st, rows, gamma, R, prm, o);
  else enqueue_rmsnorm<false>(st, rows, gamma, R, prm, o);
  return launch_error();
}

}  // namespace mxfp8::gpu
