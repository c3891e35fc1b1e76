#!/usr/bin/env bash
# Runs a command under `timeout -s TERM`, then checks that no process it started (directly
# or not: each inherits a mark in its environment) outlives it by more than a grace period.
# Usage: scripts/check_run_teardown.sh [SECONDS [COMMAND...]]  (default: 60 make test-slow)
set -euo pipefail
seconds=${1:-60}
shift || true
[ $# -gt 0 ] || set -- make test-slow
mark="DEJAVU_RUN_MARK=$$-$(date +%s%N)"

marked() {  # pids whose environment carries the mark (only this user's are readable)
  grep -lsxz -- "$mark" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true
}

status=0
env "$mark" timeout -s TERM "$seconds" "$@" || status=$?
echo "the command ended with $status"
for _ in $(seq 60); do  # 30 s for what is still stopping
  left=$(marked)
  [ -z "$left" ] && { echo "no process of the run is left"; exit 0; }
  sleep 0.5
done
echo "processes of the run still running 30 s after it ended:"
for pid in $left; do
  echo "  $pid $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-200)"
done
exit 1
