// mxfp8_allgather_rmsnorm_quantize (CPU): all-gather + RMSNorm + MXFP8 quantize, in process.
//
// One custom call per device. The devices of a group meet in an in-process rendezvous keyed by
// (RunId, op_id, rendezvous id), exchange their input buffers, and the rows are read straight from
// the peers' inputs while they are normalized and quantized: there is no separate gather pass.
//
// Operands:
//   x      [rows_max, H] bf16   this device's rows, padded to the largest shard (valid rows first)
//   gamma  [H] bf16             this device's gamma
//   where  [3] s32              (rank within the group, group along the axis, rendezvous id):
//                               the group along the axis selects its row_counts; the
//                               rendezvous id tells apart every group of the whole mesh (it
//                               folds in the device's position along the other mesh axes)
// Results (R = the group's total row count, sum of its ranks' row_counts):
//   normed   [R, H] bf16        bf16_rne((x * inv) * (gamma + weight_offset)), order of numerics.h
//   row_q    [R, H] e4m3        E4M3 codes of normed (or of the unrounded fp32 value), declared
//                               float8_e4m3fn by the Python wrapper
//   row_s    [R, H/32] u8       E8M0 scales
//   col_q    [R, H] e4m3        columnwise codes, or uint8[0] unless columnwise
//   col_s    [R/32, H] u8       columnwise scales, or uint8[0] unless columnwise
//   residual [R, H] bf16        the gathered x, bit for bit
// Attributes:
//   op_id i64               one id per call site (drawn by the Python wrapper at trace time)
//   group_size i64          devices per group
//   row_counts i64[n]       valid rows of every device of the axis (n = n_groups * group_size);
//                           a group's rows are those of its ranks, in rank order
//   eps f32, weight_offset f32, quantize_from_fp32 bool, columnwise bool, scale_rule i32
//   timeout_ms i64          how long a rank waits for its peers before DEADLINE_EXCEEDED;
//                           0 (or a bound past the clock's range): no deadline
//
// The handler is asynchronous (it returns an ffi::Future) and never blocks waiting for peers:
// each rank registers its buffers and its promise and returns. The last rank to arrive does the
// work for the whole group (on the intra-op pool, itself included) and then completes every
// rank's promise, the peers' from pool tasks, since completing a promise runs the rest of that
// device's program inline. A rank's inputs stay alive until its promise completes, so nobody
// reads a freed buffer. A blocking handler would deadlock as soon as one program holds more
// independent gathers than XLA has threads to run them: the ranks that would release the
// waiting ones never start. Ranks that never arrive make the waiting ones fail with
// DEADLINE_EXCEEDED, naming the missing ranks, after timeout_ms.
//
// Devices whose gamma bytes are equal get equal outputs, so each set of them is computed once
// and copied to the others.
#include <cstring>
#include <string>
#include <vector>

#include "cpu/fp_env.h"
#include "cpu/parallel.h"
#include "cpu/rmsnorm_cpu.h"
#include "mxfp8/ffi_util.h"
#include "mxfp8/gather_args.h"
#include "mxfp8/gather_ffi.h"
#include "mxfp8/rendezvous.h"

namespace mxfp8::cpu {
namespace {

// What one device brings to the rendezvous.
struct Arrival {
  const uint16_t* x = nullptr;
  const uint16_t* gamma = nullptr;
  NormOut out;  // with the residual
  ffi::Promise promise;
};

rendezvous::Table<Arrival>& Table() {
  // Leaked on purpose: the watchdog thread and late promise completions may outlive static
  // destruction at process exit.
  static auto* table = new rendezvous::Table<Arrival>(
      kGatherTarget, [](Arrival& a, rendezvous::Failure f, const std::string& why) {
        a.promise.SetError(meeting_error(f, why));
      });
  return *table;
}

// The group's work, run by the last rank to arrive.
void GatherNormQuantize(ffi::ThreadPool& pool, std::vector<Arrival>& ranks,
                        const std::vector<int64_t>& counts, const NormParams& p) {
  const int64_t H = p.H, S = H / kBlock;
  const int n = static_cast<int>(ranks.size());
  std::vector<const uint16_t*> row_src;
  for (int k = 0; k < n; ++k)
    for (int64_t l = 0; l < counts[k]; ++l) row_src.push_back(ranks[k].x + l * H);
  const int64_t R = static_cast<int64_t>(row_src.size());
  if (R == 0) return;

  // Ranks with byte-equal gammas share one computation: leader[k] is the first such rank.
  std::vector<int> leaders, leader(n);
  std::vector<std::vector<float>> g(n);
  for (int k = 0; k < n; ++k) {
    leader[k] = k;
    for (int j : leaders)
      if (std::memcmp(ranks[j].gamma, ranks[k].gamma, static_cast<size_t>(2 * H)) == 0) {
        leader[k] = j;
        break;
      }
    if (leader[k] == k) {
      leaders.push_back(k);
      ScopedIeeeFp ieee;
      g[k] = gamma_plus_offset(ranks[k].gamma, H, p.weight_offset);
    }
  }

  const int64_t rows_per_item =
      p.columnwise ? kBlock : std::max<int64_t>(1, (int64_t{1} << 16) / (2 * H));
  const int64_t items = (R + rows_per_item - 1) / rows_per_item;
  parallel_for(pool, items, 1, [&](int64_t i) {
    ScopedIeeeFp ieee;
    const int64_t r0 = i * rows_per_item, r1 = std::min(R, r0 + rows_per_item);
    for (int k = 0; k < n; ++k)
      for (int64_t r = r0; r < r1; ++r)
        std::memcpy(ranks[k].out.residual + r * H, row_src[r], static_cast<size_t>(2 * H));
    std::vector<uint32_t> scratch(rows_scratch_words(p));
    for (int l : leaders) {
      const NormOut& o = ranks[l].out;
      rmsnorm_quantize_rows_simd(row_src.data(), r0, r1, g[l].data(), p, o, scratch.data());
      for (int k = 0; k < n; ++k) {
        if (k == l || leader[k] != l) continue;
        const NormOut& d = ranks[k].out;
        const size_t rows = static_cast<size_t>(r1 - r0);
        std::memcpy(d.normed + r0 * H, o.normed + r0 * H, rows * H * 2);
        std::memcpy(d.row_q + r0 * H, o.row_q + r0 * H, rows * H);
        std::memcpy(d.row_s + r0 * S, o.row_s + r0 * S, rows * S);
        if (p.columnwise) {
          std::memcpy(d.col_q + r0 * H, o.col_q + r0 * H, rows * H);
          std::memcpy(d.col_s + (r0 / kBlock) * H, o.col_s + (r0 / kBlock) * H, rows / kBlock * H);
        }
      }
    }
  });
}

ffi::Future AllgatherRmsnormQuantize(
    ffi::ThreadPool pool, ffi::RunId run_id, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> gamma,
    ffi::Buffer<ffi::S32> where, ffi::Result<ffi::Buffer<ffi::BF16>> normed,
    ffi::Result<ffi::AnyBuffer> row_q, ffi::Result<ffi::AnyBuffer> row_s,
    ffi::Result<ffi::AnyBuffer> col_q, ffi::Result<ffi::AnyBuffer> col_s,
    ffi::Result<ffi::Buffer<ffi::BF16>> residual, int64_t op_id, int64_t group_size,
    ffi::Span<const int64_t> row_counts, float eps, float weight_offset, bool quantize_from_fp32,
    bool columnwise, int32_t scale_rule, int64_t timeout_ms) {
  // The future must exist before the promise is copied (it checks it is the promise's only one).
  ffi::Promise promise;
  ffi::Future future(promise);

  GatherPlan plan;
  if (ffi::Error e =
          check_gather_args(x, gamma, where, where.typed_data(), group_size, row_counts, columnwise,
                            normed, row_q, row_s, col_q, col_s, residual, &plan);
      e.failure()) {
    promise.SetError(std::move(e));
    return future;
  }
  const int64_t H = plan.H, rank = plan.rank;
  const std::vector<int64_t>& counts = plan.counts;

  const NormParams p =
      norm_params(H, eps, weight_offset, quantize_from_fp32, columnwise, scale_rule);

  Arrival a;
  a.x = reinterpret_cast<const uint16_t*>(x.typed_data());
  a.gamma = reinterpret_cast<const uint16_t*>(gamma.typed_data());
  a.out = norm_outputs(normed, row_q, row_s, col_q, col_s, columnwise);
  a.out.residual = reinterpret_cast<uint16_t*>(residual->typed_data());
  a.promise = promise;

  auto joined = Table().Join(
      rendezvous::Key{run_id.run_id, op_id, plan.rendezvous_id}, static_cast<int>(rank),
      static_cast<int>(group_size),
      gather_signature(plan, eps, weight_offset, quantize_from_fp32, columnwise, scale_rule),
      std::move(a), rendezvous::timeout_from_ms(timeout_ms));
  switch (joined.status) {
    case rendezvous::Status::kWaiting: return future;
    case rendezvous::Status::kFailed: promise.SetError(invalid(joined.error)); return future;
    case rendezvous::Status::kLast: break;
  }
  GatherNormQuantize(pool, joined.arrivals, counts, p);
  for (int64_t k = 0; k < group_size; ++k) {
    if (k == rank) continue;
    pool.Schedule([done = joined.arrivals[k].promise]() mutable { done.SetAvailable(); });
  }
  promise.SetAvailable();
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllgatherRmsnormQuantizeHandler, AllgatherRmsnormQuantize,
                              gather_binding<ffi::ThreadPool>());

}  // namespace mxfp8::cpu
