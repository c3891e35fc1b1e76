#!/usr/bin/env bash
# Profile the serving path under `dejavu bench serving --cpu`'s 64 streams: py-spy on the
# frontend's orchestrator stub (GIL-holding samples) and on the T-node's token service, perf
# on the frontend tritonserver, for 15 s once the stub is busy. Needs py-spy
# (`.venv/bin/pip install py-spy`) and perf; root, or ptrace and perf_event access.
#   bash scripts/profile_serving_cpu.sh OUT_DIR [more bench serving args]
# OUT_DIR gets the bench's cpu.csv, stub.txt and token-service.txt (py-spy raw: one stack a
# line and its samples) and perf.data (`perf report -i OUT_DIR/perf.data --sort dso`).
# On a host other work keeps busy py-spy falls behind and takes few samples: read counts.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "$1"); shift
mkdir -p "$out"
.venv/bin/dejavu bench serving --cpu --concurrency 64 --max-tokens 900 --out "$out" "$@" \
  > "$out/bench.log" 2>&1 &
bench=$!
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || true; }
stub=""
for _ in $(seq 1 300); do  # the stub of this run's frontend, once it spends > 1/4 core
  stub=$(pgrep -f "$out/cluster/repos/frontend/orchestrator/1/model.py" | head -1 || true)
  if [ -z "$stub" ]; then sleep 1; continue; fi
  a=$(ticks "$stub"); sleep 1; b=$(ticks "$stub")
  if [ -n "$a" ] && [ -n "$b" ] && [ $((b - a)) -gt 25 ]; then break; fi
  stub=""
done
[ -n "$stub" ] || { echo "the frontend stub never got busy; see $out/bench.log" >&2; exit 1; }
service=""
for pid in $(pgrep -f orchestrator.serving.service_process || true); do
  parent=$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null || true)
  if [ -n "$parent" ] && grep -qa "$out/cluster" "/proc/$parent/cmdline"; then service=$pid; fi
done
server=""
for pid in $(pgrep -x tritonserver || true); do
  if grep -qa "$out/cluster/repos/frontend" "/proc/$pid/cmdline"; then server=$pid; fi
done
.venv/bin/py-spy record --pid "$stub" --gil --rate 100 --duration 15 --format raw \
  -o "$out/stub.txt" > "$out/py-spy-stub.log" 2>&1 &
if [ -n "$service" ]; then
  .venv/bin/py-spy record --pid "$service" --rate 100 --duration 15 --format raw \
    -o "$out/token-service.txt" > "$out/py-spy-service.log" 2>&1 &
fi
if [ -n "$server" ]; then
  perf record -F 500 -g -p "$server" -o "$out/perf.data" -- sleep 15 > "$out/perf.log" 2>&1 &
fi
wait "$bench"
tail -3 "$out/bench.log"
