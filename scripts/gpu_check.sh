#!/usr/bin/env bash
# The prepared GPU check: scripts/gpu_check.py on CUDA (a JSON report; --cpu: the CPU
# stands in, as CI runs it). For a GPU machine with Python 3.12 and CUDA torch but no
# internet, tritonserver or NIXL:
#   here:  bash scripts/gpu_check.sh --download wheels   # what it may lack, for Python 3.12
#   there: bash scripts/gpu_check.sh --wheels wheels --out gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NEEDS=(transformers tokenizers safetensors)
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --download)
            "$PYTHON" -m pip download -q -d "$2" --only-binary=:all: --python-version 3.12 \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
                --platform manylinux2014_x86_64 "${NEEDS[@]}"
            du -sh "$2"; exit 0 ;;
        --wheels)
            "$PYTHON" -m pip install -q --no-index --find-links "$2" "${NEEDS[@]}"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
# Run from the checkout (the package pins Python 3.11; this needs only torch and the above).
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} exec timeout 480 "$PYTHON" scripts/gpu_check.py "${args[@]}"
