#!/usr/bin/env bash
# GPU check, in one call on a machine with a GPU (see the project's DEVICE notes). Stages:
#   build   the extension against this machine's jax, with the CUDA handlers required;
#   kernels the GPU kernels byte for byte against the references (tests/test_gpu.py);
#   suite   the multi-device tests on this host's GPUs (MXFP8_TEST_PLATFORM=gpu -m multidevice),
#           with the same oracles as on simulated CPU devices; the end-of-run summary says what
#           was not run for lack of devices;
#   bench   the GPU benchmark (mxfp8_jax.bench.gpu): GB/s vs copy bandwidth and vs XLA's compiled
#           pure-JAX reference, 1 MB .. 1 GB;
#   overlap the FSDP step with prefetch=1 against prefetch=0 (mxfp8_jax.bench.fsdp, variants mxfp8
#           and mxfp8-p0) over this host's GPUs, with the latency-hiding scheduler and the
#           collective pipeliner on (XLA_FLAGS below); on one GPU there is no gather to hide.
# Each stage has a time cap (seconds: BUILD_CAP_S, KERNELS_CAP_S, SUITE_CAP_S, BENCH_CAP_S,
# OVERLAP_CAP_S) and,
# as soon as it ends, its log and its row of the summary table are written under $OUT (default
# ./gpu-check-out), so a run cut short still reports the stages it finished. A pytest stage cut by
# its cap is interrupted (SIGINT), which still prints pytest's summary of what ran.
#
# Other knobs: MXFP8_CUDA_ARCHS (default 90-real: only the local Hopper code, to save build
# minutes), SIZES_MB (default 1,16,256,1024), PYTEST_ARGS (extra pytest arguments), STAGES (default
# "build kernels suite bench").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
ARCHS="${MXFP8_CUDA_ARCHS:-90-real}"
SIZES_MB="${SIZES_MB:-1,16,256,1024}"
STAGES="${STAGES:-build kernels suite bench overlap}"
SUMMARY="$OUT/summary.md"
status=0

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  python -c 'import sys, jax, jaxlib; print(sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__)'
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
printf '| stage | result | seconds | what it says |\n|---|---|---|---|\n' > "$SUMMARY"

# stage NAME CAP_SECONDS COMMAND...: run COMMAND with its output in $OUT/NAME.log, capped.
stage() {
  local name=$1 cap=$2 start rc result said
  shift 2
  echo "== $name (cap ${cap} s)"
  start=$(date +%s)
  timeout -s INT -k 30 "$cap" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) result=ok ;;
    124 | 137) result="TIMED OUT"; status=1 ;;
    *) result="FAILED (rc $rc)"; status=1 ;;
  esac
  # pytest's last line (counts and time), or the last line of any other stage
  said=$(grep -E "(passed|failed|skipped|error|no tests ran)" "$OUT/$name.log" | tail -1)
  [ -n "$said" ] || said=$(tail -1 "$OUT/$name.log")
  printf '| %s | %s | %s | %s |\n' "$name" "$result" "$(( $(date +%s) - start ))" "${said//|//}" >> "$SUMMARY"
  echo "$name: $result in $(( $(date +%s) - start )) s: $said"
  [ "$rc" = 0 ]
}

wants() { [[ " $STAGES " == *" $1 "* ]]; }

if wants build; then
  if ! stage build "${BUILD_CAP_S:-480}" env MXFP8_CUDA=ON MXFP8_ROCM=OFF CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      pip install --no-build-isolation --no-deps -e . \
        -C "cmake.define.MXFP8_CUDA_ARCHS=$ARCHS" -C build-dir=build/gpu-check; then
    tail -40 "$OUT/build.log"
    cat "$SUMMARY"
    exit 1
  fi
fi

export MXFP8_TEST_PLATFORM=gpu JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
python -c 'import mxfp8_jax as mx; print("extension platforms:", mx.available_backends())' 2>&1 | tee -a "$OUT/env.log"

# pytest without the project's xdist addopts (the GPU image may lack pytest-xdist): one process
PYTEST=(-q -o addopts= -p no:cacheprovider -rfEs)

if wants kernels; then
  # shellcheck disable=SC2086
  stage kernels "${KERNELS_CAP_S:-300}" python -m pytest "${PYTEST[@]}" -m gpu \
    --junitxml="$OUT/kernels.xml" tests/test_gpu.py ${PYTEST_ARGS:-}
  grep -E "^(FAILED|ERROR)" "$OUT/kernels.log" | head -20
fi

if wants suite; then
  # One pytest process (the GPUs are shared by the tests, not split between workers). A test
  # module whose dependencies this image lacks is reported as a collection error, and the rest run.
  # shellcheck disable=SC2086
  stage suite "${SUITE_CAP_S:-300}" python -m pytest "${PYTEST[@]}" -m multidevice --continue-on-collection-errors \
    --junitxml="$OUT/suite.xml" ${PYTEST_ARGS:-}
  grep -E "^(FAILED|ERROR)" "$OUT/suite.log" | head -20
  sed -n '/not run on this host/,$p' "$OUT/suite.log" | head -20
fi

if wants bench; then
  stage bench "${BENCH_CAP_S:-240}" env XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}" \
    python -m mxfp8_jax.bench.gpu --sizes-mb "$SIZES_MB" --json "$OUT/bench.json"
  # the benchmark's table (printed last)
  tail -40 "$OUT/bench.log"
fi

if wants overlap; then
  gpus=$(python -c 'import jax; print(len(jax.devices()))' 2>/dev/null || echo 1)
  stage overlap "${OVERLAP_CAP_S:-240}" env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true" \
    python -m mxfp8_jax.bench.fsdp --variants mxfp8,mxfp8-p0 --depths 8,16 --devices "$gpus" --json "$OUT/overlap.json"
  tail -20 "$OUT/overlap.log"
fi

echo "== summary ($SUMMARY)"
cat "$SUMMARY"
exit $status
