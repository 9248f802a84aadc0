// The GPU kernels' device code run on HIP-CPU, for tests/test_hipcpu.py. Built once per vendor
// path by tests/hipcpu_build.py, with the shim of that path force-included
// (xla_ffi/hipcpu/cuda.h or rocm.h), and linked with the kernels' own .cu files: it calls the
// launchers of gpu/launch.h exactly as the FFI handlers do, on host memory.
//
//   driver run CASES    runs the cases of the file CASES, one per line:
//                         quantize  x= out= type= M= K= rule= rowwise= columnwise=
//                         tiles     x= out= type= M= K= rule=
//                         segments  x= desc= out= type= S= P= desc64= rule= rowwise= columnwise=
//                         rmsnorm   x= gamma= out= R= H= eps= offset= fp32= columnwise= rule=
//                         gather    x=a,b,.. rows=n0,n1,.. gamma= out= H= eps= offset= fp32=
//                                   columnwise= rule=
//                       (type f32/bf16/f16; eps and offset as fp32 bits in hex; x, desc and gamma
//                       files of raw bytes). Each case writes the planes it asked for to
//                       OUT.row_q, .row_s, .col_q, .col_s, .normed, .residual (tiles: OUT.q,
//                       .s). Output buffers
//                       start filled with 0x5A; every buffer, inputs too, lies between guard
//                       bytes and ends at an inaccessible page: an access past it stops the run
//                       naming the case, a changed guard byte fails the case.
//   driver emulation    the fast form's emulated instructions against numerics.h's exact cast
//                       (the CUDA path only): prints "checked N mismatches M" per check.
//   driver warp         what each lane of a block sees of a vote and of a 32-wide exchange.
//   driver fpenv        in how many threads of a block a kernel keeps subnormals.
//   driver info         the vendor path, its warp width and whether it has the fast form.
//
// `run` prints one line per case ("ok NAME" or "FAIL NAME: why") and exits 1 if any failed (3
// after a fault).
//
// Before anything runs, the driver sets flush-to-zero and denormals-are-zero, as XLA:CPU's
// threads have them, and every thread the runtime starts inherits them: the kernels must set IEEE
// arithmetic themselves (the shim's launch does, in every worker thread).
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "gpu/tile.cuh"

namespace {

using namespace mxfp8;

constexpr uint8_t kGuardByte = 0xA5, kPoison = 0x5A;

// The case being run, for the fault handler.
const char* current_case = "";

// One buffer (an input or a plane) in pages of its own: it ends where an inaccessible page
// begins (rounded up to 64 bytes, and starts 64-byte aligned, as device allocations do), so a
// read or write past its end faults at once; the bytes before it down to another inaccessible
// page, and its last few padding bytes, are guard bytes that must come back unchanged.
class Buffer {
 public:
  explicit Buffer(size_t n, uint8_t fill = kPoison) : n_(n) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t span = (n + 63) / 64 * 64;
    body_ = (span + page - 1) / page * page + page;  // at least one page of guard bytes first
    size_ = page + body_ + page;
    void* m = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("mmap failed");
    map_ = static_cast<uint8_t*>(m);
    if (mprotect(map_, page, PROT_NONE) != 0 || mprotect(map_ + page + body_, page, PROT_NONE) != 0)
      throw std::runtime_error("mprotect failed");
    begin_ = map_ + page;
    data_ = begin_ + body_ - span;
    std::memset(begin_, kGuardByte, body_);
    std::memset(data_, fill, n);
  }
  ~Buffer() { munmap(map_, size_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() { return data_; }
  size_t size() const { return n_; }
  bool guards_intact() const {
    for (const uint8_t* p = begin_; p < begin_ + body_; ++p)
      if ((p < data_ || p >= data_ + n_) && *p != kGuardByte) return false;
    return true;
  }

 private:
  size_t n_, body_ = 0, size_ = 0;
  uint8_t *map_ = nullptr, *begin_ = nullptr, *data_ = nullptr;
};

// A kernel that reads or writes past a buffer's end faults: name the case and stop.
extern "C" void on_fault(int) {
  const char head[] = "FAIL ", tail[] = ": a kernel read or wrote outside its buffers (fault)\n";
  (void)!write(1, head, sizeof head - 1);
  (void)!write(1, current_case, std::strlen(current_case));
  (void)!write(1, tail, sizeof tail - 1);
  _exit(3);
}

std::unique_ptr<Buffer> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot read " + path);
  const auto n = static_cast<size_t>(f.tellg());
  auto b = std::make_unique<Buffer>(n);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(b->data()), static_cast<std::streamsize>(n));
  return b;
}

void write_file(const std::string& path, Buffer& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);) out.push_back(item);
  return out;
}

struct Case {
  std::string kind;
  std::map<std::string, std::string> kv;
  const std::string& str(const std::string& k) const {
    const auto it = kv.find(k);
    if (it == kv.end()) throw std::runtime_error("missing " + k + "=");
    return it->second;
  }
  int64_t num(const std::string& k) const { return std::stoll(str(k)); }
  bool flag(const std::string& k) const { return num(k) != 0; }
  float f32_bits(const std::string& k) const {
    return __uint_as_float(static_cast<uint32_t>(std::stoul(str(k), nullptr, 16)));
  }
  ScaleRule rule() const { return static_cast<ScaleRule>(num("rule")); }
  InType type() const {
    const std::string& t = str("type");
    if (t == "f32") return InType::kF32;
    if (t == "bf16") return InType::kBF16;
    if (t == "f16") return InType::kF16;
    throw std::runtime_error("type=" + t);
  }
};

// The planes of one call: requested ones allocated (poisoned), the others null.
struct Outputs {
  std::map<std::string, std::unique_ptr<Buffer>> planes;
  uint8_t* add(const std::string& name, size_t n) {
    planes[name] = std::make_unique<Buffer>(n);
    return planes[name]->data();
  }
  void finish(const std::string& prefix) {
    for (auto& [name, b] : planes) {
      if (!b->guards_intact()) throw std::runtime_error("a kernel wrote past the end of " + name);
      write_file(prefix + "." + name, *b);
    }
  }
};

void check_launch(const char* error) {
  if (error != nullptr) throw std::runtime_error(std::string("launch failed: ") + error);
  if (hipDeviceSynchronize() != hipSuccess) throw std::runtime_error("synchronize failed");
}

void run_quantize(const Case& c) {
  const auto x = read_file(c.str("x"));
  const int64_t M = c.num("M"), K = c.num("K");
  Outputs out;
  Planes p;
  if (c.flag("rowwise")) p.row_q = out.add("row_q", M * K), p.row_s = out.add("row_s", M * K / 32);
  if (c.flag("columnwise"))
    p.col_q = out.add("col_q", M * K), p.col_s = out.add("col_s", M * K / 32);
  check_launch(gpu::launch_quantize(nullptr, c.type(), x->data(), M, K, p, c.rule()));
  out.finish(c.str("out"));
}

void run_tiles(const Case& c) {
  const auto x = read_file(c.str("x"));
  const int64_t M = c.num("M"), K = c.num("K");
  Outputs out;
  uint8_t* q = out.add("q", M * K);
  uint8_t* s = out.add("s", M * K / (32 * 32));
  check_launch(gpu::launch_quantize_tiles(nullptr, c.type(), x->data(), M, K, q, s, c.rule()));
  out.finish(c.str("out"));
}

void run_segments(const Case& c) {
  const auto x = read_file(c.str("x"));
  const auto desc = read_file(c.str("desc"));
  const int64_t S = c.num("S");
  Outputs out;
  Planes p;
  if (c.flag("rowwise")) p.row_q = out.add("row_q", S), p.row_s = out.add("row_s", S / 32);
  if (c.flag("columnwise")) p.col_q = out.add("col_q", S), p.col_s = out.add("col_s", S / 32);
  check_launch(gpu::launch_quantize_segments(nullptr, c.type(), x->data(), S, desc->data(),
                                             c.flag("desc64"), c.num("P"), p, c.rule()));
  out.finish(c.str("out"));
}

NormParams norm_params(const Case& c) {
  NormParams prm;
  prm.H = c.num("H");
  prm.eps = c.f32_bits("eps");
  prm.weight_offset = c.f32_bits("offset");
  prm.quantize_from_fp32 = c.flag("fp32");
  prm.columnwise = c.flag("columnwise");
  prm.rule = c.rule();
  return prm;
}

NormOut norm_outputs(Outputs& out, int64_t R, const NormParams& prm, bool residual) {
  NormOut o;
  const int64_t n = R * prm.H;
  o.normed = reinterpret_cast<uint16_t*>(out.add("normed", 2 * n));
  o.row_q = out.add("row_q", n);
  o.row_s = out.add("row_s", n / 32);
  if (prm.columnwise) o.col_q = out.add("col_q", n), o.col_s = out.add("col_s", n / 32);
  if (residual) o.residual = reinterpret_cast<uint16_t*>(out.add("residual", 2 * n));
  return o;
}

void run_rmsnorm(const Case& c) {
  const auto x = read_file(c.str("x"));
  const auto gamma = read_file(c.str("gamma"));
  const NormParams prm = norm_params(c);
  const int64_t R = c.num("R");
  Outputs out;
  const NormOut o = norm_outputs(out, R, prm, false);
  check_launch(gpu::launch_rmsnorm_quantize(nullptr, reinterpret_cast<uint16_t*>(x->data()),
                                            reinterpret_cast<uint16_t*>(gamma->data()), R, prm, o));
  out.finish(c.str("out"));
}

// The fused gather's kernel for a group of ranks whose inputs are host buffers here (on GPUs,
// peers' device memory read over peer access).
void run_gather(const Case& c) {
  const std::vector<std::string> paths = split(c.str("x"), ','), rows = split(c.str("rows"), ',');
  if (paths.size() != rows.size() || paths.size() > gpu::kMaxGatherRanks)
    throw std::runtime_error("x= and rows= disagree, or too many ranks");
  std::vector<std::unique_ptr<Buffer>> inputs;
  gpu::GatherRows table;
  table.ranks = static_cast<int>(paths.size());
  for (size_t k = 0; k < paths.size(); ++k) {
    inputs.push_back(read_file(paths[k]));
    table.base[k] = reinterpret_cast<const uint16_t*>(inputs.back()->data());
    table.start[k + 1] = table.start[k] + std::stoll(rows[k]);
  }
  const auto gamma = read_file(c.str("gamma"));
  const NormParams prm = norm_params(c);
  const int64_t R = table.start[table.ranks];
  Outputs out;
  const NormOut o = norm_outputs(out, R, prm, true);
  check_launch(gpu::launch_allgather_rmsnorm_quantize(
      nullptr, table, reinterpret_cast<uint16_t*>(gamma->data()), R, prm, o));
  out.finish(c.str("out"));
}

int run(const char* cases_path) {
  std::ifstream f(cases_path);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", cases_path);
    return 2;
  }
  int failed = 0;
  for (std::string line; std::getline(f, line);) {
    if (line.empty()) continue;
    std::istringstream in(line);
    Case c;
    in >> c.kind;
    for (std::string tok; in >> tok;) {
      const auto eq = tok.find('=');
      c.kv[tok.substr(0, eq)] = eq == std::string::npos ? "" : tok.substr(eq + 1);
    }
    const std::string name = c.kv.count("out") ? c.kv["out"] : line;
    current_case = name.c_str();
    try {
      if (c.kind == "quantize") run_quantize(c);
      else if (c.kind == "tiles") run_tiles(c);
      else if (c.kind == "segments") run_segments(c);
      else if (c.kind == "rmsnorm") run_rmsnorm(c);
      else if (c.kind == "gather") run_gather(c);
      else throw std::runtime_error("unknown case kind " + c.kind);
      std::printf("ok %s\n", name.c_str());
    } catch (const std::exception& e) {
      std::printf("FAIL %s: %s\n", name.c_str(), e.what());
      ++failed;
    }
  }
  return failed ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------
// The fast form's instructions (emulated here) against the exact form of numerics.h.

#if MXFP8_HW_E4M3
struct Tally {
  uint64_t checked = 0, mismatches = 0;
  void add(bool same) { ++checked, mismatches += same ? 0 : 1; }
  void print(const char* what) const {
    std::printf("%s checked %llu mismatches %llu\n", what, static_cast<unsigned long long>(checked),
                static_cast<unsigned long long>(mismatches));
  }
};

// The fast form's cast of the pair (x0, x1) against e4m3_scaled for one scale byte.
bool same_pair(uint32_t x0, uint32_t x1, uint8_t byte) {
  const float m = gpu::inverse_scale(byte);
  const uint32_t want = e4m3_scaled(x0, byte) | static_cast<uint32_t>(e4m3_scaled(x1, byte)) << 8;
  return gpu::e4m3x2_fast(x0, m, x1, m) == want;
}

int emulation() {
  mxfp8::hipcpu::ieee_fp_env();
  // Every bf16 pattern that is not a NaN (the fast form never meets one) at every scale byte,
  // paired with its neighbour pattern (both bytes of the packed result).
  Tally bf16;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint32_t x0 = h << 16, x1 = ((h + 1) & 0xFFFFu) << 16;
    if ((x0 & 0x7FFFFFFFu) > 0x7F800000u || (x1 & 0x7FFFFFFFu) > 0x7F800000u) continue;
    for (int b = 0; b < 255; ++b) bf16.add(same_pair(x0, x1, static_cast<uint8_t>(b)));
  }
  bf16.print("bf16");
  // fp32 patterns: every exponent with mantissas at and around the E4M3 rounding points (the
  // low 20 bits 0x7FFFF, 0x80000, 0x80001 are just below, at and above a tie), and a stride
  // through all 2^32.
  Tally f32;
  const uint32_t lows[] = {0, 1, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF};
  for (uint32_t hi = 0; hi < 0x1000u; ++hi)
    for (uint32_t low : lows)
      for (int b = 0; b < 255; b += 1) {
        const uint32_t x = hi << 20 | low;
        if ((x & 0x7FFFFFFFu) > 0x7F800000u) continue;
        f32.add(same_pair(x, x ^ 0x80000000u, static_cast<uint8_t>(b)));
      }
  for (uint64_t x = 0; x < (uint64_t{1} << 32); x += 65521) {
    const auto b = static_cast<uint8_t>((x >> 7) % 255);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) continue;
    f32.add(same_pair(static_cast<uint32_t>(x), static_cast<uint32_t>(x) >> 3, b));
  }
  f32.print("f32");
  // A NaN gives a NaN code.
  Tally nan;
  for (uint32_t x : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu})
    nan.add((mxfp8::hipcpu::cvt_e4m3x2_rn_satfinite(__uint_as_float(x), 1.0f) & 0x7Fu) == 0x7Fu);
  nan.print("nan");
  // __vmaxu2 against the maxima of the halves taken one at a time.
  Tally vmax;
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 1 << 20; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const auto a = static_cast<uint32_t>(s >> 32), b = static_cast<uint32_t>(s);
    const uint32_t lo = std::max(a & 0xFFFFu, b & 0xFFFFu), hi = std::max(a >> 16, b >> 16);
    vmax.add(gpu::max_u16x2(a, b) == (hi << 16 | lo));
  }
  vmax.print("vmaxu2");
  return bf16.mismatches || f32.mismatches || nan.mismatches || vmax.mismatches ? 1 : 0;
}
#else
int emulation() {
  std::printf("no fast form on this path\n");
  return 0;
}
#endif

// ---------------------------------------------------------------------------------------------
// The warp: lane t of a block votes true only when t == voter; every lane records what
// any_lane returned and what a 32-wide exchange with lane t ^ 16 gave it.

__global__ void warp_probe(int voter, int* votes, int* partners) {
  const int t = gpu::thread_in_block();
  votes[t] = gpu::any_lane(t == voter) ? 1 : 0;
  partners[t] = gpu::shfl_xor(t, 16, 32);
}

int warp() {
  std::vector<int> votes(gpu::kBlockThreads), partners(gpu::kBlockThreads);
  for (int voter : {0, 31, 32, 63, 64, 127}) {
    gpu::launch_kernel(warp_probe, 1, nullptr, voter, votes.data(), partners.data());
    if (hipDeviceSynchronize() != hipSuccess) return 1;
    std::printf("voter %d votes ", voter);
    for (int v : votes) std::printf("%d", v);
    std::printf(" partners");
    for (int p : partners) std::printf(" %d", p);
    std::printf("\n");
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The floating-point environment.

constexpr unsigned kFlushToZero = 0x8000u, kDenormalsAreZero = 0x0040u;

void flush_subnormals() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(_mm_getcsr() | kFlushToZero | kDenormalsAreZero);
#endif
}

// kept[t]: whether thread t computed a subnormal product from a subnormal operand.
__global__ void fpenv_probe(float smallest_normal, float subnormal, int* kept) {
  const float a = smallest_normal * 0.5f, b = subnormal * 2.0f;
  kept[gpu::thread_in_block()] = a != 0.0f && b != 0.0f;
}

int fpenv() {
  std::vector<int> kept(gpu::kBlockThreads);
  gpu::launch_kernel(fpenv_probe, 1, nullptr, 0x1p-126f, 0x1p-140f, kept.data());
  if (hipDeviceSynchronize() != hipSuccess) return 1;
  int n = 0;
  for (int k : kept) n += k;
#if defined(__x86_64__) || defined(__i386__)
  const int ftz = (_mm_getcsr() & kFlushToZero) != 0;
#else
  const int ftz = 1;
#endif
  std::printf("subnormals kept in %d of %d threads main ftz %d\n", n, gpu::kBlockThreads, ftz);
  return 0;
}

int info() {
#if defined(__HIPCC__)
  const char* path = "rocm";
#else
  const char* path = "cuda";
#endif
  std::printf("path %s warp %d fast_form %d\n", path, gpu::kWarpLanes, MXFP8_HW_E4M3);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // every case's line out before a fault stops it
  std::signal(SIGSEGV, on_fault);
  std::signal(SIGBUS, on_fault);
  flush_subnormals();
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "run" && argc == 3) return run(argv[2]);
  if (cmd == "emulation") return emulation();
  if (cmd == "warp") return warp();
  if (cmd == "fpenv") return fpenv();
  if (cmd == "info") return info();
  std::fprintf(stderr, "usage: %s run CASES | emulation | warp | fpenv | info\n", argv[0]);
  return 2;
}
