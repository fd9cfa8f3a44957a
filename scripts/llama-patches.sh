#!/usr/bin/env bash
# Developer helper for the llama.cpp patch series (vendor/patches).
#
#   scripts/llama-patches.sh init     turn vendor/llama.cpp into a git work tree: base commit = pinned
#                                     sdist, one commit per patch (run once after the build fetched it)
#   scripts/llama-patches.sh export   regenerate vendor/patches from those commits (git format-patch)
#                                     and refresh the stamp the build checks
#   scripts/llama-patches.sh stat     lines added/removed per patched llama.cpp file
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
tree="$top/vendor/llama.cpp"
patches="$top/vendor/patches"
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

stamp() {
    { echo "$sdist_sha"; for p in $(ls "$patches"/*.patch 2>/dev/null | sort); do
        echo "$(basename "$p") $(sha256sum < "$p" | cut -d' ' -f1)"; done; } | sha256sum | cut -d' ' -f1
}

case "${1:-}" in
init)
    cd "$tree"
    [ -d .git ] && { echo "$tree is already a git work tree"; exit 0; }
    git init -q
    # the stamp the build checks is not part of the series: `commit -a` of a fixup must not take it
    mkdir -p "$(git rev-parse --git-dir)/info" && echo .moetier-patches >> "$(git rev-parse --git-dir)/info/exclude"
    for p in $(ls "$patches"/*.patch 2>/dev/null | sort); do git apply -R "$p"; done
    git add -A && git -c user.name=moetier -c user.email=dev@moetier commit -qm base
    for p in "$patches"/*.patch; do [ -e "$p" ] && git am -q "$p"; done
    ;;
export)
    cd "$tree"
    base=$(git rev-list --max-parents=0 HEAD)
    rm -f "$patches"/*.patch
    git format-patch -q --no-signature --zero-commit -N "$base"..HEAD -o "$patches"
    stamp > "$tree/.moetier-patches"
    ls "$patches"
    ;;
stat)
    for p in "$patches"/*.patch; do
        echo "== $(basename "$p")"; git apply --numstat "$p" | awk '{printf "  +%-4s -%-4s %s\n", $1, $2, $3}'
    done
    ;;
*)
    sed -n '2,9p' "$0"; exit 2 ;;
esac
