// mxfp8_quantize_segments (CUDA / ROCm): the MXFP8 planes of one device's packed flat segment,
// in one kernel. The FFI handler (handlers.cc) takes the operands, results and attributes of the
// CPU one (cpu/quantize_segments.cc):
//
// Operands: x [S] (f32 / bf16 / f16), desc [P, 3] i64 or i32 rows (offset, rows, row_len);
//           a row with rows == 0 is unused.
// Results:  row_q [S], row_s [S/32], col_q [S], col_s [S/32], all u8 (codes too). The piece at
//           `offset` is an [rows, row_len] matrix; its rowwise scales [rows, row_len/32] and
//           columnwise scales [rows/32, row_len] both start at offset/32. Bytes no piece covers
//           are written as 0.
// Attributes: scale_rule i32, rowwise bool, columnwise bool.
//
// The descriptor table lives on the device (it is data chosen per device under SPMD), so the
// host never reads it. Two kernels:
//   - pieces: the column groups (32 rows x V columns, two lanes each: tile.cuh) of all pieces
//     are numbered piece after piece in table order; each thread block walks the table in
//     chunks (a prefix sum of group counts in shared memory) to find the piece of each of its
//     groups. A piece has (rows / 32) * (row_len / V) groups, a multiple of G, so the G lanes of
//     a rowwise block always share a piece and a row.
//   - gaps: one thread per 32 elements of the segment writes zero codes and a zero scale where
//     no piece covers them (piece bounds fall on multiples of 32).
//
// The Python wrapper validates the table; here an entry that breaks the rules above (or would
// reach past the segment) is ignored, so a bad table can never write out of bounds.
#include "gpu/tile.cuh"

namespace mxfp8::gpu {

namespace {

using SegmentPlanes = Planes;

struct Piece {
  int64_t offset, rows, row_len;
  __device__ int64_t end() const { return offset + rows * row_len; }
};

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
         p.offset >= 0 && p.offset % kBlock == 0 && p.offset <= S &&
         p.rows <= (S - p.offset) / p.row_len;
}

constexpr int kChunk = kBlockThreads;  // table entries staged per step

}  // namespace

template <InType T>
__global__ void __launch_bounds__(kBlockThreads)
    segment_pieces_kernel(const uint8_t* x, int64_t S, const void* desc, bool desc64, int64_t P,
                          SegmentPlanes p, ScaleRule rule) {
  constexpr int V = Elems<T>::kVec, G = kBlock / V;
  constexpr int64_t kElemBytes = 16 / V;
  __shared__ Piece chunk[kChunk];
  __shared__ int64_t first[kChunk + 1];  // group number of each staged piece's first group

  const int tid = thread_in_block();
  const int lane = tid % kGroupLanes;
  const bool upper = lane >= kTileCols;
  const int64_t g =
      (block_index() * kBlockThreads + tid) / kGroupLanes * kTileCols + lane % kTileCols;

  // Find the piece of group g: table chunk by chunk, a prefix sum of group counts.
  Piece mine{0, 0, 0};
  int64_t mine_first = 0;
  int64_t base = 0;
  for (int64_t c0 = 0; c0 < P; c0 += kChunk) {
    const int64_t i = c0 + tid;
    Piece q{0, 0, 0};
    if (i < P) {
      q = read_piece(desc, desc64, i);
      if (!piece_ok(q, S)) q = Piece{0, 0, 0};
    }
    chunk[tid] = q;
    // first[k + 1] = base + the group counts of pieces 0..k: an inclusive scan over the block
    // (log2(kChunk) steps of every thread, where one thread once summed kChunk entries).
    int64_t sum = q.rows / kBlock * (q.row_len / V);
#pragma unroll
    for (int s = 1; s < kChunk; s <<= 1) {
      first[tid + 1] = sum;
      block_sync();
      if (tid >= s) sum += first[tid + 1 - s];
      block_sync();
    }
    first[tid + 1] = base + sum;
    if (tid == 0) first[0] = base;
    block_sync();
    if (g >= first[0] && g < first[kChunk]) {  // binary search: last k with first[k] <= g
      int lo = 0, hi = kChunk - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= g) lo = mid;
        else hi = mid - 1;
      }
      mine = chunk[lo];
      mine_first = first[lo];
    }
    base = first[kChunk];
    block_sync();
  }

  TileDst d;
  d.upper = upper;
  d.row_q = p.row_q, d.row_s = p.row_s, d.col_q = p.col_q, d.col_s = p.col_s;
  uint4 w[kTileRows];
  MemorySource<T> src{x, 0};
  if (mine.rows > 0) {
    const int64_t per_band = mine.row_len / V;
    const int64_t local = g - mine_first;
    const int64_t band = local / per_band;
    const int64_t col0 = (local - band * per_band) * V;
    const int64_t row0 = band * kBlock + (upper ? kTileRows : 0);  // row in the piece
    const int64_t e = mine.offset + row0 * mine.row_len + col0;     // tile's first element
    d.rows = kTileRows;
    d.ld = mine.row_len;
    d.lds = mine.row_len / kBlock;
    d.lane_in_group = static_cast<int>((col0 / V) % G);
    const int64_t s0 = mine.offset / kBlock;  // the piece's scales start here
    if (p.row_q) d.row_q = p.row_q + e, d.row_s = p.row_s + s0 + row0 * d.lds + col0 / kBlock;
    if (p.col_q) d.col_q = p.col_q + e, d.col_s = p.col_s + s0 + band * mine.row_len + col0;
    src = MemorySource<T>{x + e * kElemBytes, mine.row_len};
    load_tile(src.p, mine.row_len * kElemBytes, kTileRows, w);
  } else {
    load_tile(x, 0, 0, w);
  }
  quantize_tile<T>(w, src, d, rule);  // every lane takes part in the exchanges
}

// Zero codes and scales for the 32-element blocks of the segment that no piece covers.
__global__ void __launch_bounds__(kBlockThreads)
    segment_gaps_kernel(int64_t S, const void* desc, bool desc64, int64_t P, SegmentPlanes p) {
  constexpr int kMaxPieces = kBlockThreads * kBlock / 1024 + 2;  // pieces are >= 1024 elements
  __shared__ Piece near[kMaxPieces];
  __shared__ int count;
  const int tid = thread_in_block();
  const int64_t lo = block_index() * kBlockThreads * kBlock, hi = lo + kBlockThreads * kBlock;
  if (tid == 0) count = 0;
  block_sync();
  for (int64_t i = tid; i < P; i += kBlockThreads) {
    const Piece q = read_piece(desc, desc64, i);
    if (!piece_ok(q, S) || q.offset >= hi || q.end() <= lo) continue;
    const int slot = atomicAdd(&count, 1);
    if (slot < kMaxPieces) near[slot] = q;  // more only with overlapping (invalid) tables
  }
  block_sync();
  const int n = count < kMaxPieces ? count : kMaxPieces;
  const int64_t pos = lo + static_cast<int64_t>(tid) * kBlock;
  if (pos >= S) return;
  for (int j = 0; j < n; ++j)
    if (near[j].offset <= pos && pos < near[j].end()) return;
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (uint8_t* q : {p.row_q, p.col_q})
    if (q) reinterpret_cast<uint4*>(q + pos)[0] = z, reinterpret_cast<uint4*>(q + pos)[1] = z;
  for (uint8_t* s : {p.row_s, p.col_s})
    if (s) s[pos / kBlock] = 0;
}

template <InType T>
static const char* launch_segments(cudaStream_t stream, const uint8_t* x, int64_t S,
                                   const void* desc, bool desc64, int64_t P, const SegmentPlanes& p,
                                   ScaleRule rule) {
  // Pieces are disjoint, so they hold at most S / (32 * V) groups.
  const int64_t groups = S / (kBlock * Elems<T>::kVec);
  const int64_t blocks = ceil_div(ceil_div(groups, kTileCols) * kGroupLanes, kBlockThreads);
  const int64_t gap_blocks = ceil_div(S / kBlock, kBlockThreads);
  if (!grid_fits(blocks) || !grid_fits(gap_blocks)) return kGridTooLarge;
  clear_pending_error();
  if (blocks > 0)
    launch_kernel(segment_pieces_kernel<T>, blocks, stream, x, S, desc, desc64, P, p, rule);
  if (gap_blocks > 0) launch_kernel(segment_gaps_kernel, gap_blocks, stream, S, desc, desc64, P, p);
  return launch_error();
}

const char* launch_quantize_segments(void* stream, InType t, const uint8_t* x, int64_t S,
                                     const void* desc, bool desc64, int64_t P, const Planes& p,
                                     ScaleRule rule) {
  const auto st = static_cast<cudaStream_t>(stream);
  switch (t) {
    case InType::kF32: return launch_segments<InType::kF32>(st, x, S, desc, desc64, P, p, rule);
    case InType::kBF16: return launch_segments<InType::kBF16>(st, x, S, desc, desc64, P, p, rule);
    case InType::kF16: return launch_segments<InType::kF16>(st, x, S, desc, desc64, P, p, rule);
  }
  return "unknown input type";
}

}  // namespace mxfp8::gpu
