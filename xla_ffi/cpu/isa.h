// Which instruction set the CPU kernels run: the best this CPU supports, unless lowered for a
// comparison (the benchmarks' --isa flag, the tests that check every path gives the same bytes).
// Every kernel entry point (quantize_rows_simd, rmsnorm_quantize_rows_simd) is compiled once per
// instruction set and reads the selection on each call.
#pragma once

namespace mxfp8::cpu {

enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// "baseline" (x86-64 SSE2, or the compiler's default elsewhere), "avx2", "avx512" (F, BW, VL).
const char* isa_name(CpuIsa isa);
bool isa_from_name(const char* name, CpuIsa* isa);

// The best instruction set of this CPU that the kernels have a build for.
CpuIsa best_isa();
// The one in use.
CpuIsa active_isa();
// Selects `isa` for the calls that start from now on; false (and nothing changes) when this CPU
// cannot run it.
bool set_active_isa(CpuIsa isa);

}  // namespace mxfp8::cpu
