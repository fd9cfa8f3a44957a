#!/bin/sh
# Compiler launcher of the external builds: ccache, with ggml's AMX code paths compiled out as this
# project's own build does (CMakeLists.txt: on Sapphire Rapids -march=native turns AMX on, and its
# matmul segfaults on moefy's q8_0 down projections, upstream ggml-org/llama.cpp#20824). The flags
# go last so they win over -march=native; without AMX on the CPU they change nothing.
if command -v ccache >/dev/null 2>&1; then
    exec ccache "$@" -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
fi
exec "$@" -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
