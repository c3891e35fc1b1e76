#!/usr/bin/env bash
# Repository hygiene ruff cannot see: odd file names (editing accidents) and YAML whitespace.
set -euo pipefail
cd "$(dirname "$0")/.."
odd=$(git ls-files | LC_ALL=C grep -vE '^[A-Za-z0-9_./+@=-]+$' || true)
if [ -n "$odd" ]; then
  echo "tracked files with odd names:" >&2; echo "$odd" >&2; exit 1
fi
trailing=$(git grep -nI -E '[[:space:]]+$' -- '*.yml' '*.yaml' '*.pbtxt' '*.toml' || true)
if [ -n "$trailing" ]; then
  echo "trailing whitespace:" >&2; echo "$trailing" >&2; exit 1
fi
