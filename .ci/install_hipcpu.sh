#!/usr/bin/env bash
# HIP-CPU for the hipcpu tests (tests/test_hipcpu.py: the GPU kernels' device code run on CPUs).
# Installs TBB, which HIP-CPU's parallel algorithms need (Debian: libtbb-dev), and prints HIP-CPU's
# directory on stdout: $MXFP8_HIP_CPU if set, else shared/hip-cpu beside the repository (or beside a
# parent folder of it); it
# prints nothing when there is none (the tests then skip, saying how to get it).
# Idempotent and quiet (messages go to stderr): installs nothing when TBB is there.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg-query -W -f='${Status}' libtbb-dev 2>/dev/null | grep -q "install ok installed"; then
  if command -v apt-get >/dev/null; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq >/dev/null
    $SUDO apt-get install -y -qq libtbb-dev >/dev/null
    echo "install_hipcpu: installed libtbb-dev" >&2
  else
    echo "install_hipcpu: no apt-get; install TBB (libtbb-dev) for the hipcpu tests" >&2
  fi
fi

# $MXFP8_HIP_CPU, else shared/hip-cpu beside the repository or beside one of its parent folders
candidates=()
if [ -n "${MXFP8_HIP_CPU:-}" ]; then
  candidates=("$MXFP8_HIP_CPU")
else
  up=".."
  for _ in 1 2 3 4; do
    candidates+=("$up/shared/hip-cpu")
    up="$up/.."
  done
fi
for dir in "${candidates[@]}"; do
  if [ -f "$dir/include/hip/hip_runtime.h" ]; then
    (cd "$dir" && pwd)
    exit 0
  fi
done
echo "install_hipcpu: no HIP-CPU at ${candidates[*]}; the hipcpu tests will skip (see tests/hipcpu_build.py)" >&2
