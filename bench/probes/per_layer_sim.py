"""Per-layer cache simulation of a real routing trace: what a policy that keeps each layer to its fair
share of slots can reach (LRU, LFU, a decayed frequency, and Belady inside each layer), beside the
engine's global replay (`moetier replay`). Pure Python, for a first look; slow on long traces.

    python bench/probes/per_layer_sim.py ../shared/traces/deepseek-v2-lite-chat-puffin/trace.npz \\
        --tokens 6000 --budgets 10,25
"""

from __future__ import annotations

import argparse
import collections
import math
from collections.abc import Callable

import numpy as np


def belady(seq: list[set[int]], slots: int) -> int:
    last: dict[int, int] = {}
    nxt: list[dict[int, int]] = [{} for _ in seq]
    for t in range(len(seq) - 1, -1, -1):
        for e in seq[t]:
            nxt[t][e] = last.get(e, 1 << 60)
        for e in seq[t]:
            last[e] = t
    cache: dict[int, int] = {}
    miss = 0
    for t, need in enumerate(seq):
        for e in need & cache.keys():
            cache[e] = nxt[t][e]
        for e in need - cache.keys():
            miss += 1
            if len(cache) >= slots:
                del cache[max((x for x in cache if x not in need), key=lambda x: cache[x])]
            cache[e] = nxt[t][e]
    return miss


def scored(seq: list[set[int]], slots: int, keep: Callable[[int, int, list[int]], float]) -> int:
    """A policy that evicts the cached expert (not needed now) with the lowest keep(expert, t, uses)."""
    cache: set[int] = set()
    uses: dict[int, list[int]] = collections.defaultdict(list)
    miss = 0
    for t, need in enumerate(seq):
        for e in need:
            uses[e].append(t)
        for e in need - cache:
            miss += 1
            if len(cache) >= slots:
                cache.discard(min((x for x in cache if x not in need), key=lambda x: keep(x, t, uses[x])))
            cache.add(e)
    return miss


POLICIES: dict[str, Callable[[int, int, list[int]], float]] = {
    "lru": lambda e, t, u: u[-1],
    "lfu": lambda e, t, u: len(u) + u[-1] * 1e-9,
    "decay64": lambda e, t, u: sum(math.exp(-(t - s) * math.log(2) / 64) for s in u[-64:]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a trace in the shared format (ids [T, L, K], n_experts)")
    p.add_argument("--tokens", type=int, default=6000, help="first N tokens (default: 6000)")
    p.add_argument("--budgets", default="10,25", help="shares of all experts, %% (default: 10,25)")
    a = p.parse_args()
    z = np.load(a.trace)
    ids = np.asarray(z["ids"][: a.tokens], dtype=np.int64)
    n_expert = int(z["n_experts"])
    t_n, n_layer, k = ids.shape
    for pct in (float(x) for x in a.budgets.split(",")):
        slots = round(n_expert * pct / 100)
        miss: collections.Counter[str] = collections.Counter()
        for il in range(n_layer):
            seq = [set(ids[t, il].tolist()) for t in range(t_n)]
            miss["belady (per layer)"] += belady(seq, slots)
            for name, keep in POLICIES.items():
                miss[name] += scored(seq, slots, keep)
        lookups = t_n * n_layer * k
        print(
            f"{pct:g}% ({slots} slots per layer): "
            + ", ".join(f"{n} {100 * (1 - m / lookups):.1f}%" for n, m in miss.items())
        )


if __name__ == "__main__":
    main()
