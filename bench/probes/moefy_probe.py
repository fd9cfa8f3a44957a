"""Probe, 2026-11-24. Question: do moefy's least-squares fits overfit, and which ridge strengths and how
many calibration tokens hold up on held-out text? Answer, layers 3, 14 and 24 of the 1.5B: ridge 1.0
for the router and the refit, and 32768 calibration tokens (now the defaults); a perfect router would
gain only 3-7%. Result: bench/results/moefy-ridge-probe.jsonl (read in bench/results/moefy-c32k.md).

Held-out FFN error of moefy plan variants on a few layers: how the conversion's knobs (ridge
strengths, calibration tokens, oracle routing as a bound on the router) do on tokens the fit never
saw, without converting whole models. Validation text is taken from the corpora's calib splits far
past what a calibration mix uses (bench/corpora.py), so the eval splits stay unseen.

    python bench/probes/moefy_probe.py --dense qwen2.5-coder-1.5b.gguf --calib calib-mix.txt --layers 3,14,24 \\
        --variants '[{"oracle": true}, {"refit_ridge": 3.0}, {"calib_tokens": 32768}]' --work /tmp/probe

Prints one JSON line per layer and variant: the error on the fitted tokens ("calib") and on 2048
tokens of each validation text (mean over tokens of ||y - y_moe|| / ||y||, dense inputs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the harness's modules

from corpora import default_cache
from moetier.model import Model
from moetier.tools import distill as dl
from moetier.tools import moefy as mf

# (corpus, character offset into its calib split): far past the first 600,000 characters a mix uses
VALIDATION = (("fortunes", 800_000), ("linux-doc", 10_000_000), ("py-stdlib", 2_000_000))


def oracle_error(pl: mf.LayerPlan, x: mf.F32, y: mf.F32, w: tuple[mf.F32, mf.F32, mf.F32], k: int) -> float:
    """The plan's error when each token takes the k groups with the largest true output norms (the
    router's softmax weights renormalised over them): what a perfect router would reach."""
    wg, wu, wd = w
    h = mf._silu(x @ wg.T) * (x @ wu.T)
    norms = np.stack([np.linalg.norm(h[:, g] @ wd[:, g].T, axis=1) for g in pl.groups], axis=1)
    top = np.argsort(-norms, axis=1)[:, :k]
    logits = x @ pl.router.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    wt = np.take_along_axis(p, top, axis=1)
    wt /= wt.sum(axis=1, keepdims=True)
    out = h[:, pl.shared] @ pl.down_shared.T
    for j in range(k):
        for e in range(len(pl.groups)):
            rows = np.flatnonzero(top[:, j] == e)
            out[rows] += wt[rows, j, None] * (h[rows][:, pl.groups[e]] @ pl.down_experts[e].T)
    return float(np.mean(np.linalg.norm(y - out, axis=1) / (np.linalg.norm(y, axis=1) + 1e-8)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", required=True, help="dense qwen2 GGUF")
    p.add_argument("--calib", required=True, help="calibration text (as given to moetier moefy)")
    p.add_argument("--layers", default="3,14,24", help="comma-separated layer indices")
    p.add_argument(
        "--variants", required=True, help="JSON list of MoefyConfig overrides; 'oracle': true adds the bound"
    )
    p.add_argument("--work", required=True, help="directory for the collected activations (reused)")
    a = p.parse_args()
    src, work = Path(a.dense), Path(a.work)
    variants: list[dict[str, Any]] = json.loads(a.variants)
    n_tok = max(int(v.get("calib_tokens", mf.MoefyConfig.calib_tokens)) for v in variants)
    reader = gguf.GGUFReader(src)
    tensors = {t.name: t for t in reader.tensors}
    n_layer = int(reader.fields["qwen2.block_count"].parts[-1][0])

    tok = Model(src, n_ctx=512)
    calib = tok.tokenize(Path(a.calib).read_text(errors="replace"))[:n_tok]
    corpora = default_cache() / "corpora"
    val = {n: tok.tokenize((corpora / f"{n}.calib.txt").read_text()[off : off + 40000])[:2048] for n, off in VALIDATION}
    del tok
    xc = mf._collect(src, calib, n_layer, None, work / f"calib-{mf.cache_key(calib)}")["ffn_norm"]
    xv = {n: mf._collect(src, t, n_layer, None, work / f"val-{n}")["ffn_norm"] for n, t in val.items()}

    for il in (int(v) for v in a.layers.split(",")):
        w = tuple(mf._tensor_f32(tensors[f"blk.{il}.ffn_{q}.weight"]) for q in ("gate", "up", "down"))
        for v in variants:
            opts = {k: val_ for k, val_ in v.items() if k != "oracle"}
            cfg = mf.MoefyConfig(**opts)
            t0 = time.monotonic()
            x = np.asarray(xc[il][: cfg.calib_tokens])
            pl = mf.plan_layer(x, *w, cfg, np.random.default_rng(0))  # type: ignore[misc]
            layer = mf.layer_from_plan(pl, w[0], w[1])
            res: dict[str, Any] = {"layer": il, "variant": v, "calib": round(pl.rel_error, 4)}
            for n in xv:
                x_v = np.asarray(xv[n][il])
                y_v = mf.dense_ffn(x_v, *w)  # type: ignore[misc]
                res[n] = round(dl.rel_error(layer, x_v, y_v, cfg.n_expert_used, True), 4)
                if v.get("oracle"):
                    res[n + "-oracle"] = round(oracle_error(pl, x_v, y_v, w, cfg.n_expert_used), 4)  # type: ignore[arg-type]
            res["seconds"] = round(time.monotonic() - t0)
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
