#!/usr/bin/env bash
# Create .venv and install specllama with its test extras, with llama.cpp built for this machine.
#
#   bash scripts/setup.sh                # set up (the first run compiles llama.cpp, ~10 min on 2 cores)
#   bash scripts/setup.sh --print-build  # only say which llama.cpp build this machine gets, and why
#   SPECLLAMA_RPC=0 bash scripts/setup.sh  # leave out llama.cpp's RPC backend (specllama worker, --rpc)
#
# The build: your CMAKE_ARGS if set; else Metal on Apple Silicon, CUDA where an NVIDIA GPU and
# the CUDA toolkit (nvcc) are present, CPU otherwise; each with the RPC backend, which adds
# two source files to the build (measured in the README). The compiled wheel is kept in
# ~/.cache/specllama/wheels under a key of its build arguments, so a change of build compiles
# again while a fresh checkout on the same machine reuses it (pip's own cache ignores CMAKE_ARGS).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"

choose_build() {
  # Sets BUILD (a name), BUILD_ARGS (CMAKE_ARGS for llama.cpp), BUILD_CFLAGS (compiler flags,
  # passed as CFLAGS/CXXFLAGS, which CMake takes as its initial C/C++ flags) and BUILD_REASON.
  BUILD_CFLAGS=""
  if [ -n "${CMAKE_ARGS:-}" ]; then
    BUILD=custom BUILD_ARGS=$CMAKE_ARGS BUILD_REASON="CMAKE_ARGS is set, so it is used as given"
    return
  fi
  local os arch
  os=$(uname -s) arch=$(uname -m)
  if [ "$os" = Darwin ]; then
    if [ "$arch" = arm64 ]; then
      BUILD=metal BUILD_ARGS="-DGGML_METAL=on" BUILD_REASON="Apple Silicon: the GPU is Metal, sharing the Mac's memory"
    else
      BUILD=cpu BUILD_ARGS="-DGGML_METAL=off" BUILD_REASON="an Intel Mac: Metal offload does not pay there, CPU build"
    fi
    return
  fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
    local gpu
    gpu=$(nvidia-smi -L 2>/dev/null | head -n 1)
    if command -v nvcc >/dev/null 2>&1; then
      BUILD=cuda BUILD_ARGS="-DGGML_CUDA=on"
      BUILD_REASON="NVIDIA GPU ($gpu) and the CUDA toolkit ($(nvcc --version | grep -o 'release [0-9.]*' | head -n 1))"
    else
      BUILD=missing-cuda-toolkit BUILD_ARGS=""
      BUILD_REASON="this machine has an NVIDIA GPU ($gpu) but no CUDA toolkit: nvcc is not on PATH. Install the \
CUDA toolkit (e.g. 'sudo apt install nvidia-cuda-toolkit', or NVIDIA's installer) and run setup again, or build \
for the CPU on purpose with CMAKE_ARGS=-DGGML_CUDA=off"
    fi
    return
  fi
  BUILD=cpu BUILD_ARGS="" BUILD_REASON="no GPU backend found (no Apple Silicon, no NVIDIA GPU with nvidia-smi)"
  if [ "$arch" = x86_64 ] || [ "$arch" = amd64 ]; then
    # llama.cpp's AMX kernels crashed with an illegal instruction (tilezero) on a Sapphire Rapids
    # VM that advertises AMX; the AVX-512 kernels run everywhere -march=native allows. Each AMX
    # part is named: -march=native turns on any that is not explicitly off.
    BUILD_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    BUILD_REASON="$BUILD_REASON; x86-64: native instructions except AMX"
  fi
}

choose_build
if [ -z "${CMAKE_ARGS:-}" ] && [ "${SPECLLAMA_RPC:-1}" != 0 ] && [ "$BUILD" != missing-cuda-toolkit ]; then
  BUILD_ARGS="${BUILD_ARGS:+$BUILD_ARGS }-DGGML_RPC=ON" BUILD="$BUILD+rpc"
fi
if [ "${1:-}" = "--print-build" ]; then
  echo "build: $BUILD"
  echo "CMAKE_ARGS: $BUILD_ARGS"
  echo "CFLAGS: $BUILD_CFLAGS"
  echo "reason: $BUILD_REASON"
  [ "$BUILD" != missing-cuda-toolkit ]
  exit
fi
if [ "$BUILD" = missing-cuda-toolkit ]; then
  echo "setup: $BUILD_REASON" >&2
  exit 1
fi

PYTHON=${PYTHON:-python3}
check_python() {
  # what the venv needs, named before anything is downloaded or compiled
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "setup: needs Python 3.10 or newer: '$PYTHON' is not on PATH (set PYTHON=/path/to/python3.11)" >&2
    exit 1
  fi
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "setup: needs Python 3.10 or newer; $PYTHON is $("$PYTHON" -V 2>&1) (macOS's /usr/bin/python3 is 3.9:" \
         "brew install python@3.11, then PYTHON=python3.11 bash scripts/setup.sh)" >&2
    exit 1
  fi
  if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    echo "setup: $PYTHON has no venv module with pip (Debian/Ubuntu: sudo apt install python3-venv)" >&2
    exit 1
  fi
}
check_compiler() {
  if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
    echo "setup: compiling llama.cpp needs a C/C++ compiler, and none is on PATH (Debian/Ubuntu: sudo apt install" \
         "build-essential; Fedora: sudo dnf install gcc-c++; macOS: xcode-select --install)" >&2
    exit 1
  fi
  local free_kb
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt 6000000 ]; then
    echo "setup: warning: $((free_kb / 1024)) MiB free here; the build and the demo's models take about 6 GB" >&2
  fi
}
if [ ! -x .venv/bin/python ]; then
  check_python
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi

STAMP=.venv/llama-cpp-build.txt
BUILD_ID="$LLAMA_CPP_PYTHON $BUILD_ARGS $BUILD_CFLAGS"
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null || [ "$(cat "$STAMP" 2>/dev/null)" != "$BUILD_ID" ]; then
  # hashed in Python: stock macOS has no sha256sum, and a fallback after a failed pipe read the terminal
  key=$(.venv/bin/python -c "import hashlib, sys, sysconfig
print(hashlib.sha256(f'{sys.argv[1]}\n{sys.version} {sysconfig.get_platform()}\n'.encode()).hexdigest())" "$BUILD_ID")
  wheels="${XDG_CACHE_HOME:-$HOME/.cache}/specllama/wheels/${key:0:16}"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    check_compiler
    echo "setup: compiling $LLAMA_CPP_PYTHON for $BUILD - about 10 minutes on 2 cores, once per build" >&2
    echo "setup: $BUILD_REASON" >&2
    mkdir -p "$wheels"
    CMAKE_ARGS=$BUILD_ARGS CFLAGS="${CFLAGS:-} $BUILD_CFLAGS" CXXFLAGS="${CXXFLAGS:-} $BUILD_CFLAGS" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || sysctl -n hw.ncpu)} \
      .venv/bin/python -m pip wheel --quiet --disable-pip-version-check --no-cache-dir --no-deps \
      -w "$wheels" "$LLAMA_CPP_PYTHON"
  fi
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
  echo "$BUILD_ID" > "$STAMP"
fi
# the test tools at the versions the suite passed with (scripts/constraints.txt)
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e '.[test]'
