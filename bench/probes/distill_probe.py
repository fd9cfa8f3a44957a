"""Probe, 2026-11-24. Question: does layer-wise distillation (moetier.tools.distill) pay on a real
model? Answer, layers 5 and 20 of the 0.5B: no, it overfits: the training tokens' error fell 9-12% in
six epochs, the held-out error by at most 1.2%. Result: bench/results/moefy-distill.{json,md}.

Does layer-wise distillation (moetier.tools.distill) pay on a real model? For a few layers of a
dense qwen2 GGUF: the training-free plan (moefy.plan_layer), then Adam on every weight of the MoE layer
against the dense FFN, at several step sizes; the relative FFN error on training tokens and on the
held-out tail of the calibration tokens after every epoch. A gain on the training tokens that the
held-out ones do not show is overfitting: the layer has more weights than the calibration gives
targets.

    python bench/probes/distill_probe.py --model dense.gguf --calib calib.txt --layers 5,12,20 --lrs 1e-3,3e-4 \\
        --epochs 8 --out bench/results/moefy-distill
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import gguf
import numpy as np

from moetier.model import Model
from moetier.tools.distill import DistillConfig, distill_layer
from moetier.tools.moefy import ARCHS, MoefyConfig, _collect, _tensor_f32, dense_ffn, layer_from_plan, plan_layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="dense qwen2 GGUF")
    p.add_argument("--calib", required=True, help="calibration text (not evaluation text)")
    p.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens (default: 16384)")
    p.add_argument("--layers", default="5,12,20", help="layers to probe (default: 5,12,20)")
    p.add_argument("--lrs", default="1e-3,3e-4", help="Adam step sizes to try (default: 1e-3,3e-4)")
    p.add_argument("--epochs", type=int, default=8, help="epochs per step size (default: 8)")
    p.add_argument("--threads", type=int, default=2, help="threads of the activation run (default: 2)")
    p.add_argument("--work-dir", default=None, help="keeps the collected activations between runs")
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.md")
    a = p.parse_args()

    cfg = MoefyConfig(calib_tokens=a.calib_tokens)
    renorm, sh_gate = ARCHS[cfg.arch]
    layers = [int(v) for v in a.layers.split(",")]
    tok = Model(a.model, n_ctx=512, n_threads=a.threads)
    tokens = tok.tokenize(Path(a.calib).read_text(errors="replace"))[: a.calib_tokens]
    del tok
    reader = gguf.GGUFReader(a.model)
    tensors = {t.name: t for t in reader.tensors}
    n_layer = int(reader.fields["qwen2.block_count"].parts[-1][0])
    t0 = time.monotonic()
    xs = _collect(Path(a.model), tokens, n_layer, a.threads, Path(a.work_dir) if a.work_dir else None)["ffn_norm"]
    collect_s = time.monotonic() - t0

    rows: list[dict[str, object]] = []
    for il in layers:
        wg, wu, wd = (_tensor_f32(tensors[f"blk.{il}.ffn_{n}.weight"]) for n in ("gate", "up", "down"))
        x = np.asarray(xs[il])
        y = dense_ffn(x, wg, wu, wd)
        start = layer_from_plan(plan_layer(x, wg, wu, wd, cfg, np.random.default_rng([cfg.seed, il])), wg, wu)
        for lr in (float(v) for v in a.lrs.split(",")):
            dcfg = replace(DistillConfig(), epochs=a.epochs, lr=lr)
            t0 = time.monotonic()
            res = distill_layer(start, x, y, cfg.n_expert_used, renorm, dcfg, sh_gate)
            row = {
                "layer": il,
                "lr": lr,
                "seconds": time.monotonic() - t0,
                "history": res.history,
                "best_epoch": res.best_epoch,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

    out = Path(a.out)
    report = {
        "model": a.model,
        "calib": a.calib,
        "n_tokens": len(tokens),
        "moefy": asdict(cfg),
        "distill": asdict(replace(DistillConfig(), epochs=a.epochs)),
        "collect_seconds": collect_s,
        "rows": rows,
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [
        f"`{Path(a.model).name}`, {len(tokens)} calibration tokens of `{Path(a.calib).name}` "
        f"({int(len(tokens) * DistillConfig().holdout)} held out), E={cfg.n_expert} k={cfg.n_expert_used}, "
        f"shared_frac {cfg.shared_frac}, {cfg.arch}; relative FFN error (train / held-out)",
        "",
        "| layer | lr | start | " + " | ".join(f"epoch {e}" for e in range(1, a.epochs + 1)) + " | best epoch | s |",
        "|---|---|---|" + "---|" * a.epochs + "---|---|",
    ]
    for r in rows:
        h = r["history"]
        assert isinstance(h, list)
        cells = " | ".join(f"{tr:.4f} / {ho:.4f}" for tr, ho in h)
        lines.append(f"| {r['layer']} | {r['lr']:g} | {cells} | {r['best_epoch']} | {r['seconds']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
