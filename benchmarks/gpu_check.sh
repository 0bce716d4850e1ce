#!/usr/bin/env bash
# The check to run on a lent GPU machine for hybrid execution (issue 44): it installs nothing from the network.
# It builds the package in place through benchmarks/device_check.sh (its build and info steps only), then writes
# under $OUT, each step time-boxed, all within DEADLINE seconds:
#   build.log, info.txt   from device_check.sh (the build; the machine, GPUs and `hybridmoe info`);
#   tests_gpu.log         the GPU tests: tests named *cuda* under tests/hybrid, tests/accel and tests/disagg (the
#                         same greedy tokens with stream-loading prefill on CUDA as the plain engine; dual-batch
#                         overlap's decode on CUDA against the steps whole and the plain engine; the PD KV handoff
#                         from and into caches on CUDA, ...), skipped without CUDA;
#   slp.json, slp.txt     benchmarks/slp_check.py: pinned host->device copy bandwidth; a DeepSeek-V3-shaped slice
#                         (4 MoE layers of 256 FP8 experts of 7168 x 2048 with block scales, random bytes) streamed
#                         for a 4096-token chunk: SLP's achieved H2D throughput as a fraction of the pinned
#                         bandwidth (goal >= 0.90 with compute overlapped), the slice's prefill tok/s (experts
#                         half) next to the planner's prediction; hybrid decode tok/s of the demo model through the
#                         engine on CUDA next to its plan's predicted decode tok/s;
#   overlap.json, overlap.txt   benchmarks/overlap_decode.py (issue 45): aggregate decode throughput with
#                         dual-batch overlap and without, alternating rounds in one process, on a Qwen3-MoE-shaped
#                         bf16 model (--shape gpu: 4 layers of 64 experts of 768 x 2048, 2.4 GB, written once under
#                         $MODELS) with a 2 GB budget (1 GB of it the plan's CUDA reserve; attention, routers, KV
#                         and ~50 hot experts on the GPU, the other ~200 on the CPU kernels), 16 sequences of
#                         512-token prompts: the ratio on/off (the seed paper: +50%), the CPU experts' time per step
#                         and the part of it the forward waited for;
#   pd_tpot.json, pd_tpot.txt   benchmarks/pd_tpot.py (issue 45): the decode TPOT of 4 users while one 4000-token
#                         prompt prefills, one engine against prefill/decode disaggregation (`serve --pd`: two worker
#                         processes, each its own CUDA context; and the same with the prefill worker on a quarter
#                         of the CPUs, the decode worker on the rest), demo model, alternating rounds in one
#                         process: the rise over their undisturbed TPOT (goal < 10% with PD) and the long prompt's TTFT;
#   pd_kv_streaming.json, pd_kv_streaming.txt   benchmarks/pd_kv_streaming.py (issue 45): `serve --pd` with the
#                         prompt's KV streamed layer by layer and packed after the prefill, side by side, demo model,
#                         a 3000-token prompt: TTFT and the first-to-second token time of each;
#   costmodel_slp.json    `hybridmoe bench costmodel --cases slp`: the SLP cases predicted vs measured on CUDA.
# Usage: OUT=/some/dir [PYTHON=python3] [DEADLINE=600] [MODELS=/tmp/hybridmoe-check-models] bash benchmarks/gpu_check.sh
# Host memory: the slice holds one layer of experts (11.3 GB) on the host and two slots (22.5 GB) on the GPU.
# Exit status: 0 when every step passed, else the number of failed or skipped steps.
set -uo pipefail
OUT=${OUT:-/tmp/hybridmoe-gpu-check}
PYTHON=${PYTHON:-python3}
DEADLINE=${DEADLINE:-600}
MODELS=${MODELS:-${TMPDIR:-/tmp}/hybridmoe-check-models}  # the benchmark's random model: never under $OUT
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
failed=0

. benchmarks/check_step.sh

OUT="$OUT" PYTHON="$PYTHON" STEPS="" DEADLINE=$((DEADLINE / 2)) bash benchmarks/device_check.sh || true
"$PYTHON" -c "import hybridmoe.kernels._native" 2>/dev/null || { echo "build failed"; exit 99; }
"$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" ||
  echo "!! torch sees no CUDA device: the GPU tests skip and the measures run on the CPU stand-in"

TAIL=15 step 180 tests_gpu.log "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/hybrid tests/accel tests/disagg \
  -k cuda
TAIL=8 step 240 slp.txt "$PYTHON" benchmarks/slp_check.py --json "$OUT/slp.json"
TAIL=12 step 240 overlap.txt "$PYTHON" benchmarks/overlap_decode.py --shape gpu --cache-dir "$MODELS" --vram 2GB \
  --batch 16 --prompt-tokens 512 --tokens 32 --rounds 3 --json "$OUT/overlap.json"
TAIL=8 step 150 pd_tpot.txt "$PYTHON" benchmarks/pd_tpot.py --long-tokens 4000 --rounds 3 --json "$OUT/pd_tpot.json"
TAIL=6 step 90 pd_kv_streaming.txt "$PYTHON" benchmarks/pd_kv_streaming.py --rounds 3 \
  --json "$OUT/pd_kv_streaming.json"
TAIL=8 step 180 costmodel_slp.txt "$PYTHON" -m hybridmoe.cli bench costmodel --cases slp --rounds 2 \
  --json "$OUT/costmodel_slp.json"
echo "gpu_check: $failed step(s) failed or skipped; results in $OUT"
exit $failed
