// mxfp8_quantize_segments (CUDA / ROCm): the MXFP8 planes of one device's packed flat segment,
// in one kernel. Operands, results and attributes as the CPU handler (cpu/quantize_segments.cc):
//
// Operands: x [S] (f32 / bf16 / f16), desc [P, 3] i64 or i32 rows (offset, rows, row_len);
//           a row with rows == 0 is unused.
// Results:  row_q [S], row_s [S/32], col_q [S], col_s [S/32] (u8). The piece at `offset` is an
//           [rows, row_len] matrix; its rowwise scales [rows, row_len/32] and columnwise scales
//           [rows/32, row_len] both start at offset/32. Bytes no piece covers are written as 0.
// Attributes: scale_rule i32, rowwise bool, columnwise bool.
//
// The descriptor table lives on the device (it is data chosen per device under SPMD), so the
// host never reads it. Tiles map one to one onto the segment: a piece of E elements is E / C
// tiles of C = 32 * V elements (its rows are multiples of 32 and its offset a multiple of
// 32 * row_len), so tile t covers segment elements [t*C, (t+1)*C) whichever piece holds them,
// and a tile in no piece zero-fills that range and its scale bytes. Each thread block first
// collects the pieces that meet its range into shared memory.
//
// The Python wrapper validates the table; here an entry that breaks the rules above (or would
// reach past the segment) is ignored, so a bad table can never write out of bounds.
#include "cuda/tile.cuh"

namespace mxfp8::gpu {

namespace {

struct SegmentPlanes {
  uint8_t* row_q;
  uint8_t* row_s;
  uint8_t* col_q;
  uint8_t* col_s;
};

struct Piece {
  int64_t offset, rows, row_len;
};

// At most this many pieces meet one block's range (pieces are >= 1024 elements and disjoint, a
// block covers (threads / 2) * C elements); extra entries (overlapping tables) are dropped.
constexpr int kMaxPiecesPerBlock = kBlockThreads / 2 * kBlock * 8 / 1024 + 2;

__device__ Piece read_piece(const void* desc, bool desc64, int64_t i) {
  if (desc64) {
    const int64_t* d = static_cast<const int64_t*>(desc) + 3 * i;
    return {d[0], d[1], d[2]};
  }
  const int32_t* d = static_cast<const int32_t*>(desc) + 3 * i;
  return {d[0], d[1], d[2]};
}

__device__ bool piece_ok(const Piece& p, int64_t S) {
  return p.rows > 0 && p.row_len > 0 && p.row_len % kBlock == 0 && p.rows % kBlock == 0 &&
         p.offset >= 0 && p.offset % (kBlock * p.row_len) == 0 && p.offset <= S &&
         p.rows <= (S - p.offset) / p.row_len;
}

// Writes zero codes and scales for segment elements [b, e) (b a multiple of 32).
__device__ void zero_fill(const SegmentPlanes& p, int64_t b, int64_t e) {
  for (uint8_t* q : {p.row_q, p.col_q})
    if (q)
      for (int64_t i = b; i < e; ++i) q[i] = 0;
  for (uint8_t* s : {p.row_s, p.col_s})
    if (s)
      for (int64_t i = b / kBlock; i < e / kBlock; ++i) s[i] = 0;
}

// Zero codes for elements [b, b + n) (n a multiple of 16, b aligned to 16) of the code planes.
__device__ __forceinline__ void zero_codes(const SegmentPlanes& p, int64_t b, int n) {
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (uint8_t* q : {p.row_q, p.col_q})
    if (q)
      for (int i = 0; i < n; i += 16) *reinterpret_cast<uint4*>(q + b + i) = z;
}

}  // namespace

// Column groups (32 rows x V columns, two lanes each: tile.cuh) map one to one onto segment
// chunks of C = 32 * V elements. Planes with null pointers in p are skipped.
template <InType T>
__global__ void __launch_bounds__(kBlockThreads)
    quantize_segments_kernel(const uint8_t* x, int64_t S, const void* desc, bool desc64,
                             int64_t P, SegmentPlanes p, ScaleRule rule) {
  constexpr int V = Elems<T>::kVec, G = kBlock / V, C = kBlock * V;
  constexpr int64_t kElemBytes = 16 / V;
  constexpr int kGroupsPerBlock = kBlockThreads / 2;
  __shared__ Piece pieces[kMaxPiecesPerBlock];
  __shared__ int count;

  const int tid = thread_in_block();
  const int64_t lo = block_index() * kGroupsPerBlock * C, hi = lo + kGroupsPerBlock * C;
  if (tid == 0) count = 0;
  block_sync();
  for (int64_t i = tid; i < P; i += kBlockThreads) {
    const Piece q = read_piece(desc, desc64, i);
    if (!piece_ok(q, S) || q.offset >= hi || q.offset + q.rows * q.row_len <= lo) continue;
    const int slot = atomicAdd(&count, 1);
    if (slot < kMaxPiecesPerBlock) pieces[slot] = q;
  }
  block_sync();
  const int n = count < kMaxPiecesPerBlock ? count : kMaxPiecesPerBlock;

  const int lane = tid % kGroupLanes;
  const bool upper = lane >= kTileCols;
  const int64_t pos = lo + ((tid / kGroupLanes) * kTileCols + lane % kTileCols) * C;
  int found = -1;
  for (int j = 0; j < n && found < 0; ++j)
    if (pieces[j].offset <= pos && pos < pieces[j].offset + pieces[j].rows * pieces[j].row_len)
      found = j;

  // Lanes without a piece keep the plane bases (rows = 0): the planes' presence is uniform.
  TileDst d;
  d.upper = upper;
  d.row_q = p.row_q, d.row_s = p.row_s, d.col_q = p.col_q, d.col_s = p.col_s;
  uint4 w[kTileRows];
  MemorySource<T> src{x, 0};
  if (found >= 0) {
    const Piece q = pieces[found];
    const int64_t per_band = q.row_len / V;
    const int64_t local = (pos - q.offset) / C;
    const int64_t band = local / per_band;
    const int64_t col0 = (local - band * per_band) * V;
    const int64_t row0 = band * kBlock + (upper ? kTileRows : 0);  // row in the piece
    const int64_t e = q.offset + row0 * q.row_len + col0;         // tile's first element
    d.rows = kTileRows;
    d.ld = q.row_len;
    d.lds = q.row_len / kBlock;
    d.lane_in_group = static_cast<int>((col0 / V) % G);
    const int64_t s0 = q.offset / kBlock;  // the piece's scales start here
    if (p.row_q) d.row_q = p.row_q + e, d.row_s = p.row_s + s0 + row0 * d.lds + col0 / kBlock;
    if (p.col_q) d.col_q = p.col_q + e, d.col_s = p.col_s + s0 + band * q.row_len + col0;
    src = MemorySource<T>{x + e * kElemBytes, q.row_len};
    load_tile(src.p, q.row_len * kElemBytes, kTileRows, w);
  } else {
    load_tile(x, 0, 0, w);
    if (pos + C <= S) {  // each lane of the pair clears half the codes, the lower the scales
      zero_codes(p, pos + (upper ? C / 2 : 0), C / 2);
      const uint32_t zs[V / 4] = {};
      if (!upper)
        for (uint8_t* s : {p.row_s, p.col_s})
          if (s) store_codes<V>(s + pos / kBlock, zs);
    } else if (pos < S && !upper) {
      zero_fill(p, pos, S);
    }
  }
  quantize_tile<T>(w, src, d, rule);  // every lane takes part in the exchanges
}

template <InType T>
static void launch_segments(cudaStream_t stream, const uint8_t* x, int64_t S, const void* desc,
                            bool desc64, int64_t P, const SegmentPlanes& p, ScaleRule rule) {
  const int64_t groups = ceil_div(S, kBlock * Elems<T>::kVec);
  const int64_t blocks = ceil_div(groups, kBlockThreads / 2);
  quantize_segments_kernel<T><<<blocks, kBlockThreads, 0, stream>>>(x, S, desc, desc64, P, p, rule);
}

static ffi::Error QuantizeSegments(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer desc,
                                   ffi::Result<ffi::AnyBuffer> row_q,
                                   ffi::Result<ffi::AnyBuffer> row_s,
                                   ffi::Result<ffi::AnyBuffer> col_q,
                                   ffi::Result<ffi::AnyBuffer> col_s, int32_t scale_rule,
                                   bool rowwise, bool columnwise) {
  InType t;
  if (!input_type(x.element_type(), &t))
    return invalid("mxfp8_quantize_segments: input must be f32, bf16 or f16");
  if (x.dimensions().size() != 1) return invalid("mxfp8_quantize_segments: x must be 1-D");
  const int64_t S = static_cast<int64_t>(x.element_count());
  if (S % kBlock)
    return invalid("mxfp8_quantize_segments: segment length must be a multiple of 32");
  const auto ddims = desc.dimensions();
  if (ddims.size() != 2 || ddims[1] != 3)
    return invalid("mxfp8_quantize_segments: desc must have shape [P, 3]");
  const bool desc64 = desc.element_type() == ffi::DataType::S64;
  if (!desc64 && desc.element_type() != ffi::DataType::S32)
    return invalid("mxfp8_quantize_segments: desc must be int64 or int32");
  const size_t n = static_cast<size_t>(S);
  if ((rowwise && (row_q->size_bytes() != n || row_s->size_bytes() != n / kBlock)) ||
      (columnwise && (col_q->size_bytes() != n || col_s->size_bytes() != n / kBlock)))
    return invalid("mxfp8_quantize_segments: result sizes do not match the segment");
  if (S == 0 || !(rowwise || columnwise)) return ffi::Error::Success();

  SegmentPlanes p{rowwise ? bytes(row_q) : nullptr, rowwise ? bytes(row_s) : nullptr,
                  columnwise ? bytes(col_q) : nullptr, columnwise ? bytes(col_s) : nullptr};
  const auto* xp = static_cast<const uint8_t*>(x.untyped_data());
  const int64_t P = ddims[0];
  const ScaleRule rule = static_cast<ScaleRule>(scale_rule);
  const void* dp = desc.untyped_data();
  switch (t) {
    case InType::kF32: launch_segments<InType::kF32>(stream, xp, S, dp, desc64, P, p, rule); break;
    case InType::kBF16: launch_segments<InType::kBF16>(stream, xp, S, dp, desc64, P, p, rule); break;
    case InType::kF16: launch_segments<InType::kF16>(stream, xp, S, dp, desc64, P, p, rule); break;
  }
  return launch_status("mxfp8_quantize_segments");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeSegmentsHandler, QuantizeSegments,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("scale_rule")
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("columnwise"));

}  // namespace mxfp8::gpu
