#!/usr/bin/env bash
# Create .venv and install specllama with its test extras. The first run compiles llama.cpp
# (llama-cpp-python ships as source only): about 10 minutes on 2 cores; later runs are quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "setup: compiling llama-cpp-python (llama.cpp) - about 10 minutes on 2 cores, once" >&2
fi
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || sysctl -n hw.ncpu)} \
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
