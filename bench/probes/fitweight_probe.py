"""Probe, 2026-11-26. Question: do a few massive tokens decide moefy's refit, and do relative token
weights (MoefyConfig.fit_weight) help? Answer, the 0.5B: the 16 window-start tokens hold 96.8% of
layer 3's squared FFN output and 43.9% of layer 22's; relative weights lower those layers' held-out
error by about 1% and perplexity not at all. Result: bench/results/moefy-fitweight-layers.json
(read in bench/results/moefy-fitweight.md).

Where the squared FFN output of a dense qwen2 model sits over its calibration tokens, and what
moefy's relative token weights (MoefyConfig.fit_weight) do to a layer's held-out FFN error
(bench/results/moefy-fitweight.md). Reads the dense activations a `moetier moefy --work-dir W` run
cached (W/<key>/dense/ffn_norm-<layer>.npy: the fitted tokens, then the held-out ones).

    python bench/probes/fitweight_probe.py --dense qwen2.5-coder-0.5b.gguf --acts W/<key>/dense \\
        --norm-layers 1,3,12,22 --fit-layers 3,22 --out bench/results/moefy-fitweight-layers.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np

from moetier.tools import moefy as mf
from plan_probe import plan_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", required=True, help="dense qwen2 GGUF")
    p.add_argument("--acts", required=True, help="directory of the cached dense ffn_norm-<layer>.npy")
    p.add_argument("--norm-layers", default="1,3,12,22", help="layers whose output norms are reported")
    p.add_argument("--norm-tokens", type=int, default=8192, help="tokens the norm report covers")
    p.add_argument("--fit-layers", default="3,22", help="layers planned with each fit weight")
    p.add_argument("--out", required=True, help="JSON output path")
    a = p.parse_args()
    cfg0 = mf.MoefyConfig()
    t = {x.name: x for x in gguf.GGUFReader(a.dense).tensors}

    def load(il: int) -> tuple[np.ndarray, tuple[mf.F32, mf.F32, mf.F32]]:
        x = np.load(Path(a.acts) / f"ffn_norm-{il}.npy", mmap_mode="r")
        w = tuple(mf._tensor_f32(t[f"blk.{il}.ffn_{k}.weight"]) for k in ("gate", "up", "down"))
        return x, w  # type: ignore[return-value]

    out: dict[str, object] = {"dense": a.dense, "acts": a.acts, "norms": [], "fits": []}
    for il in (int(v) for v in a.norm_layers.split(",")):
        x, w = load(il)
        n = np.linalg.norm(mf.dense_ffn(np.asarray(x[: a.norm_tokens]), *w), axis=1)
        sq = np.sort(n**2)[::-1]
        row = {
            "layer": il,
            "tokens": len(n),
            "median": float(np.median(n)),
            "q999": float(np.quantile(n, 0.999)),
            "max": float(n.max()),
            "top16_share_of_sum_sq": float(sq[:16].sum() / sq.sum()),
        }
        out["norms"].append(row)  # type: ignore[attr-defined]
        print(json.dumps(row), flush=True)
    # the fits: plan_probe's rows (a superset of the columns this probe wrote before)
    layers = [int(v) for v in a.fit_layers.split(",")]
    out["fits"] = plan_rows(a.dense, a.acts, layers, cfg0, "fit_weight", list(mf.FIT_WEIGHTS))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
