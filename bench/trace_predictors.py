"""Expert predictors that use only routing history, judged on a trace of real routing split by
sequence: fitted on one part (the first sequences), judged on the rest. What each names for layer
l + d of the same token (d = 1..3, known when layer l has routed) and for layer l of the next token.

- popularity: layer l + d's most used experts in the fitted part;
- previous-token: what the previous token chose at the same layer (next-token only);
- affinity: DuoServe's inter-layer affinity (paper 004, sec. 4): the experts layer l + d chose most
  often in the fitted part when layer l chose what it chose now, summed over layer l's choice;
- path: affinity from every layer routed so far (l, l - 1, ...) to l + d, the nearer layers weighted
  more (DuoServe's path), plus the previous token's choice at l + d and the popularity, with weights
  chosen on the fitted part;
- token-memory (with --tokens-file): what the same token id chose at layer l + d the last time it was
  seen (the engine knows a ubatch's token ids before any layer runs).

Each predictor names k experts (the trace's top-k); reported: slot overlap (the share of the k true
experts it names), averaged over tokens and layers. Without gate weights there is no top-1.

    python bench/trace_predictors.py ../shared/traces/deepseek-v2-lite-chat-puffin/trace.npz --split 40 \\
        --tokens-file ../shared/traces/deepseek-v2-lite-chat-puffin/tokens.jsonl \\
        --out bench/results/trace-predictors-deepseek-v2-lite-2026-11-29
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from moetier.calibrate import Trace
from moetier.tools.replay import select_sequences

F32 = npt.NDArray[np.float32]


def one_hot(ids: npt.NDArray[np.int32], n_expert: int) -> F32:
    oh = np.zeros((*ids.shape[:2], n_expert), np.float32)
    np.put_along_axis(oh, ids.astype(np.int64), 1.0, axis=2)
    return oh


def overlap(scores: F32, truth: F32, k: int) -> float:
    """Mean share of the true k experts among the k best scores (ties broken by expert id)."""
    top = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    return float(np.take_along_axis(truth, top, axis=-1).sum(-1).mean() / k)


def affinity(fit: F32, d: int) -> F32:
    """[l][e][e']: P(layer l + d chooses e' | layer l chose e), from the fitted part (add-one)."""
    c: F32 = np.einsum("tle,tlf->lef", fit[:, :-d], fit[:, d:])
    p: F32 = ((c + 1.0 / fit.shape[2]) / (fit[:, :-d].sum(0)[:, :, None] + 1.0)).astype(np.float32)
    return p


def path_scores(data: F32, fit: F32, d: int) -> tuple[F32, F32]:
    """Scores for layer l + d from layer l's choice (affinity), and from every routed layer l - back
    (back = 0..3) weighted 2^-back (the path); [tokens][l][expert] for targets l + d."""
    n_layers = data.shape[1]
    s_aff = np.einsum("tle,lef->tlf", data[:, :-d], affinity(fit, d))
    s_path = s_aff.copy()
    for back in range(1, 4):
        if d + back >= n_layers:
            break
        s_b = np.einsum("tle,lef->tlf", data[:, : -(d + back)], affinity(fit, d + back))
        s_path[:, back:] += 0.5**back * s_b  # from layer l - back to l + d
    return s_aff, s_path


def token_memory(toks: list[int], oh: F32) -> F32:
    """For each token, what the same token id chose the last time it was seen (zeros if never)."""
    out = np.zeros_like(oh)
    last: dict[int, int] = {}
    for t, tk in enumerate(toks):
        if tk in last:
            out[t] = oh[last[tk]]
        last[tk] = t
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="routing trace (shared format or moetier trace)")
    p.add_argument("--split", type=int, required=True, help="fit on sequences 0 .. SPLIT - 1, judge on the rest")
    p.add_argument("--tokens-file", type=Path, default=None, help="JSON lines with each sequence's tokens")
    p.add_argument("--max-d", type=int, default=3, help="layers ahead to predict (default 3)")
    p.add_argument("--out", required=True, help="OUT.json and OUT.md")
    a = p.parse_args()

    full = Trace.load(a.trace)
    fit_t = select_sequences(full, 0, a.split, str(a.trace))
    judge_t = select_sequences(full, a.split, None, str(a.trace))
    n_expert, k = full.n_expert, full.ids.shape[2]
    fit, judge = one_hot(fit_t.ids, n_expert), one_hot(judge_t.ids, n_expert)
    n_layers = fit.shape[1]
    # the judged part's sequence starts: no previous token there
    first = np.zeros(judge.shape[0], bool)
    first[list(judge_t.seq_starts)] = True
    prev = np.concatenate([np.zeros_like(judge[:1]), judge[:-1]])
    prev[first] = 0.0
    pop = fit.sum(0)  # [l][e]
    toks_mem = None
    if a.tokens_file is not None:
        toks: list[str] = []
        for line in a.tokens_file.read_text().splitlines():
            toks += json.loads(line)["tokens"]
        vocab: dict[str, int] = {}
        ids = [vocab.setdefault(t, len(vocab)) for t in toks]
        if len(ids) != full.ids.shape[0]:
            msg = f"{a.tokens_file}: {len(ids)} tokens, the trace has {full.ids.shape[0]}"
            raise SystemExit(msg)
        mem = token_memory(ids, one_hot(full.ids, n_expert))
        toks_mem = mem[fit.shape[0] :]
        seen = float((toks_mem.sum((1, 2)) > 0).mean())

    rows: list[dict[str, Any]] = []
    # next token, same layer
    tie = 1e-3 * pop / pop.max()  # popularity breaks the ties of the 0/1 predictors
    nxt = {"popularity": overlap(np.broadcast_to(pop, judge.shape).copy(), judge, k)}
    mask = ~first
    nxt["previous-token"] = overlap((prev + tie)[mask], judge[mask], k)
    if toks_mem is not None:
        nxt["token-memory"] = overlap(toks_mem + tie, judge, k)
    for name, v in nxt.items():
        rows.append({"target": "next token, same layer", "predictor": name, "overlap": v})

    for d in tqdm(range(1, a.max_d + 1), desc="distances"):
        truth = judge[:, d:]
        s_aff, s_path = path_scores(judge, fit, d)
        popd = np.broadcast_to(pop[d:], truth.shape)
        res = {
            "popularity": overlap(popd.copy(), truth, k),
            "affinity": overlap(s_aff, truth, k),
            "path": overlap(s_path, truth, k),
        }
        # path + previous token + popularity, weights chosen on the fitted part's last tenth
        best = (0.0, 0.0, -1.0)
        n_fit = fit.shape[0]
        tune = fit[n_fit - n_fit // 10 :]
        t_prev = np.concatenate([np.zeros_like(tune[:1]), tune[:-1]])
        t_path = path_scores(tune, fit, d)[1]
        t_pop = np.broadcast_to(pop[d:] / pop.sum(1, keepdims=True)[d:], t_path.shape)
        for wp in (0.0, 0.25, 0.5, 1.0, 2.0):
            for wq in (0.0, 1.0, 4.0):
                v = overlap((t_path + wp * t_prev[:, d:] + wq * t_pop).astype(np.float32), tune[:, d:], k)
                if v > best[2]:
                    best = (wp, wq, v)
        wp, wq, _ = best
        res["path+previous+popularity"] = overlap(
            (s_path + wp * prev[:, d:] + wq * popd / pop.sum(1, keepdims=True)[d:]).astype(np.float32), truth, k
        )
        if toks_mem is not None:
            res["token-memory"] = overlap(toks_mem[:, d:] + 1e-3 * popd / pop.max(), truth, k)
            res["path+token-memory"] = overlap(s_path + toks_mem[:, d:], truth, k)
        for name, v in res.items():
            rows.append({"target": f"layer l+{d}, same token", "predictor": name, "overlap": v})

    rep = {
        "trace": str(a.trace),
        "split": a.split,
        "fit_tokens": int(fit.shape[0]),
        "judge_tokens": int(judge.shape[0]),
        "n_expert": n_expert,
        "top_k": k,
        "n_layers": n_layers,
        "token_ids_seen_before": seen if toks_mem is not None else None,
        "rows": rows,
    }
    out = [
        f"History-only expert predictors on {a.trace} ({n_layers} layers, top-{k} of {n_expert}): fitted on "
        f"sequences 0-{a.split - 1} ({fit.shape[0]} tokens), judged on sequences {a.split}- ({judge.shape[0]} "
        "tokens). Overlap: the share of the true top-k experts among the k the predictor names.",
        "",
        "| target | predictor | overlap |",
        "|---|---|---|",
    ]
    out += [f"| {r['target']} | {r['predictor']} | {100 * r['overlap']:.1f}% |" for r in rows]
    if toks_mem is not None:
        out += ["", f"Token ids of the judged part seen earlier in the trace: {100 * seen:.1f}%."]
    Path(a.out + ".json").write_text(json.dumps(rep, indent=1) + "\n")
    Path(a.out + ".md").write_text("\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
