"""Probe, 2026-11-27. Question: how much balance (moefy --balance B) can a layer take before its
held-out FFN error gives back what split rounds gained? Answer, layers 4 and 27 of the 1.5B's sr2
conversion: B = 0.25 removes the idle experts and gives back 43% / 16% of that gain; B = 0.5 gives
back more than all of it on layer 4. Result: bench/results/moefy-balance-probe.jsonl (read in
bench/results/moefy-balance.md).

What moefy's --balance costs a layer, before a whole conversion is paid for. For a few layers of a
converted model whose plans a `moetier moefy --work-dir W` run cached (W/<key>/plan-<plan key>/
layer-N.npz) and whose dense activations it collected (W/<key>/dense/ffn_norm-N.npy: the fitted
tokens, then the held-out ones): the layer under each balance value (moefy.balance_layer: the
selection bias fitted on the fitted tokens, the down projections refitted under it), its relative
FFN error on the fitted and the held-out tokens, and the selection frequencies it gives.

    python bench/probes/balance_probe.py --dense qwen2.5-coder-1.5b.gguf --work W/<key> --plan <plan key> \\
        --base shared_frac=0.6 --base router_scale=0.25 --base split_rounds=2 --layers 4,27 --balance 0,0.25,0.5,1 \\
        --out bench/results/moefy-balance-probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np

from moetier.tools import moefy as mf
from moetier.tools.distill import rel_error, route
from plan_probe import _typed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", required=True, help="the dense source GGUF")
    p.add_argument("--work", required=True, help="the conversion's work dir (holding dense/ and plan-*/)")
    p.add_argument("--plan", required=True, help="the plan key (the plan-<key> dir name's tail)")
    p.add_argument("--base", action="append", default=[], help="FIELD=VALUE of the conversion's MoefyConfig")
    p.add_argument("--layers", required=True, help="layers, e.g. 4,27")
    p.add_argument("--balance", default="0,0.25,0.5,1", help="balance values (0: the plan as it is)")
    p.add_argument("--out", required=True, help="JSONL output, one line per layer and value")
    a = p.parse_args()

    work = Path(a.work)
    tensors = {t.name: t for t in gguf.GGUFReader(a.dense).tensors}
    cfg0 = mf.MoefyConfig(**{k: _typed(k, v) for k, v in (s.split("=", 1) for s in a.base)})
    k, n_fit = cfg0.n_expert_used, cfg0.calib_tokens
    renorm, sh_gate = mf.ARCHS[cfg0.arch]
    with open(a.out, "w") as out:
        for il in (int(v) for v in a.layers.split(",")):
            w = tuple(mf._tensor_f32(tensors[f"blk.{il}.ffn_{n}.weight"]) for n in ("gate", "up", "down"))
            x = np.load(work / "dense" / f"ffn_norm-{il}.npy", mmap_mode="r")
            xf, xh = np.asarray(x[:n_fit]), np.asarray(x[n_fit:])
            yf, yh = mf.dense_ffn(xf, *w), mf.dense_ffn(xh, *w)
            plan, _ = mf._load_layer(work / f"plan-{a.plan}" / f"layer-{il}.npz")
            for bal in (float(v) for v in a.balance.split(",")):
                t0 = time.monotonic()
                if bal > 0:
                    layer, err = mf.balance_layer(plan, xf, yf, replace(cfg0, balance=bal), renorm, sh_gate)
                else:
                    layer, err = plan, rel_error(plan, xf, yf, k, renorm, sh_gate)
                freq = {}
                for name, xs in (("fit", xf), ("held", xh)):
                    top, _, _ = route(layer, xs, k, renorm)
                    freq[name] = np.bincount(top.ravel(), minlength=layer.router.shape[0]) / len(xs)
                row = {
                    "layer": il,
                    "balance": bal,
                    "fit": err,
                    "held": rel_error(layer, xh, yh, k, renorm, sh_gate),
                    "fit_freq_min_max": [float(freq["fit"].min()), float(freq["fit"].max())],
                    "held_freq": [round(float(v), 3) for v in freq["held"]],
                    "held_cv": float(freq["held"].std() / freq["held"].mean()),
                    "seconds": time.monotonic() - t0,
                }
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
