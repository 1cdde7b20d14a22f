#!/usr/bin/env bash
# Build llama-server from the llama.cpp that llama-cpp-python vendors (the same version specllama
# runs on), for benchmarks that compare against it. Not part of setup or the test suite.
#
#   bash scripts/build_llama_server.sh   # prints the binary's path; ~7 minutes on 2 cores, once
#
# CPU build with the same x86-64 flags as setup.sh; no web UI (nothing fetched at build time).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(grep -o 'llama-cpp-python==[0-9.]*' scripts/setup.sh | head -n 1 | cut -d= -f3)
home="${XDG_CACHE_HOME:-$HOME/.cache}/specllama/llama-server-$VERSION"
binary="$home/bin/llama-server"
if [ -x "$binary" ]; then
  echo "$binary"
  exit
fi
mkdir -p "$home"
if [ ! -d "$home/src" ]; then
  echo "build_llama_server: fetching the llama-cpp-python $VERSION source" >&2
  .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$home/sdist" "llama-cpp-python==$VERSION"
  mkdir -p "$home/src.partial"
  tar xzf "$home"/sdist/llama_cpp_python-*.tar.gz -C "$home/src.partial" --strip-components=1
  mv "$home/src.partial" "$home/src"
fi
flags=""
case "$(uname -m)" in x86_64|amd64) flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;; esac
echo "build_llama_server: compiling llama-server (about 7 minutes on 2 cores)" >&2
CFLAGS="$flags" CXXFLAGS="$flags" cmake -S "$home/src/vendor/llama.cpp" -B "$home/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$home/build" --target llama-server -j "$(nproc 2>/dev/null || sysctl -n hw.ncpu)" >/dev/null
mkdir -p "$home/bin"
cp "$home/build/bin/llama-server" "$binary"
echo "$binary"
