"""A small feed-forward network in numpy, trained on CPU with AdamW: the learned parts of the cache
(FlashMoE's eviction scorer, DuoServe's expert predictor) are a few thousand to a few hundred
thousand weights, for which numpy is fast enough and no deep-learning framework is needed.

Layers are dense with SiLU between them (none after the last). Losses: mean squared error
(regression, FlashMoE's Table 1) or binary cross-entropy on the logits (multi-label, DuoServe).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

F32 = npt.NDArray[np.float32]


def silu(z: F32) -> F32:
    return np.asarray(z / (1.0 + np.exp(-z)), dtype=np.float32)


def silu_grad(z: F32) -> F32:
    s = 1.0 / (1.0 + np.exp(-z))
    return np.asarray(s * (1.0 + z * (1.0 - s)), dtype=np.float32)


@dataclass
class MLP:
    """weights[i]: [out, in], biases[i]: [out]."""

    weights: list[F32]
    biases: list[F32]

    @classmethod
    def init(cls, dims: list[int], rng: np.random.Generator) -> MLP:
        ws = [
            np.asarray(rng.standard_normal((o, i)) / np.sqrt(i), dtype=np.float32) for i, o in itertools.pairwise(dims)
        ]
        return cls(ws, [np.zeros(o, np.float32) for o in dims[1:]])

    def params(self) -> list[F32]:
        return [*self.weights, *self.biases]

    def forward(self, x: F32) -> tuple[F32, list[F32], list[F32]]:
        """Output, and per layer its input and pre-activation (for backprop)."""
        ins, pre = [], []
        h = x
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            ins.append(h)
            z = np.asarray(h @ w.T + b, dtype=np.float32)
            pre.append(z)
            h = silu(z) if i < len(self.weights) - 1 else z
        return h, ins, pre

    def __call__(self, x: F32, chunk: int = 16384) -> F32:
        """The output alone, in chunks of rows (a forward pass keeps every layer's activations)."""
        if len(x) <= chunk:
            return self.forward(x)[0]
        return np.concatenate([self.forward(x[i : i + chunk])[0] for i in range(0, len(x), chunk)])

    def grads(self, x: F32, y: F32, loss: Literal["mse", "bce"]) -> tuple[float, list[F32]]:
        out, ins, pre = self.forward(x)
        if loss == "mse":
            value = float(np.mean((out - y) ** 2))
            d = (2.0 / out.size) * (out - y)
        else:
            p = 1.0 / (1.0 + np.exp(-out))
            value = float(np.mean(np.logaddexp(0.0, out) - y * out))
            d = (p - y) / out.size
        gw: list[F32] = [np.zeros(0, np.float32)] * len(self.weights)
        gb: list[F32] = [np.zeros(0, np.float32)] * len(self.weights)
        d = np.asarray(d, dtype=np.float32)
        for i in range(len(self.weights) - 1, -1, -1):
            gw[i] = np.asarray(d.T @ ins[i], dtype=np.float32)
            gb[i] = np.asarray(d.sum(0), dtype=np.float32)
            if i:
                d = np.asarray((d @ self.weights[i]) * silu_grad(pre[i - 1]), dtype=np.float32)
        return value, [*gw, *gb]


@dataclass(frozen=True)
class FitConfig:
    epochs: int = 8
    lr: float = 1e-3
    weight_decay: float = 1e-2
    batch: int = 512
    betas: tuple[float, float] = field(default=(0.9, 0.999))


def fit(
    net: MLP,
    x: F32,
    y: F32,
    loss: Literal["mse", "bce"],
    cfg: FitConfig,
    rng: np.random.Generator,
    desc: str = "training",
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW with decoupled weight decay; the mean loss of each epoch."""
    ps = net.params()
    m = [np.zeros_like(p) for p in ps]
    v = [np.zeros_like(p) for p in ps]
    b1, b2 = cfg.betas
    step = 0
    losses = []
    n_batches = max(1, len(y) // cfg.batch)
    for epoch in tqdm(range(cfg.epochs), desc=desc, unit="epoch", leave=False):
        perm = rng.permutation(len(y))
        total = 0.0
        for i in range(n_batches):
            idx = perm[i * cfg.batch : (i + 1) * cfg.batch]
            value, gs = net.grads(x[idx], y[idx], loss)
            total += value
            step += 1
            for p, g, mi, vi in zip(ps, gs, m, v, strict=True):
                mi *= b1
                mi += (1 - b1) * g
                vi *= b2
                vi += (1 - b2) * g * g
                p *= 1 - cfg.lr * cfg.weight_decay
                p -= cfg.lr * (mi / (1 - b1**step)) / (np.sqrt(vi / (1 - b2**step)) + 1e-8)
        losses.append(total / n_batches)
        if progress:
            progress(epoch, losses[-1])
    return losses
