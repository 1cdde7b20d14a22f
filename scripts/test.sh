#!/usr/bin/env bash
# Set up, fetch the test models (once), check the code (ruff, mypy) and run the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/fetch_models.py target draft gemma smollm2 target-f16 >/dev/null  # F16: made once from target
.venv/bin/ruff check specllama tests benchmarks scripts
.venv/bin/mypy
if [ $# -eq 0 ]; then
  # the pure modules first (about a minute): a layout, verifier or sampler slip fails at once, not
  # after the whole suite; the second run leaves them out
  fast=(tests/test_layout.py tests/test_sampling.py tests/test_verify.py tests/test_text.py tests/test_tree_verify.py
        tests/test_records.py tests/test_registry.py tests/test_messages.py)
  .venv/bin/python -m pytest -q -x "${fast[@]}"
  for module in "${fast[@]}"; do set -- "$@" --ignore "$module"; done
fi
# every test's time goes to .test-results/durations.txt (tests/conftest.py); a hung test fails
# after pyproject.toml's timeout instead of holding CI for its 90 minutes
exec .venv/bin/python -m pytest -q --durations=25 --junitxml=.test-results/junit.xml "$@"
