#!/usr/bin/env bash
# The one check to run on a lent accelerator machine (or any machine beside this one): it installs nothing from
# the network. It builds the package in place, then, each step's output under $OUT:
#   info.txt           `hybridmoe info`: the kernel ISA that runs, CPU features, threads;
#   tests.log          the whole test suite (kernel tests run every ISA the CPU has: AVX-512 where present; tests
#                      marked gpu run where CUDA is present);
#   bench_kernels.*    `hybridmoe bench kernels --quick` (table and JSON);
#   profile.json       `hybridmoe profile --quick`: the hardware profile the planner reads (GPU matmul, copy and
#                      attention timings where CUDA is present).
# Usage: OUT=/some/dir [PYTHON=python3] [TESTS="tests/kernels ..."] bash benchmarks/device_check.sh
# (TESTS: the pytest paths, default the whole suite; exit status: the test suite's)
set -uo pipefail
OUT=${OUT:-/tmp/hybridmoe-device-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

echo "== build" | tee "$OUT/build.log"
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index -q -e . \
  >>"$OUT/build.log" 2>&1 || { echo "build failed: see build.log"; tail -40 "$OUT/build.log"; exit 2; }

run() {  # run NAME COMMAND...: output to $OUT/NAME and its last lines to the screen
  local name=$1; shift
  echo "== $name: $*"
  "$@" >"$OUT/$name" 2>&1
  local status=$?
  tail -25 "$OUT/$name"
  return $status
}

run info.txt "$PYTHON" -m hybridmoe.cli info
run tests.log "$PYTHON" -m pytest -q -p no:cacheprovider ${TESTS:-tests}
tests_status=$?
run bench_kernels.txt "$PYTHON" -m hybridmoe.cli bench kernels --quick --json "$OUT/bench_kernels.json"
run profile.txt "$PYTHON" -m hybridmoe.cli profile --quick --out "$OUT/profile.json"
exit $tests_status
