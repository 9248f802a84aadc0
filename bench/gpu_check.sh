#!/usr/bin/env bash
# GPU check, in one call on a machine with a GPU (see the project's DEVICE notes):
#   1. build the extension against this machine's jax with the GPU handlers required;
#   2. run the GPU tests (byte-exact against the references, tests/test_gpu.py);
#   3. run the GPU benchmark (mxfp8_jax.bench.gpu): GB/s vs copy bandwidth and vs XLA's compiled
#      pure-JAX reference, 1 MB .. 1 GB, table printed last.
# Full logs and the JSON results go under $OUT (default: ./gpu-check-out).
#
# Environment knobs: MXFP8_CUDA_ARCHS (default 90-real: only the local Hopper code, to save
# build minutes), SIZES_MB (default 1,16,256,1024), PYTEST_ARGS (extra pytest arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
ARCHS="${MXFP8_CUDA_ARCHS:-90-real}"
SIZES_MB="${SIZES_MB:-1,16,256,1024}"
status=0

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  python -c 'import sys, jax, jaxlib; print(sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__)'
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

echo "== build (CUDA archs: $ARCHS)"
start=$(date +%s)
if MXFP8_CUDA=ON MXFP8_ROCM=OFF CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip install --no-build-isolation --no-deps -e . \
      -C "cmake.define.MXFP8_CUDA_ARCHS=$ARCHS" -C build-dir=build/gpu-check > "$OUT/build.log" 2>&1; then
  echo "build ok in $(( $(date +%s) - start )) s"
else
  echo "BUILD FAILED after $(( $(date +%s) - start )) s; last lines of $OUT/build.log:"
  tail -40 "$OUT/build.log"
  exit 1
fi

export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
python -c 'import mxfp8_jax as mx; print("extension platforms:", mx.available_backends())' 2>&1 | tee -a "$OUT/env.log"

echo "== GPU tests"
start=$(date +%s)
# shellcheck disable=SC2086
python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
echo "tests: $(tail -1 "$OUT/tests.log") ($(( $(date +%s) - start )) s)"

echo "== GPU benchmark (sizes $SIZES_MB MB)"
XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}" \
  python -m mxfp8_jax.bench.gpu --sizes-mb "$SIZES_MB" --json "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1 || status=1
# the table (printed last by the benchmark) closes this script's output
tail -40 "$OUT/bench.log"
exit $status
