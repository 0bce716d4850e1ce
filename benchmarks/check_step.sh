# Sourced by device_check.sh and gpu_check.sh (from the repo root, with OUT, DEADLINE and failed set).
# step SECONDS LOGFILE COMMAND...: runs COMMAND time-boxed to SECONDS and to what is left of DEADLINE (skipped under
# 15 s), its output appended to $OUT/LOGFILE and its last TAIL lines (20) shown; a failure or skip counts in $failed.
step() {  # step SECONDS LOGFILE COMMAND...: time-boxed, output to $OUT/LOGFILE, its last lines to the screen
  local seconds=$1 log=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  [ $left -lt $seconds ] && seconds=$left
  if [ $seconds -lt 15 ]; then echo "== $log: $* skipped, ${left}s left"; failed=$((failed + 1)); return; fi
  echo "== $log: $* (at most ${seconds}s)"
  local start=$SECONDS
  timeout "$seconds" "$@" >>"$OUT/$log" 2>&1
  local status=$?
  tail -${TAIL:-20} "$OUT/$log"
  echo "-- $log: status $status after $((SECONDS - start))s"
  [ $status -eq 0 ] || failed=$((failed + 1))
}
