#!/usr/bin/env bash
# Set up, fetch the Qwen2.5-Coder 1.5B target + 0.5B draft (about 1.6 GB, once), then generate
# with speculative decoding and compare with plain decoding of the same prompt: once on code
# (the draft model guesses ahead) and once on an edit (prompt lookup copies from the input).
# Extra arguments go to both `specllama run` calls.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
TARGET=$(.venv/bin/python scripts/fetch_models.py --path target)
.venv/bin/python scripts/fetch_models.py draft >/dev/null  # next to the target: --draft auto finds it
PROMPT=${PROMPT:-"Write a Python function that returns the n-th Fibonacci number, with a docstring."}
EDIT_PROMPT="Rename the variable total to subtotal everywhere in this code and output only the code:

def checkout(cart, tax_rate):
    total = 0
    for item in cart:
        total += item.price * item.quantity
    total = round(total * (1 + tax_rate), 2)
    return total"
if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$(uname -s)/$(uname -m)" != Darwin/arm64 ]; then
  echo "demo: no GPU here. On a CPU the target is compute-bound: a verify pass of several tokens costs more" >&2
  echo "demo: than one, so expect code at or a little below plain decoding's speed and the edit faster (prompt lookup" >&2
  echo "demo: copies from the input). On a GPU or Apple Silicon the draft pays on code too." >&2
fi
echo "== code, speculative then plain ==" >&2
.venv/bin/specllama run "$TARGET" "$PROMPT" --max-tokens 128 --compare "$@"
echo >&2
echo "== an edit, speculative then plain ==" >&2
.venv/bin/specllama run "$TARGET" "$EDIT_PROMPT" --max-tokens 128 --compare "$@"
