"""Probe, 2026-11-25. Question: how alike do consecutive tokens route, by gate rank and by age? Answer,
the 1.5B: an expert a token ranks first is routed again by the next token 87-92% of the time, one it
ranks eighth 52-54%; the reuse-rank policy was built on these tables. Results:
bench/results/routing-locality-0.5b-ernie-c32k.{json,md} and
bench/results/routing-locality-1.5b-ernie-c32k.{json,md}.

How alike consecutive tokens route, from routing traces (`moetier trace`): what an eviction policy
can know about an expert's next use from its past. Per trace, over decode-like steps (token t to
t + 1 within a sequence):

- by gate rank: of the experts a token routes at rank r (0 = the largest weight), the share the
  next token routes too;
- by age: of the experts last routed a passes ago, the share the next token routes.

reuse-rank (csrc/policies/reuse_rank.cpp) learns these tables online; this measures them offline.

    python bench/probes/routing_locality.py TRACE.npz [...] -o bench/results/routing-locality.json

Writes the JSON and a Markdown table beside it (OUT.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from moetier.calibrate import Trace

MAX_AGE = 8


def locality(tr: Trace) -> dict[str, Any]:
    """The two tables of one trace."""
    ids = np.asarray(tr.ids)
    n_tokens, n_layers, k = ids.shape
    n_expert = int(tr.n_expert)
    order = np.argsort(-np.asarray(tr.weights), axis=2, kind="stable")
    ranked = np.take_along_axis(ids, order, axis=2)  # [token, layer, rank] expert ids
    used = np.zeros((n_tokens, n_layers, n_expert), dtype=bool)
    np.put_along_axis(used, ranked, True, axis=2)
    bounds = [*tr.seq_starts, n_tokens]
    back = np.zeros(k)
    seen = np.zeros(k)
    age_back = np.zeros(MAX_AGE + 1)
    age_seen = np.zeros(MAX_AGE + 1)
    rows = np.arange(n_layers)[:, None]
    for a, b in itertools.pairwise(bounds):
        last = np.full((n_layers, n_expert), -1)
        for t in range(a, b):
            if t > a:
                nxt = used[t]
                back += nxt[rows, ranked[t - 1]].sum(axis=0)
                seen += n_layers
                known = last >= 0
                age = np.minimum(t - last, MAX_AGE)
                np.add.at(age_seen, age[known], 1)
                np.add.at(age_back, age[known], nxt[known])
            last[used[t]] = t
    return {
        "tokens": int(n_tokens),
        "by_rank": (back / np.maximum(seen, 1)).round(4).tolist(),
        "by_age": (age_back[1:] / np.maximum(age_seen[1:], 1)).round(4).tolist(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path, help="routing traces (.npz of moetier trace or calibrate)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="JSON to write; OUT.md beside it")
    args = ap.parse_args()
    out: dict[str, Any] = {"max_age": MAX_AGE, "traces": {}}
    for path in args.traces:
        out["traces"][path.name] = locality(Trace.load(path))
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    k = len(next(iter(out["traces"].values()))["by_rank"])
    lines = [
        "Routing locality (bench/probes/routing_locality.py): share of experts the next token routes again, "
        "by the gate rank the token gave them (1 = the largest weight) and by passes since their last use "
        f"({MAX_AGE} = {MAX_AGE} or more).",
        "",
        "| trace | tokens | "
        + " | ".join(f"rank {r + 1}" for r in range(k))
        + " | "
        + " | ".join(f"age {a}" for a in range(1, MAX_AGE + 1))
        + " |",
        "|---|---|" + "---|" * (k + MAX_AGE),
    ]
    for name, r in out["traces"].items():
        cells = [f"{x:.3f}" for x in r["by_rank"]] + [f"{x:.3f}" for x in r["by_age"]]
        lines.append(f"| {name} | {r['tokens']} | " + " | ".join(cells) + " |")
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
