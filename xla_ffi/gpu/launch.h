// The host-side interface of the GPU kernels: plain C++, no CUDA, HIP or XLA header. The .cu
// files hold kernels and these launchers only; the XLA FFI handlers that check the buffers and
// call them (handlers.cc) are compiled once by the host compiler for both GPU modules, which
// keeps the heavy FFI templates out of every nvcc/clang -x hip pass and architecture.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mxfp8/numerics.h"
#include "mxfp8/planes.h"

namespace mxfp8::gpu {

// Each enqueues its kernels on `stream` (a cudaStream_t or hipStream_t) and returns nullptr, or
// the runtime's message when a launch failed. Arguments are checked by the caller.

// [M, K] input; M a multiple of 32 when columnwise planes are requested.
const char* launch_quantize(void* stream, InType t, const uint8_t* x, int64_t M, int64_t K,
                            const Planes& p, ScaleRule rule);

// [M, K] input, M and K multiples of 32: codes q [M, K], one scale per 32x32 tile s [M/32, K/32].
const char* launch_quantize_tiles(void* stream, InType t, const uint8_t* x, int64_t M, int64_t K,
                                  uint8_t* q, uint8_t* s, ScaleRule rule);

// A packed segment of S elements; desc: P device-resident rows (offset, rows, row_len), int64
// when desc64 else int32.
const char* launch_quantize_segments(void* stream, InType t, const uint8_t* x, int64_t S,
                                     const void* desc, bool desc64, int64_t P, const Planes& p,
                                     ScaleRule rule);

// RMSNorm of [R, prm.H] bf16 rows, then MXFP8 of the result (prm.columnwise: R a multiple of
// 32). o.residual is not written.
const char* launch_rmsnorm_quantize(void* stream, const uint16_t* x, const uint16_t* gamma,
                                    int64_t R, const NormParams& prm, const NormOut& o);

// ---------------------------------------------------------------------------------------------
// The in-process all-gather (allgather.cu).

// Ranks a group may have: the row table travels by value in the kernel's arguments.
constexpr int kMaxGatherRanks = 16;

// Where the group's rows live: rank k's valid rows are rows [start[k], start[k+1]) of the
// gathered [R, H], read from base[k] (its x, row stride H; device memory of another GPU).
struct GatherRows {
  const uint16_t* base[kMaxGatherRanks] = {};
  int64_t start[kMaxGatherRanks + 1] = {};
  int ranks = 0;
};

// RMSNorm + MXFP8 of the group's R rows, as launch_rmsnorm_quantize, and o.residual = the rows.
const char* launch_allgather_rmsnorm_quantize(void* stream, const GatherRows& rows,
                                              const uint16_t* gamma, int64_t R,
                                              const NormParams& prm, const NormOut& o);

// Runtime helpers of the gather's host protocol (handlers.cc does not call the runtime itself).
// Each returns nullptr, or the runtime's message. `device` is a runtime device ordinal; the
// helpers make it current while they work and restore the caller's device afterwards.

// The device that owns the device memory at p.
const char* gpu_device_of(const void* p, int* device);
// Copies `bytes` from device memory to the host after the work enqueued on `stream` so far
// (blocks until then).
const char* gpu_copy_to_host(void* stream, int device, void* dst, const void* src, size_t bytes);
// Whether `device` can map the memory of `peer` (cached per pair).
const char* gpu_can_access_peer(int device, int peer, bool* can);
// Lets kernels on `device` read the memory of `peer` (once per pair; already enabled is fine).
const char* gpu_enable_peer_access(int device, int peer);
// Makes the memory at p (a peer's input) readable by kernels on `device`, where peer access
// alone does not: a stream-ordered pool (cudaMallocAsync) is granted access for `device` (once
// per pool). When the memory cannot be made readable (a virtual-memory mapping without access
// for `device`), *refusal says why and nothing is changed.
const char* gpu_grant_peer_read(int device, const void* p, const char** refusal);
// A new event (no timing) recorded on `stream` now.
const char* gpu_record_event(void* stream, int device, void** event);
// Work enqueued on `stream` from now on waits for `event` (of any device).
const char* gpu_stream_wait(void* stream, int device, void* event);
// Blocks until the work enqueued on `stream` so far is done.
const char* gpu_stream_sync(void* stream, int device);
// Releases an event; waits already enqueued on it stay valid.
void gpu_destroy_event(int device, void* event);

// ---------------------------------------------------------------------------------------------
// The build and the runtime (runtime.cu), for the checks made when the module is imported.

// The architectures the kernels were compiled for, as the build lists them (CMake syntax:
// "90-real;100f-real;90-virtual", or "gfx942;gfx950").
const char* gpu_architectures();
// The runtime the module was built with: CUDART_VERSION (13000 for 13.0), or ROCm
// major * 100 + minor.
int gpu_runtime_version();
// nullptr when this machine's driver / runtime can run the module (or there is none at all),
// else why not, as a sentence for the ImportError.
const char* gpu_runtime_problem();

}  // namespace mxfp8::gpu
