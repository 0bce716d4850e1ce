#!/usr/bin/env bash
# The one check to run on a lent accelerator machine (or any machine beside this one): it installs nothing from
# the network. It builds the package in place, then writes under $OUT (at most 8 files, each step time-boxed):
#   build.log            the build;
#   info.txt             the machine (lscpu, GPUs) and `hybridmoe info`: the kernel ISA that runs, CPU features;
#   tests_kernels.log    the kernel tests, run on every ISA the CPU has (AVX-512 where present);
#   bench.txt            the benches' tables, among them (step amx, where the CPU has AMX) one matrix's AMX tiles
#                        at 1-32 tokens against what the avx512 table runs by itself (benchmarks/bf16_dot.py),
#                        (step dispatch) a tiny MoE call's fixed cost by pool size and idle spin
#                        (benchmarks/dispatch.py), and (step prefetch) the MoE with short rows' far prefetch into
#                        L1 and into L2 (benchmarks/prefetch_level.py), whose default is measured on Zen 4 only;
#   bench_best.json      `hybridmoe bench kernels` (full mode) on the best ISA (table in the output);
#   bench_quick.json     (step quick, not by default) `hybridmoe bench kernels --quick` on the best ISA;
#   bench_avx512.json    `hybridmoe bench kernels --formats fp8,bf16` with HYBRIDMOE_ISA=avx512 (float32
#                        activations), to set beside the best ISA's where that is avx512bf16 (bf16 dot products) or amx;
#   bench_avx2.json      (step avx2, not by default: a 9th file) `hybridmoe bench kernels --quick` with
#                        HYBRIDMOE_ISA=avx2;
#   profile.json         `hybridmoe profile --quick`: the hardware profile the planner reads (GPU matmul, copy and
#                        attention timings where CUDA is present);
#   tests_rest.log       the rest of the test suite.
# The tests run in parallel where pytest-xdist is installed, each worker on its own share of the CPUs
# (tests/xdist_cpus.py), so that the workers' kernel pools do not oversubscribe them.
# Usage: OUT=/some/dir [PYTHON=python3] [STEPS="kernels amx dispatch prefetch profile bench rest avx512"]
#        [DEADLINE=540]
#        bash benchmarks/device_check.sh
# Steps run in the order given, each time-boxed and all of them within DEADLINE seconds of the start (a step that
# would get under 15 s is skipped), so that a lease's minutes are spent on what comes first.
# Exit status: 0 when every step that ran passed, else the number of failed or skipped steps.
set -uo pipefail
OUT=${OUT:-/tmp/hybridmoe-device-check}
PYTHON=${PYTHON:-python3}
STEPS=${STEPS-kernels amx dispatch prefetch profile bench rest avx512}
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
failed=0

. benchmarks/check_step.sh

TAIL=40 step 400 build.log env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index -q -e . || true
"$PYTHON" -c "import hybridmoe.kernels._native" 2>/dev/null || { echo "build failed"; exit 99; }

{ lscpu; echo; nvidia-smi -L 2>&1; echo; "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__,
'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"; } >"$OUT/info.txt" 2>&1
TAIL=12 step 60 info.txt "$PYTHON" -m hybridmoe.cli info

# the tests in parallel where pytest-xdist is installed (half the CPUs, at most 8 workers)
workers=$(( $(nproc) / 2 < 8 ? $(nproc) / 2 : 8 ))
xdist=$("$PYTHON" -c "import xdist" 2>/dev/null && [ $workers -gt 1 ] && echo "-n $workers")
# the import-direction test needs import-linter, which an accelerator machine's image may lack
nolint=$("$PYTHON" -c "import importlinter" 2>/dev/null ||
         echo "--deselect tests/test_architecture.py::test_imports_only_go_downwards")
for s in $STEPS; do
  case $s in
    kernels) TAIL=15 step 240 tests_kernels.log "$PYTHON" -m pytest -q -p no:cacheprovider $xdist tests/kernels ;;
    amx) if "$PYTHON" -c "import sys; from hybridmoe.kernels import isa; sys.exit('amx' not in isa.available_isas())"
         then TAIL=70 step 150 bench.txt "$PYTHON" benchmarks/bf16_dot.py --isas avx512,amx --paths auto,gemm \
                --tokens 1,2,3,4,6,8,16,32 --seconds 0.1
         else echo "== amx: skipped, this CPU (or its kernel) grants no AMX"; fi ;;
    dispatch) TAIL=25 step 90 bench.txt "$PYTHON" benchmarks/dispatch.py --spins-us 100,10000 --calls 1000 \
                --rounds 3 ;;
    prefetch) TAIL=19 step 150 bench.txt "$PYTHON" benchmarks/prefetch_level.py --tokens 1,4 --rounds 6 \
                --seconds 0.15 ;;
    quick) TAIL=45 step 120 bench.txt "$PYTHON" -m hybridmoe.cli bench kernels --quick --json "$OUT/bench_quick.json" ;;
    bench) TAIL=45 step 360 bench.txt "$PYTHON" -m hybridmoe.cli bench kernels --json "$OUT/bench_best.json" ;;
    avx512) if "$PYTHON" -c "import sys; from hybridmoe.kernels import isa; sys.exit('avx512' not in isa.available_isas())"
            then TAIL=12 step 240 bench.txt env HYBRIDMOE_ISA=avx512 \
                   "$PYTHON" -m hybridmoe.cli bench kernels --formats fp8,bf16 --json "$OUT/bench_avx512.json"
            else echo "== avx512: skipped, this CPU has no AVX-512"; fi ;;
    avx2) TAIL=12 step 120 bench.txt env HYBRIDMOE_ISA=avx2 \
            "$PYTHON" -m hybridmoe.cli bench kernels --quick --json "$OUT/bench_avx2.json" ;;
    profile) TAIL=5 step 120 bench.txt "$PYTHON" -m hybridmoe.cli profile --quick --out "$OUT/profile.json" ;;
    rest) TAIL=25 step 240 tests_rest.log "$PYTHON" -m pytest -q -p no:cacheprovider $xdist $nolint \
            --ignore=tests/kernels tests ;;
    *) echo "unknown step $s"; failed=$((failed + 1)) ;;
  esac
done
echo "== done: $failed failed step(s)"
exit $failed
