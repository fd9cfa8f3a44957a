#!/usr/bin/env bash
# Compiles ggml's CUDA backend sources, as patched for moetier, for the Orin's GPU (sm_87) with the
# flags install.sh uses, without a Jetson: the check that a board's build will compile, where only
# another nvcc is at hand. Each source is compiled to an object and thrown away; the summary says
# which compiled. The whole backend takes long on few cores: pass the sources to check (default: the
# MUL_MAT_ID path the expert cache uses and the backend's entry point).
#
# usage: [CUBLAS_INCLUDE=DIR] deploy/jetson/check-sm87.sh [SOURCE.cu ...]
#   (from a checkout with vendor/llama.cpp fetched by one build; CUBLAS_INCLUDE: where cublas_v2.h is
#   when the toolkit has no cuBLAS headers, e.g. nvidia/cu13/include of the nvidia-cublas wheel)
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cuda_dir=$root/vendor/llama.cpp/ggml/src/ggml-cuda
[ -d "$cuda_dir" ] || { echo "error: $cuda_dir is missing: build moetier once (pip install .) to fetch llama.cpp" >&2; exit 1; }
nvcc=${NVCC:-nvcc}
command -v "$nvcc" >/dev/null || { echo "error: no nvcc (set NVCC=/path/to/nvcc)" >&2; exit 1; }
if [ $# -eq 0 ]; then
    set -- "$cuda_dir/ggml-cuda.cu" "$cuda_dir/mmid.cu" "$cuda_dir/mmq.cu" "$cuda_dir/getrows.cu"
fi
echo "nvcc: $("$nvcc" --version | tail -n 1)"
# FlashAttention's K-V type combinations as ggml/cmake/common.cmake defines them for the default
# GGML_CUDA_FA_QUANTS (the vector kernels' instances compiled; the others 0)
fa_defs=(-DGGML_CUDA_FA_QUANTS='"q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16"')
for v in q4_0 q4_1 q5_0 q5_1 q8_0 bf16 f16; do
    for k in q4_0 q4_1 q5_0 q5_1 q8_0 bf16 f16; do
        case "$k-$v" in q4_0-q4_0 | q8_0-q8_0 | f16-f16 | bf16-bf16) on=1 ;; *) on=0 ;; esac
        fa_defs+=("-DGGML_CUDA_FA_${k^^}_${v^^}=$on")
    done
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
for src in "$@"; do
    t0=$(date +%s)
    # the flags ggml-cuda/CMakeLists.txt gives nvcc, and the two install.sh sets
    if "$nvcc" -std=c++17 -O2 -arch=sm_87 -use_fast_math -extended-lambda -DGGML_CUDA_NO_VMM -DGGML_CUDA_FORCE_MMQ -DGGML_USE_CUDA \
        -I"$root/vendor/llama.cpp/ggml/include" -I"$root/vendor/llama.cpp/ggml/src" -I"$cuda_dir" \
        ${CUBLAS_INCLUDE:+-I"$CUBLAS_INCLUDE"} "${fa_defs[@]}" \
        -c "$src" -o "$tmp/out.o" 2>"$tmp/err"; then
        echo "ok   $(basename "$src") ($(($(date +%s) - t0)) s)"
    else
        echo "FAIL $(basename "$src"): $(head -n 5 "$tmp/err")"
        fail=1
    fi
done
exit $fail
