"""Probe, 2026-11-27. Question: how much of the LRU-Belady gap could eviction close if it knew which
experts the current token uses in its next layers? Answer: the truth about the next layer is worth
17% of the gap to reuse-rank's rule on the 0.5B at 25%, the best fitted predictor's guess about 5%,
and the stacked gate's guess makes it worse; it was not built into the engine. Results:
bench/results/lookahead-0.5b-ernie-c32k-25.json,
bench/results/lookahead-pred-0.5b-ernie-c32k-25-{stacked,linear-post}.json and
bench/results/lookahead-pred-1.5b-ernie-sh60-25-linear-post.json.

A probe, not a policy: a simplified replay in Python of reuse-rank's rule
(csrc/policies/reuse_rank.cpp), with and without that knowledge of the next layers.

The rule: evict the slot whose next use is expected farthest away, d + L (1 - q) / q resolves, where
d is the layer distance to the slot's next chance and q the chance that it uses it, from a table
of (gate rank at the expert's last use, passes since) counted on the calibration traces. Unlike
the engine's policy it has no decayed-frequency term, so its own numbers sit a little above the
engine's; what the probe measures is the difference lookahead makes to the same rule.

Lookahead D: for the slots of layers l+1 .. l+D, the probe is told the truth: a slot the current
token will use there is kept to its use (v = d), one it will not use has its next chance a pass
later. A perfect predictor at distance D bounds what any predictor-aware eviction (the stacked
gate, DuoServe's) can add.

--predict stacked|linear-post: the same rule told a real predictor's guess instead of the truth
(the predictors of bench/predictors.py, at distances 1..D), on routing and activations the stock
model produces on the held-out texts (every row of that replay, Belady's too, runs on those ids).

    python bench/probes/lookahead_probe.py --model M.gguf --budget 25 --out bench/results/lookahead-0.5b
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from moetier.calibrate import Trace, concat_traces
from moetier.tools import replay as rp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness's modules

I32 = NDArray[np.int32]
MAX_AGE = 16


def sorted_ids(path: Path) -> I32:
    """ids [tokens, layers, k] of a trace, each row in gate-weight order (rank 0 first)."""
    d = np.load(path)
    order = np.argsort(-d["weights"], axis=2, kind="stable")
    return np.take_along_axis(d["ids"], order, 2).astype(np.int32)


def ranks(ids: I32, n_expert: int) -> NDArray[np.int8]:
    """[tokens, layers, n_expert] rank of each expert in the token's selection, k if not selected."""
    n, n_layers, k = ids.shape
    r = np.full((n, n_layers, n_expert), k, np.int8)
    for j in range(k):
        np.put_along_axis(r, ids[:, :, j : j + 1], j, axis=2)
    return r


def reuse_table(traces: list[I32], n_expert: int) -> NDArray[np.float64]:
    """q[rank at last use][passes since]: the share of such chances that used the expert."""
    k = traces[0].shape[2]
    used = np.ones((k + 1, MAX_AGE + 1))
    chances = np.full((k + 1, MAX_AGE + 1), 2.0)
    for ids in traces:
        r = ranks(ids, n_expert)
        for il in range(ids.shape[1]):
            for e in range(n_expert):
                uses = np.nonzero(r[:, il, e] < k)[0]
                for a, b in itertools.pairwise(uses):
                    gap, rk = int(b - a), int(r[a, il, e])
                    chances[rk, 1 : min(gap, MAX_AGE)] += 1
                    if gap > MAX_AGE:
                        chances[rk, MAX_AGE] += gap - MAX_AGE
                    chances[rk, min(gap, MAX_AGE)] += 1
                    used[rk, min(gap, MAX_AGE)] += 1
    return used / chances


def simulate(
    ids: I32,
    n_expert: int,
    n_slots: int,
    q_table: NDArray[np.float64],
    mode: str,
    depth: int = 0,
    guess: dict[int, NDArray[np.bool_]] | None = None,
    soft: bool = False,
) -> float:
    """Misses per token of one decode-order replay (one pass per token). mode: belady | rule.
    guess[d][t, l, e]: a predictor at layer l - d says token t uses expert e at layer l (None: the
    truth is told). soft: what is told only keeps the slots it names; the others keep the rule's value."""
    n, n_layers, k = ids.shape
    r = ranks(ids, n_expert)
    future: list[list[list[int]]] = [[[] for _ in range(n_expert)] for _ in range(n_layers)]
    if mode == "belady":
        for t in range(n):
            for il in range(n_layers):
                for e in ids[t, il]:
                    future[il][e].append(t * n_layers + il)
    ptr = np.zeros((n_layers, n_expert), np.int64)
    key_l = np.full(n_slots, -1)
    key_e = np.full(n_slots, -1)
    where = np.full((n_layers, n_expert), -1)
    last_pass = np.full((n_layers, n_expert), -1)
    last_rank = np.full((n_layers, n_expert), k)
    misses = 0
    for t in range(n):
        for il in range(n_layers):
            need = ids[t, il]
            now = t * n_layers + il
            ptr[il, need] += 1
            pinned = [int(where[il, e]) for e in need if where[il, e] >= 0]
            for e in need:
                if where[il, e] >= 0:
                    continue
                misses += 1
                empty = np.nonzero(key_l < 0)[0]
                if len(empty):
                    s = int(empty[0])
                else:
                    if mode == "belady":
                        v = np.array(
                            [
                                future[a][b][ptr[a, b]] - now if ptr[a, b] < len(future[a][b]) else 1e18
                                for a, b in zip(key_l, key_e, strict=True)
                            ],
                            dtype=np.float64,
                        )
                    else:
                        d = (key_l - il) % n_layers
                        nxt = np.where(key_l > il, t, t + 1)
                        age = np.clip(nxt - last_pass[key_l, key_e], 1, MAX_AGE)
                        q = np.clip(q_table[last_rank[key_l, key_e], age], 1e-4, 1.0)
                        v = np.where(d == 0, n_layers, d) + n_layers * (1 - q) / q
                        ahead = np.nonzero((key_l > il) & (key_l <= il + depth))[0]
                        if len(ahead):
                            la, ea = key_l[ahead], key_e[ahead]
                            if guess is None:
                                used_now = r[t, la, ea] < k
                            else:
                                used_now = np.array(
                                    [guess[int(x - il)][t, x, y] for x, y in zip(la, ea, strict=True)], dtype=bool
                                )
                            age2 = np.clip(t + 1 - last_pass[la, ea], 1, MAX_AGE)
                            q2 = np.clip(q_table[last_rank[la, ea], age2], 1e-4, 1.0)
                            later = v[ahead] if soft else d[ahead] + n_layers + n_layers * (1 - q2) / q2
                            v[ahead] = np.where(used_now, d[ahead], later)
                    v[pinned] = -np.inf
                    s = int(np.argmax(v))
                    where[key_l[s], key_e[s]] = -1
                key_l[s], key_e[s] = il, e
                where[il, e] = s
                pinned.append(s)
            last_pass[il, need] = t
            last_rank[il, need] = np.arange(k)
    return misses / n


def predicted(a: argparse.Namespace, depths: list[int], n_expert: int) -> tuple[I32, dict[int, NDArray[np.bool_]]]:
    """The held-out texts' routing from a stock run ([tokens, layers, k], rank order) and a
    predictor's guesses guess[d][t, l, e] (made at layer l - d) for every d in depths."""
    import predictors as pr  # bench/predictors.py: the same predictors its report card judges
    from corpora import default_cache

    texts = default_cache() / "corpora"
    layers, _ = pr.moe_layers(a.model)
    k = pr.experts_used(a.model)
    use = a.use if a.use > 0 else a.tokens
    held = pr.activations(a.model, [texts / f"{c}.eval.txt" for c in a.corpora], use, layers)
    cal = (
        pr.activations(a.model, [texts / f"{c}.calib.txt" for c in a.corpora], a.tokens, layers)
        if a.predict == "linear-post"
        else None
    )
    w_router = pr.routers(a.model, layers)
    ids = np.stack([pr.topk(x, k) for x in held["ffn_moe_logits"]], axis=1).astype(np.int32)
    n, n_layers, _ = ids.shape
    guess: dict[int, NDArray[np.bool_]] = {}
    for d in range(1, max(depths) + 1):
        g = np.zeros((n, n_layers, n_expert), bool)
        for dst in range(d, n_layers):
            x = held["ffn_norm"][dst - d]
            if cal is None:
                scores = x @ w_router[dst].T
            else:
                scores = pr.apply(pr.ridge(cal["ffn_norm"][dst - d], cal["ffn_moe_logits"][dst], a.ridge), x)
            np.put_along_axis(g[:, dst], pr.topk(scores, k), True, axis=1)
        guess[d] = g
    return ids, guess


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="MoE GGUF the traces were recorded on")
    p.add_argument("--corpora", nargs="+", default=["fortunes", "linux-doc", "py-library"], help="corpus names")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of each trace (as bench/policy_card.py)")
    p.add_argument("--use", type=int, default=0, help="replay only the first N tokens of each trace (0: all)")
    p.add_argument("--budget", type=float, default=25.0, help="budget in %% of the experts' bytes")
    p.add_argument("--depths", default="0,1,3", help="lookahead distances to try, comma-separated")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache/moetier/traces", help="where traces are kept")
    p.add_argument(
        "--predict",
        default=None,
        choices=["stacked", "linear-post"],
        help="also run the rule told this predictor's guesses at the --depths (bench/predictors.py's); every "
        "row then replays the stock model's routing of the held-out texts, from the same run as the guesses",
    )
    p.add_argument("--ridge", type=float, default=1e-3, help="ridge of the linear-post predictor")
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json")
    a = p.parse_args()

    def trace(c: str, split: str) -> Path:
        path = a.work / f"{a.model.stem}.{c}.{split}.{a.tokens}.npz"
        if not path.exists():
            sys.exit(f"{path}: no trace (bench/policy_card.py --model {a.model} records it)")
        return path

    held = [sorted_ids(trace(c, "eval")) for c in a.corpora]
    if a.use > 0:
        held = [x[: a.use] for x in held]
    n_expert = int(np.load(trace(a.corpora[0], "eval"))["n_expert"])
    q_table = reuse_table([sorted_ids(trace(c, "calib")) for c in a.corpora], n_expert)
    geo = rp.geometry(a.model, None, rp.probe(a.model, None), a.budget, 1.0, 1.0, 0.0)
    ids = np.concatenate(held)
    depths = [int(x) for x in a.depths.split(",")]
    guess: dict[int, NDArray[np.bool_]] | None = None
    if a.predict:
        ids, guess = predicted(a, depths, n_expert)

    # the engine's own replay of the same tokens, for scale: its LRU, reuse-rank and Belady
    def cut(t: Trace) -> Trace:
        n = a.use if a.use > 0 else t.ids.shape[0]
        starts = (tuple(x for x in t.seq_starts if x < n), tuple(x for x in t.ubatch_starts if x < n))
        return Trace(t.ids[:n], t.weights[:n], t.layers, t.n_expert, *starts)

    names = [str(trace(c, "eval")) for c in a.corpora]
    engine_trace = concat_traces([cut(Trace.load(x)) for x in names], names)
    engine = {
        p: rp.replay_one(engine_trace, geo, p, 1.0, 1.0, (0.25, 0.25, 0.25, 0.25))["misses_per_token"]
        for p in ("lru", "reuse-rank", "belady")
    }
    sys.stdout.write(f"engine replay, misses/token: {engine}\n")
    rows = []
    runs = [("belady", 0, False, False)] + [("rule", d, False, False) for d in depths]
    runs += [("rule", d, False, True) for d in depths if d > 0]
    if guess is not None:
        runs += [("rule", d, True, soft) for d in depths if d > 0 for soft in (False, True)]
    for mode, depth, guessed, soft in runs:
        t0 = time.monotonic()
        m = simulate(ids, n_expert, int(geo["n_slots"]), q_table, mode, depth, guess if guessed else None, soft)
        told = (a.predict if guessed else "truth") + (", keeps only" if soft else "")
        row = {"mode": mode, "lookahead": depth, "told": told, "misses_per_token": m}
        rows.append(row | {"seconds": time.monotonic() - t0})
        sys.stdout.write(f"{mode} lookahead {depth} ({told}): {m:.2f} misses/token\n")
    rep = {
        "model": str(a.model),
        "budget_pct": a.budget,
        "n_slots": int(geo["n_slots"]),
        "tokens": int(ids.shape[0]),
        "held_out": [str(trace(c, "eval")) for c in a.corpora],
        "table_from": [str(trace(c, "calib")) for c in a.corpora],
        "engine_misses_per_token": engine,
        "replayed": f"the stock model's routing of the held-out texts ({a.predict} guesses)" if a.predict else "traces",
        "rows": rows,
    }
    Path(a.out + ".json").write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
