#!/usr/bin/env bash
# The GEMV of the kernel headers at a git ref against the working tree's, compiled side by side into one
# program that times them alternately on the same matrices (gemv_ab/main.cpp): the host's bandwidth drifts too
# much between separate runs to see a few percent.
#
#   benchmarks/gemv_ab.sh [--base REF] [--isa avx2|avx512|avx512bf16] FORMAT ROWS COLS TOKENS...
#
# REF defaults to HEAD; the ISA defaults to the table hybridmoe would choose here (avx512bf16 on AMD CPUs with
# AVX512-BF16, else avx512 where the CPU has it, else avx2). FORMAT fp8 | bf16 | int4 | int8; COLS a multiple
# of 128. Example: benchmarks/gemv_ab.sh fp8 2048 7168 1 2 4 8. Needs git and a C++17 compiler ($CXX, g++).
# Environment: HM_AB_POOL_BYTES (the matrices rotate over ~400 MB), HM_AB_HUGE_PAGES=1 (matrices on transparent
# huge pages, as the kernels' own copies of the experts are), HM_AB_INT_GROUP=32|128 (int4 / int8 scale groups;
# default 128), HM_AB_SUBNORMALS=1 (fp8: a subnormal code about 1 in 5000, as in real checkpoints; default none),
# HM_AB_THREADS=n (each side on n threads at once, each over its share of the matrices; default 1),
# HM_AB_SHORT_ROW_PREFETCH=l1|l2 (where both sides' far prefetch puts short rows, as HYBRIDMOE_SHORT_ROW_PREFETCH
# does in hybridmoe; default l1, a side whose headers predate the setting always l1), HM_AB_LONG_ROW_PREFETCH=on|off
# (whether both sides' one-row tiles of long rows prefetch the next row, as HYBRIDMOE_LONG_ROW_PREFETCH does; default
# on, a side whose headers predate the setting always on), HM_AB_BUILD_DIR=DIR (build
# into DIR and reuse the program there while the base, ISA, compiler and sources are the same; default a
# temporary directory).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
base=HEAD
isa=""
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --base) base=$2; shift 2 ;;
    --isa) isa=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
if [[ -z $isa ]]; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  has() { [[ " $flags " == *" $1 "* ]]; }
  if has avx512f && has avx512bw && has avx512vl && has avx512dq && has avx512_vnni; then
    isa=avx512
    if has avx512_bf16 && grep -q -m1 AuthenticAMD /proc/cpuinfo; then isa=avx512bf16; fi
  else
    isa=avx2
  fi
fi
cflags=(-mavx2 -mfma -mf16c)
case $isa in
  avx2) vocab=hm::Avx2 ;;
  avx512) vocab=hm::Avx512; cflags+=(-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -DHM_AB_AVX512) ;;
  avx512bf16) vocab=hm::Avx512Bf16
    cflags+=(-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -DHM_AB_AVX512) ;;
  *) echo "--isa must be avx2, avx512 or avx512bf16, got $isa" >&2; exit 2 ;;
esac
if [[ -n ${HM_AB_INT_GROUP:-} && $HM_AB_INT_GROUP != 32 && $HM_AB_INT_GROUP != 128 ]]; then
  echo "HM_AB_INT_GROUP must be 32 or 128, got $HM_AB_INT_GROUP" >&2
  exit 2
fi
if [[ -n ${HM_AB_THREADS:-} && ! $HM_AB_THREADS =~ ^([1-9]|[1-5][0-9]|6[0-4])$ ]]; then
  echo "HM_AB_THREADS must be 1..64, got $HM_AB_THREADS" >&2
  exit 2
fi
if [[ -n ${HM_AB_SHORT_ROW_PREFETCH:-} && $HM_AB_SHORT_ROW_PREFETCH != l1 && $HM_AB_SHORT_ROW_PREFETCH != l2 ]]; then
  echo "HM_AB_SHORT_ROW_PREFETCH must be l1 or l2, got $HM_AB_SHORT_ROW_PREFETCH" >&2
  exit 2
fi
if [[ -n ${HM_AB_LONG_ROW_PREFETCH:-} && $HM_AB_LONG_ROW_PREFETCH != on && $HM_AB_LONG_ROW_PREFETCH != off ]]; then
  echo "HM_AB_LONG_ROW_PREFETCH must be on or off, got $HM_AB_LONG_ROW_PREFETCH" >&2
  exit 2
fi
cxx=${CXX:-g++}
if [[ -n ${HM_AB_BUILD_DIR:-} ]]; then
  tmp=$HM_AB_BUILD_DIR
  mkdir -p "$tmp"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
fi
# what the program is built from: a build dir's program is reused while this is unchanged
stamp=$( { git -C "$repo" rev-parse "$base"; echo "$isa $cxx"; cat "$repo"/csrc/*.h "$repo"/csrc/*.cpp "$here"/gemv_ab/*; } |
  sha256sum | cut -d' ' -f1)
if [[ ! -x $tmp/gemv_ab || $(cat "$tmp/stamp" 2>/dev/null) != "$stamp" ]]; then
  rm -rf "$tmp/base" "$tmp/stamp"
  mkdir "$tmp/base"
  git -C "$repo" archive "$base" csrc | tar -x -C "$tmp/base"
  common=(-O3 -std=c++17 "${cflags[@]}" "-DVOCAB=$vocab")
  "$cxx" "${common[@]}" -I"$tmp/base/csrc" -DSIDE=run_base -c "$here/gemv_ab/side.cpp" -o "$tmp/base.o" &
  "$cxx" "${common[@]}" -I"$repo/csrc" -DSIDE=run_work -c "$here/gemv_ab/side.cpp" -o "$tmp/work.o"
  wait
  "$cxx" -O2 -std=c++17 -mavx2 -I"$repo/csrc" "$here/gemv_ab/main.cpp" "$repo/csrc/activation_quant.cpp" \
    "$tmp/base.o" "$tmp/work.o" -pthread -o "$tmp/gemv_ab"
  echo "$stamp" > "$tmp/stamp"
fi
echo "base $(git -C "$repo" rev-parse --short "$base") vs working tree, ISA $isa, short rows prefetched to" \
  "${HM_AB_SHORT_ROW_PREFETCH:-l1}, long rows' next-row prefetch ${HM_AB_LONG_ROW_PREFETCH:-on}," \
  "${HM_AB_THREADS:-1} thread(s)"
"$tmp/gemv_ab" "$@"
