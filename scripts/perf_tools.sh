#!/usr/bin/env bash
# Install the load tools for `dejavu bench serving` (idempotent, fast when done):
#   - perf_analyzer 2.51 from the tritonclient 2.51.0 wheel (venv perf): the
#     newest build that runs on Debian 12's glibc 2.36; it needs libb64 (apt) and
#     libcudart.so.12 (nvidia-cuda-runtime-cu12, found through LD_LIBRARY_PATH);
#   - genai-perf 0.0.16 (venv genai-perf): it pulls numpy 2, which must stay out of
#     .venv (the Triton Python backend returns empty tensors with numpy 2);
#   - aiperf 0.13 (venv aiperf; genai-perf's successor; its own pins again).
# Prints `KEY=value` lines saying where things are (clients/perf.py reads them).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_PYTHON=${BASE_PYTHON:-/usr/bin/python3}
# Outside the checkout, as podman's storage is (scripts/podman_env.sh): a fresh clone on
# a machine that has them does not install them again.
TOOLS_DIR=${DEJAVU_TOOLS_DIR:-/var/tmp/dejavu-tools}
PERF_VENV=${PERF_VENV:-$TOOLS_DIR/perf}
GENAI_VENV=${GENAI_VENV:-$TOOLS_DIR/genai-perf}
AIPERF_VENV=${AIPERF_VENV:-$TOOLS_DIR/aiperf}
TRITONCLIENT=tritonclient[all]==2.51.0
CUDART=nvidia-cuda-runtime-cu12==12.9.79  # libcudart.so.12
GENAI_PERF=genai-perf==0.0.16
AIPERF=aiperf==0.13.0

log() { echo "perf_tools: $*" >&2; }

install_libb64() {
  # grep without -q reads to the end: an early exit would fail ldconfig under pipefail.
  if ldconfig -p | grep 'libb64\.so\.0d' >/dev/null; then return; fi
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  log "installing libb64-0d (apt)"
  # The package index of a fresh machine may be stale or empty: update only then.
  $sudo apt-get install -y -q libb64-0d >/dev/null ||
    { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q libb64-0d >/dev/null; }
}

# venv_with DIR PACKAGES...: a venv at DIR holding PACKAGES; DIR/.installed records them,
# so a second run with the same packages does nothing.
venv_with() {
  local dir=$1 marker=$1/.installed; shift
  if [[ -f $marker && $(cat "$marker") == "$*" ]]; then return; fi
  log "installing $* into $dir"
  [[ -x $dir/bin/python ]] || "$BASE_PYTHON" -m venv "$dir"
  "$dir/bin/pip" install -q --disable-pip-version-check "$@"
  echo "$*" >"$marker"
}

install_libb64
# Shared by every checkout on the machine: one installs at a time, the others then find
# the venvs made.
mkdir -p "$TOOLS_DIR"
exec 9>"$TOOLS_DIR/.lock"
flock 9
# Three independent installs, side by side (on a fresh machine ~3 min one after another).
pids=()
venv_with "$PERF_VENV" "$TRITONCLIENT" "$CUDART" & pids+=($!)
venv_with "$GENAI_VENV" "$GENAI_PERF" & pids+=($!)
venv_with "$AIPERF_VENV" "$AIPERF" & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || { log "an install failed"; exit 1; }; done

PERF_ANALYZER=$PERF_VENV/bin/perf_analyzer
CUDART_LIB=$("$PERF_VENV/bin/python" -c \
  'import nvidia.cuda_runtime, os; print(os.path.join(nvidia.cuda_runtime.__path__[0], "lib"))')
# A smoke run proves the binary finds its libraries (a missing one fails here, not mid-bench).
for tool in "$PERF_ANALYZER" "$GENAI_VENV/bin/genai-perf" "$AIPERF_VENV/bin/aiperf"; do
  LD_LIBRARY_PATH=$CUDART_LIB "$tool" --version >/dev/null 2>&1 ||
    { log "$tool does not run:"; LD_LIBRARY_PATH=$CUDART_LIB "$tool" --version; exit 1; }
done

echo "PERF_ANALYZER=$PERF_ANALYZER"
echo "PERF_LD_LIBRARY_PATH=$CUDART_LIB"
echo "GENAI_PERF=$GENAI_VENV/bin/genai-perf"
echo "AIPERF=$AIPERF_VENV/bin/aiperf"
