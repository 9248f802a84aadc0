#include "cpu/isa.h"

#include <atomic>
#include <cstring>

#include "cpu/target.h"

namespace mxfp8::cpu {

namespace {

CpuIsa detect() {
#if MXFP8_X86_BUILDS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return CpuIsa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kBaseline;
}

std::atomic<int>& selected() {
  static std::atomic<int> isa{static_cast<int>(best_isa())};
  return isa;
}

constexpr const char* kNames[] = {"baseline", "avx2", "avx512"};

}  // namespace

const char* isa_name(CpuIsa isa) { return kNames[static_cast<int>(isa)]; }

bool isa_from_name(const char* name, CpuIsa* isa) {
  for (int i = 0; i < 3; ++i)
    if (std::strcmp(name, kNames[i]) == 0) {
      *isa = static_cast<CpuIsa>(i);
      return true;
    }
  return false;
}

CpuIsa best_isa() {
  static const CpuIsa best = detect();
  return best;
}

CpuIsa active_isa() { return static_cast<CpuIsa>(selected().load(std::memory_order_relaxed)); }

bool set_active_isa(CpuIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(best_isa())) return false;
  selected().store(static_cast<int>(isa), std::memory_order_relaxed);
  return true;
}

}  // namespace mxfp8::cpu
