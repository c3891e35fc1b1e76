#!/usr/bin/env bash
# The README's main command (`make demo`): make a tiny dummy model, start a
# frontend + 1 prefill node + 1 decode node (real tritonservers on loopback),
# stream a generation over HTTP and over gRPC, ask the OpenAI-compatible API, and stop
# the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-runs/demo}
MODEL_DIR=${MODEL_DIR:-$RUN_DIR/tiny-llama}

if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  dejavu model make --arch llama --preset tiny "$MODEL_DIR"
fi

trap 'dejavu down --dir "$RUN_DIR" >/dev/null 2>&1 || true' EXIT
dejavu up --prefill 1 --decode 1 --model "$MODEL_DIR" --dir "$RUN_DIR"
dejavu status --dir "$RUN_DIR"

echo "--- HTTP generate_stream (prompt on the P-node, tokens from the T-node):"
dejavu generate --dir "$RUN_DIR" --stream --max-tokens 24 "The prompt phase reads the whole prompt"
echo "--- gRPC stream:"
dejavu generate --dir "$RUN_DIR" --protocol grpc --stream --max-tokens 24 "Where is the server?"
echo "--- OpenAI-compatible API (/v1/completions, greedy):"
API=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["openai"]["url"])' \
  "$RUN_DIR/cluster.json")
curl -sf "$API/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$(basename "$MODEL_DIR")\", \"prompt\": \"Hello\", \"max_tokens\": 16, \"temperature\": 0}"
echo

trap - EXIT
dejavu down --dir "$RUN_DIR"
echo "logs: $RUN_DIR/logs"
