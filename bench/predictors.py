"""Expert predictors for prefetch, judged offline on held-out text: how well each
one names, at layer l, the experts that layer l+d (d = 1..3) will select.

- stacked: HOBBIT's stacked gate, the engine's predictor today: layer l+d's router applied to layer
  l's normalised FFN input.
- linear-post / linear-pre: a linear map fitted (ridge, on calibration text) from layer l's
  normalised FFN input (after attention) / normalised attention input (before it) to layer l+d's
  router logits: the published "pre-attention" predictors.
- duoserve: DuoServe's predictor (paper 004, sec. 4): the path of experts selected so far, layer
  l+d's popularity and the l -> l+d affinity, into an MLP with one output per expert (numpy,
  3 layers where the paper uses 7; BCE).
- affinity, popularity, previous-token: the heuristics those are built from, as baselines.

Every predictor names k experts (the model's top-k). Reported per predictor and distance: top-1
(its first choice is the true top-1), slot overlap (share of the k true experts it names), exact
top-k match, and wasted reads per useful one if all k were prefetched. Activations come from the
stock model run through llama.cpp (moetier._core.trace.collect).

What bounds top-1: where layer l+d's router gives its top two experts nearly equal logits, a small
error in the predicted logits swaps them. So the top-1 of the predictors that output logits
(stacked, linear-post, linear-pre) is also reported by the true top-1/top-2 logit margin, in
quintiles of each target layer's own margins (the narrowest fifth first).

    python bench/predictors.py --model M.gguf --corpora fortunes linux-doc py-library --tokens 2048 \
        --out bench/results/predictors-1.5b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from corpora import default_cache
from moetier import Model, _core
from moetier.calibrate import moe_layers
from moetier.tools.mlp import MLP, FitConfig, fit

F32 = npt.NDArray[np.float32]
DISTANCES = (1, 2, 3)
MARGIN_BINS = 5
LOGIT_PREDICTORS = ("stacked", "linear-post", "linear-pre")


def activations(model: Path, texts: list[Path], tokens: int, layers: list[int]) -> dict[str, list[F32]]:
    """attn_norm, ffn_norm and ffn_moe_logits of every MoE layer over the first tokens of each text."""
    m = Model(model, n_ctx=512)
    kinds = ("attn_norm", "ffn_norm", "ffn_moe_logits")
    out: dict[str, list[list[F32]]] = {k: [[] for _ in layers] for k in kinds}
    for t in texts:
        toks = m.tokenize(t.read_text(errors="replace"))[:tokens]
        rows = _core.trace.collect(m._m, toks, [f"{k}-{il}" for k in kinds for il in layers], 512)
        for k in kinds:
            for i, il in enumerate(layers):
                out[k][i].append(np.asarray(rows[f"{k}-{il}"], dtype=np.float32).reshape(len(toks), -1))
    return {k: [np.concatenate(v) for v in out[k]] for k in kinds}


def experts_used(model: Path) -> int:
    from gguf import GGUFReader

    r = GGUFReader(str(model))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    f = r.fields[f"{arch}.expert_used_count"]
    return int(f.parts[f.data[0]][0])


def routers(model: Path, layers: list[int]) -> list[F32]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    by_name = {t.name: t for t in GGUFReader(str(model)).tensors}
    out = []
    for il in layers:
        t = by_name[f"blk.{il}.ffn_gate_inp.weight"]
        out.append(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1, t.shape[0]))
    return out


def topk(scores: F32, k: int) -> npt.NDArray[np.int64]:
    """Indices of the k largest per row, largest first."""
    idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, idx, 1), axis=1)
    return np.take_along_axis(idx, order, 1)


def metrics(pred: npt.NDArray[np.int64], true: npt.NDArray[np.int64]) -> dict[str, float]:
    k = true.shape[1]
    hits = (pred[:, :, None] == true[:, None, :]).any(2).sum(1)
    useful = hits.sum()
    return {
        "top1": float(np.mean(pred[:, 0] == true[:, 0])),
        "overlap": float(np.mean(hits / k)),
        "exact": float(np.mean(hits == k)),
        "wasted_per_useful": float((pred.size - useful) / max(1, useful)),
    }


def margin_bins(logits: F32, bins: int = MARGIN_BINS) -> npt.NDArray[np.int64]:
    """Per token, the quintile (0 = narrowest) of its top-1/top-2 logit margin among this layer's tokens."""
    top2 = -np.sort(-logits, axis=1)[:, :2]
    margin = top2[:, 0] - top2[:, 1]
    rank = np.argsort(np.argsort(margin, kind="stable"), kind="stable")
    return np.asarray(rank * bins // len(margin), dtype=np.int64)


def ridge(x: F32, y: F32, lam: float) -> F32:
    """[W; b] minimising |[x 1] W - y|^2 + lam * scale * |W|^2 (scale: mean diagonal of x^T x)."""
    xb = np.concatenate([x, np.ones((len(x), 1), np.float32)], 1).astype(np.float64)
    g = xb.T @ xb
    reg = lam * np.mean(np.diag(g)[:-1]) * np.eye(len(g))
    reg[-1, -1] = 0.0
    return np.linalg.solve(g + reg, xb.T @ y.astype(np.float64)).astype(np.float32)


def apply(w: F32, x: F32) -> F32:
    return np.asarray(x @ w[:-1] + w[-1], dtype=np.float32)


def path_features(sel: list[npt.NDArray[np.int64]], l_src: int, l_dst: int, n_expert: int, pop: F32, aff: F32) -> F32:
    """DuoServe's state for predicting layer l_dst at layer l_src: multi-hot of the experts selected at
    layers 0..l_src (later ones zero), l_dst's popularity, the mean l_src -> l_dst affinity row of
    l_src's selection, and one-hots of l_dst and the distance."""
    n = len(sel[0])
    n_layers = len(sel)
    path = np.zeros((n, n_layers * n_expert), np.float32)
    rows = np.arange(n)[:, None]
    for i in range(l_src + 1):
        path[rows, i * n_expert + sel[i]] = 1.0
    a = aff[sel[l_src]].mean(1)  # [n, E]
    onehot = np.zeros((n, n_layers + len(DISTANCES)), np.float32)
    onehot[:, l_dst] = 1.0
    onehot[:, n_layers + l_dst - l_src - 1] = 1.0
    return np.concatenate([path, np.broadcast_to(pop, (n, n_expert)), a, onehot], 1)


def statistics(sel: list[npt.NDArray[np.int64]], n_expert: int) -> tuple[F32, dict[tuple[int, int], F32]]:
    """Popularity per layer [L, E] and affinity A[l, l+d][i, j] = P(j at l+d | i at l)."""
    n_layers = len(sel)
    pop = np.stack([np.bincount(s.ravel(), minlength=n_expert) for s in sel]).astype(np.float32)
    pop /= pop.sum(1, keepdims=True)
    aff = {}
    for d in DISTANCES:
        for l_src in range(n_layers - d):
            c = np.zeros((n_expert, n_expert), np.float32)
            src, dst = sel[l_src], sel[l_src + d]
            np.add.at(c, (np.repeat(src, dst.shape[1], 1).ravel(), np.tile(dst, src.shape[1]).ravel()), 1.0)
            aff[(l_src, l_src + d)] = (c + 1e-3) / (c + 1e-3).sum(1, keepdims=True)
    return pop, aff


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="MoE GGUF")
    p.add_argument("--corpora", nargs="+", default=["fortunes", "linux-doc", "py-library"], help="corpus names")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per corpus and split")
    p.add_argument("--ridge", type=float, default=1e-3, help="ridge of the linear predictors (x mean diag of X^T X)")
    p.add_argument("--mlp-rows", type=int, default=150_000, help="DuoServe training examples (random subset)")
    p.add_argument("--epochs", type=int, default=6, help="DuoServe MLP epochs")
    p.add_argument("--out", required=True, help="OUT.json and OUT.md")
    a = p.parse_args()
    texts = default_cache() / "corpora"
    layers, n_expert = moe_layers(a.model)
    t0 = time.time()
    cal = activations(a.model, [texts / f"{c}.calib.txt" for c in a.corpora], a.tokens, layers)
    held = activations(a.model, [texts / f"{c}.eval.txt" for c in a.corpora], a.tokens, layers)
    k = experts_used(a.model)
    w_router = routers(a.model, layers)
    n_layers = len(layers)
    true_cal = [topk(x, k) for x in cal["ffn_moe_logits"]]
    true = [topk(x, k) for x in held["ffn_moe_logits"]]
    sys.stderr.write(f"activations: {time.time() - t0:.0f} s, {len(true[0])} held-out tokens, top-{k} of {n_expert}\n")
    pop, aff = statistics(true_cal, n_expert)
    rng = np.random.default_rng(0)
    # DuoServe's MLP: one network over every (source, target) pair
    xs, ys = [], []
    for d in DISTANCES:
        for l_src in range(n_layers - d):
            f = path_features(true_cal, l_src, l_src + d, n_expert, pop[l_src + d], aff[(l_src, l_src + d)])
            y = np.zeros((len(f), n_expert), np.float32)
            y[np.arange(len(f))[:, None], true_cal[l_src + d]] = 1.0
            xs.append(f)
            ys.append(y)
    x_all, y_all = np.concatenate(xs), np.concatenate(ys)
    keep = rng.choice(len(x_all), size=min(a.mlp_rows, len(x_all)), replace=False)
    net = MLP.init([x_all.shape[1], 256, 256, n_expert], rng)
    t1 = time.time()
    losses = fit(net, x_all[keep], y_all[keep], "bce", FitConfig(epochs=a.epochs), rng, "duoserve mlp")
    sys.stderr.write(f"duoserve mlp: {time.time() - t1:.0f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}\n")
    del x_all, y_all, xs, ys
    rows: list[dict[str, Any]] = []
    by_margin: list[dict[str, Any]] = []
    for d in DISTANCES:
        acc: dict[str, list[dict[str, float]]] = {}
        right = {name: np.zeros(MARGIN_BINS) for name in LOGIT_PREDICTORS}
        seen = np.zeros(MARGIN_BINS)
        for l_src in range(n_layers - d):
            l_dst = l_src + d
            tr = true[l_dst]
            bins = margin_bins(held["ffn_moe_logits"][l_dst])
            seen += np.bincount(bins, minlength=MARGIN_BINS)

            def linear(kind: str, l_src: int = l_src, l_dst: int = l_dst) -> npt.NDArray[np.int64]:
                w = ridge(cal[kind][l_src], cal["ffn_moe_logits"][l_dst], a.ridge)
                return topk(apply(w, held[kind][l_src]), k)

            preds = {
                "stacked": topk(held["ffn_norm"][l_src] @ w_router[l_dst].T, k),
                "linear-post": linear("ffn_norm"),
                "linear-pre": linear("attn_norm"),
                "duoserve": topk(net(path_features(true, l_src, l_dst, n_expert, pop[l_dst], aff[(l_src, l_dst)])), k),
                "affinity": topk(aff[(l_src, l_dst)][true[l_src]].mean(1) + 1e-3 * pop[l_dst], k),
                "popularity": np.broadcast_to(topk(pop[l_dst][None], k), tr.shape),
                "previous-token": np.concatenate([tr[:1], tr[:-1]]),
            }
            for name, pr in preds.items():
                acc.setdefault(name, []).append(metrics(np.asarray(pr), tr))
            for name in LOGIT_PREDICTORS:
                hit = np.asarray(preds[name])[:, 0] == tr[:, 0]
                right[name] += np.bincount(bins, weights=hit, minlength=MARGIN_BINS)
        for name, ms in acc.items():
            rows.append({"predictor": name, "distance": d, **{m: float(np.mean([x[m] for x in ms])) for m in ms[0]}})
        for name in LOGIT_PREDICTORS:
            share = (right[name] / seen).tolist()
            by_margin.append({"predictor": name, "distance": d, "top1_by_margin_quintile": share})
    rep = {
        "model": str(a.model),
        "corpora": a.corpora,
        "tokens_per_corpus": a.tokens,
        "n_expert": n_expert,
        "k": k,
        "ridge": a.ridge,
        "duoserve_loss": losses,
        "rows": rows,
        "top1_by_margin": by_margin,
    }
    md = [
        f"Expert predictors on {a.model.name}, held-out {', '.join(a.corpora)} ({len(true[0])} tokens), top-{k} of "
        f"{n_expert}; linear and DuoServe fitted on the calibration splits. Means over source layers.",
        "",
        "| predictor | distance | top-1 | slot overlap | exact top-k | wasted per useful |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["distance"], -r["overlap"])):
        md.append(
            f"| {r['predictor']} | {r['distance']} | {100 * r['top1']:.1f}% | {100 * r['overlap']:.1f}% "
            f"| {100 * r['exact']:.1f}% | {r['wasted_per_useful']:.2f} |"
        )
    md += [
        "",
        "Top-1 by the true top-1/top-2 logit margin of the target layer, in quintiles of each layer's",
        "own margins (narrowest first):",
        "",
        "| predictor | distance | " + " | ".join(f"q{i + 1}" for i in range(MARGIN_BINS)) + " |",
        "|---|---|" + "---|" * MARGIN_BINS,
    ]
    for r in by_margin:
        md.append(
            f"| {r['predictor']} | {r['distance']} | "
            + " | ".join(f"{100 * v:.1f}%" for v in r["top1_by_margin_quintile"])
            + " |"
        )
    Path(a.out + ".json").write_text(json.dumps(rep, indent=1) + "\n")
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    sys.stdout.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
