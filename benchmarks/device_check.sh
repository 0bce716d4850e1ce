#!/usr/bin/env bash
# The one check to run on a lent accelerator machine (or any machine beside this one): it installs nothing from
# the network. It builds the package in place, then writes under $OUT (at most 8 files, each step time-boxed):
#   build.log            the build;
#   info.txt             the machine (lscpu, GPUs) and `hybridmoe info`: the kernel ISA that runs, CPU features;
#   tests_kernels.log    the kernel tests, run on every ISA the CPU has (AVX-512 where present);
#   bench_best.json      `hybridmoe bench kernels` (full mode) on the best ISA (table in the output);
#   bench_avx512.json    `hybridmoe bench kernels --formats fp8,bf16` with HYBRIDMOE_ISA=avx512 (float32
#                        activations), to set beside the best ISA's where that is avx512bf16 (bf16 dot products);
#   bench_avx2.json      (step avx2, not by default: a 9th file) `hybridmoe bench kernels --quick` with
#                        HYBRIDMOE_ISA=avx2;
#   profile.json         `hybridmoe profile --quick`: the hardware profile the planner reads (GPU matmul, copy and
#                        attention timings where CUDA is present);
#   tests_rest.log       the rest of the test suite (in parallel where pytest-xdist is installed).
# Usage: OUT=/some/dir [PYTHON=python3] [STEPS="kernels bench avx512 profile rest"] bash benchmarks/device_check.sh
# Exit status: 0 when every step that ran passed, else the number of failed steps.
set -uo pipefail
OUT=${OUT:-/tmp/hybridmoe-device-check}
PYTHON=${PYTHON:-python3}
STEPS=${STEPS-kernels bench avx512 profile rest}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
failed=0

step() {  # step SECONDS LOGFILE COMMAND...: time-boxed, output to $OUT/LOGFILE, its last lines to the screen
  local seconds=$1 log=$2; shift 2
  echo "== $log: $* (at most ${seconds}s)"
  local start=$SECONDS
  timeout "$seconds" "$@" >>"$OUT/$log" 2>&1
  local status=$?
  tail -${TAIL:-20} "$OUT/$log"
  echo "-- $log: status $status after $((SECONDS - start))s"
  [ $status -eq 0 ] || failed=$((failed + 1))
}

TAIL=40 step 400 build.log env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index -q -e . || true
"$PYTHON" -c "import hybridmoe.kernels._native" 2>/dev/null || { echo "build failed"; exit 99; }

{ lscpu; echo; nvidia-smi -L 2>&1; echo; "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__,
'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"; } >"$OUT/info.txt" 2>&1
TAIL=12 step 60 info.txt "$PYTHON" -m hybridmoe.cli info

xdist=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 8")
for s in $STEPS; do
  case $s in
    kernels) TAIL=15 step 240 tests_kernels.log "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels ;;
    bench) TAIL=45 step 360 bench.txt "$PYTHON" -m hybridmoe.cli bench kernels --json "$OUT/bench_best.json" ;;
    avx512) if "$PYTHON" -c "import sys; from hybridmoe.kernels import isa; sys.exit('avx512' not in isa.available_isas())"
            then TAIL=12 step 240 bench.txt env HYBRIDMOE_ISA=avx512 \
                   "$PYTHON" -m hybridmoe.cli bench kernels --formats fp8,bf16 --json "$OUT/bench_avx512.json"
            else echo "== avx512: skipped, this CPU has no AVX-512"; fi ;;
    avx2) TAIL=12 step 120 bench.txt env HYBRIDMOE_ISA=avx2 \
            "$PYTHON" -m hybridmoe.cli bench kernels --quick --json "$OUT/bench_avx2.json" ;;
    profile) TAIL=5 step 120 bench.txt "$PYTHON" -m hybridmoe.cli profile --quick --out "$OUT/profile.json" ;;
    rest) TAIL=25 step 240 tests_rest.log "$PYTHON" -m pytest -q -p no:cacheprovider $xdist \
            --ignore=tests/kernels tests ;;
    *) echo "unknown step $s"; failed=$((failed + 1)) ;;
  esac
done
echo "== done: $failed failed step(s)"
exit $failed
