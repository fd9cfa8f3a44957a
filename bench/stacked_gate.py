"""Micro-benchmark of prefetch's stacked routers (HOBBIT Fig. 17a): the routers of the next p layers
in ONE matmul against p routers computed one after another, on the CPU backend.

    python bench/stacked_gate.py --n-embd 1536 --n-expert 16 --p 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse
import json
import sys

from moetier import _core


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--n-embd", type=int, default=1536, help="router input width (model hidden size)")
    a.add_argument("--n-expert", type=int, default=16, help="experts per layer (router outputs)")
    a.add_argument("--p", default="1,2,3,4,6,8", help="numbers of layers predicted ahead")
    a.add_argument("--n-tokens", type=int, default=1, help="tokens per call (1 = decode)")
    a.add_argument("--reps", type=int, default=500, help="timed repetitions (median reported)")
    a.add_argument("--threads", type=int, default=1, help="compute threads")
    a.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ns = a.parse_args()
    rows = []
    print("| p | one router us | p sequential us | p stacked us | stacked / one | sequential / stacked |")
    print("|---|---|---|---|---|---|")
    for p in (int(x) for x in ns.p.split(",")):
        r = _core.bench_stacked_gate(ns.n_embd, ns.n_expert, p, ns.n_tokens, ns.reps, ns.threads)
        rows.append({"p": p, **r})
        print(
            f"| {p} | {r['single_us']:.1f} | {r['sequential_us']:.1f} | {r['stacked_us']:.1f} "
            f"| {r['stacked_us'] / r['single_us']:.2f}x | {r['sequential_us'] / r['stacked_us']:.2f}x |"
        )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"config": vars(ns), "rows": rows}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
