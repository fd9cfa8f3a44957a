#!/usr/bin/env bash
# The expert cache on ggml's CUDA backend: is it exact, and do the lossy modes run?
#
# Runs the patched llama-perplexity of a CUDA build (MOETIER_CUDA=ON) on tiny generated MoE GGUFs
# (qwen2moe with q8_0 experts and a store with q4_0 copies, qwen3moe with f16 experts) and compares,
# per backend placement, stock (no --expert-cache) with the cache holding every expert and with a
# cache of about a third of them:
#   - placement: -ngl 0 (weights on the host: ggml offloads an op of >= 32 tokens to the GPU, the
#     expert mul_mat_ids included), -ngl 99 (all but the experts on the GPU), -ngl 99
#     --no-op-offload, and -dev none (the CPU alone, the reference the CPU tests hold);
#   - batch: -ub 128 (prefill) and -ub 1 (one token per graph, as decode);
#   - stock keeps its experts on the host as ours are (--cpu-moe with -ngl 99);
#   - exact configurations must print the same chunk perplexities as stock where both compute the
#     experts on the CPU, and be within 0.5% where op offload moves stock's expert matmuls to the
#     GPU (a batch of >= 32 tokens without --no-op-offload): ours stay on the CPU;
#     lossy ones (mixed: low-precision copies; skip: skipped experts, i.e. negative ids in the
#     mul_mat_ids) must finish, stay finite and within 2% of the same configuration on the CPU
#     alone (the same numbers where every op runs on the CPU: -ngl 0 with one token per graph).
# Each line of the summary is `name rc ppl match`; the script exits non-zero if any check fails.
#
# usage: [MODE=lossy] [THREADS=N] scripts/cuda-check.sh BIN_DIR DATA_DIR OUT_DIR
#   MODE=lossy runs the lossy configurations alone
#   BIN_DIR:  llama-perplexity and its shared libraries
#   DATA_DIR: q2moe.gguf, q2moe.experts/, q3moe.gguf, text.txt (made by moetier.tools.tiny, moetier pack)
set -uo pipefail

bin=$1
data=$2
out=$3
mkdir -p "$out"
threads=${THREADS:-4}
mode=${MODE:-all}
fail=0

# name model flags... -> "$out/name.log"; prints `name rc final-ppl`
run_ppl() {
    local name=$1 model=$2
    shift 2
    local t0 t1 rc chunks final
    t0=$(date +%s.%N)
    # common_log writes from its own thread, and a process that ends before it is through loses the
    # last lines (seen on a starved CPU): such a run is repeated
    for _ in 1 2 3; do
        "$bin/llama-perplexity" -m "$data/$model" -f "$data/text.txt" -c 128 -b 128 --chunks 12 -t "$threads" \
            --seed 1 "$@" >"$out/$name.out" 2>"$out/$name.log"
        rc=$?
        # the chunks go to stdout, the log (with the final estimate) to stderr
        chunks=$(grep -o '^\[1\].*' "$out/$name.out" | tail -1)
        final=$(cat "$out/$name.out" "$out/$name.log" | grep -o 'Final estimate: PPL = [^ ]*' | awk '{print $NF}')
        [ "$rc" != 0 ] || [ -n "$final" ] && break
    done
    t1=$(date +%s.%N)
    echo "$chunks" >"$out/$name.chunks"
    printf '%-34s rc=%-3s ppl=%-12s %6.2fs\n' "$name" "$rc" "${final:-none}" "$(python3 -c "print($t1 - $t0)")"
    [ "$rc" = 0 ] && [ -n "$final" ] || {
        echo "  FAIL $name: rc $rc, see $name.log:"
        tail -5 "$out/$name.log" | sed 's/^/    /'
        fail=1
    }
}

# same chunk perplexities as the reference
same() {
    if [ -s "$out/$1.chunks" ] && cmp -s "$out/$1.chunks" "$out/$2.chunks"; then
        echo "  exact: $1 == $2"
    else
        echo "  FAIL exact: $1 != $2"
        diff <(tr ',' '\n' <"$out/$1.chunks") <(tr ',' '\n' <"$out/$2.chunks") | head -6 | sed 's/^/    /'
        fail=1
    fi
}

# near_pct PCT A B: near A B PCT
near_pct() { near "$2" "$3" "$1"; }

# finite and within PCT percent of the reference's final perplexity
near() {
    local a b
    a=$(cat "$out/$1.out" "$out/$1.log" | grep -o 'Final estimate: PPL = [^ ]*' | awk '{print $NF}')
    b=$(cat "$out/$2.out" "$out/$2.log" | grep -o 'Final estimate: PPL = [^ ]*' | awk '{print $NF}')
    if [ -n "$a" ] && [ -n "$b" ] && python3 -c "import math,sys; a,b,p=map(float,sys.argv[1:]); sys.exit(not (math.isfinite(a) and abs(a-b)/b*100 <= p))" "$a" "$b" "$3"; then
        echo "  near: $1 ($a) within $3% of $2 ($b)"
    else
        echo "  FAIL near: $1 (${a:-none}) vs $2 (${b:-none}), allowed $3%"
        fail=1
    fi
}

for ub in 128 1; do
    for place in cpu ngl0 ngl99 ngl99-nooff; do
        # pf: the placement; sf: what stock adds to keep its experts where ours are (on the host);
        # cmp: exact where both compute the experts on the CPU, else near (op offload for >= 32
        # tokens moves stock's expert matmuls to the GPU, while ours stay on the CPU)
        cmp=same
        case $place in
        cpu) pf=(-dev none) sf=() ;;
        ngl0) pf=(-ngl 0) sf=() ;;
        ngl99) pf=(-ngl 99) sf=(--cpu-moe) ;;
        ngl99-nooff) pf=(-ngl 99 --no-op-offload) sf=(--cpu-moe) ;;
        esac
        [ "$ub" = 128 ] && { [ "$place" = ngl0 ] || [ "$place" = ngl99 ]; } && cmp="near_pct 0.5"
        for m in q2moe q3moe; do
            [ "$mode" = lossy ] && break
            p="$m-ub$ub-$place"
            run_ppl "$p-stock" "$m.gguf" -ub "$ub" "${pf[@]}" "${sf[@]}"
            run_ppl "$p-all" "$m.gguf" -ub "$ub" "${pf[@]}" --expert-cache 64M
            run_ppl "$p-third" "$m.gguf" -ub "$ub" "${pf[@]}" --expert-cache 1M
            $cmp "$p-all" "$p-stock"
            $cmp "$p-third" "$p-stock"
        done
        # lossy: low-precision copies (mixed) and skipped experts (skip); no prefetch and no warm
        # start, so that which experts are cached, and so each miss's precision, is deterministic
        p="q2moe-ub$ub-$place"
        run_ppl "$p-mixed" q2moe.gguf -ub "$ub" "${pf[@]}" --expert-cache 1M --expert-store "$data/q2moe.experts" \
            --expert-opt "t1=0.5,t2=1,low_frac=0.25,prefetch=0,warm=0"
        run_ppl "$p-skip" q2moe.gguf -ub "$ub" "${pf[@]}" --expert-cache 1M --expert-opt "t1=0.6,t2=0.6,prefetch=0,warm=0"
        if [ "$place" != cpu ]; then
            for kind in mixed skip; do
                # one token per graph on the host computes every op on the CPU: the same numbers
                if [ "$place$ub" = ngl01 ]; then
                    same "$p-$kind" "q2moe-ub$ub-cpu-$kind"
                else
                    near "$p-$kind" "q2moe-ub$ub-cpu-$kind" 2
                fi
            done
        fi
    done
done
exit $fail
