"""Probe, 2026-11-27. Question: what is left in the training-free conversion of the 1.5B, layer by
layer? Answer, layers 3 and 20 of sh60: the routing weights cost 4-5% of a layer's held-out FFN
error, which a flatter softmax (router_scale 0.25) removes; other clustering features gain on one
layer what they lose on the other. Results: bench/results/moefy-router-scale-probe.json and
bench/results/moefy-cluster-probe.json (read in bench/results/moefy-router-scale.md).
balance_probe.py and fitweight_probe.py reuse its parsing and its rows.

What one moefy knob does to a layer's held-out FFN error, before a whole conversion is paid for.
For a few layers of a dense qwen2 GGUF: moefy's training-free plan (moefy.plan_layer) under each
value of one MoefyConfig field, its relative FFN error on the fitted tokens and on the held-out ones,
how peaked the routing weights it gives are (the top-1 share of the selected weight, which
HOBBIT's importance rule reads), and what the router's selection loses against the best top-k.
Reads the dense activations a `moetier moefy --work-dir W` run cached
(W/<key>/dense/ffn_norm-<layer>.npy: the fitted tokens, then the held-out ones).

    python bench/probes/plan_probe.py --dense qwen2.5-coder-1.5b.gguf --acts W/<key>/dense --layers 3,20 \\
        --base shared_frac=0.6 --vary router_scale=1,0.25,0.05 --out bench/results/moefy-router-scale-probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from moetier.tools import moefy as mf
from moetier.tools.distill import rel_error, relative_error, route


def _typed(name: str, text: str) -> Any:
    kinds = {f.name: f.type for f in fields(mf.MoefyConfig)}
    if name not in kinds:
        msg = f"--base/--vary: {name!r} is not a MoefyConfig field ({', '.join(kinds)})"
        raise SystemExit(msg)
    kind = str(kinds[name])
    if kind == "bool":
        if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
            msg = f"--base/--vary: {name}={text!r} is not a bool (true/false)"
            raise SystemExit(msg)
        return text.lower() in ("1", "true", "yes")
    if kind not in ("int", "float", "str"):
        msg = f"--base/--vary: {name} has type {kind}, which this probe does not parse"
        raise SystemExit(msg)
    return int(text) if kind == "int" else float(text) if kind == "float" else text


def _selection_loss(
    pl: mf.LayerPlan, layer: Any, x: Any, y: Any, w_gate: Any, w_up: Any, w_down: Any, k: int
) -> tuple[float, float]:
    """The relative FFN error of the plan's split with the dense down weights and weight 1 for each
    selected group (no refit, no routing weights): top-k groups by the router, then by the groups'
    true output norms (the oracle). Their gap is what routing loses, apart from the refit."""
    h = mf._silu(x @ w_gate.T) * (x @ w_up.T)
    base = h[:, pl.shared] @ w_down[:, pl.shared].T
    z = np.stack([h[:, g] @ w_down[:, g].T for g in pl.groups], axis=1)  # [N, E, d]
    errs = []
    for top in (route(layer, x, k, True)[0], np.argsort(-np.linalg.norm(z, axis=2), axis=1)[:, :k]):
        out = base + np.take_along_axis(z, top[:, :, None], axis=1).sum(axis=1)
        errs.append(relative_error(out, y))
    return errs[0], errs[1]


def plan_rows(
    dense: str, acts: str, layers: list[int], base: mf.MoefyConfig, name: str, values: list[Any]
) -> list[dict[str, Any]]:
    """One row per layer and value of the field `name`: the plan's errors, top-1 share and selection loss."""
    t = {x.name: x for x in gguf.GGUFReader(dense).tensors}
    rows: list[dict[str, Any]] = []
    for il in layers:
        x = np.load(Path(acts) / f"ffn_norm-{il}.npy", mmap_mode="r")
        w = tuple(mf._tensor_f32(t[f"blk.{il}.ffn_{k}.weight"]) for k in ("gate", "up", "down"))
        xf, xh = np.asarray(x[: base.calib_tokens]), np.asarray(x[base.calib_tokens :])
        yh = mf.dense_ffn(xh, *w)
        for v in values:
            cfg = replace(base, **{name: v})
            renorm, sh_gate = mf.ARCHS[cfg.arch]
            t0 = time.monotonic()
            pl = mf.plan_layer(xf, *w, cfg, np.random.default_rng([cfg.seed, il]))
            layer = mf.layer_from_plan(pl, w[0], w[1])
            held = rel_error(layer, xh, yh, cfg.n_expert_used, renorm, sh_gate)
            _, wk, _ = route(layer, xh, cfg.n_expert_used, renorm)
            top1 = np.sort(wk, axis=1)[:, -1] / wk.sum(axis=1)
            sel_router, sel_oracle = _selection_loss(pl, layer, xh, yh, *w, cfg.n_expert_used)
            row = {
                "layer": il,
                name: v,
                "fitted": pl.rel_error,
                "held_out": held,
                "held_tokens": len(xh),
                "top1_share": float(top1.mean()),
                "selection_router": sel_router,
                "selection_oracle": sel_oracle,
                "seconds": time.monotonic() - t0,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", required=True, help="dense qwen2 GGUF")
    p.add_argument("--acts", required=True, help="directory of the cached dense ffn_norm-<layer>.npy")
    p.add_argument("--layers", default="3,20", help="layers to plan (default: 3,20)")
    p.add_argument("--base", action="append", default=[], help="FIELD=VALUE of MoefyConfig for every plan")
    p.add_argument("--vary", required=True, help="FIELD=V1,V2,...: the field and its values to compare")
    p.add_argument("--out", required=True, help="JSON output path")
    a = p.parse_args()
    base = mf.MoefyConfig(**{k: _typed(k, v) for k, v in (s.split("=", 1) for s in a.base)})
    vname, vvals = a.vary.split("=", 1)
    if vname == "calib_tokens":
        # the fitted / held-out split of the cached activations is base.calib_tokens
        msg = "--vary calib_tokens: set it with --base; the cached activations are split there"
        raise SystemExit(msg)
    values = [_typed(vname, v) for v in vvals.split(",")]
    out: dict[str, Any] = {"dense": a.dense, "acts": a.acts, "base": a.base, "vary": a.vary}
    out["rows"] = plan_rows(a.dense, a.acts, [int(v) for v in a.layers.split(",")], base, vname, values)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
