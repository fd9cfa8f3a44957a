"""Perplexity cost of HOBBIT's dynamic precision: a MoE served by moetier's expert cache at
one budget, decoded token by token (-ub 1, so the rule applies per token as in generation), for
several (t1, t2) settings against all-high (t1 = t2 = 1, which equals stock llama.cpp).

Runs the shipped llama-perplexity with --expert-cache / --expert-store / --expert-opt. The share of
selections the rule puts in high / low / skip comes from a routing trace (`moetier calibrate`
writes one), and the share of expert *loads* read in low precision from replaying that trace
through the engine's cache code at the same budget (the same C++ as the live run).

    python bench/precision_eval.py --moe M.gguf --store M.experts --text eval.txt --budget 25% \
        --trace M.cache.trace.npz --settings 1:1,0.6:0.9,0.5:0.9 --out R.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moefy_eval import perplexity
from moetier import _core
from moetier.calibrate import Trace, scores_of, split_of
from moetier.config import CacheConfig
from moetier.model import Model


def load_split(trace: Trace, info: dict[str, Any], t1: float, t2: float) -> dict[str, float]:
    """Replays the trace at the cache geometry of info: share of loads read in low precision, skips,
    and MB read per token."""
    n_experts = int(info["n_layers"]) * int(info["n_expert"])
    c = _core.replay(
        trace.ids,
        trace.weights,
        trace.n_expert,
        int(info["expert_bytes"]) // n_experts,
        int(info.get("expert_bytes_low", 0)) // n_experts,
        int(info["n_slots"]),
        int(info.get("n_slots_low", 0)),
        "lru",
        [0.25, 0.25, 0.25, 0.25],
        t1,
        t2,
        list(trace.seq_starts),
    )
    loads = max(1, c.n_loads_high + c.n_loads_low)
    return {
        "loads_low": c.n_loads_low / loads,
        "skipped": c.n_skipped / max(1, c.n_lookups),
        "mb_per_token": c.n_bytes_read / trace.ids.shape[0] / 1e6,
    }


def budget_bytes(moe: str, store: str, budget: str) -> int:
    """budget as bytes: "25%" of the model's expert bytes, or a size the cache config parses."""
    if not budget.endswith("%"):
        return CacheConfig(budget=budget).budget_bytes
    # a probe cache larger than every expert (the pools stop at one slot per expert)
    big = sum(f.stat().st_size for f in Path(store).iterdir())
    info = Model(moe, store=store, cache=CacheConfig.exact(big), n_ctx=64).cache_info()
    return int(int(info["expert_bytes"]) * float(budget[:-1]) / 100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe", required=True, help="MoE GGUF")
    p.add_argument("--store", required=True, help="its expert store (`moetier pack`), with the low copies")
    p.add_argument("--text", required=True, help="held-out evaluation text")
    p.add_argument("--budget", default="25%", help="expert cache budget: bytes (512M) or %% of expert bytes")
    p.add_argument("--settings", default="1:1,0.6:0.9", help="comma-separated t1:t2 pairs; 1:1 = all high")
    p.add_argument("--low-frac", type=float, default=0.25, help="share of the budget for low slots")
    p.add_argument("--trace", default=None, help="routing trace (.npz from `moetier calibrate`) for the splits")
    p.add_argument("--ctx", type=int, default=512, help="perplexity context (default: 512)")
    p.add_argument("--chunks", type=int, default=4, help="chunks of ctx tokens (default: 4)")
    p.add_argument("--threads", type=int, default=2, help="threads (default: 2)")
    p.add_argument("--out", default=None, help="JSON output path")
    a = p.parse_args()

    settings = [tuple(float(x) for x in s.split(":")) for s in a.settings.split(",") if s]
    budget = budget_bytes(a.moe, a.store, a.budget)
    trace = Trace.load(a.trace) if a.trace else None
    scores = scores_of(trace) if trace else None
    rows: list[dict[str, Any]] = []
    for t1, t2 in settings:
        cfg = CacheConfig(budget=str(budget), t1=t1, t2=t2, low_frac=a.low_frac)
        extra = ["-ub", "1", "--expert-cache", str(budget), "--expert-store", a.store, "--expert-opt", cfg.opts()]
        ppl = perplexity(Path(a.moe), Path(a.text), a.ctx, a.chunks, a.threads, extra)
        row: dict[str, Any] = {"t1": t1, "t2": t2, "ppl": ppl}
        if trace is not None and scores is not None:
            row["selections"] = split_of(scores, t1, t2)
            geo = Model(a.moe, store=a.store, cache=cfg, n_ctx=64).cache_info()
            row["replay"] = load_split(trace, geo, t1, t2)
        rows.append(row)
        sys.stderr.write(f"t1 {t1} t2 {t2}: {ppl:.4f}\n")
    base = next((r["ppl"] for r in rows if r["t1"] >= 1 and r["t2"] >= 1), rows[0]["ppl"])
    lines = [
        f"{Path(a.moe).name}, store {Path(a.store).name}, budget {a.budget} ({budget / 2**20:.0f} MiB), "
        f"low_frac {a.low_frac}, {a.chunks} x {a.ctx} tokens decoded one by one;",
        "low loads and MB/token: the trace replayed at the budget (LRU)",
        "",
        "| t1 | t2 | selections high / low / skip | low loads | MB/token | perplexity | vs all high |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sel = r.get("selections")
        rep = r.get("replay")
        sel_s = f"{100 * sel['high']:.0f} / {100 * sel['low']:.0f} / {100 * sel['skip']:.1f} %" if sel else "-"
        low_s = f"{100 * rep['loads_low']:.0f}%" if rep else "-"
        mb_s = f"{rep['mb_per_token']:.1f}" if rep else "-"
        rel = 100 * (r["ppl"] / base - 1)
        lines.append(f"| {r['t1']} | {r['t2']} | {sel_s} | {low_s} | {mb_s} | {r['ppl']:.4f} | {rel:+.2f}% |")
    sys.stdout.write("\n".join(lines) + "\n")
    if a.out:
        doc = {"moe": a.moe, "store": a.store, "budget": budget, "low_frac": a.low_frac, "rows": rows}
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
