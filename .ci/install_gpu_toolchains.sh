#!/usr/bin/env bash
# Compilers for the GPU parts of the extension, so that CI builds (and so checks) both:
#   - CUDA: nvcc, found on PATH (or CUDACXX) where the machine has a CUDA toolkit; it is not an
#     apt package here, so this script does not install it;
#   - ROCm/HIP: Debian's clang 22 (knows gfx942/gfx950), lld, the HIP headers and libamdhip64.
#     The kernels use compiler builtins only, so no ROCm device library is needed (-nogpulib);
#     rocm-device-libs and hipcc come along for completeness of the toolchain.
# Idempotent and quiet: does nothing when everything is installed already.
set -euo pipefail
pkgs=(clang-22 lld-22 clang-tools-22 hipcc libamdhip64-dev rocm-device-libs)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
if ! command -v apt-get >/dev/null; then
  echo "install_gpu_toolchains: no apt-get; skipping ${missing[*]} (the GPU parts build only where their compilers exist)" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
echo "install_gpu_toolchains: installed ${missing[*]}"
