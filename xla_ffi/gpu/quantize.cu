// mxfp8_quantize (CUDA / ROCm): rowwise and/or columnwise planes of an [M, K] input in one
// pass over it. Operands, results and attributes as the CPU handler (cpu/quantize.cc):
//
// Operands: x [..., K] (f32 / bf16 / f16; leading axes are rows).
// Results:  row_q [M, K] e4m3, row_s [M, K/32] u8, col_q [M, K] e4m3, col_s [M/32, K] u8
//           (E4M3 codes as float8_e4m3fn, E8M0 scales as uint8: the types the Python wrapper
//           declares; the handler checks sizes in bytes only).
// Attributes: scale_rule i32 (0 rceil, 1 floor), rowwise bool, columnwise bool.
// An unrequested plane is passed as a zero-size result and left alone.
#include "gpu/tile.cuh"

namespace mxfp8::gpu {

// Column groups (32 rows x V columns, two lanes each: tile.cuh) are numbered band-major.
// Planes with null pointers in p are skipped.
template <InType T>
__global__ void __launch_bounds__(kBlockThreads)
    quantize_kernel(const uint8_t* x, int64_t M, int64_t K, Planes p, ScaleRule rule) {
  constexpr int V = Elems<T>::kVec, G = kBlock / V;
  constexpr int64_t kElemBytes = 16 / V;
  const int64_t per_band = K / V;
  const int64_t t = global_thread(kBlockThreads);
  const int lane = static_cast<int>(t % kGroupLanes);
  const int64_t cg = (t / kGroupLanes) * kTileCols + lane % kTileCols;
  const bool active = cg < ((M + kBlock - 1) / kBlock) * per_band;
  const int64_t band = active ? cg / per_band : 0;
  const int64_t col0 = active ? (cg - band * per_band) * V : 0;

  TileDst d;
  d.upper = lane >= kTileCols;
  const int64_t row0 = band * kBlock + (d.upper ? kTileRows : 0);
  const int64_t left = M - row0;
  d.rows = active && left > 0 ? static_cast<int>(left < kTileRows ? left : kTileRows) : 0;
  d.ld = K;
  d.lds = K / kBlock;
  d.lane_in_group = static_cast<int>((col0 / V) % G);
  const int64_t e = row0 * K + col0;
  if (p.row_q) d.row_q = p.row_q + e, d.row_s = p.row_s + row0 * d.lds + col0 / kBlock;
  if (p.col_q) d.col_q = p.col_q + e, d.col_s = p.col_s + band * K + col0;

  const uint8_t* tile = x + (d.rows ? e : 0) * kElemBytes;
  uint4 w[kTileRows];
  load_tile(tile, K * kElemBytes, d.rows, w);
  quantize_tile<T>(w, MemorySource<T>{tile, K}, d, rule);
}

template <InType T>
static const char* launch_typed(cudaStream_t stream, const uint8_t* x, int64_t M, int64_t K,
                                const Planes& p, ScaleRule rule) {
  const int64_t groups = ceil_div(M, kBlock) * (K / Elems<T>::kVec);
  const int64_t blocks = ceil_div(ceil_div(groups, kTileCols) * kGroupLanes, kBlockThreads);
  if (blocks == 0) return nullptr;
  if (!grid_fits(blocks)) return kGridTooLarge;
  clear_pending_error();
  launch_kernel(quantize_kernel<T>, blocks, stream, x, M, K, p, rule);
  return launch_error();
}

const char* launch_quantize(void* stream, InType t, const uint8_t* x, int64_t M, int64_t K,
                            const Planes& p, ScaleRule rule) {
  const auto st = static_cast<cudaStream_t>(stream);
  switch (t) {
    case InType::kF32: return launch_typed<InType::kF32>(st, x, M, K, p, rule);
    case InType::kBF16: return launch_typed<InType::kBF16>(st, x, M, K, p, rule);
    case InType::kF16: return launch_typed<InType::kF16>(st, x, M, K, p, rule);
  }
  return "unknown input type";
}

}  // namespace mxfp8::gpu
