#!/usr/bin/env bash
# Builds upstream llama.cpp, unpatched, at the commit this project pins (the llama-cpp-python sdist's
# vendor/llama.cpp, sha256-checked by `python -m moetier.lcpp`), for bench/run.py's --upstream: its
# llama-completion runs the same prompts as stock/moetier in the same caps (mmap with and without
# repacking, and its --load-mode dio).
#
# Usage: bench/external/build-upstream.sh [DEST]   (default: $MOETIER_CACHE or ~/.cache/moetier, /upstream)
# Prints the path of the built llama-completion.
set -euo pipefail
# ccache, with AMX compiled out as in this project's own build (see cc-noamx.sh)
LAUNCH=$(cd "$(dirname "$0")" && pwd)/cc-noamx.sh
CACHE=${MOETIER_CACHE:-$HOME/.cache/moetier}
DEST=${1:-$CACHE/upstream}
LL=$DEST/llama.cpp
mkdir -p "$DEST"
if [ ! -f "$LL/CMakeLists.txt" ]; then
    SDIST=$(ls "$CACHE"/llama_cpp_python-*.tar.gz | head -1)
    tmp=$(mktemp -d)
    tar -xzf "$SDIST" -C "$tmp"
    rm -rf "$LL"
    mv "$tmp"/*/vendor/llama.cpp "$LL"
    rm -rf "$tmp"
fi
cmake -S "$LL" -B "$LL/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DCMAKE_C_COMPILER_LAUNCHER="$LAUNCH" -DCMAKE_CXX_COMPILER_LAUNCHER="$LAUNCH" >"$DEST/cmake.log"
cmake --build "$LL/build" -j"${JOBS:-2}" --target llama-completion >"$DEST/build.log"
BIN=$LL/build/bin/llama-completion
test -x "$BIN"
echo "upstream llama.cpp built at $BIN" >&2
echo "$BIN"
