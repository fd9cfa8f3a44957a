"""How realistic a MoE's routing is, in the terms that published MoEs are described by:

- per-layer expert selection frequency (the share of tokens that select each expert; top-k of E
  gives k/E on average), and its spread (min, max, coefficient of variation);
- the top-1 share of the selected gate weight (HOBBIT's precision rule needs peaked weights: 1/k
  is flat, 1 is all on the top-1);
- the distance-1 stacked-gate accuracy (HOBBIT sec. 3.3: the next layer's router run on this layer's
  gate input) as the engine's own predictor measures it: top-1 right, and the whole top-k set right.

Routing comes from calibrate.record_trace (the stock model run through llama.cpp); the predictor
accuracy from a generation with prefetch on, every expert cached, so that the counters are the
engine's and nothing is read twice.

    python -m moetier.tools.routing MODEL.gguf --text held-out.txt [--tokens 4096] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .._files import write_text
from ..calibrate import CalibrateConfig, read_texts, record_trace
from ..config import CacheConfig
from ..model import Model


@dataclass
class RoutingReport:
    n_expert: int
    n_expert_used: int
    n_tokens: int
    freq: list[list[float]]  # [layer][expert] share of tokens selecting it
    top1_share: list[float]  # [layer] mean over tokens of top-1 weight / selected weight
    stacked_top1: float  # distance-1 stacked-gate predictions: top-1 right (engine counters)
    stacked_allk: float  # ... the whole top-k set right
    n_pred: int  # predictions those two are over
    layers: list[int] = field(default_factory=list)  # the model's layer number of each row (empty: 0, 1, ...)

    def freq_stats(self) -> tuple[float, float, float]:
        """(min, max, mean coefficient of variation across layers) of the selection frequencies."""
        f = np.asarray(self.freq)
        cv = float(np.mean(f.std(axis=1) / f.mean(axis=1)))
        return float(f.min()), float(f.max()), cv

    def summary(self) -> str:
        lo, hi, cv = self.freq_stats()
        t1 = np.asarray(self.top1_share)
        return (
            f"routing over {self.n_tokens} tokens, top-{self.n_expert_used} of {self.n_expert}: selection frequency "
            f"{lo:.2f}-{hi:.2f} (uniform {self.n_expert_used / self.n_expert:.2f}, CV {cv:.2f}); top-1 share of the "
            f"selected weight {t1.mean():.2f} (layers {t1.min():.2f}-{t1.max():.2f}; "
            f"flat {1 / self.n_expert_used:.2f}); "
            f"stacked gate distance 1: top-1 {100 * self.stacked_top1:.1f}%, whole top-k "
            f"{100 * self.stacked_allk:.1f}% ({self.n_pred} predictions)"
        )

    def table(self) -> str:
        lines = ["| layer | freq min | freq max | top-1 share |", "|---|---|---|---|"]
        names = self.layers or list(range(len(self.freq)))  # a model's MoE layers need not start at 0
        for il, f, s in zip(names, self.freq, self.top1_share, strict=True):
            lines.append(f"| {il} | {min(f):.3f} | {max(f):.3f} | {s:.3f} |")
        return "\n".join(lines)


def routing_report(
    model_path: str | Path,
    text: str,
    tokens: int = 4096,
    prompts: Sequence[str] = (),
    n_predict: int = 64,
    n_threads: int | None = None,
) -> RoutingReport:
    """Routing statistics of the MoE at model_path over the first `tokens` tokens of text, and the
    stacked-gate accuracy over generations from prompts (default: four slices of text)."""
    trace = record_trace(model_path, text, CalibrateConfig(tokens=tokens), n_threads)
    n, n_layer, k = trace.ids.shape
    freq = np.zeros((n_layer, trace.n_expert))
    for il in range(n_layer):
        freq[il] = np.bincount(trace.ids[:, il].reshape(-1), minlength=trace.n_expert) / n
    w = trace.weights.astype(np.float64)
    top1 = (w.max(axis=2) / np.maximum(w.sum(axis=2), 1e-30)).mean(axis=0)

    probe = Model(model_path, cache=CacheConfig(budget="64G", warm=False), n_threads=n_threads)  # no sidecar
    all_bytes = int(probe.cache_info()["expert_bytes"])
    del probe
    m = Model(model_path, cache=CacheConfig.exact(all_bytes, prefetch=1, warm=False), n_ctx=1024, n_threads=n_threads)
    if not prompts:
        step = max(1, len(text) // 4)
        prompts = [text[i * step : i * step + 400] for i in range(4)]
    # generate() resets the counters: each prompt's are added up
    n_pred = n_top1 = n_allk = 0
    for p in prompts:
        m.generate(p, max_tokens=n_predict)
        pf = m.prefetch_stats()
        n_pred, n_top1, n_allk = n_pred + int(pf.n_pred[0]), n_top1 + int(pf.n_top1[0]), n_allk + int(pf.n_allk[0])
    return RoutingReport(
        n_expert=trace.n_expert,
        n_expert_used=k,
        n_tokens=n,
        freq=freq.tolist(),
        top1_share=top1.tolist(),
        stacked_top1=n_top1 / max(1, n_pred),
        stacked_allk=n_allk / max(1, n_pred),
        n_pred=n_pred,
        layers=list(trace.layers),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="moetier routing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="MoE GGUF")
    p.add_argument("--text", required=True, help="text file to route (held-out text, not calibration text)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the trace (default: 4096)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per generation (default: 64)")
    p.add_argument(
        "-t", "--threads", type=int, default=None, help="compute threads (default: the machine's cores, at most 8)"
    )
    p.add_argument("--json", default=None, help="write the report as JSON here")
    a = p.parse_args(argv)
    r = routing_report(a.model, read_texts([a.text], "--text")[0], a.tokens, (), a.n_predict, a.threads)
    sys.stdout.write(r.summary() + "\n\n" + r.table() + "\n")
    if a.json:
        write_text(a.json, json.dumps(asdict(r), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
