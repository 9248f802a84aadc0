// The XLA FFI handlers of the GPU modules (_mxfp8_cuda, and _mxfp8_rocm from the same source):
// decode and check the buffers, then call the kernel launchers of launch.h. Host C++ only; the
// stream arrives as the platform's opaque stream pointer (cudaStream_t or hipStream_t).
//
// Operands, results and attributes are those of the CPU handlers (xla_ffi/README.md).
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/launch.h"
#include "mxfp8/ffi_util.h"
#include "mxfp8/gather_args.h"
#include "mxfp8/gather_ffi.h"
#include "mxfp8/quantize_args.h"
#include "mxfp8/quantize_ffi.h"
#include "mxfp8/rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace mxfp8::gpu {
namespace {

// A launcher's result (nullptr or the runtime's message) as the handler's status.
ffi::Error status(const char* target, const char* launch_error) {
  if (launch_error == nullptr) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(target) + ": kernel launch failed: " + launch_error);
}

ffi::Error Quantize(void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> row_q,
                    ffi::Result<ffi::AnyBuffer> row_s, ffi::Result<ffi::AnyBuffer> col_q,
                    ffi::Result<ffi::AnyBuffer> col_s, int32_t scale_rule, bool rowwise,
                    bool columnwise) {
  QuantizeArgs a;
  ffi::Error e = check_quantize_args(x, row_q, row_s, col_q, col_s, rowwise, columnwise, &a);
  if (e.failure()) return e;
  if (a.n == 0 || !(rowwise || columnwise)) return ffi::Error::Success();
  const Planes p = requested_planes(rowwise, columnwise, row_q, row_s, col_q, col_s);
  return status("mxfp8_quantize",
                launch_quantize(stream, a.t, static_cast<const uint8_t*>(x.untyped_data()), a.M,
                                a.K, p, static_cast<ScaleRule>(scale_rule)));
}

ffi::Error QuantizeTiles(void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                         ffi::Result<ffi::AnyBuffer> s, int32_t scale_rule) {
  QuantizeTilesArgs a;
  ffi::Error e = check_quantize_tiles_args(x, q, s, &a);
  if (e.failure()) return e;
  if (a.n == 0) return ffi::Error::Success();
  return status(
      "mxfp8_quantize_tiles",
      launch_quantize_tiles(stream, a.t, static_cast<const uint8_t*>(x.untyped_data()), a.M, a.K,
                            bytes(q), bytes(s), static_cast<ScaleRule>(scale_rule)));
}

ffi::Error QuantizeSegments(void* stream, ffi::AnyBuffer x, ffi::AnyBuffer desc,
                            ffi::Result<ffi::AnyBuffer> row_q, ffi::Result<ffi::AnyBuffer> row_s,
                            ffi::Result<ffi::AnyBuffer> col_q, ffi::Result<ffi::AnyBuffer> col_s,
                            int32_t scale_rule, bool rowwise, bool columnwise) {
  QuantizeSegmentsArgs a;
  ffi::Error e =
      check_quantize_segments_args(x, desc, row_q, row_s, col_q, col_s, rowwise, columnwise, &a);
  if (e.failure()) return e;
  if (a.S == 0 || !(rowwise || columnwise)) return ffi::Error::Success();
  const Planes p = requested_planes(rowwise, columnwise, row_q, row_s, col_q, col_s);
  return status("mxfp8_quantize_segments",
                launch_quantize_segments(stream, a.t, static_cast<const uint8_t*>(x.untyped_data()),
                                         a.S, desc.untyped_data(), a.desc64, a.P, p,
                                         static_cast<ScaleRule>(scale_rule)));
}

ffi::Error RmsnormQuantize(void* stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> gamma,
                           ffi::Result<ffi::Buffer<ffi::BF16>> normed,
                           ffi::Result<ffi::AnyBuffer> row_q, ffi::Result<ffi::AnyBuffer> row_s,
                           ffi::Result<ffi::AnyBuffer> col_q, ffi::Result<ffi::AnyBuffer> col_s,
                           float eps, float weight_offset, bool quantize_from_fp32, bool columnwise,
                           int32_t scale_rule) {
  RmsnormQuantizeArgs a;
  ffi::Error e =
      check_rmsnorm_quantize_args(x, gamma, normed, row_q, row_s, col_q, col_s, columnwise, &a);
  if (e.failure()) return e;
  if (a.n == 0) return ffi::Error::Success();

  const NormParams prm =
      norm_params(a.H, eps, weight_offset, quantize_from_fp32, columnwise, scale_rule);
  const NormOut o = norm_outputs(normed, row_q, row_s, col_q, col_s, columnwise);
  return status(
      "mxfp8_rmsnorm_quantize",
      launch_rmsnorm_quantize(stream, reinterpret_cast<const uint16_t*>(x.typed_data()),
                              reinterpret_cast<const uint16_t*>(gamma.typed_data()), a.R, prm, o));
}

// ---------------------------------------------------------------------------------------------
// mxfp8_allgather_rmsnorm_quantize (experimental; see xla_ffi/README.md).
//
// Every device of a group runs the kernel for the whole group, reading the peers' rows straight
// from their inputs over peer access. XLA runs the program of each device of a single-process
// multi-GPU run on that device's own host thread, so the handler may block while its peers
// arrive (unlike the CPU one, whose devices share a pool): the devices meet twice.
//   1. Each rank records a "ready" event on its stream (its x is produced) and meets its peers,
//      exchanging x, device and event. Then it enables peer access to the peers whose rows it
//      reads, makes its stream wait for their ready events, launches the kernel and records a
//      "done" event.
//   2. It meets them again, exchanging the done events, and makes its stream wait for every
//      peer's: nothing after this op on a device (which may overwrite or free its x) runs while
//      a peer still reads x.
// A rank that fails after the first meeting still comes to the second one with its error, so
// its peers never wait for it in vain and every rank of the group returns an error. Events
// are shared: the last rank to let go of one destroys it (waits already enqueued on an event
// stay valid).

using Event = std::shared_ptr<void>;

Event owned_event(int device, void* event) {
  return Event(event, [device](void* e) { gpu_destroy_event(device, e); });
}

struct Ready {
  const uint16_t* x = nullptr;
  int device = -1;
  Event event;        // recorded once x was produced
  std::string error;  // this rank cannot take part (nothing was enqueued yet)
};

struct Done {
  Event event;  // recorded after this rank's kernel; null when it enqueued none
  ffi::ErrorCode code = ffi::ErrorCode::kOk;
  std::string error;
};

// Leaked on purpose, as the CPU table: the watchdog thread may outlive static destruction.
rendezvous::Exchange<Ready>& ReadyMeeting() {
  static auto* m = new rendezvous::Exchange<Ready>(std::string(kGatherTarget) + " (inputs ready)");
  return *m;
}

rendezvous::Exchange<Done>& DoneMeeting() {
  static auto* m = new rendezvous::Exchange<Done>(std::string(kGatherTarget) + " (reads done)");
  return *m;
}

ffi::Error gather_error(ffi::ErrorCode code, const std::string& msg) {
  return ffi::Error(code, std::string(kGatherTarget) + ": " + msg);
}

std::string rank_on_gpu(int rank, int device) {
  return "rank " + std::to_string(rank) + " (GPU " + std::to_string(device) + ")";
}

// Keeps the first failure of a rank after meeting 1: it is taken to meeting 2.
void note(Done* done, ffi::ErrorCode code, const std::string& msg) {
  if (done->error.empty()) done->code = code, done->error = msg;
}

// One rank's call, once its arguments are checked: what the steps below share.
struct GatherCall {
  void* stream = nullptr;
  int device = -1;  // the GPU that holds this rank's inputs
  int rank = 0;     // within the group
  int n = 0;        // ranks in the group
  GatherPlan plan;
  rendezvous::Key key;
  std::string signature;  // what every rank of the group must agree on
  rendezvous::Clock::duration timeout = rendezvous::kNoDeadline;
  // The kernel's arguments other than the rows.
  const uint16_t* x = nullptr;
  const uint16_t* gamma = nullptr;
  NormParams prm;
  NormOut out;
};

// Step 1, decoding the arguments. The kernel's row table holds kMaxGatherRanks ranks.
ffi::Error check_group_size(int64_t group_size) {
  if (group_size <= kMaxGatherRanks) return ffi::Error::Success();
  return invalid(std::string(kGatherTarget) + ": group_size=" + std::to_string(group_size) +
                 " exceeds the " + std::to_string(kMaxGatherRanks) +
                 " ranks the GPU kernel reads from (its row table travels in the kernel's "
                 "arguments); use smaller groups or strategy='xla'");
}

// Step 1, continued. `where` (rank, group, rendezvous id) is computed on the device, and the
// host needs it to find its group: it is copied once the work that produces it is done (this
// waits for the stream). A `where` of the wrong size is left for plan_gather to reject.
ffi::Error read_where(void* stream, const ffi::Buffer<ffi::S32>& where, int32_t (&host)[3],
                      int* device) {
  if (where.element_count() != 3) return ffi::Error::Success();
  if (const char* e = gpu_device_of(where.untyped_data(), device))
    return gather_error(ffi::ErrorCode::kInternal,
                        std::string("cannot tell the device of the inputs: ") + e);
  if (const char* e = gpu_copy_to_host(stream, *device, host, where.untyped_data(), sizeof host))
    return gather_error(ffi::ErrorCode::kInternal, std::string("reading `where` failed: ") + e);
  return ffi::Error::Success();
}

// Step 2, meeting 1 (inputs ready): records the "ready" event and exchanges x, device and event
// with the peers. Fails on every rank alike when the meeting fails or a rank cannot take part.
ffi::Error meet_inputs_ready(const GatherCall& c, std::vector<Ready>* peers) {
  Ready mine;
  mine.x = c.x;
  mine.device = c.device;
  void* ready_event = nullptr;
  if (const char* e = gpu_record_event(c.stream, c.device, &ready_event)) {
    mine.error = std::string("recording an event failed: ") + e;
  } else {
    mine.event = owned_event(c.device, ready_event);
  }
  auto ready = ReadyMeeting().Meet(c.key, c.rank, c.n, c.signature, std::move(mine), c.timeout);
  if (!ready.ok) return meeting_error(ready.failure, ready.error);
  for (int k = 0; k < c.n; ++k)
    if (!ready.values[k].error.empty())
      return gather_error(ffi::ErrorCode::kInternal,
                          rank_on_gpu(k, ready.values[k].device) + ": " + ready.values[k].error);
  *peers = std::move(ready.values);
  return ffi::Error::Success();
}

// Step 3, for one peer: its input may live where peer access does not reach (a cudaMallocAsync
// pool, a cuMem mapping): the pool is granted access, a mapping without access is refused.
void grant_peer_read(const GatherCall& c, int k, const Ready& peer, Done* done) {
  const char* refusal = nullptr;
  if (const char* e = gpu_grant_peer_read(c.device, peer.x, &refusal)) {
    note(done, ffi::ErrorCode::kInternal,
         "granting GPU " + std::to_string(c.device) + " access to the input of " +
             rank_on_gpu(k, peer.device) + " failed: " + e);
  } else if (refusal != nullptr) {
    note(done, ffi::ErrorCode::kFailedPrecondition,
         rank_on_gpu(c.rank, c.device) + " cannot read the input of " +
             rank_on_gpu(k, peer.device) + ": " + refusal +
             ". strategy='p2p' reads the peers' inputs directly; use strategy='xla' with this "
             "allocator");
  }
}

// Step 3: lets this GPU read the peers' inputs. Peer access to every GPU whose rows it reads
// (once per pair), then its stream waits for every peer's ready event. Stops at the first
// failure, noted in `done`.
void open_peer_reads(const GatherCall& c, const std::vector<Ready>& peers, Done* done) {
  for (int k = 0; k < c.n && done->error.empty(); ++k) {
    const int peer = peers[k].device;
    if (k == c.rank || peer == c.device || c.plan.counts[k] == 0) continue;  // reads nothing there
    bool can = false;
    if (const char* e = gpu_can_access_peer(c.device, peer, &can)) {
      note(done, ffi::ErrorCode::kInternal, "querying peer access failed: " + std::string(e));
    } else if (!can) {
      note(done, ffi::ErrorCode::kFailedPrecondition,
           rank_on_gpu(c.rank, c.device) + " cannot access the memory of " + rank_on_gpu(k, peer) +
               ": the runtime reports no peer access between GPU " + std::to_string(c.device) +
               " and GPU " + std::to_string(peer) +
               " (no NVLink or PCIe P2P path). strategy='p2p' reads the peers' inputs "
               "directly; use strategy='xla' on this machine");
    } else if (const char* e = gpu_enable_peer_access(c.device, peer)) {
      note(done, ffi::ErrorCode::kInternal,
           "enabling peer access from GPU " + std::to_string(c.device) + " to GPU " +
               std::to_string(peer) + " failed: " + e);
    } else {
      grant_peer_read(c, k, peers[k], done);
    }
  }
  for (int k = 0; k < c.n && done->error.empty(); ++k)
    if (k != c.rank)
      if (const char* e = gpu_stream_wait(c.stream, c.device, peers[k].event.get()))
        note(done, ffi::ErrorCode::kInternal,
             std::string("waiting for a peer's input failed: ") + e);
}

// Step 4: the kernel over the group's rows, then the "done" event the peers wait for (or, when
// no event can be had, the kernel is finished here, which does as well). Failures are noted in
// `done`.
void launch_gather(const GatherCall& c, const std::vector<Ready>& peers, Done* done) {
  GatherRows rows;
  rows.ranks = c.n;
  for (int k = 0; k < c.n; ++k) {
    rows.base[k] = peers[k].x;
    rows.start[k + 1] = rows.start[k] + c.plan.counts[k];
  }
  if (const char* e =
          launch_allgather_rmsnorm_quantize(c.stream, rows, c.gamma, c.plan.R, c.prm, c.out)) {
    note(done, ffi::ErrorCode::kInternal, std::string("kernel launch failed: ") + e);
    return;
  }
  void* done_event = nullptr;
  if (gpu_record_event(c.stream, c.device, &done_event) == nullptr) {
    done->event = owned_event(c.device, done_event);
  } else if (const char* e = gpu_stream_sync(c.stream, c.device)) {
    note(done, ffi::ErrorCode::kInternal,
         std::string("cannot tell the peers when the kernel is done: ") + e);
  }
}

// Step 5, meeting 2 (reads done): exchanges the done events and errors, and makes this stream
// wait for every peer's event. Returns the group's first error (in rank order) on every rank,
// this rank's own included; devices[k] is rank k's GPU.
ffi::Error meet_reads_done(const GatherCall& c, const std::vector<int>& devices, Done done) {
  auto finished = DoneMeeting().Meet(c.key, c.rank, c.n, c.signature, std::move(done), c.timeout);
  if (!finished.ok) return meeting_error(finished.failure, finished.error);
  std::string wait_error;
  for (int k = 0; k < c.n; ++k)
    if (k != c.rank && finished.values[k].event)
      if (const char* e = gpu_stream_wait(c.stream, c.device, finished.values[k].event.get()))
        if (wait_error.empty()) wait_error = e;
  for (int k = 0; k < c.n; ++k) {
    const Done& d = finished.values[k];
    if (!d.error.empty())
      return gather_error(
          d.code, (k == c.rank ? "" : "peer " + rank_on_gpu(k, devices[k]) + ": ") + d.error);
  }
  if (!wait_error.empty())
    return gather_error(ffi::ErrorCode::kInternal,
                        "waiting for the peers' reads failed: " + wait_error);
  return ffi::Error::Success();
}

ffi::Error AllgatherRmsnormQuantize(
    void* stream, ffi::RunId run_id, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> gamma,
    ffi::Buffer<ffi::S32> where, ffi::Result<ffi::Buffer<ffi::BF16>> normed,
    ffi::Result<ffi::AnyBuffer> row_q, ffi::Result<ffi::AnyBuffer> row_s,
    ffi::Result<ffi::AnyBuffer> col_q, ffi::Result<ffi::AnyBuffer> col_s,
    ffi::Result<ffi::Buffer<ffi::BF16>> residual, int64_t op_id, int64_t group_size,
    ffi::Span<const int64_t> row_counts, float eps, float weight_offset, bool quantize_from_fp32,
    bool columnwise, int32_t scale_rule, int64_t timeout_ms) {
  // 1. Decode and check the arguments (the CPU handler's checks: mxfp8/gather_args.h).
  if (ffi::Error e = check_group_size(group_size); e.failure()) return e;
  GatherCall c;
  int32_t where_host[3] = {0, 0, 0};
  if (ffi::Error e = read_where(stream, where, where_host, &c.device); e.failure()) return e;
  if (ffi::Error e =
          check_gather_args(x, gamma, where, where_host, group_size, row_counts, columnwise, normed,
                            row_q, row_s, col_q, col_s, residual, &c.plan);
      e.failure())
    return e;
  if (c.plan.R == 0) return ffi::Error::Success();  // the whole group has no rows: nothing to read
  c.stream = stream;
  c.rank = static_cast<int>(c.plan.rank);
  c.n = static_cast<int>(group_size);
  c.key = rendezvous::Key{run_id.run_id, op_id, c.plan.rendezvous_id};
  c.signature =
      gather_signature(c.plan, eps, weight_offset, quantize_from_fp32, columnwise, scale_rule);
  c.timeout = rendezvous::timeout_from_ms(timeout_ms);  // 0: no deadline
  c.x = reinterpret_cast<const uint16_t*>(x.typed_data());
  c.gamma = reinterpret_cast<const uint16_t*>(gamma.typed_data());
  c.prm = norm_params(c.plan.H, eps, weight_offset, quantize_from_fp32, columnwise, scale_rule);
  c.out = norm_outputs(normed, row_q, row_s, col_q, col_s, columnwise);
  c.out.residual = reinterpret_cast<uint16_t*>(residual->typed_data());

  // 2. Meeting 1.
  std::vector<Ready> peers;
  if (ffi::Error e = meet_inputs_ready(c, &peers); e.failure()) return e;
  std::vector<int> devices(c.n);
  for (int k = 0; k < c.n; ++k) devices[k] = peers[k].device;

  // 3, 4. From here on a failure is noted and taken to meeting 2 (the peers may read this x).
  Done done;
  open_peer_reads(c, peers, &done);
  if (done.error.empty()) launch_gather(c, peers, &done);
  peers.clear();  // every wait on the peers' ready events is enqueued

  // 5. Meeting 2.
  return meet_reads_done(c, devices, std::move(done));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeHandler, Quantize,
                              quantize_binding<ffi::PlatformStream<void*>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeTilesHandler, QuantizeTiles,
                              quantize_tiles_binding<ffi::PlatformStream<void*>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeSegmentsHandler, QuantizeSegments,
                              quantize_segments_binding<ffi::PlatformStream<void*>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsnormQuantizeHandler, RmsnormQuantize,
                              rmsnorm_quantize_binding<ffi::PlatformStream<void*>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllgatherRmsnormQuantizeHandler, AllgatherRmsnormQuantize,
                              gather_binding<ffi::PlatformStream<void*>>());

}  // namespace mxfp8::gpu
