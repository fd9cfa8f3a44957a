#!/usr/bin/env bash
# The GPU measurements of bench/results/gpu.md in one call on a GPU machine that reaches no network.
#
#   bench/gpu-run.sh pack        here: .gpu/llama.tgz (the patched llama.cpp tree without its models,
#                                docs, tests and other backends, ~10 MB), .gpu/site (the gguf
#                                package) and .gpu/routing-dsv2lite.bin (DeepSeek-V2-Lite's routing
#                                trace, TRACE=NPZ for another); add /.gpu/ to .git/info/exclude and
#                                carry .gpu
#   bench/gpu-run.sh run OUT     there: unpacks the tree, writes the model while it builds
#                                moetier-gpu-bench and llama-perplexity for the GPU (sm_90 unless
#                                CUDA_ARCH is set), runs bench/gpu.py; results and logs.tgz in OUT
#
# A run takes about 3 minutes to build on 16 cores, 2 to write the model, 4 to measure; DEADLINE
# (seconds from the start, default 520) stops starting new measurements; QUICK=1 runs bench/gpu.py's
# short follow-up plan (--quick).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"

case "${1:-}" in
pack)
    mkdir -p .gpu
    tar czf .gpu/llama.tgz -C vendor \
        --exclude=llama.cpp/models --exclude=llama.cpp/docs --exclude=llama.cpp/benches \
        --exclude=llama.cpp/examples --exclude=llama.cpp/tests --exclude=llama.cpp/.git \
        --exclude=llama.cpp/ggml/src/ggml-sycl --exclude=llama.cpp/ggml/src/ggml-opencl \
        --exclude=llama.cpp/ggml/src/ggml-hexagon --exclude=llama.cpp/ggml/src/ggml-metal \
        --exclude=llama.cpp/ggml/src/ggml-vulkan llama.cpp
    rm -rf .gpu/site && mkdir -p .gpu/site
    cp -r "$(python3 -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')" .gpu/site/
    # DeepSeek-V2-Lite's routing, its first 20,000 tokens (read from ../shared/traces, never committed)
    trace=${TRACE:-../shared/traces/deepseek-v2-lite-chat-puffin/trace.npz}
    if [ -f "$trace" ]; then
        python3 -c "import sys; sys.path.insert(0, 'bench'); from gpu import write_routing_file; from pathlib import Path
print(write_routing_file(Path('$trace'), Path('.gpu/routing-dsv2lite.bin'), 20000))"
    fi
    du -sh .gpu
    ;;
run)
    out=${2:?usage: bench/gpu-run.sh run OUT}
    t0=$(date +%s)
    export PYTHONUNBUFFERED=1 PYTHONPATH="$top/.gpu/site"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    if [ ! -f vendor/llama.cpp/CMakeLists.txt ]; then
        mkdir -p vendor && tar xzf .gpu/llama.tgz -C vendor
    fi
    python3 bench/gpu.py --inputs-only uniform --work /tmp/moetier-gpu --bin - --tool - --out "$out" \
        >"$out/inputs.log" 2>&1 &
    writer=$!
    trace_args=()
    if [ -f .gpu/routing-dsv2lite.bin ]; then
        python3 bench/gpu.py --inputs-only trace --work /tmp/moetier-gpu --bin - --tool - --out "$out" \
            >"$out/inputs-trace.log" 2>&1 &
        writer_trace=$!
        trace_args=(--trace .gpu/routing-dsv2lite.bin)
    fi
    cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOETIER_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_CUDA_FA=OFF >"$out/cmake.log" 2>&1 ||
        { tail -20 "$out/cmake.log"; exit 1; }
    cmake --build build/gpu --target moetier-gpu-bench llama-perplexity -j "$(nproc)" >"$out/build.log" 2>&1 ||
        { grep -m5 -B2 -A8 error "$out/build.log"; exit 1; }
    echo "built in $(($(date +%s) - t0)) s"
    wait "$writer" || { cat "$out/inputs.log"; exit 1; }
    if [ -n "${writer_trace:-}" ]; then
        wait "$writer_trace" || { cat "$out/inputs-trace.log"; exit 1; }
        cat "$out/inputs-trace.log"
    fi
    cat "$out/inputs.log"
    plan=()
    [ -n "${QUICK:-}" ] && plan=(--quick)
    python3 bench/gpu.py --bin build/gpu/bin --tool build/gpu/moetier-gpu-bench --work /tmp/moetier-gpu \
        --out "$out" --threads "$(nproc)" --deadline $((t0 + ${DEADLINE:-520})) "${trace_args[@]}" "${plan[@]}" 2>&1 |
        tee "$out/gpu.log"
    tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
    echo "done in $(($(date +%s) - t0)) s"
    ;;
*)
    sed -n 2,14p "$0"
    exit 2
    ;;
esac
