// mxfp8_quantize (CUDA / ROCm): rowwise and/or columnwise planes of an [M, K] input in one
// pass over it. Operands, results and attributes as the CPU handler (cpu/quantize.cc):
//
// Operands: x [..., K] (f32 / bf16 / f16; leading axes are rows).
// Results:  rowwise_data [M, K] u8, rowwise_scale [M, K/32] u8,
//           columnwise_data [M, K] u8, columnwise_scale [M/32, K] u8.
// Attributes: scale_rule i32 (0 rceil, 1 floor), rowwise bool, columnwise bool.
// An unrequested plane is passed as a zero-size result and left alone.
#include "cuda/tile.cuh"

namespace mxfp8::gpu {

struct QuantizePlanes {
  uint8_t* row_q;
  uint8_t* row_s;
  uint8_t* col_q;
  uint8_t* col_s;
};

// Column groups (32 rows x V columns, two lanes each: tile.cuh) are numbered band-major.
// Planes with null pointers in p are skipped.
template <InType T>
__global__ void __launch_bounds__(kBlockThreads)
    quantize_kernel(const uint8_t* x, int64_t M, int64_t K, QuantizePlanes p, ScaleRule rule) {
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
static void launch_quantize(cudaStream_t stream, const uint8_t* x, int64_t M, int64_t K,
                            const QuantizePlanes& p, ScaleRule rule) {
  const int64_t groups = ceil_div(M, kBlock) * (K / Elems<T>::kVec);
  const int64_t blocks = ceil_div(ceil_div(groups, kTileCols) * kGroupLanes, kBlockThreads);
  quantize_kernel<T><<<blocks, kBlockThreads, 0, stream>>>(x, M, K, p, rule);
}

static ffi::Error Quantize(cudaStream_t stream, ffi::AnyBuffer x,
                           ffi::Result<ffi::AnyBuffer> row_q, ffi::Result<ffi::AnyBuffer> row_s,
                           ffi::Result<ffi::AnyBuffer> col_q, ffi::Result<ffi::AnyBuffer> col_s,
                           int32_t scale_rule, bool rowwise, bool columnwise) {
  InType t;
  if (!input_type(x.element_type(), &t))
    return invalid("mxfp8_quantize: input must be f32, bf16 or f16");
  const auto dims = x.dimensions();
  if (dims.size() < 2) return invalid("mxfp8_quantize: input must have rank >= 2");
  const int64_t K = dims.back();
  const int64_t M = static_cast<int64_t>(x.element_count()) / (K ? K : 1);
  if (K % kBlock) return invalid("mxfp8_quantize: K must be a multiple of 32");
  if (columnwise && M % kBlock) return invalid("mxfp8_quantize: M must be a multiple of 32");
  const size_t n = static_cast<size_t>(M * K);
  if ((rowwise && (row_q->size_bytes() != n || row_s->size_bytes() != n / kBlock)) ||
      (columnwise && (col_q->size_bytes() != n || col_s->size_bytes() != n / kBlock)))
    return invalid("mxfp8_quantize: result sizes do not match the input");
  if (n == 0 || !(rowwise || columnwise)) return ffi::Error::Success();

  QuantizePlanes p{rowwise ? bytes(row_q) : nullptr, rowwise ? bytes(row_s) : nullptr,
                   columnwise ? bytes(col_q) : nullptr, columnwise ? bytes(col_s) : nullptr};
  const auto* xp = static_cast<const uint8_t*>(x.untyped_data());
  const ScaleRule rule = static_cast<ScaleRule>(scale_rule);
  switch (t) {
    case InType::kF32: launch_quantize<InType::kF32>(stream, xp, M, K, p, rule); break;
    case InType::kBF16: launch_quantize<InType::kBF16>(stream, xp, M, K, p, rule); break;
    case InType::kF16: launch_quantize<InType::kF16>(stream, xp, M, K, p, rule); break;
  }
  return launch_status("mxfp8_quantize");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeHandler, Quantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("scale_rule")
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("columnwise"));

}  // namespace mxfp8::gpu
