#!/usr/bin/env bash
# Set up, fetch the Qwen2.5-Coder 1.5B target + 0.5B draft (about 1.6 GB, once), then run
# speculative decoding on a prompt. Extra arguments go to `specllama run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
TARGET=$(.venv/bin/python scripts/fetch_models.py --path target)
.venv/bin/python scripts/fetch_models.py draft >/dev/null  # next to the target: --draft auto finds it
PROMPT=${PROMPT:-"Write a Python function that returns the n-th Fibonacci number, with a docstring."}
exec .venv/bin/specllama run "$TARGET" "$PROMPT" --max-tokens 128 "$@"
