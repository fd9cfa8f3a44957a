"""moetier fit-predictor: a fitted prefetch predictor (the linear predictors of
bench/results/predictors-1.5b-ernie-c32k.md).

HOBBIT's stacked gate predicts layer l + d's experts by running l + d's router on layer l's gate
input. This fits, per MoE layer l and distance d = 1..depth, the linear map (weights and a bias)
from l's gate input to l + d's router logits that does this best on calibration text (ridge
regression on activations the stock model produces, as moefy fits its routers), and writes them
where the engine's prefetcher looks (`_core.predictor_path`: <store>/predictor.gguf, or
<model>.predictor.gguf): it then runs them on the same graph node in place of the routers.
Prefetch changes which reads start early, never what is computed: output stays exact.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from .. import _core, calibrate
from .._files import replacing
from ..calibrate import read_texts
from ..errors import ConfigError, ModelError

F32 = npt.NDArray[np.float32]
ARCH = "moetier-predictor"


def moe_layers(model: str | os.PathLike[str]) -> list[int]:
    """The layers with a router (blk.N.ffn_gate_inp.weight), in order."""
    return calibrate.moe_layers(model, "nothing to predict", "no MoE layer (no blk.N.ffn_gate_inp.weight)")[0]


def ridge_fit(x: F32, y: F32, lam: float) -> tuple[F32, F32]:
    """(W [n_out, n_in], b [n_out]) minimising |x W^T + b - y|^2 + lam * s * |W|^2, s the mean diagonal
    of x^T x (the bias is not shrunk)."""
    xb = np.concatenate([x, np.ones((len(x), 1), np.float32)], 1).astype(np.float64)
    g = xb.T @ xb
    reg = lam * float(np.mean(np.diag(g)[:-1])) * np.eye(len(g))
    reg[-1, -1] = 0.0
    w = np.linalg.solve(g + reg, xb.T @ y.astype(np.float64))
    return np.ascontiguousarray(w[:-1].T, dtype=np.float32), np.ascontiguousarray(w[-1], dtype=np.float32)


def fit_predictor(
    model: str | os.PathLike[str],
    text: str,
    *,
    depth: int = 1,
    tokens: int = 8192,
    ridge: float = 1e-3,
    n_threads: int | None = None,
) -> dict[tuple[int, int], tuple[F32, F32]]:
    """{(layer, distance): (W [n_expert, n_embd], b [n_expert])} fitted on the first tokens of text."""
    from ..model import Model

    if depth < 1 or tokens < 16 or not 0 <= ridge < math.inf:
        msg = f"fit-predictor: depth {depth} must be >= 1, tokens {tokens} >= 16, ridge {ridge} a finite number >= 0"
        raise ConfigError(msg)
    layers = moe_layers(model)
    if len(layers) < 2:
        msg = f"{model}: one MoE layer (layer {layers[0]}): a predictor maps a layer's input to a later MoE layer's"
        raise ModelError(msg)
    m = Model(model, n_ctx=512, n_threads=n_threads)
    toks = m.tokenize(text)[:tokens]
    if len(toks) < 16:
        msg = f"fit-predictor: the text gives {len(toks)} tokens; need at least 16"
        raise ConfigError(msg)
    names = [f"{k}-{il}" for k in ("ffn_norm", "ffn_moe_logits") for il in layers]
    rows = _core.trace.collect(m._m, toks, names, 512)
    del m
    x = {il: np.asarray(rows[f"ffn_norm-{il}"], dtype=np.float32).reshape(len(toks), -1) for il in layers}
    y = {il: np.asarray(rows[f"ffn_moe_logits-{il}"], dtype=np.float32).reshape(len(toks), -1) for il in layers}
    out: dict[tuple[int, int], tuple[F32, F32]] = {}
    for i, il in enumerate(layers):
        for d in range(1, depth + 1):
            if i + d < len(layers):
                out[(il, layers[i + d] - il)] = ridge_fit(x[il], y[layers[i + d]], ridge)
    return out


def write_predictor(
    path: str | os.PathLike[str], model: str | os.PathLike[str], maps: dict[tuple[int, int], tuple[F32, F32]]
) -> Path:
    """The GGUF the prefetcher reads: blk.L.pred.D.weight [n_embd, n_expert] and .bias [n_expert]
    (F32), naming the model it was fitted on; written to a temporary name, then renamed."""
    path = Path(path)
    with replacing(path) as tmp:
        w = gguf.GGUFWriter(tmp, ARCH)
        try:  # closed on a failure too: the temporary file is then removed
            w.add_string(f"{ARCH}.model", _core.predictor_model_key(str(model)))
            w.add_uint32(f"{ARCH}.depth", max(d for _, d in maps))
            for (il, d), (wt, b) in sorted(maps.items()):
                w.add_tensor(f"blk.{il}.pred.{d}.weight", np.ascontiguousarray(wt, dtype=np.float32))
                w.add_tensor(f"blk.{il}.pred.{d}.bias", np.ascontiguousarray(b, dtype=np.float32))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="moetier fit-predictor",
        description="Fit the prefetch predictor of a MoE model: per layer and distance, a linear map from the layer's "
        "gate input to a later layer's router logits (ridge regression on calibration text), written where "
        "the prefetcher finds it (<store>/predictor.gguf, or <model>.predictor.gguf); prefetch then predicts "
        "with it instead of the next layers' routers (cache option fitted_prefetch=0 turns it off).",
    )
    p.add_argument("model", help="MoE GGUF")
    p.add_argument("--text", nargs="+", required=True, help="calibration text file(s), concatenated")
    p.add_argument("--store", default=None, help="expert store the predictor goes with (default: the model)")
    p.add_argument("-o", "--output", default=None, help="write here instead of where the prefetcher looks")
    p.add_argument("--depth", type=int, default=1, help="distances fitted, 1..depth (prefetch=N uses N; default: 1)")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default: 8192)")
    p.add_argument(
        "--ridge", type=float, default=1e-3, help="ridge strength, times x^T x's mean diagonal (default: %(default)s)"
    )
    p.add_argument(
        "-t", "--threads", type=int, default=None, help="compute threads (default: the machine's cores, at most 8)"
    )
    a = p.parse_args(argv)
    t0 = time.monotonic()
    text = "\n\n".join(read_texts(a.text, "--text"))
    if a.output and a.store:
        msg = f"--store {a.store}: it only chooses where the predictor is written; -o {a.output} chose already"
        raise ConfigError(msg)
    maps = fit_predictor(a.model, text, depth=a.depth, tokens=a.tokens, ridge=a.ridge, n_threads=a.threads)
    out = a.output or _core.predictor_path(str(a.model), a.store or "")
    path = write_predictor(out, a.model, maps)
    reach = min(a.depth, len(moe_layers(a.model)) - 1)  # MoE layers ahead: no further than the last one
    sys.stdout.write(
        f"moetier: wrote {path}: {len(maps)} maps (distances 1..{reach}) fitted on up to {a.tokens} tokens "
        f"in {time.monotonic() - t0:.0f} s\n"
    )
    return 0
