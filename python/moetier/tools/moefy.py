"""moefy: turn a dense qwen2 GGUF into a MoE GGUF that stock llama.cpp runs.

The target architecture is ernie4_5-moe by default: its shared expert is ungated, so it adds the
dense part of the FFN exactly. qwen2moe (also available) gates the shared expert with a sigmoid that
llama.cpp computes as silu(z)/z: no gate weight makes that a constant for every input (z = 0 gives
NaN, an underflowing z a gate of 0). The attention is qwen2's in both: ernie4_5-moe rotates
adjacent pairs (rope NORM) where qwen2 rotates halves (NEOX), so Q and K rows are permuted per
head, which leaves every q.k product, hence the attention, unchanged.

Training-free MoEfication of each FFN (what each recipe reached: bench/results/moefy-*.md):

1. Calibration: run the dense model (through llama.cpp) on real text and record every layer's
   normalised FFN input x (graph tensor ffn_norm-N).
2. Shared expert: the neurons with the largest mean |activation| x ||down column||, always on.
3. Routed experts: the other neurons, clustered into E balanced groups by co-activation.
4. Router: ridge regression from x to the centred log output norm of each group, so that the
   softmax of the router's logits is proportional to the predicted output norms: the gate weights
   carry each expert's importance (HOBBIT ranks experts by them).
5. Down projections: refit by ridge least squares given the router's top-k masks and its softmax
   weights (qwen2moe does not renormalise over the top-k), so the sparse layer reproduces the dense
   output as closely as a linear refit can.
6. Balance (optional, --balance): a per-expert selection bias (ernie4_5-moe's exp_probs_b, added
   to the softmax for the top-k choice only, as DeepSeek-V3 balances its experts) moves each
   expert's selection frequency toward k/E, and the down projections are refitted under that
   choice: trained MoEs are balanced by a loss or a bias, and a cache benchmark on a model whose
   experts go idle would flatter every cache.

gate/up rows are neurons, so they are split without touching their quantized bytes; the down
projections are re-quantized (q8_0 by default) because their blocks run along the FFN dimension.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from .._files import replacing
from ..errors import ConfigError, ModelError
from .distill import (
    DistillConfig,
    DistillResult,
    MoeLayer,
    distill_layer,
    rel_error,
    relative_error,
    route,
    softmax,
)

F32 = npt.NDArray[np.float32]
# target architectures: whether llama.cpp renormalises the top-k weights, and the shared expert's gate
ARCHS = {"ernie4_5-moe": (True, 1.0), "qwen2moe": (False, 0.5)}
# qwen2moe's shared-gate weight (every component): z = QWEN2MOE_SHEXP_GATE * sum(x) stays small
QWEN2MOE_SHEXP_GATE = 1e-4
# how the refit weighs calibration tokens (MoefyConfig.fit_weight)
FIT_WEIGHTS = ("relative", "uniform")
CLUSTER_FEATURES = ("abs", "token", "binary")
# calibration tokens past the fitted ones on which each layer's error is reported
HELD_OUT_TOKENS = 2048
# checked besides the held-out tail of each calibration text: the converted model's logits must be finite
CHECK_SAMPLES = (
    # plain English prose
    "The committee met on Tuesday to review the budget. After a long discussion, the members agreed "
    "that the library would stay open on weekends, and that the old reading room would be repaired "
    "before winter. Several residents wrote letters in support; one of them recalled how, as a child, "
    "she had spent whole afternoons there among the atlases and the encyclopedias.",
    # code
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    # numbers, tables and markup
    "| year | revenue | margin |\n|---|---|---|\n| 2021 | 1,204.50 | 12.5% |\n| 2022 | 1,387.25 | 13.1% |\n"
    '{"id": 40213, "tags": ["a", "b"], "ratio": 0.000125, "ok": true}\n<div class="x"><p>3 &lt; 4</p></div>\n',
    # other languages and scripts
    "Der schnelle braune Fuchs springt über den faulen Hund. 敏捷的棕色狐狸跳过了懒狗。 "
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку. El zorro marrón salta sobre el perro.",
    # degenerate input: one token over and over, and whitespace
    "a a a a a a a a a a a a a a a a a a a a a a a a a a a a a a a a" + " " * 64 + "\n\n\n\t\t\t" + "=" * 48,
)


@dataclass(frozen=True)
class MoefyConfig:
    """How a dense FFN becomes a MoE layer."""

    # defaults: half of the routed neurons active per token; 32768 calibration tokens and ridge 1.0 on
    # both fits: the fits overfit 16384 tokens at ridge 0.1 (1.5B layer 3, held-out FFN error 0.256
    # against 0.114 on the fitted tokens; 0.218 with these; bench/results/moefy-c32k.md)
    n_expert: int = field(default=16, metadata={"help": "routed experts per layer"})
    n_expert_used: int = field(default=8, metadata={"help": "routed experts per token (top-k)"})
    shared_frac: float = field(
        default=0.5, metadata={"help": "fraction of each FFN's neurons in the always-active shared expert"}
    )
    calib_tokens: int = field(default=32768, metadata={"help": "calibration tokens used for clustering and fits"})
    router_ridge: float = field(default=1.0, metadata={"help": "ridge strength of the router fit"})
    router_scale: float = field(
        default=1.0,
        metadata={
            "help": "multiplies the router logits (inverse temperature); 0 = flat weights 1/E (no importance; "
            "only with every expert active). Flatter weights fit the dense FFN better (0.25 on the 1.5B: "
            "perplexity 0.9-1.7 percent lower on six held-out texts) but are less peaked than a real MoE's "
            "(top-1 share of the selected weight 0.13 against 0.16; flat: 0.125); HOBBIT's mixed precision "
            "cost no more on them (one text): "
            "bench/results/moefy-router-scale.md"
        },
    )
    refit: bool = field(default=True, metadata={"help": "refit the down projections for the sparse routing"})
    refit_ridge: float = field(default=1.0, metadata={"help": "ridge strength of the down-projection refit"})
    fit_weight: str = field(
        default="uniform",
        metadata={
            "help": "how the refit weighs tokens: uniform (plain least squares, where a few tokens with massive "
            "activations outweigh the rest) or relative (each token's error relative to its dense FFN output; "
            "no perplexity gain on the 0.5B: bench/results/moefy-fitweight.md)"
        },
    )
    cluster_features: str = field(
        default="abs",
        metadata={
            "help": "what groups routed neurons into experts: abs (each neuron's |activation| over the calibration "
            "tokens), token (the same with each token's row first scaled to unit sum, so that a few tokens with "
            "massive activations do not decide the clusters) or binary (1 where the neuron is in the token's "
            "top half of routed |activations|); on two 1.5B layers each alternative lowered the held-out FFN "
            "error of one and raised the other's (bench/results/moefy-router-scale.md)"
        },
    )
    correct_rounds: int = field(
        default=0,
        metadata={
            "help": "rounds of error correction: run the converted model, and refit each layer's down "
            "projections on the FFN inputs it produces, toward the dense model's residual stream"
        },
    )
    correct_share: float = field(
        default=0.5,
        metadata={
            "help": "correction rounds: share of each layer's target that brings the residual stream back to the "
            "dense model's (the rest: the dense FFN on the layer's own inputs)"
        },
    )
    dense_lead: int = field(
        default=0,
        metadata={
            "help": "leading layers kept dense (ernie4_5-moe only), as DeepSeek-V2/V3, Kimi K2 and GLM-4.5 keep "
            "their first layers. On the 1.5B with --split-rounds 2, layer 0 dense moved perplexity by under 0.7 "
            "percent either way on six held-out texts (bench/results/moefy-split-rounds.md)"
        },
    )
    split_rounds: int = field(
        default=0,
        metadata={
            "help": "rounds that move routed neurons between experts toward what the router selects: fit the "
            "router to the split, then give each neuron (equal expert sizes) to the expert whose selected tokens "
            "hold most of its output energy. 2 on the 1.5B (with --shared-frac 0.6 --router-scale 0.25): held-out "
            "FFN error 3.7-13 percent lower on every layer, perplexity 1.6-4.8 percent lower on six held-out texts "
            "(Python tutorial 1.28x -> 1.23x dense), +11 percent conversion time; routing less balanced (expert-layers "
            "picked by under 5 percent of tokens: 31 of 448 against 4): bench/results/moefy-split-rounds.md"
        },
    )
    balance: float = field(
        default=0.0,
        metadata={
            "help": "per-expert selection bias (ernie4_5-moe's exp_probs_b, as DeepSeek-V3 balances its experts: "
            "added to the router's probabilities, a softmax here, for the top-k choice only, never to the gate "
            "weights), fitted so that each expert's selection frequency on the calibration tokens moves this "
            "fraction of the way from the router's own to the uniform k/E; the down projections are then "
            "refitted under the biased choice (unless --no-refit). Fitted on the dense model's FFN inputs, once: "
            "correction rounds and distillation keep it. 0: no bias (published MoEs are trained with a balancing "
            "loss or bias; without one some experts go almost idle). 0.25 on the 1.5B with --split-rounds 2: "
            "expert-layers picked by under 5 percent of held-out tokens 31 -> 6 of 448, perplexity within 0.4 "
            "percent on five of six held-out texts and +1.7 percent on one (bench/results/moefy-balance.md)"
        },
    )
    down_type: str = field(default="q8_0", metadata={"help": "type of the re-split down projections: q8_0 or f16"})
    seed: int = field(default=0, metadata={"help": "seed of the clustering"})
    arch: str = field(
        default="ernie4_5-moe",
        metadata={
            "help": "target architecture: ernie4_5-moe (ungated shared expert, top-k weights renormalised) or "
            "qwen2moe (sigmoid-gated shared expert: NaN where the gate input is exactly 0)"
        },
    )

    def __post_init__(self) -> None:
        if self.n_expert < 2:
            msg = f"moefy.n_expert: {self.n_expert} must be >= 2"
            raise ConfigError(msg)
        if not 1 <= self.n_expert_used <= self.n_expert:
            msg = f"moefy.n_expert_used: {self.n_expert_used} must be in [1, n_expert={self.n_expert}]"
            raise ConfigError(msg)
        if not 0.0 <= self.shared_frac < 1.0:
            msg = f"moefy.shared_frac: {self.shared_frac} must be in [0, 1)"
            raise ConfigError(msg)
        if isinstance(self.calib_tokens, bool) or not isinstance(self.calib_tokens, int) or self.calib_tokens < 512:
            msg = (
                f"moefy.calib_tokens: {self.calib_tokens!r} must be an integer of at least 512 (one collection window)"
            )
            raise ConfigError(msg)
        for name in ("router_ridge", "refit_ridge", "router_scale"):
            v = getattr(self, name)
            if not 0.0 <= v < math.inf:  # NaN too: it would only surface as non-finite logits at the end
                msg = f"moefy.{name}: {v} must be a finite number, 0 or more"
                raise ConfigError(msg)
        if self.router_scale == 0.0 and self.n_expert_used < self.n_expert:
            # the router written is all zeros: llama.cpp would give every token the same experts
            msg = (
                f"moefy.router_scale: 0 routes every token to the same {self.n_expert_used} of {self.n_expert} "
                "experts (all router logits 0); it needs every expert active (n_expert_used = n_expert), or "
                "use a small positive scale for flat weights"
            )
            raise ConfigError(msg)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= 2**63 - 1:
            msg = f"moefy.seed: {self.seed!r} must be an integer in [0, 2^63 - 1]"
            raise ConfigError(msg)
        if self.arch not in ARCHS:
            msg = f"moefy.arch: {self.arch!r} must be one of {', '.join(ARCHS)}"
            raise ConfigError(msg)
        if self.correct_rounds < 0 or not 0.0 <= self.correct_share <= 1.0:
            msg = (
                f"moefy: correct_rounds {self.correct_rounds} must be >= 0 and correct_share "
                f"{self.correct_share} in [0, 1]"
            )
            raise ConfigError(msg)
        if self.fit_weight not in FIT_WEIGHTS:
            msg = f"moefy.fit_weight: {self.fit_weight!r} must be one of {', '.join(FIT_WEIGHTS)}"
            raise ConfigError(msg)
        if self.cluster_features not in CLUSTER_FEATURES:
            msg = f"moefy.cluster_features: {self.cluster_features!r} must be one of {', '.join(CLUSTER_FEATURES)}"
            raise ConfigError(msg)
        if self.dense_lead < 0 or (self.dense_lead > 0 and self.arch != "ernie4_5-moe"):
            msg = f"moefy.dense_lead: {self.dense_lead} must be >= 0, and 0 for {self.arch} (no dense layers there)"
            raise ConfigError(msg)
        if self.split_rounds < 0:
            msg = f"moefy.split_rounds: {self.split_rounds} must be >= 0"
            raise ConfigError(msg)
        if not 0.0 <= self.balance <= 1.0:
            msg = f"moefy.balance: {self.balance} must be in [0, 1]"
            raise ConfigError(msg)
        if self.balance > 0 and self.arch != "ernie4_5-moe":
            msg = f"moefy.balance: must be 0 for {self.arch} (llama.cpp reads no selection bias there)"
            raise ConfigError(msg)
        if self.balance > 0 and self.n_expert_used == self.n_expert:
            msg = (
                f"moefy.balance: {self.balance} needs a choice to even out: top-{self.n_expert_used} of "
                f"{self.n_expert} selects every expert"
            )
            raise ConfigError(msg)
        if self.down_type not in ("q8_0", "f16"):
            msg = f"moefy.down_type: {self.down_type!r} must be q8_0 or f16"
            raise ConfigError(msg)


@dataclass
class LayerPlan:
    """The conversion of one FFN: which neurons go where, the router and the new down weights."""

    shared: npt.NDArray[np.int64]  # [n_sh] neuron indices
    groups: npt.NDArray[np.int64]  # [E, ff_e] neuron indices
    router: F32  # [E, d]
    down_shared: F32  # [d, n_sh]
    down_experts: F32  # [E, d, ff_e]
    rel_error: float  # calibration ||y - y_moe|| / ||y||, mean over tokens


def _silu(x: F32) -> F32:
    return (x / (1.0 + np.exp(-x))).astype(np.float32, copy=False)


def _tensor_f32(t: Any) -> F32:
    """Dequantized float32 of a reader tensor, numpy shape = reversed ggml ne."""
    shape = tuple(int(v) for v in reversed(t.shape))
    data = np.asarray(t.data)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return data.astype(np.float32).reshape(shape)
    return np.asarray(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape)


def _rows_raw(t: Any) -> npt.NDArray[np.uint8]:
    """The bytes of a 2-D tensor, one row (ggml ne[0] values) per numpy row."""
    n_rows = int(t.shape[1])
    return np.asarray(t.data).view(np.uint8).reshape(n_rows, -1)


def _balanced_assign(score: npt.NDArray[Any], size: int) -> npt.NDArray[np.int64]:
    """Each row of score [n, k] to one column, exactly `size` rows per column (k * size == n), greedily
    by descending score."""
    n, k = score.shape
    assign = np.zeros(n, dtype=np.int64)
    taken = np.zeros(n, dtype=bool)
    fill = np.zeros(k, dtype=np.int64)
    left = n
    for flat in np.argsort(-score, axis=None):
        i, c = divmod(int(flat), k)
        if taken[i] or fill[c] >= size:
            continue
        assign[i] = c
        taken[i] = True
        fill[c] += 1
        left -= 1
        if left == 0:
            break
    return assign


def _swap_improve(score: npt.NDArray[Any], assign: npt.NDArray[np.int64], sweeps: int = 20) -> npt.NDArray[np.int64]:
    """A balanced assignment (rows of score [n, k] to columns) improved by exchanges between each pair
    of columns until none gains: the greedy one leaves much on the table where rows prefer the same
    columns, as a 1.5B layer's neuron-to-expert energies do (on two columns the exchanges are exact)."""
    assign = assign.copy()
    k = score.shape[1]
    for _ in range(sweeps):
        moved = 0
        for e in range(k):
            for f in range(e + 1, k):
                ie, jf = np.flatnonzero(assign == e), np.flatnonzero(assign == f)
                gi = np.sort(score[ie, f] - score[ie, e])[::-1]  # gains of moving e's rows to f, best first
                gj = np.sort(score[jf, e] - score[jf, f])[::-1]
                m = int(np.sum(gi + gj > 0))  # both sorted descending: the gainful pairs are a prefix
                if m:
                    oi, oj = np.argsort(score[ie, e] - score[ie, f]), np.argsort(score[jf, f] - score[jf, e])
                    assign[ie[oi[:m]]], assign[jf[oj[:m]]] = f, e
                    moved += m
        if moved == 0:
            break
    return assign


def _balanced_kmeans(feats: F32, k: int, size: int, rng: np.random.Generator, iters: int = 12) -> npt.NDArray[np.int64]:
    """Partitions the rows of feats into k groups of exactly `size` rows (k * size == len(feats))."""
    n = feats.shape[0]
    centers = feats[rng.choice(n, size=k, replace=False)].copy()
    assign = np.zeros(n, dtype=np.int64)
    for _ in range(iters):
        assign = _balanced_assign(feats @ centers.T, size)  # cosine similarity
        for c in range(k):
            m = feats[assign == c].mean(axis=0)
            centers[c] = m / (np.linalg.norm(m) + 1e-8)
    return np.stack([np.flatnonzero(assign == c) for c in range(k)])


def _ridge(a: F32, b: F32, lam: float, prior: F32 | None = None) -> F32:
    """argmin_W ||a W - b||^2 + lam ||W - prior||^2, scaled to a's mean diagonal."""
    g = a.T @ a
    scale = float(np.mean(np.diag(g))) or 1.0
    rhs = a.T @ b
    if prior is not None:
        rhs = rhs + lam * scale * prior
    g[np.diag_indices_from(g)] += lam * scale
    return np.linalg.solve(g, rhs).astype(np.float32)


def token_weights(y: F32, how: str) -> F32 | None:
    """Row weights [N, 1] of a least-squares fit to targets y [N, d]: None (uniform: leave the rows
    as they are), or 1 / ||y_t|| (relative: each token's squared error counted relative to its
    target's), floored at 1% of the median norm so that a near-zero target does not take the fit."""
    if how == "uniform":
        return None
    n = np.linalg.norm(np.asarray(y, dtype=np.float32), axis=1)
    floor = 0.01 * float(np.median(n)) + 1e-12
    w: F32 = (1.0 / np.maximum(n, floor)).astype(np.float32)[:, None]
    return w


def plan_layer(
    x: F32,
    w_gate: F32,
    w_up: F32,
    w_down: F32,
    cfg: MoefyConfig,
    rng: np.random.Generator,
    split: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None,
) -> LayerPlan:
    """x [N, d] ffn inputs; w_gate/w_up [ff, d]; w_down [d, ff]. split: the (shared, groups) neuron
    indices to use instead of clustering (a partition shared by variants of one base): only the router
    and the down projections are fitted."""
    ff = w_gate.shape[0]
    E, k = cfg.n_expert, cfg.n_expert_used
    h = _silu(x @ w_gate.T) * (x @ w_up.T)  # [N, ff]
    y = h @ w_down.T  # [N, d]
    if split is not None:
        return _fit_plan(x, h, y, w_down, cfg, split[0], split[1])

    # shared expert: the most important neurons; the routed rest must split into E equal groups
    # whose size is a multiple of 32 (q8_0 blocks run along it in the down projection)
    ff_e = int(ff * (1.0 - cfg.shared_frac)) // E // 32 * 32
    if ff_e == 0:
        msg = f"moefy: FFN of {ff} neurons is too small for {E} experts with shared_frac {cfg.shared_frac}"
        raise ConfigError(msg)
    n_sh = ff - E * ff_e
    score = np.abs(h).mean(axis=0) * np.linalg.norm(w_down, axis=0)
    order = np.argsort(-score)
    shared = np.sort(order[:n_sh])
    routed = np.sort(order[n_sh:])

    # co-activation features: each routed neuron's |activation| over the calibration tokens
    act = np.abs(h[:, routed])  # [N, n_routed]
    if cfg.cluster_features == "token":
        act = act / (act.sum(axis=1, keepdims=True) + 1e-8)
    elif cfg.cluster_features == "binary":
        act = (act >= np.median(act, axis=1, keepdims=True)).astype(np.float32)
    act = act.T
    act = act / (np.linalg.norm(act, axis=1, keepdims=True) + 1e-8)
    groups = routed[_balanced_kmeans(act.astype(np.float32), E, ff_e, rng)]
    del act

    if cfg.split_rounds:
        # co-activation is a proxy: what a token loses is the output of the routed neurons in the
        # experts its router does not select. Each round moves every neuron to the expert whose
        # selected tokens hold most of its output energy (each token's energy relative to its total,
        # so that the few tokens with massive activations do not decide), then refits the router.
        energy = np.square(h[:, routed]) * np.square(np.linalg.norm(w_down[:, routed], axis=0))
        energy /= energy.sum(axis=1, keepdims=True) + 1e-12
        for _ in range(cfg.split_rounds):
            top = np.argsort(-(x @ _router_fit(x, h, w_down, groups, cfg.router_ridge)), axis=1)[:, :k]
            selected = np.zeros((len(x), E), dtype=np.float32)
            np.put_along_axis(selected, top, 1.0, axis=1)
            kept = energy.T @ selected  # [n_routed, E]: energy kept if the neuron were in expert e
            assign = _swap_improve(kept, _balanced_assign(kept, ff_e))
            groups = np.stack([routed[assign == e] for e in range(E)])
        del energy

    return _fit_plan(x, h, y, w_down, cfg, shared, groups)


def _router_fit(x: F32, h: F32, w_down: F32, groups: npt.NDArray[np.int64], ridge: float) -> F32:
    """[d, E]: softmax(x @ it) ~ predicted group output norms [HOBBIT needs importance in the weights]"""
    norms = np.stack([np.linalg.norm(h[:, g] @ w_down[:, g].T, axis=1) for g in groups], axis=1)  # [N, E]
    target = np.log(norms + 1e-6)
    target -= target.mean(axis=1, keepdims=True)
    return _ridge(x, target.astype(np.float32), ridge)


def _fit_plan(
    x: F32, h: F32, y: F32, w_down: F32, cfg: MoefyConfig, shared: npt.NDArray[np.int64], groups: npt.NDArray[np.int64]
) -> LayerPlan:
    """The router and the down projections of a layer split into shared and groups."""
    E, k = cfg.n_expert, cfg.n_expert_used
    n_sh = len(shared)
    ff_e = groups.shape[1]
    router_unscaled = _router_fit(x, h, w_down, groups, cfg.router_ridge)
    router = router_unscaled.T * np.float32(cfg.router_scale)  # [E, d]
    logits = x @ router.T
    p = softmax(logits)
    top = np.argsort(-logits, axis=1)[:, :k]  # router_scale 0 only with k = E: every expert selected
    mask = np.zeros_like(p)
    np.put_along_axis(mask, top, 1.0, axis=1)
    w = p * mask  # [N, E] weight of each expert, 0 if not selected
    renorm, sh_gate = ARCHS[cfg.arch]
    if renorm:  # ernie4_5-moe: the selected experts' weights sum to 1
        w /= w.sum(axis=1, keepdims=True)
    w = w.astype(np.float32)
    # qwen2moe's shared gate is sigmoid(z) with z ~ 0 (see write): 1/2, compensated in down
    mean_w = np.array([w[:, e][mask[:, e] > 0].mean() if mask[:, e].any() else 1.0 for e in range(E)])
    prior = np.concatenate(
        [w_down[:, shared] / sh_gate] + [w_down[:, g] / mean_w[e] for e, g in enumerate(groups)], axis=1
    ).astype(np.float32)  # [d, ff]
    feats = np.concatenate([h[:, shared] * sh_gate] + [h[:, g] * w[:, e : e + 1] for e, g in enumerate(groups)], axis=1)
    # plain least squares lets a handful of tokens decide the fit: the window starts, whose FFN
    # outputs are ~100x the others' (Qwen2.5 layer 3: 16 of 8192 tokens hold 97% of the squared
    # output), while the next layer normalises each token; relative weights fit the error per token
    rw = token_weights(y, cfg.fit_weight)
    feats = feats.astype(np.float32, copy=False)
    a, b = (feats, y) if rw is None else (feats * rw, y * rw)
    down = _ridge(a, b, cfg.refit_ridge, prior.T).T if cfg.refit else prior

    y_moe = feats @ down.T
    rel = relative_error(y_moe, y)
    down_shared = down[:, :n_sh]
    down_experts = np.stack([down[:, n_sh + e * ff_e : n_sh + (e + 1) * ff_e] for e in range(E)])
    return LayerPlan(shared, groups, router.astype(np.float32), down_shared, down_experts, rel)


def layer_from_plan(pl: LayerPlan, w_gate: F32, w_up: F32) -> MoeLayer:
    """The float weights of a planned MoE layer: gate/up rows taken from the dense FFN."""
    return MoeLayer(
        router=pl.router.copy(),
        gate_sh=w_gate[pl.shared].copy(),
        up_sh=w_up[pl.shared].copy(),
        down_sh=pl.down_shared.copy(),
        gate=w_gate[pl.groups].copy(),
        up=w_up[pl.groups].copy(),
        down=pl.down_experts.copy(),
    )


def dense_ffn(x: F32, w_gate: F32, w_up: F32, w_down: F32) -> F32:
    """The dense SwiGLU FFN's output [N, d] on inputs x [N, d], in blocks of tokens."""
    out = np.empty((x.shape[0], w_down.shape[0]), dtype=np.float32)
    for i in range(0, len(x), 2048):
        out[i : i + 2048] = (_silu(x[i : i + 2048] @ w_gate.T) * (x[i : i + 2048] @ w_up.T)) @ w_down.T
    return out


def _ggml_type_name(qt: gguf.GGMLQuantizationType) -> str:
    """gguf's enum name as ggml_type_name spells it (Q4_K -> q4_K, Q8_0 -> q8_0, F16 -> f16)."""
    n = qt.name.lower()
    return n[:-2] + "_K" if n.endswith("_k") else n


def _quantize_like(a: F32, qt: gguf.GGMLQuantizationType, imatrix: F32) -> np.ndarray[Any, Any]:
    """Rows of a (last axis = ggml ne[0]) in the type qt, as raw bytes shaped [..., row bytes]."""
    from .. import _core

    if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return a.astype(np.float32 if qt == gguf.GGMLQuantizationType.F32 else np.float16)
    rows = np.ascontiguousarray(a.reshape(-1, a.shape[-1]), dtype=np.float32)
    q = _core.quantize(rows, _ggml_type_name(qt), np.ascontiguousarray(imatrix, dtype=np.float32))
    return q.reshape(*a.shape[:-1], -1)


def _kv_copy(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, arch_from: str, arch_to: str) -> None:
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        name = arch_to + f.name[len(arch_from) :] if f.name.startswith(arch_from + ".") else f.name
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                vals: Any = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            writer.add_key_value(name, vals, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, bytes(f.parts[f.data[0]]).decode("utf-8"), vtype)
        else:
            writer.add_key_value(name, f.parts[f.data[0]].tolist()[0], vtype)


def _rope_norm_rows(n_rows: int, head_dim: int) -> npt.NDArray[np.int64]:
    """Row order that turns NEOX rope rows (head halves rotate together) into NORM rope rows
    (adjacent pairs rotate together): per head [0, h, 1, h + 1, ...] with h = head_dim / 2."""
    h = head_dim // 2
    head = np.stack([np.arange(h), np.arange(h) + h], axis=1).reshape(-1)
    return (np.arange(n_rows // head_dim)[:, None] * head_dim + head[None, :]).reshape(-1)


def _quantize(a: F32, qtype: str) -> tuple[np.ndarray[Any, Any], gguf.GGMLQuantizationType]:
    if qtype == "f16":
        return a.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


@dataclass
class MoefyResult:
    """What a conversion did: per-layer relative FFN errors (mean over calibration tokens of
    ||y - y_moe|| / ||y||; held-out tokens where distilled) and where the time went."""

    errors_plan: list[float]  # training-free plan (and its balance step), on the dense model's inputs
    errors: list[float]  # the written layers (after distillation, if any)
    seconds: dict[str, float] = field(default_factory=dict)
    n_calib_tokens: int = 0
    # the training-free plan (and its balance step) on held-out tokens (the calibration text past the fitted ones, dense
    # inputs): the fit's error on its own tokens flatters it (16384 tokens, ~9000 weights per output)
    errors_held_out: list[float] = field(default_factory=list)
    n_held_out_tokens: int = 0
    dense_lead: int = 0  # leading layers kept dense: error 0 in the lists, left out of the means

    def summary(self) -> str:
        n = self.dense_lead
        e, p, h = self.errors[n:], self.errors_plan[n:], self.errors_held_out[n:]
        t = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
        t = f"; {t}" if t else ""
        dense = "" if n == 0 else "; layer 0 dense" if n == 1 else f"; layers 0-{n - 1} dense"
        held = f"; held-out ({self.n_held_out_tokens} tokens) mean {sum(h) / len(h):.3f}, max {max(h):.3f}" if h else ""
        return (
            f"FFN error mean {sum(e) / len(e):.3f}, max {max(e):.3f} (training-free {sum(p) / len(p):.3f}){held}; "
            f"{self.n_calib_tokens} calibration tokens{t}{dense}"
        )


def _plan_fields(cfg: MoefyConfig) -> dict[str, Any]:
    """The fields the training-free plan of a MoE layer depends on (its cache key): not the correction
    rounds, nor how many leading layers stay dense (each layer is planned on the dense model's inputs), nor
    the balance (a step after the plan, cached on its own)."""
    return {
        k: v
        for k, v in key_fields(cfg).items()
        if k not in ("correct_rounds", "correct_share", "dense_lead", "balance")
    }


def _balance_fields(cfg: MoefyConfig) -> dict[str, Any]:
    """The fields a balanced layer depends on: its plan's and the balance."""
    return {**_plan_fields(cfg), "balance": cfg.balance}


# fields added after conversions were cached under keys of the config: at the value that does what
# the code did before them they stay out of the key, so those conversions are still found
_KEY_LATER_FIELDS: dict[str, Any] = {"cluster_features": "abs", "dense_lead": 0, "split_rounds": 0, "balance": 0.0}


def key_fields(cfg: MoefyConfig) -> dict[str, Any]:
    """The config as cached conversion work and artifacts are named by (cache_key)."""
    return {k: v for k, v in asdict(cfg).items() if _KEY_LATER_FIELDS.get(k, object()) != v}


def refit_down(
    layer: MoeLayer,
    x: F32,
    y: F32,
    k: int,
    renorm: bool,
    sh_gate: float,
    ridge: float,
    fit_weight: str = "uniform",
    gram: type[np.floating[Any]] = np.float64,
) -> MoeLayer:
    """The layer with its down projections (shared and routed) refitted in closed form so that its
    output on inputs x [N, d] approaches y [N, d] (tokens weighed as token_weights says): ridge toward
    the current down weights, gate/up and router kept (the routing, hence each token's features, stays
    as llama.cpp computes it)."""
    E, ff_e = layer.gate.shape[0], layer.gate.shape[1]
    n_sh = layer.gate_sh.shape[0]
    ff = n_sh + E * ff_e
    g = np.zeros((ff, ff), dtype=gram)
    rhs = np.zeros((ff, y.shape[1]), dtype=gram)
    for i in range(0, len(x), 2048):
        xb = np.asarray(x[i : i + 2048], dtype=np.float32)
        top, w, _ = route(layer, xb, k, renorm)
        wfull = np.zeros((len(xb), E), dtype=np.float32)
        np.put_along_axis(wfull, top, w, axis=1)
        parts = [_silu(xb @ layer.gate_sh.T) * (xb @ layer.up_sh.T) * np.float32(sh_gate)]
        for e in range(E):
            parts.append(_silu(xb @ layer.gate[e].T) * (xb @ layer.up[e].T) * wfull[:, e : e + 1])
        yb = np.asarray(y[i : i + 2048], dtype=np.float32)
        rw = token_weights(yb, fit_weight)
        f = np.concatenate(parts, axis=1)
        if rw is not None:
            f, yb = f * rw, yb * rw
        g += f.T @ f
        rhs += f.T @ yb
    prior = np.concatenate([layer.down_sh] + [layer.down[e] for e in range(E)], axis=1).T  # [ff, d]
    scale = float(np.mean(np.diag(g))) or 1.0
    g[np.diag_indices_from(g)] += ridge * scale
    down = np.linalg.solve(g.astype(np.float64, copy=False), rhs + ridge * scale * prior).T.astype(
        np.float32
    )  # [d, ff]
    out = layer.copy()
    out.down_sh = np.ascontiguousarray(down[:, :n_sh])
    out.down = np.stack([down[:, n_sh + e * ff_e : n_sh + (e + 1) * ff_e] for e in range(E)])
    return out


def selection_freq(p: F32, k: int, bias: F32 | None = None) -> npt.NDArray[np.float64]:
    """[E] the share of tokens (rows of p [N, E]) whose top-k of p + bias holds each expert."""
    top = np.argsort(-(p if bias is None else p + bias), axis=1, kind="stable")[:, :k]
    out: npt.NDArray[np.float64] = np.bincount(top.ravel(), minlength=p.shape[1]) / len(p)
    return out


def fit_selection_bias(p: F32, k: int, target: npt.NDArray[np.float64], sweeps: int = 30) -> F32:
    """[E] bias b such that the top-k of p + b selects expert e on a share target[e] of the tokens
    (rows of p [N, E], sum(target) == k), by coordinate steps: with the others fixed, e is selected
    exactly where p_e + b_e beats the k-th best of the others, so the b_e that gives target[e] is a
    quantile of (that threshold - p_e)."""
    n, E = p.shape
    b = np.zeros(E, dtype=np.float64)
    q = p.astype(np.float64)
    for _ in range(sweeps):
        for e in range(E):
            others = np.delete(q + b, e, axis=1)
            thr = -np.partition(-others, k - 1, axis=1)[:, k - 1]  # k-th largest of the others
            need = thr - q[:, e]  # b_e above this selects e on the token
            frac = float(np.clip(target[e], 0.0, 1.0))
            b[e] = np.quantile(need, frac)
        b -= b.mean()
        if np.max(np.abs(selection_freq(p, k, b.astype(np.float32)) - target)) < 2.0 / n:
            break
    return b.astype(np.float32)


def balance_layer(
    layer: MoeLayer, x: F32, y: F32, cfg: MoefyConfig, renorm: bool, sh_gate: float
) -> tuple[MoeLayer, float]:
    """The layer with a selection bias that moves each expert's selection frequency on x [N, d]
    cfg.balance of the way to k/E, and its down projections refitted (toward its current ones) so
    that its output under the biased choice approaches y [N, d]; and its relative error on x."""
    k, E = cfg.n_expert_used, cfg.n_expert
    p = softmax(x @ layer.router.T)
    f0 = selection_freq(p, k)
    out = layer.copy()
    out.bias = fit_selection_bias(p, k, (1.0 - cfg.balance) * f0 + cfg.balance * k / E)
    if cfg.refit:
        # float32 sums, as the plan's refit: half the time of float64 on these sizes
        out = refit_down(out, x, y, k, renorm, sh_gate, cfg.refit_ridge, cfg.fit_weight, gram=np.float32)
    return out, rel_error(out, x, y, k, renorm, sh_gate)


def _correction_target(x: F32, dense: tuple[F32, F32, F32], l_out: F32, ffn_inp: F32, share: float) -> F32:
    """What a correction round fits a layer to on the converted model's FFN inputs x: the dense FFN
    on x, and (share) the output that brings the residual stream (ffn_inp, the converted model's
    before the FFN) to the dense model's after the layer (l_out)."""
    y = dense_ffn(x, *dense)
    drift = np.asarray(l_out, dtype=np.float32) - np.asarray(ffn_inp, dtype=np.float32)
    out: F32 = ((1.0 - share) * y + share * drift).astype(np.float32)
    return out


def cache_key(*parts: Any) -> str:
    """A short hex digest of JSON-able parts (and bytes): names cached conversion work and artifacts."""
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode() if not isinstance(p, bytes) else p)
    return h.hexdigest()[:16]


COLLECT_SLICE = 8192  # tokens per collect call when the activations go to a cache (a multiple of 512)


def _collect(
    model_path: Path,
    tokens: list[int],
    n_layer: int,
    n_threads: int | None,
    cache: Path | None,
    kinds: tuple[str, ...] = ("ffn_norm",),
) -> dict[str, list[F32]]:
    """Every layer's graph tensors `kind`-N over tokens, for each kind (ffn_norm: the normalised FFN
    input; ffn_inp: the residual stream before the FFN; l_out: after it), from one run of the model
    at model_path; kept in cache (one .npy per layer and kind) when given, and read back from there."""
    from .. import _core
    from ..model import Model

    def path(kind: str, i: int) -> Path:
        assert cache is not None
        return cache / f"{kind}-{i}.npy"

    if cache is not None and all(path(k, i).exists() for k in kinds for i in range(n_layer)):
        return {k: [np.load(path(k, i), mmap_mode="r") for i in range(n_layer)] for k in kinds}
    names = [f"{k}-{i}" for k in kinds for i in range(n_layer)]
    m = Model(model_path, n_ctx=512, n_threads=n_threads)
    if cache is None:
        rows = _core.trace.collect(m._m, tokens, names, 512)
        return {k: [np.asarray(rows[f"{k}-{i}"], dtype=np.float32) for i in range(n_layer)] for k in kinds}
    # in slices of COLLECT_SLICE tokens, each written into every layer's .npy as it comes: 65536 tokens
    # of the 1.5B are 12 GB of activations, more than one collect call may hold (the graph sees
    # 512-token windows, so slicing at multiples of 512 changes nothing)
    cache.mkdir(parents=True, exist_ok=True)
    outs: dict[str, Any] = {}
    for s in range(0, len(tokens), COLLECT_SLICE):
        rows = _core.trace.collect(m._m, tokens[s : s + COLLECT_SLICE], names, 512)
        for n in names:
            r = np.asarray(rows[n], dtype=np.float32)
            if n not in outs:
                outs[n] = np.lib.format.open_memmap(
                    cache / f"{n}.tmp.npy", mode="w+", dtype=np.float32, shape=(len(tokens), r.shape[1])
                )
            outs[n][s : s + len(r)] = r
        del rows
    del m
    for a in outs.values():
        a.flush()
    outs.clear()
    for n in names:
        os.replace(cache / f"{n}.tmp.npy", cache / f"{n}.npy")
    return {k: [np.load(path(k, i), mmap_mode="r") for i in range(n_layer)] for k in kinds}


def _save_layer(path: Path, layer: MoeLayer, err: float, **extra: npt.NDArray[Any]) -> None:
    arrays: dict[str, Any] = {"err": np.float64(err), **layer.arrays(), **extra}
    if layer.bias is not None:
        arrays["bias"] = layer.bias
    with replacing(path) as tmp, open(tmp, "wb") as f:  # a file object: numpy adds no .npz to the name
        np.savez(f, **arrays)


def _load_layer(path: Path) -> tuple[MoeLayer, float]:
    with np.load(path) as z:
        bias = np.asarray(z["bias"]) if "bias" in z.files else None
        return MoeLayer(**{n: np.asarray(z[n]) for n in MoeLayer.NAMES}, bias=bias), float(z["err"])


def _collect_converted(
    reader: gguf.GGUFReader,
    tensors: dict[str, Any],
    tmp_model: Path,
    cfg: MoefyConfig,
    layers: list[MoeLayer | None],
    splits: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None],
    xs: list[Any] | None,
    tokens: list[int],
    n_threads: int | None,
    acts_dir: Path,
    kinds: tuple[str, ...],
) -> dict[str, list[Any]]:
    """The activations of the model converted so far: written to tmp_model unless acts_dir already
    holds them, run, and removed whatever happens (it is as large as the output)."""
    n_layer = len(layers)
    try:
        if not all((acts_dir / f"{k}-{il}.npy").exists() for k in kinds for il in range(n_layer)):
            _write_moe(reader, tensors, tmp_model, cfg, layers, splits, xs)
        return _collect(tmp_model, tokens, n_layer, n_threads, acts_dir, kinds)
    finally:
        tmp_model.unlink(missing_ok=True)


def _check_used(cfg: MoefyConfig, distill: DistillConfig | None) -> None:
    """Settings that the rest of the request leaves unused are refused, not ignored."""
    if distill is not None and distill.epochs == 0 and distill != DistillConfig():
        unused = [
            f"{f.name} {getattr(distill, f.name)!r}" for f in fields(distill) if getattr(distill, f.name) != f.default
        ]
        msg = f"distill.epochs: 0 (no distillation) leaves the other distill settings unused: {', '.join(unused)}"
        raise ConfigError(msg)
    if distill is not None and distill.epochs > 0 and distill.rounds == 1 and distill.residual > 0:
        msg = f"distill.residual: {distill.residual} applies from the second round on, and one round is asked for"
        raise ConfigError(msg)
    if distill is not None and distill.epochs > 0 and cfg.correct_rounds > 0:
        msg = "moefy: correction rounds and distillation are alternatives; ask for one"
        raise ConfigError(msg)
    share = MoefyConfig.__dataclass_fields__["correct_share"].default
    if cfg.correct_rounds == 0 and cfg.correct_share != share:
        msg = f"moefy.correct_share: {cfg.correct_share} applies to correction rounds, and none is asked for"
        raise ConfigError(msg)


def moefy(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    calib_text: str,
    cfg: MoefyConfig | None = None,
    *,
    distill: DistillConfig | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    check_texts: tuple[str, ...] = (),
    n_threads: int | None = None,
    progress: bool | None = None,
    partition: str | os.PathLike[str] | None = None,
    save_partition: str | os.PathLike[str] | None = None,
) -> MoefyResult:
    """Converts the dense qwen2 GGUF src into the MoE GGUF dst (written to a temp name, checked for
    finite logits on held-out text, then renamed).

    With distill (epochs > 0), every layer is then fitted to its dense FFN (tools/distill.py), first on
    the dense model's FFN inputs and, for rounds >= 2, on the inputs the converted model itself
    produces (so each layer learns the inputs it will see: errors of earlier layers no longer
    compound unseen); the trained gate/up go back to the source's quantization types, weighted by the
    calibration inputs (an importance matrix). work_dir keeps the collected activations and trained
    layers, so an interrupted conversion resumes where it stopped. check_texts: more samples (e.g. the
    end of each calibration file) on which the converted model's logits must be finite.

    partition: a file written by save_partition on another conversion (of the base these variants were
    fine-tuned from): its neurons go to the same experts here, so that an expert position (layer,
    expert) means the same neurons in every variant; the routers and down projections are fitted on
    this model. save_partition: where to write this conversion's partition."""
    cfg = cfg or MoefyConfig()
    _check_used(cfg, distill)
    dcfg = distill if distill is not None and distill.epochs > 0 else None
    src, dst = Path(src), Path(dst)
    show = sys.stderr.isatty() if progress is None else progress
    t_start = time.monotonic()
    seconds: dict[str, float] = {}
    reader = gguf.GGUFReader(src)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    if arch != "qwen2":
        msg = f"{src}: moefy converts qwen2 models, this one is {arch!r}"
        raise ModelError(msg)
    n_layer = int(reader.fields["qwen2.block_count"].parts[-1][0])
    if cfg.dense_lead >= n_layer:
        msg = f"moefy.dense_lead: {cfg.dense_lead} leaves no MoE layer in {src} ({n_layer} layers)"
        raise ConfigError(msg)
    tensors = {t.name: t for t in reader.tensors}
    renorm, sh_gate = ARCHS[cfg.arch]
    n_ff = int(tensors["blk.0.ffn_gate.weight"].shape[1])
    given = read_partition(partition, n_layer, n_ff, cfg) if partition is not None else None
    # every piece of cached layer work depends on the neurons' split: a given partition joins its key
    part: tuple[str, ...] = (_partition_key(given),) if given is not None else ()

    from ..model import Model

    tok_model = Model(src, n_ctx=512, n_threads=n_threads)
    tokens_all = tok_model.tokenize(calib_text)
    del tok_model
    tokens = tokens_all[: cfg.calib_tokens]
    if len(tokens) < 512:
        msg = f"moefy: calibration text gives {len(tokens)} tokens; need at least 512"
        raise ConfigError(msg)

    # held-out tokens ride along in the collection run (the graph sees 512-token windows, so the
    # split at calib_tokens, a multiple of 512 by default, changes nothing) and are cut off there
    held = tokens_all[cfg.calib_tokens : cfg.calib_tokens + HELD_OUT_TOKENS]
    held = held[: len(held) // 512 * 512]
    n_fit = len(tokens)
    work: Path | None = None
    if dcfg is not None or work_dir is not None or cfg.correct_rounds > 0:
        base = Path(work_dir) if work_dir is not None else _default_cache() / "moefy-work"
        st = src.stat()
        work = base / cache_key(src.name, st.st_size, st.st_mtime_ns, np.asarray(tokens + held, np.int32).tobytes())
        # rounds left out: a run with more rounds resumes from a run with fewer
        lkey = cache_key(
            key_fields(cfg), {k: v for k, v in asdict(dcfg).items() if k != "rounds"} if dcfg else None, *part
        )
        # round 1 does not depend on the residual share either
        lkey1 = cache_key(
            key_fields(cfg),
            {k: v for k, v in asdict(dcfg).items() if k not in ("rounds", "residual")} if dcfg else None,
            *part,
        )
    t0 = time.monotonic()
    residual = (dcfg is not None and dcfg.rounds > 1 and dcfg.residual > 0) or cfg.correct_rounds > 0
    dense_kinds = ("ffn_norm", "l_out") if residual else ("ffn_norm",)
    dense_acts = _collect(src, tokens + held, n_layer, n_threads, work / "dense" if work else None, dense_kinds)
    xs_held = [x[n_fit:] for x in dense_acts["ffn_norm"]]
    dense_l_out = dense_acts.get("l_out", [])  # with the held-out tail: the correction rounds report on it
    dense_acts = {k: [x[:n_fit] for x in v] for k, v in dense_acts.items()}
    xs = dense_acts["ffn_norm"]
    seconds["collect"] = time.monotonic() - t0

    def dense_weights(il: int) -> tuple[F32, F32, F32]:
        return tuple(_tensor_f32(tensors[f"blk.{il}.ffn_{p}.weight"]) for p in ("gate", "up", "down"))  # type: ignore[return-value]

    # None: a leading layer kept dense (its FFN is written as the source's, error 0)
    layers: list[MoeLayer | None] = [None] * cfg.dense_lead
    errors_plan: list[float] = [0.0] * cfg.dense_lead
    errors: list[float] = [0.0] * cfg.dense_lead
    errors_held: list[float] = [0.0] * cfg.dense_lead if len(held) else []
    splits: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None] = [None] * cfg.dense_lead
    t0 = time.monotonic()
    for il in tqdm(range(cfg.dense_lead, n_layer), desc="moefy layers", disable=not show):
        # dequantized once per layer: the plan, the balance step and the held-out error use them
        w_gate, w_up, w_down = dense_weights(il)
        plan_path = work / f"plan-{cache_key(_plan_fields(cfg), *part)}" / f"layer-{il}.npz" if work else None
        if plan_path is not None and plan_path.exists():
            layer, err = _load_layer(plan_path)
            with np.load(plan_path) as z:
                split = (np.asarray(z["shared"]), np.asarray(z["groups"]))
        else:
            # one generator per layer: a resumed conversion plans the missing layers as a whole run would
            rng = np.random.default_rng([cfg.seed, il])
            pl = plan_layer(np.asarray(xs[il]), w_gate, w_up, w_down, cfg, rng, given[il] if given else None)
            layer, err, split = layer_from_plan(pl, w_gate, w_up), pl.rel_error, (pl.shared, pl.groups)
            if plan_path is not None:
                plan_path.parent.mkdir(parents=True, exist_ok=True)
                _save_layer(plan_path, layer, err, shared=split[0], groups=split[1])
        if cfg.balance > 0:
            bal_path = work / f"balance-{cache_key(_balance_fields(cfg), *part)}" / f"layer-{il}.npz" if work else None
            if bal_path is not None and bal_path.exists():
                layer, err = _load_layer(bal_path)
            else:
                x = np.asarray(xs[il])
                layer, err = balance_layer(layer, x, dense_ffn(x, w_gate, w_up, w_down), cfg, renorm, sh_gate)
                if bal_path is not None:
                    bal_path.parent.mkdir(parents=True, exist_ok=True)
                    _save_layer(bal_path, layer, err)
        errors_plan.append(err)
        if len(held):
            xh = np.asarray(xs_held[il])
            errors_held.append(
                rel_error(layer, xh, dense_ffn(xh, w_gate, w_up, w_down), cfg.n_expert_used, renorm, sh_gate)
            )
        splits.append(split)
        layers.append(layer)
        errors.append(err)
    seconds["plan"] = time.monotonic() - t0
    if save_partition is not None:
        write_partition(save_partition, splits, n_ff, cfg, src.name)

    for rnd in range(1, cfg.correct_rounds + 1):
        # errors of earlier layers compound: each layer is refitted on the inputs the converted model
        # gives it, toward its dense FFN and (correct_share) toward the dense model's residual stream
        assert work is not None
        t0 = time.monotonic()
        # a run with more rounds resumes from one with fewer
        later = cache_key({**key_fields(cfg), "correct_rounds": None}, *part)
        layers_dir = work / f"correct-{later}"
        # round 1 runs the plan's model: its activations do not depend on the share; later rounds do
        # (with dense layers or a balance the model differs from the plan's: they join the key)
        lead: list[dict[str, Any]] = [{"dense_lead": cfg.dense_lead}] if cfg.dense_lead else []
        lead += [{"balance": cfg.balance}] if cfg.balance else []
        akey = cache_key(_plan_fields(cfg), *lead, *part) if rnd == 1 else later
        acts_dir = work / f"correct-acts-{akey}-r{rnd}"
        kinds: tuple[str, ...] = ("ffn_norm", "ffn_inp")
        tmp_model = work / f"correct-acts-{akey}-r{rnd}.gguf"
        acts = _collect_converted(
            reader, tensors, tmp_model, cfg, layers, splits, None, tokens + held, n_threads, acts_dir, kinds
        )
        bar = tqdm(
            range(cfg.dense_lead, n_layer), desc=f"correction round {rnd}/{cfg.correct_rounds}", disable=not show
        )
        for il in bar:
            moe = layers[il]
            assert moe is not None
            path = layers_dir / f"round-{rnd}-layer-{il}.npz"
            x_all = np.asarray(acts["ffn_norm"][il])
            x, xh = x_all[:n_fit], x_all[n_fit:]
            w = dense_weights(il)
            if path.exists():
                moe, errors[il] = _load_layer(path)
                layers[il] = moe
            else:
                y = _correction_target(x, w, dense_l_out[il][:n_fit], acts["ffn_inp"][il][:n_fit], cfg.correct_share)
                layers[il] = moe = refit_down(
                    moe, x, y, cfg.n_expert_used, renorm, sh_gate, cfg.refit_ridge, cfg.fit_weight
                )
                errors[il] = rel_error(moe, x, y, cfg.n_expert_used, renorm, sh_gate)
                path.parent.mkdir(parents=True, exist_ok=True)
                _save_layer(path, moe, errors[il])
            if len(xh):
                yh = _correction_target(xh, w, dense_l_out[il][n_fit:], acts["ffn_inp"][il][n_fit:], cfg.correct_share)
                errors_held[il] = rel_error(moe, xh, yh, cfg.n_expert_used, renorm, sh_gate)
            bar.set_postfix_str(f"err {errors[il]:.3f}")
        seconds[f"correction round {rnd}"] = time.monotonic() - t0

    if dcfg is not None:
        assert work is not None
        for rnd in range(1, dcfg.rounds + 1):
            t0 = time.monotonic()
            if rnd > 1:
                # the inputs the converted model produces: write it as it stands, run it, collect
                kinds = ("ffn_norm", "ffn_inp") if dcfg.residual > 0 else ("ffn_norm",)
                key = lkey1 if rnd == 2 else lkey
                tmp_model = work / f"round-{rnd}-{key}.gguf"
                acts_dir = work / f"moe-{key}-r{rnd}"
                acts = _collect_converted(
                    reader, tensors, tmp_model, cfg, layers, splits, xs, tokens, n_threads, acts_dir, kinds
                )
                xs = acts["ffn_norm"]
            bar = tqdm(range(cfg.dense_lead, n_layer), desc=f"distill round {rnd}/{dcfg.rounds}", disable=not show)
            for il in bar:
                moe = layers[il]
                assert moe is not None
                path = work / f"layers-{lkey1 if rnd == 1 else lkey}" / f"round-{rnd}-layer-{il}.npz"
                if path.exists():
                    layers[il], errors[il] = _load_layer(path)
                    continue
                w_gate, w_up, w_down = dense_weights(il)
                x = np.asarray(xs[il])
                y = dense_ffn(x, w_gate, w_up, w_down)
                if rnd > 1 and dcfg.residual > 0:
                    # what brings this layer's residual stream back to the dense model's, in part
                    drift = np.asarray(dense_acts["l_out"][il]) - np.asarray(acts["ffn_inp"][il])
                    y = (1.0 - dcfg.residual) * y + dcfg.residual * drift
                res: DistillResult = distill_layer(moe, x, y, cfg.n_expert_used, renorm, dcfg, sh_gate)
                layers[il], errors[il] = res.layer, res.err_after
                path.parent.mkdir(parents=True, exist_ok=True)
                _save_layer(path, res.layer, res.err_after)
                bar.set_postfix_str(f"err {res.err_before:.3f} -> {res.err_after:.3f} (epoch {res.best_epoch})")
            seconds[f"distill round {rnd}"] = time.monotonic() - t0

    with replacing(dst) as tmp:  # a failed or interrupted write leaves no partial model (GBs) behind
        _write_moe(reader, tensors, tmp, cfg, layers, splits, xs if dcfg is not None else None, show=show)
        try:
            _check_finite(tmp, tokens_all[cfg.calib_tokens :], n_threads, check_texts)
        except ModelError as e:
            msg = f"{dst}: conversion failed: {e}"
            raise ModelError(msg) from None
    seconds["total"] = time.monotonic() - t_start
    return MoefyResult(errors_plan, errors, seconds, len(tokens), errors_held, len(held), cfg.dense_lead)


PARTITION_FORMAT = "moetier-moefy-partition-1"
# what decides the split itself; a conversion given a partition does not use them, so it must not ask
# for other values than the partition was made with (the flags would be ignored)
PARTITION_FIELDS = ("shared_frac", "split_rounds", "cluster_features", "seed")


def write_partition(
    path: str | os.PathLike[str],
    splits: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None],
    n_ff: int,
    cfg: MoefyConfig,
    source: str,
) -> None:
    """The neuron partition of a conversion (shared and per-expert neuron indices of each MoE layer),
    for converting variants of the same base with the same experts (moefy's partition argument)."""
    meta = {
        "format": PARTITION_FORMAT,
        "source": source,
        "n_layer": len(splits),
        "n_ff": n_ff,
        "n_expert": cfg.n_expert,
        "dense_lead": cfg.dense_lead,
        **{k: getattr(cfg, k) for k in PARTITION_FIELDS},
    }
    arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    for il, sp in enumerate(splits):
        if sp is not None:
            arrays[f"shared_{il}"], arrays[f"groups_{il}"] = sp
    with replacing(path) as tmp, open(tmp, "wb") as f:  # a file object: numpy adds no .npz to the name
        np.savez(f, **arrays)


def read_partition(
    path: str | os.PathLike[str], n_layer: int, n_ff: int, cfg: MoefyConfig
) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None]:
    """A partition written by write_partition, checked against the model it is applied to."""
    try:
        z = np.load(path)
    except (OSError, ValueError) as e:
        msg = f"{path}: not a moefy partition ({e})"
        raise ConfigError(msg) from None
    if not isinstance(z, np.lib.npyio.NpzFile):  # a plain .npy array
        msg = f"{path}: not a moefy partition (a single array, not an .npz archive)"
        raise ConfigError(msg)
    with z:
        problem = ""
        try:
            meta = json.loads(bytes(z["meta"]).decode())
        except (KeyError, ValueError):
            meta = {}
            problem = "not a moefy partition (no meta record)"
        if not isinstance(meta, dict):
            meta = {}
            problem = "not a moefy partition (its meta record is not an object)"
        if not problem and meta.get("format") != PARTITION_FORMAT:
            problem = f"format {meta.get('format')!r}, expected {PARTITION_FORMAT}"
        for key, want in (
            ("n_layer", n_layer),
            ("n_ff", n_ff),
            ("n_expert", cfg.n_expert),
            ("dense_lead", cfg.dense_lead),
        ):
            if not problem and meta.get(key) != want:
                problem = f"{key} {meta.get(key)} in the partition (of {meta.get('source')}), {want} here"
        # written since this check: older partitions say nothing of how they were split
        differ = [k for k in PARTITION_FIELDS if k in meta and meta[k] != getattr(cfg, k)]
        if not problem and differ:
            problem = (
                "the partition decides the split, and it was made with "
                + ", ".join(f"{k} {meta[k]!r}" for k in differ)
                + "; this conversion asks for "
                + ", ".join(f"{k} {getattr(cfg, k)!r}" for k in differ)
                + " (leave those at the partition's values)"
            )
        out: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None] = [None] * cfg.dense_lead
        for il in range(cfg.dense_lead, n_layer):
            if problem:
                break
            if f"shared_{il}" not in z.files or f"groups_{il}" not in z.files:
                problem = f"layer {il} is missing"
                break
            try:
                shared, groups = np.asarray(z[f"shared_{il}"]), np.asarray(z[f"groups_{il}"])
            except ValueError as e:  # object arrays (pickles) are not loaded
                problem = f"layer {il}: {e}"
                break
            if not (np.issubdtype(shared.dtype, np.integer) and np.issubdtype(groups.dtype, np.integer)):
                problem = f"layer {il}: neuron indices of type {shared.dtype}/{groups.dtype}, need integers"
            elif shared.ndim != 1:
                problem = f"layer {il}: shared neurons of shape {shared.shape}, need one list"
            elif groups.ndim != 2 or groups.shape[0] != cfg.n_expert or groups.shape[1] % 32 or not groups.shape[1]:
                problem = f"layer {il}: groups of shape {groups.shape}, need [{cfg.n_expert}, a multiple of 32]"
            elif not np.array_equal(np.sort(np.concatenate([shared, groups.reshape(-1)])), np.arange(n_ff)):
                problem = f"layer {il}: the shared and expert neurons are not each of the {n_ff} neurons once"
            out.append((shared.astype(np.int64), groups.astype(np.int64)))
    if problem:
        msg = f"{path}: {problem}"
        raise ConfigError(msg)
    return out


def _partition_key(
    given: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None],
) -> str:
    """The partition's neurons, layer by layer, with the shapes that say which are shared."""
    return cache_key(
        *(p for sp in given if sp is not None for p in (list(sp[1].shape), sp[0].tobytes(), sp[1].tobytes()))
    )


def _default_cache() -> Path:
    return Path(os.environ.get("MOETIER_CACHE", str(Path.home() / ".cache" / "moetier")))


def _write_moe(
    reader: gguf.GGUFReader,
    tensors: dict[str, Any],
    path: Path,
    cfg: MoefyConfig,
    layers: list[MoeLayer | None],
    splits: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None],
    xs: list[F32] | None,
    show: bool = False,
) -> None:
    """Writes the MoE GGUF. Without xs, gate/up rows are the source's bytes split by splits (shared
    and per-expert neuron indices: the training-free conversion changes no gate/up weight); with xs
    (each layer's FFN inputs), the float gate/up are quantized to the source's types, weighted by the
    mean squared input per column. A layer of None (the leading dense ones) keeps the source's FFN."""
    n_layer = len(layers)
    moes = [ly for ly in layers if ly is not None]
    n_dense = n_layer - len(moes)
    if any(ly is None for ly in layers[n_dense:]):
        msg = "moefy: only leading layers can stay dense"
        raise ConfigError(msg)
    writer = gguf.GGUFWriter(path, cfg.arch)
    _kv_copy(reader, writer, "qwen2", cfg.arch)
    # rows of Q and K (and their biases) in the target's rope layout
    permute: dict[str, npt.NDArray[np.int64]] = {}
    if cfg.arch == "ernie4_5-moe":
        writer.add_interleave_moe_layer_step(1)  # every layer past the leading dense ones is a MoE layer
        if n_dense:
            writer.add_leading_dense_block_count(n_dense)
        n_head = int(reader.fields["qwen2.attention.head_count"].parts[-1][0])
        head_dim = int(tensors["blk.0.attn_q.weight"].shape[1]) // n_head
        for il in range(n_layer):
            for proj in ("q", "k"):
                for kind in ("weight", "bias"):
                    name = f"blk.{il}.attn_{proj}.{kind}"
                    if name in tensors:
                        n_rows = int(tensors[name].shape[1 if kind == "weight" else 0])
                        permute[name] = _rope_norm_rows(n_rows, head_dim)
    ff_e = moes[0].gate.shape[1]
    n_sh = moes[0].gate_sh.shape[0]
    writer.add_expert_count(cfg.n_expert)
    writer.add_expert_used_count(cfg.n_expert_used)
    writer.add_expert_feed_forward_length(ff_e)
    writer.add_expert_shared_feed_forward_length(n_sh)
    if "output.weight" not in tensors:
        t = tensors["token_embd.weight"]
        writer.add_tensor("output.weight", np.asarray(t.data), raw_dtype=t.tensor_type)
    for t in reader.tensors:
        dense_ffn_tensor = any(t.name.endswith(s) for s in (".ffn_gate.weight", ".ffn_up.weight", ".ffn_down.weight"))
        if dense_ffn_tensor and int(t.name.split(".")[1]) >= n_dense:
            continue
        if t.name in permute:
            data = _rows_raw(t) if len(t.shape) == 2 else np.asarray(t.data)  # weight rows, or bias values
            writer.add_tensor(t.name, np.ascontiguousarray(data[permute[t.name]]), raw_dtype=t.tensor_type)
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    d = int(tensors["blk.0.ffn_gate.weight"].shape[0])
    for il, ly in enumerate(layers):
        split = splits[il]
        if ly is None or split is None:
            continue
        for proj in ("gate", "up"):
            t = tensors[f"blk.{il}.ffn_{proj}.weight"]
            w_exps, w_sh = getattr(ly, proj), getattr(ly, proj + "_sh")
            if xs is None:
                raw = _rows_raw(t)
                shared, groups = split
                exps = np.stack([raw[g] for g in groups])  # [E, ff_e, row bytes]
                sh = raw[shared]
            else:
                imat = np.mean(np.square(np.asarray(xs[il], dtype=np.float64)), axis=0).astype(np.float32)
                exps = _quantize_like(w_exps, t.tensor_type, imat)
                sh = _quantize_like(w_sh, t.tensor_type, imat)
            # uint8 arrays carry byte shapes; the writer derives the element shape from the type
            writer.add_tensor(f"blk.{il}.ffn_{proj}_exps.weight", exps, raw_dtype=t.tensor_type)
            writer.add_tensor(f"blk.{il}.ffn_{proj}_shexp.weight", sh, raw_dtype=t.tensor_type)
        q, qt = _quantize(ly.down.reshape(-1, ff_e), cfg.down_type)
        writer.add_tensor(f"blk.{il}.ffn_down_exps.weight", q.reshape(cfg.n_expert, d, -1), raw_dtype=qt)
        q, qt = _quantize(ly.down_sh, cfg.down_type)
        writer.add_tensor(f"blk.{il}.ffn_down_shexp.weight", q, raw_dtype=qt)
        writer.add_tensor(f"blk.{il}.ffn_gate_inp.weight", ly.router)
        if ly.bias is not None:
            writer.add_tensor(f"blk.{il}.exp_probs_b.bias", np.ascontiguousarray(ly.bias, dtype=np.float32))
        if cfg.arch == "qwen2moe":
            # shared gate sigmoid(z), computed as silu(z)/z: a tiny constant direction keeps z small,
            # so the gate is 1/2 (compensated in the refit), but z == 0 exactly gives NaN
            gate = np.full(d, QWEN2MOE_SHEXP_GATE, dtype=np.float32)
            writer.add_tensor(f"blk.{il}.ffn_gate_inp_shexp.weight", gate)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=show)
    writer.close()


# general-knowledge openings for the dense model to continue (generated_prose): everyday topics a
# CPython install has no prose about; none is a question the demo asks
PROSE_PROMPTS = (
    "The history of the printing press begins",
    "Photosynthesis is the process by which",
    "When you travel by train across Europe,",
    "The human heart has four chambers:",
    "A good recipe for bread needs",
    "The Pacific Ocean is the largest",
    "Volcanoes form where",
    "In the nineteenth century, the railways",
    "The moon orbits the Earth",
    "A short story: The old fisherman woke before dawn and",
    "Honey bees communicate with each other by",
    "The rules of chess are simple:",
    "Rainbows appear when",
    "The Roman Empire was",
    "To plant a tree, first",
    "Elephants are the largest land animals,",
    "The invention of the telephone",
    "Mount Everest stands on the border of",
    "Dear friend, I am writing to tell you about my trip to",
    "The seasons change because",
    "Music has been part of every human culture,",
    "A healthy breakfast usually includes",
    "The library in our town opened in",
    "Earthquakes are measured with",
)


def generated_prose(model_path: str | os.PathLike[str], n_tokens: int, n_threads: int | None = None) -> list[str]:
    """English prose written by the dense model itself, continuing PROSE_PROMPTS (sampled at
    temperature 0.7, one seed per text, so the same model gives the same texts): general text in the
    model's own words where no prose corpus is at hand. A CPython install has the language reference
    and its sources but little everyday English, and a MoE calibrated without it gets simple facts
    wrong ('Water freezes at a temperature of 10 degrees Celsius')."""
    from ..model import Model

    m = Model(model_path, n_ctx=512, n_threads=n_threads)
    out: list[str] = []
    total = i = 0
    while total < n_tokens:
        prompt = PROSE_PROMPTS[i % len(PROSE_PROMPTS)]
        r = m.generate(prompt, max_tokens=160, temperature=0.7, seed=i)
        out.append(prompt + r.text)
        total += r.prompt_tokens + len(r.tokens)
        i += 1
    return out


def builtin_calibration_text(n_chars: int, slice_chars: int = 3000, extra: str = "") -> str:
    """Prose and code that every CPython install has, interleaved slice by slice: the language
    reference's topics (pydoc_data, English prose), the standard library's top-level sources and, if
    given, the slices of extra (e.g. generated_prose joined) as a third stream. A model calibrated on
    code alone answers prose badly; evaluation text must come from elsewhere
    (bench/corpora.py keeps its eval documents apart)."""
    import sysconfig
    from pydoc_data.topics import topics

    prose = [topics[k] for k in sorted(topics)]
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    code = [f.read_text(errors="replace") for f in files[:: max(1, len(files) // 60)]]
    streams = [prose, code]
    if extra:
        streams.append([extra[j : j + slice_chars] for j in range(0, len(extra), slice_chars)])
    out: list[str] = []
    total = i = 0
    while total < n_chars and i < max(len(d) for d in streams):
        for docs in streams:
            if i < len(docs):
                t = docs[i][:slice_chars]
                out.append(t)
                total += len(t)
        i += 1
    return "\n\n".join(out)[:n_chars]


def _check_finite(
    path: Path, held_out: list[int], n_threads: int | None, texts: tuple[str, ...] = (), window: int = 256
) -> None:
    """The converted model's last-position logits over windows of held-out text (the calibration
    text past the tokens the fit used, CHECK_SAMPLES, the last window of each of texts) must be
    finite. A NaN or inf at any position reaches the last one through the attention, so one check per
    window covers the window."""
    from ..model import Model

    m = Model(path, n_ctx=window + 8, n_threads=n_threads)
    windows = [held_out[i : i + window] for i in range(0, min(len(held_out), 4 * window), window)]
    windows += [m.tokenize(s)[-window:] for s in (*CHECK_SAMPLES, *texts)]
    for w in windows:
        if len(w) < 2:
            continue
        logits = m.logits(w)
        if not np.isfinite(logits).all():
            text = m.detokenize(w[:12]).replace("\n", " ")
            msg = f"logits are not finite ({int((~np.isfinite(logits)).sum())} of {logits.size}) after {text!r}..."
            raise ModelError(msg)
