// mxfp8_quantize_segments (CPU): the MXFP8 planes of one device's packed flat segment, in one call.
//
// A segment holds pieces of several tensors back to back (a QuantizedDBuffer shard). The same
// SPMD program runs on every device, so which piece sits where is data, not code: a descriptor
// table with one row (offset, rows, row_len) per piece, chosen per device by the caller.
//
// Operands: x [S] (f32 / bf16 / f16), desc [P, 3] i64 (or i32: jax without x64 has no i64
//           arrays); a row with rows == 0 is unused.
// Results:  row_q [S], row_s [S/32], col_q [S], col_s [S/32], all u8 (codes too). The piece at
//           `offset` is an [rows, row_len] matrix; its rowwise scales [rows, row_len/32] and
//           columnwise scales [rows/32, row_len] both start at offset/32. Bytes no piece covers
//           are written as 0.
// An unrequested plane is passed as a zero-size result and left alone.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/quantize_cpu.h"
#include "mxfp8/ffi_util.h"
#include "mxfp8/quantize_args.h"
#include "mxfp8/quantize_ffi.h"

namespace mxfp8::cpu {

namespace {

// One unit of parallel work: rows [r0, r1) of the piece at element `offset` with rows of
// `row_len`; row_len == 0 means "write zeros to elements [offset, offset + r1)".
struct Task {
  int64_t offset;
  int64_t row_len;
  int64_t r0;
  int64_t r1;
};

struct Piece {
  int64_t offset, rows, row_len;
};

std::string piece_error(int64_t i, const Piece& p, const char* rule) {
  return "mxfp8_quantize_segments: desc row " + std::to_string(i) + " (offset " +
         std::to_string(p.offset) + ", rows " + std::to_string(p.rows) + ", row_len " +
         std::to_string(p.row_len) + ") " + rule;
}

}  // namespace

static ffi::Error QuantizeSegments(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer desc,
                                   ffi::Result<ffi::AnyBuffer> row_q,
                                   ffi::Result<ffi::AnyBuffer> row_s,
                                   ffi::Result<ffi::AnyBuffer> col_q,
                                   ffi::Result<ffi::AnyBuffer> col_s, int32_t scale_rule,
                                   bool rowwise, bool columnwise) {
  QuantizeSegmentsArgs a;
  ffi::Error e =
      check_quantize_segments_args(x, desc, row_q, row_s, col_q, col_s, rowwise, columnwise, &a);
  if (e.failure()) return e;
  const InType t = a.t;
  const int64_t S = a.S;
  const bool desc64 = a.desc64;
  auto entry = [&](int64_t j) -> int64_t {
    return desc64 ? static_cast<const int64_t*>(desc.untyped_data())[j]
                  : static_cast<const int32_t*>(desc.untyped_data())[j];
  };

  // The descriptors are checked here only so that a wrong table cannot write out of bounds.
  std::vector<Piece> pieces;
  for (int64_t i = 0; i < a.P; ++i) {
    const Piece p{entry(3 * i), entry(3 * i + 1), entry(3 * i + 2)};
    if (p.rows == 0) continue;
    if (p.rows < 0 || p.row_len <= 0 || p.row_len % kBlock || p.rows % kBlock)
      return invalid(piece_error(i, p, "needs rows and row_len positive multiples of 32"));
    if (p.offset < 0 || p.offset % kBlock || p.rows > (S - p.offset) / p.row_len)
      return invalid(
          piece_error(i, p, "must start at a multiple of 32 and lie inside the segment"));
    pieces.push_back(p);
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.offset < b.offset; });

  // ~64 KiB of input per task; gaps (padding) become zero-fill tasks.
  const int64_t elem = t == InType::kF32 ? 4 : 2;
  std::vector<Task> tasks;
  int64_t covered = 0;
  auto zero_fill = [&](int64_t b, int64_t e) {
    if (e > b) tasks.push_back({b, 0, 0, e - b});
  };
  for (const Piece& p : pieces) {
    if (p.offset < covered) return invalid("mxfp8_quantize_segments: desc pieces overlap");
    zero_fill(covered, p.offset);
    const int64_t band_bytes = kBlock * p.row_len * elem;
    const int64_t rows_per_task = kBlock * std::max<int64_t>(1, (1 << 16) / band_bytes);
    for (int64_t r = 0; r < p.rows; r += rows_per_task)
      tasks.push_back({p.offset, p.row_len, r, std::min(p.rows, r + rows_per_task)});
    covered = p.offset + p.rows * p.row_len;
  }
  zero_fill(covered, S);

  const Planes whole = requested_planes(rowwise, columnwise, row_q, row_s, col_q, col_s);
  const bool stream = (int64_t{rowwise} + int64_t{columnwise}) * S >= kStreamBytes;
  const ScaleRule rule = static_cast<ScaleRule>(scale_rule);
  const auto* xb = static_cast<const uint8_t*>(x.untyped_data());
  parallel_for(pool, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i) {
    const Task& k = tasks[i];
    if (k.row_len == 0) {  // zero-fill [offset, offset + r1) and its scale bytes
      const int64_t b = k.offset, len = k.r1;
      for (uint8_t* q : {whole.row_q, whole.col_q})
        if (q) std::memset(q + b, 0, len);
      for (uint8_t* s : {whole.row_s, whole.col_s})
        if (s) std::memset(s + b / kBlock, 0, len / kBlock);
      return;
    }
    Planes p;
    const int64_t o = k.offset, os = k.offset / kBlock;
    if (whole.row_q) p.row_q = whole.row_q + o, p.row_s = whole.row_s + os;
    if (whole.col_q) p.col_q = whole.col_q + o, p.col_s = whole.col_s + os;
    // the piece as an [rows, row_len] matrix, through the per-ISA builds of the quantize loop
    quantize_rows_simd(t, xb + o * elem, k.r0, k.r1, k.row_len, p, rule, stream);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeSegmentsHandler, QuantizeSegments,
                              quantize_segments_binding<ffi::ThreadPool>());

}  // namespace mxfp8::cpu
