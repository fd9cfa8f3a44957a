#!/usr/bin/env bash
# Builds the peer BigMoeOnEdge (github.com/Helldez/BigMoeOnEdge, Apache-2.0) for bench/run.py's
# --peer: its source outside this repository (in DEST), against the llama.cpp this project pins
# (the llama-cpp-python sdist's vendor/llama.cpp), with local edits, none of its code in ours:
#   1. its MTP (speculative drafting) path does not compile against the pinned llama.cpp
#      (`common_speculative_process` takes a `common_batch` there; the draft params have no n_past):
#      those three calls are disabled, so --mtp fails with the peer's own clear error. MTP needs a
#      model with a trained MTP head, which no model of this benchmark has.
#   2. its --overlap needs a ~25-line hook on its llama.cpp fork branch (bmoe/expert-ready-hook),
#      which cannot be fetched here: it is written from the contract in its docs/seam.md §3
#      (ggml_cpu_set_expert_ready_hook(hook, user_data); mul_mat_id calls hook(src0, expert,
#      user_data) for every routed expert before it reads its weights). Without it --overlap fails.
#   3. its architecture registry gets one row for ernie4_5-moe, the bench models' architecture.
#
# A `git clone --recursive` of the peer brings its own llama.cpp fork (which has the hook and the MTP
# API it expects): the script then builds it unchanged. The two edits apply only to the pinned copy
# it puts in third_party/llama.cpp when the clone has none (marked .moetier-pinned).
#
# Usage: bench/external/build-bigmoeonedge.sh [SRC] [DEST]
#   SRC:  a clone of the peer (default: git clone --recursive https://github.com/Helldez/BigMoeOnEdge)
#   DEST: build root (default: $MOETIER_CACHE or ~/.cache/moetier, then /peer)
# Prints the path of the built bmoe-cli.
set -euo pipefail
# ccache, with AMX compiled out as in this project's own build (see cc-noamx.sh)
LAUNCH=$(cd "$(dirname "$0")" && pwd)/cc-noamx.sh
CACHE=${MOETIER_CACHE:-$HOME/.cache/moetier}
DEST=${2:-$CACHE/peer}
SRC=${1:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$DEST"
if [ ! -d "$DEST/BigMoeOnEdge" ]; then
    if [ -n "$SRC" ]; then
        git clone -q "$SRC" "$DEST/BigMoeOnEdge"
    else
        git clone -q --recursive https://github.com/Helldez/BigMoeOnEdge "$DEST/BigMoeOnEdge"
    fi
fi
P=$DEST/BigMoeOnEdge
LL=$P/third_party/llama.cpp
if [ ! -f "$LL/CMakeLists.txt" ]; then
    # the llama.cpp this project pins, from the sha256-checked sdist that `python -m moetier.lcpp`
    # fetches (the peer's own submodule pins a fork commit that is not reachable here)
    SDIST=$(ls "$CACHE"/llama_cpp_python-*.tar.gz | head -1)
    tmp=$(mktemp -d)
    tar -xzf "$SDIST" -C "$tmp"
    rm -rf "$LL"
    mv "$tmp"/*/vendor/llama.cpp "$LL"
    rm -rf "$tmp"
    touch "$LL/.moetier-pinned"
fi

# a recursive clone brings the peer's own fork (MTP API and hook included): built as it is
if [ -f "$LL/.moetier-pinned" ]; then
# 1. MTP off (idempotent)
S=$P/core/src/engine/session.cpp
sed -i 's/common_speculative_process(im\.mtp\.get(), \([a-z_.]*\))/false \/* bench: MTP disabled, pinned llama.cpp API differs *\/ \&\& ((void) \1, true)/' "$S"
sed -i 's/^\(\s*\)dp\.n_past = n_past;/\1(void) n_past; \/\/ bench: no n_past in the pinned API/' "$S"

# 2. the expert-ready hook (idempotent)
H=$LL/ggml/include/ggml-cpu.h
C=$LL/ggml/src/ggml-cpu/ggml-cpu.c
if ! grep -q ggml_cpu_set_expert_ready_hook "$H"; then
    sed -i 's/^\(\s*\)GGML_BACKEND_API void ggml_cpu_init(void);/&\n\n    \/\/ bench: the BigMoeOnEdge expert-ready hook (its docs\/seam.md §3), called by mul_mat_id for every\n    \/\/ routed expert before its weights are read; may block\n    typedef void (*ggml_expert_ready_hook_t)(const struct ggml_tensor * src0, int expert, void * user_data);\n    GGML_BACKEND_API void ggml_cpu_set_expert_ready_hook(ggml_expert_ready_hook_t hook, void * user_data);/' "$H"
    python3 - "$C" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
decl = """
// bench: BigMoeOnEdge's expert-ready hook (see ggml-cpu.h)
static ggml_expert_ready_hook_t g_expert_ready_hook = NULL;
static void * g_expert_ready_ud = NULL;

void ggml_cpu_set_expert_ready_hook(ggml_expert_ready_hook_t hook, void * user_data) {
    g_expert_ready_ud = user_data;
    g_expert_ready_hook = hook;
}

static void ggml_compute_forward_mul_mat_id("""
s = s.replace("\nstatic void ggml_compute_forward_mul_mat_id(", decl, 1)
old = """        if (cne1 == 0) {
            continue;
        }

        // tiled takes over"""
new = """        if (cne1 == 0) {
            continue;
        }

        if (g_expert_ready_hook) {
            g_expert_ready_hook(src0, cur_a, g_expert_ready_ud);
        }

        // tiled takes over"""
assert old in s, "mul_mat_id expert loop not found"
s = s.replace(old, new, 1)
open(p, "w").write(s)
PY
fi
fi

# 3. one registry row for ernie4_5-moe (the bench models' architecture; its expert tensors are named
#    as qwen2moe's, and it routes through llama.cpp's common MoE graph): the peer's docs/adding-a-model.md
R=$P/core/src/moe/arch_registry.cpp
if ! grep -q '"ernie4_5-moe"' "$R"; then
    sed -i 's/^\(\s*\){"qwen2moe", {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}},/&\n\1{"ernie4_5-moe", {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}}, \/\/ bench: added/' "$R"
    grep -q '"ernie4_5-moe"' "$R"
fi

cmake -S "$P" -B "$P/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBMOE_BUILD_TESTS=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_COMPILER_LAUNCHER="$LAUNCH" -DCMAKE_CXX_COMPILER_LAUNCHER="$LAUNCH" >"$DEST/cmake.log"
cmake --build "$P/build" -j"${JOBS:-2}" --target bmoe-cli >"$DEST/build.log"
BIN=$(find "$P/build" -name bmoe-cli -type f -perm -u+x | head -1)
echo "peer: $(git -C "$P" rev-parse --short HEAD) built at $BIN" >&2
echo "$BIN"
