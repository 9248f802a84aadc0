// The arguments of mxfp8_allgather_rmsnorm_quantize as one device's call sees them: checked the
// same way, with the same messages, by the CPU handler (cpu/allgather.cc) and the GPU one
// (gpu/handlers.cc), and turned into the group's row counts and the signature that the devices
// of a group compare when they meet. Standard C++ only (no XLA type): each handler reads the
// sizes off its own buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "mxfp8/numerics.h"

namespace mxfp8 {

// What a handler reads off its operands, results and attributes.
struct GatherArgs {
  size_t x_rank = 0;               // rank of x (must be 2)
  int64_t x_rows = 0, x_cols = 0;  // its dimensions when 2-D
  size_t gamma_elements = 0;
  size_t where_elements = 0;
  const int32_t* where = nullptr;  // host copy of `where`, read only when it has 3 elements
  int64_t group_size = 0;
  const int64_t* row_counts = nullptr;
  size_t n_row_counts = 0;
  bool columnwise = false;
  size_t normed_elements = 0, residual_elements = 0;
  size_t row_q_bytes = 0, row_s_bytes = 0, col_q_bytes = 0, col_s_bytes = 0;
};

// GatherArgs from a handler's XLA FFI operands and results (duck-typed, so that this header
// needs no XLA include): both handlers read their buffers through this one function.
// where_host is the host copy of `where`'s values (the GPU handler copies them from the device).
template <typename Buffer, typename Where, typename Counts, typename NormedResult,
          typename PlaneResult>
GatherArgs read_gather_args(const Buffer& x, const Buffer& gamma, const Where& where,
                            const int32_t* where_host, int64_t group_size, const Counts& row_counts,
                            bool columnwise, NormedResult& normed, PlaneResult& row_q,
                            PlaneResult& row_s, PlaneResult& col_q, PlaneResult& col_s,
                            NormedResult& residual) {
  GatherArgs a;
  const auto dims = x.dimensions();
  a.x_rank = dims.size();
  if (dims.size() == 2) a.x_rows = dims[0], a.x_cols = dims[1];
  a.gamma_elements = gamma.element_count();
  a.where_elements = where.element_count();
  a.where = where_host;
  a.group_size = group_size;
  a.row_counts = row_counts.begin();
  a.n_row_counts = row_counts.size();
  a.columnwise = columnwise;
  a.normed_elements = normed->element_count();
  a.residual_elements = residual->element_count();
  a.row_q_bytes = row_q->size_bytes();
  a.row_s_bytes = row_s->size_bytes();
  a.col_q_bytes = col_q->size_bytes();
  a.col_s_bytes = col_s->size_bytes();
  return a;
}

// One device's view of its group.
struct GatherPlan {
  int64_t rows_max = 0;          // rows of x (valid ones first)
  int64_t H = 0;
  int64_t rank = 0;              // within the group
  int64_t group = 0;             // along the axis: selects the group's row counts
  int64_t rendezvous_id = 0;     // tells apart every group of the mesh
  std::vector<int64_t> counts;   // valid rows of each rank of the group
  int64_t R = 0;                 // the group's rows: sum of counts
};

// "" when the call is well formed (and *plan is filled in), else the rule it breaks.
inline std::string plan_gather(const GatherArgs& a, GatherPlan* plan) {
  if (a.x_rank != 2) return "x must be [rows, H]";
  const int64_t rows_max = a.x_rows, H = a.x_cols;
  if (H % kBlock) return "H must be a multiple of 32";
  if (a.gamma_elements != static_cast<size_t>(H)) return "gamma must be [H]";
  if (a.where_elements != 3 || a.where == nullptr)
    return "where must be [3] (rank, group, rendezvous id)";
  const int64_t rank = a.where[0], group = a.where[1];
  const int64_t n_all = static_cast<int64_t>(a.n_row_counts);
  if (a.group_size < 1 || n_all % a.group_size) return "row_counts must cover whole groups";
  if (rank < 0 || rank >= a.group_size || group < 0 || group >= n_all / a.group_size)
    return "rank or group out of range";
  std::vector<int64_t> counts(a.row_counts + group * a.group_size,
                              a.row_counts + (group + 1) * a.group_size);
  int64_t R = 0;
  for (int64_t c : counts) {
    if (c < 0 || c > rows_max) return "a row count exceeds the rows of x";
    R += c;
  }
  if (a.columnwise && R % kBlock) return "R must be a multiple of 32 for columnwise output";
  const size_t n = static_cast<size_t>(R * H);
  if (a.normed_elements != n || a.residual_elements != n || a.row_q_bytes != n ||
      a.row_s_bytes != n / kBlock ||
      (a.columnwise && (a.col_q_bytes != n || a.col_s_bytes != n / kBlock)))
    return "result sizes do not match the group's rows";
  plan->rows_max = rows_max;
  plan->H = H;
  plan->rank = rank;
  plan->group = group;
  plan->rendezvous_id = a.where[2];
  plan->counts = std::move(counts);
  plan->R = R;
  return "";
}

// What every device of a group must agree on (compared when they meet): shapes, the group's row
// counts and the numerics options, floats by their bits.
inline std::string gather_signature(const GatherPlan& p, float eps, float weight_offset,
                                    bool quantize_from_fp32, bool columnwise, int32_t scale_rule) {
  const auto float_bits = [](float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
  };
  std::ostringstream s;
  s << "x [" << p.rows_max << ", " << p.H << "], row counts (";
  for (size_t k = 0; k < p.counts.size(); ++k) s << (k ? ", " : "") << p.counts[k];
  s << "), eps bits " << float_bits(eps) << ", weight_offset bits " << float_bits(weight_offset)
    << ", quantize_from_fp32 " << quantize_from_fp32 << ", columnwise " << columnwise
    << ", scale_rule " << scale_rule;
  return s.str();
}

}  // namespace mxfp8
