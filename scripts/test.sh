#!/usr/bin/env bash
# Set up, fetch the test models (once), check the code (ruff, mypy) and run the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/fetch_models.py target draft gemma smollm2 >/dev/null
.venv/bin/ruff check specllama tests benchmarks scripts
.venv/bin/mypy
exec .venv/bin/python -m pytest -q --durations=25 "$@"
