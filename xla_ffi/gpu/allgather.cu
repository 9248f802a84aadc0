// mxfp8_allgather_rmsnorm_quantize (CUDA / ROCm, experimental): the runtime helpers of the
// in-process all-gather's host protocol. The FFI handler (handlers.cc) meets the group's other
// devices, hands the kernel their input pointers, and orders the streams with the events made
// here; operands, results and attributes are those of the CPU handler (cpu/allgather.cc).
//
// The kernel (launch_allgather_rmsnorm_quantize, in rmsnorm_quantize.cu) is the RMSNorm + MXFP8
// kernel of rmsnorm_kernels.cuh reading row r from the rank that owns it (a peer's x, over peer
// access: NVLink or PCIe), and also writing the residual (the gathered rows, bit for bit).
// Every device of the group runs it for the whole group.
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "gpu/gpu.cuh"
#include "gpu/launch.h"

#if defined(__HIPCC__)
// The runtime calls of the host protocol, under their HIP names.
using cudaEvent_t = hipEvent_t;
using cudaPointerAttributes = hipPointerAttribute_t;
#define cudaErrorPeerAccessAlreadyEnabled hipErrorPeerAccessAlreadyEnabled
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaPointerGetAttributes hipPointerGetAttributes
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaDeviceCanAccessPeer hipDeviceCanAccessPeer
#define cudaDeviceEnablePeerAccess hipDeviceEnablePeerAccess
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventRecord hipEventRecord
#define cudaEventDestroy hipEventDestroy
#define cudaStreamWaitEvent hipStreamWaitEvent
using cudaMemPool_t = hipMemPool_t;
using cudaMemAccessDesc = hipMemAccessDesc;
#define cudaMemLocationTypeDevice hipMemLocationTypeDevice
#define cudaMemAccessFlagsProtReadWrite hipMemAccessFlagsProtReadWrite
#define cudaMemPoolSetAccess hipMemPoolSetAccess
#else
#include <cuda.h>  // driver API types only: its entry points come through the runtime (no -lcuda)
#endif

namespace mxfp8::gpu {
namespace {

// Makes `device` current for the helper's runtime calls and restores the caller's device: XLA
// runs each device's program on its own thread with that device current, and a helper called
// from another thread (an event released by a peer) must not leave it changed.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      previous_ = -1;
      (void)cudaGetLastError();  // not left pending for a later launch_error()
    }
    if (previous_ != device) {
      error_ = cudaSetDevice(device);
      changed_ = error_ == cudaSuccess;
    }
  }
  // A failed restore is not reported (destructors do not fail), and its error is cleared so
  // that the caller's next launch does not report it as a launch failure.
  ~ScopedDevice() {
    if (changed_ && previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess)
      (void)cudaGetLastError();
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  bool changed_ = false;
  cudaError_t error_ = cudaSuccess;
};

// The runtime also keeps a failed call's error as its "last error", which launch_error() of a
// later kernel launch would report: every helper clears it and returns its own error instead.
const char* message(cudaError_t e) {
  (void)cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

std::mutex peer_mu;
std::map<std::pair<int, int>, bool> can_access;  // (device, peer) -> cudaDeviceCanAccessPeer
std::set<std::pair<int, int>> enabled;  // pairs already enabled in this process

}  // namespace

const char* gpu_device_of(const void* p, int* device) {
  cudaPointerAttributes attr{};
  if (const cudaError_t e = cudaPointerGetAttributes(&attr, p); e != cudaSuccess) return message(e);
  *device = attr.device;
  return nullptr;
}

const char* gpu_copy_to_host(void* stream, int device, void* dst, const void* src, size_t bytes) {
  ScopedDevice scoped(device);
  if (scoped.error() != cudaSuccess) return message(scoped.error());
  const auto st = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  return message(e);
}

const char* gpu_can_access_peer(int device, int peer, bool* can) {
  std::lock_guard<std::mutex> lock(peer_mu);
  const auto key = std::make_pair(device, peer);
  if (auto it = can_access.find(key); it != can_access.end()) {
    *can = it->second;
    return nullptr;
  }
  int yes = 0;
  if (const cudaError_t e = cudaDeviceCanAccessPeer(&yes, device, peer); e != cudaSuccess)
    return message(e);
  can_access[key] = *can = yes != 0;
  return nullptr;
}

const char* gpu_enable_peer_access(int device, int peer) {
  std::lock_guard<std::mutex> lock(peer_mu);
  const auto key = std::make_pair(device, peer);
  if (enabled.count(key)) return nullptr;
  ScopedDevice scoped(device);
  if (scoped.error() != cudaSuccess) return message(scoped.error());
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  // XLA may have enabled the pair already (it does for the devices of its client).
  const bool ok = e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled;
  if (ok) enabled.insert(key);
  return message(ok ? cudaSuccess : e);
}

// ---------------------------------------------------------------------------------------------
// Peer reads of memory that peer access does not cover.
//
// cudaDeviceEnablePeerAccess maps the peer's cudaMalloc memory only. Memory of a stream-ordered
// pool (cudaMallocAsync: XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async) is readable from another GPU
// once the pool grants it access (cudaMemPoolSetAccess, for every allocation of that pool), and
// memory mapped through the virtual memory API (cuMemCreate/cuMemMap) only where its mapping
// grants access; a read of either without access faults and poisons the context.

namespace {

std::set<std::pair<void*, int>> granted;  // (pool, device) pairs given read access

#if !defined(__HIPCC__)
// Driver entry points, looked up once through the runtime; nullptr when the driver lacks them.
template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

using PointerGetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
using RetainAllocationFn = CUresult (*)(CUmemGenericAllocationHandle*, void*);
using ReleaseFn = CUresult (*)(CUmemGenericAllocationHandle);
using MemGetAccessFn = CUresult (*)(unsigned long long*, const CUmemLocation*, CUdeviceptr);

// The pool p was allocated from, or nullptr (not a pool allocation, or no way to tell).
cudaMemPool_t pool_of(const void* p) {
  static const auto get = driver_entry<PointerGetAttributeFn>("cuPointerGetAttribute");
  CUmemoryPool pool = nullptr;
  if (get == nullptr || get(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                            reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS)
    return nullptr;
  return reinterpret_cast<cudaMemPool_t>(pool);
}

// Whether p lies in a virtual-memory mapping that does not let `device` read it (false when it
// is no such mapping, or the driver cannot tell).
bool vmm_without_access(const void* p, int device) {
  static const auto retain = driver_entry<RetainAllocationFn>("cuMemRetainAllocationHandle");
  static const auto release = driver_entry<ReleaseFn>("cuMemRelease");
  static const auto access = driver_entry<MemGetAccessFn>("cuMemGetAccess");
  if (retain == nullptr || release == nullptr || access == nullptr) return false;
  CUmemGenericAllocationHandle handle{};
  if (retain(&handle, const_cast<void*>(p)) != CUDA_SUCCESS) return false;  // not cuMemMap'ped
  (void)release(handle);
  CUmemLocation where{};
  where.type = CU_MEM_LOCATION_TYPE_DEVICE;
  where.id = device;
  unsigned long long flags = 0;
  if (access(&flags, &where, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return false;
  return (flags & CU_MEM_ACCESS_FLAGS_PROT_READ) == 0;
}
#else
cudaMemPool_t pool_of(const void* p) {
  hipMemPool_t pool = nullptr;
  if (hipPointerGetAttribute(&pool, HIP_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                             reinterpret_cast<hipDeviceptr_t>(const_cast<void*>(p))) !=
      hipSuccess) {
    (void)hipGetLastError();
    return nullptr;
  }
  return pool;
}
// The HIP headers the module builds against (ROCm 5.2+) have no allocation-handle query.
bool vmm_without_access(const void*, int) { return false; }
#endif

}  // namespace

const char* gpu_grant_peer_read(int device, const void* p, const char** refusal) {
  *refusal = nullptr;
  std::lock_guard<std::mutex> lock(peer_mu);
  if (cudaMemPool_t pool = pool_of(p)) {
    const auto key = std::make_pair(static_cast<void*>(pool), device);
    if (granted.count(key)) return nullptr;
    cudaMemAccessDesc desc{};
    desc.location.type = cudaMemLocationTypeDevice;
    desc.location.id = device;
    desc.flags = cudaMemAccessFlagsProtReadWrite;  // read-only access is not offered for pools
    if (const cudaError_t e = cudaMemPoolSetAccess(pool, &desc, 1); e != cudaSuccess)
      return message(e);
    granted.insert(key);
    return nullptr;
  }
  if (vmm_without_access(p, device))
    *refusal =
        "it is virtual-memory (cuMem) mapped memory whose mapping gives this GPU no access, "
        "which peer access does not change";
  return nullptr;
}

const char* gpu_record_event(void* stream, int device, void** event) {
  ScopedDevice scoped(device);
  if (scoped.error() != cudaSuccess) return message(scoped.error());
  cudaEvent_t ev = nullptr;
  if (const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess)
    return message(e);
  if (const cudaError_t e = cudaEventRecord(ev, static_cast<cudaStream_t>(stream));
      e != cudaSuccess) {
    (void)cudaEventDestroy(ev);
    return message(e);
  }
  *event = ev;
  return nullptr;
}

const char* gpu_stream_wait(void* stream, int device, void* event) {
  ScopedDevice scoped(device);
  if (scoped.error() != cudaSuccess) return message(scoped.error());
  return message(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

const char* gpu_stream_sync(void* stream, int device) {
  ScopedDevice scoped(device);
  if (scoped.error() != cudaSuccess) return message(scoped.error());
  return message(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

void gpu_destroy_event(int device, void* event) {
  ScopedDevice scoped(device);
  message(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
}

}  // namespace mxfp8::gpu
