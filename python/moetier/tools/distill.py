"""Layer-wise distillation of a moefied FFN: every weight of the MoE layer (router, shared and routed
experts' gate/up/down) fitted by gradient descent so that the sparse layer reproduces the dense
FFN's output on calibration activations (bench/results/moefy-distill.md: on real layers it overfits).

The training-free plan (moefy.plan_layer) splits the dense neurons into a shared expert and E
routed ones and refits the down projections in closed form; what it cannot do is let the kept
neurons take over the work of the dropped ones, which needs gate/up to move too. This does that,
one layer at a time, on CPU with NumPy (the gradients of a SwiGLU MoE layer are short enough to
write out, and BLAS does the work): Adam, minibatches of tokens, the loss each token's squared
error relative to its dense output (the error moefy reports), and a held-out tail of the tokens
picks the best epoch (the layer has more weights than the calibration gives targets).

Routing is llama.cpp's for the target architecture: softmax over the router's logits, top-k, and
(ernie4_5-moe) the selected weights renormalised. The top-k choice itself has no gradient; the
router learns through the weights of the experts it selected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class DistillConfig:
    """How each MoE layer is fitted to its dense FFN."""

    # off by default: on Qwen2.5-Coder-0.5B with 16384 calibration tokens it fits the training tokens
    # better but not held-out ones (bench/results/moefy-distill.md)
    epochs: int = field(
        default=0,
        metadata={
            "help": "passes over the calibration tokens per layer (0 = no distillation: with 16k calibration "
            "tokens it overfits, see bench/results/moefy-distill.md)"
        },
    )
    rounds: int = field(
        default=2,
        metadata={"help": "1: fit on the dense model's FFN inputs; 2: then again on the converted model's own"},
    )
    residual: float = field(
        default=0.0,
        metadata={
            "help": "rounds >= 2: share of each layer's target that is the dense model's residual stream after "
            "the layer minus the converted model's before its FFN (0 = the dense FFN on the layer's own inputs)"
        },
    )
    lr: float = field(
        default=1e-3, metadata={"help": "Adam step size, relative to each weight tensor's RMS at the start"}
    )
    batch_tokens: int = field(default=512, metadata={"help": "tokens per Adam step"})
    holdout: float = field(
        default=0.1, metadata={"help": "fraction of the calibration tokens held out to pick the best epoch"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the minibatch order"})

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                msg = f"distill.{f.name}: {v!r} is not a number"
                raise ConfigError(msg)
        if self.epochs < 0:
            msg = f"distill.epochs: {self.epochs} must be >= 0"
            raise ConfigError(msg)
        if self.rounds < 1:
            msg = f"distill.rounds: {self.rounds} must be >= 1"
            raise ConfigError(msg)
        if not 0.0 <= self.residual <= 1.0:
            msg = f"distill.residual: {self.residual} must be in [0, 1]"
            raise ConfigError(msg)
        if not self.lr > 0:
            msg = f"distill.lr: {self.lr} must be > 0"
            raise ConfigError(msg)
        if self.batch_tokens < 1:
            msg = f"distill.batch_tokens: {self.batch_tokens} must be >= 1"
            raise ConfigError(msg)
        if not 0.0 < self.holdout < 0.5:
            msg = f"distill.holdout: {self.holdout} must be in (0, 0.5)"
            raise ConfigError(msg)
        if not isinstance(self.seed, int) or not 0 <= self.seed <= 2**63 - 1:
            msg = f"distill.seed: {self.seed!r} must be an integer in [0, 2^63 - 1]"
            raise ConfigError(msg)


@dataclass
class MoeLayer:
    """The float weights of one MoE FFN (numpy shapes; ggml's ne reversed)."""

    router: F32  # [E, d]
    gate_sh: F32  # [n_sh, d]
    up_sh: F32  # [n_sh, d]
    down_sh: F32  # [d, n_sh]
    gate: F32  # [E, ff_e, d]
    up: F32  # [E, ff_e, d]
    down: F32  # [E, d, ff_e]
    # [E] added to the softmax for the top-k choice only, never to the weights (llama.cpp's
    # exp_probs_b, DeepSeek-V3's balancing bias); not trained (arrays() leaves it out)
    bias: F32 | None = None

    NAMES = ("router", "gate_sh", "up_sh", "down_sh", "gate", "up", "down")

    def arrays(self) -> dict[str, F32]:
        return {n: getattr(self, n) for n in self.NAMES}

    def copy(self) -> MoeLayer:
        bias = None if self.bias is None else self.bias.copy()
        return MoeLayer(**{n: a.copy() for n, a in self.arrays().items()}, bias=bias)


def _sigmoid(a: F32) -> F32:
    out: F32 = (0.5 * (1.0 + np.tanh(0.5 * a))).astype(a.dtype, copy=False)
    return out


def softmax(logits: F32) -> F32:
    """Row-wise softmax [N, E] of router logits, as llama.cpp's gating."""
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    out: F32 = p / p.sum(axis=1, keepdims=True)
    return out


def route(layer: MoeLayer, x: F32, k: int, renorm: bool) -> tuple[npt.NDArray[np.int64], F32, F32]:
    """llama.cpp's routing: (top-k ids [N, k], their weights [N, k], the softmax [N, E] or, with renorm,
    the renormalised weights scattered over [N, E]); the layer's bias, if any, moves the choice only."""
    logits = x @ layer.router.T
    p = softmax(logits)
    top = np.argsort(-(logits if layer.bias is None else p + layer.bias), axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, top, axis=1)
    if renorm:
        w = w / w.sum(axis=1, keepdims=True)
        p = np.zeros_like(p)
        np.put_along_axis(p, top, w, axis=1)
    return top, w.astype(x.dtype), p.astype(x.dtype)


def forward(layer: MoeLayer, x: F32, k: int, renorm: bool, sh_gate: float = 1.0) -> F32:
    """The MoE layer's output [N, d] for inputs x [N, d]."""
    top, w, _ = route(layer, x, k, renorm)
    a = x @ layer.gate_sh.T
    y = ((a * _sigmoid(a)) * (x @ layer.up_sh.T)) @ layer.down_sh.T * np.float32(sh_gate)
    for e in range(layer.router.shape[0]):
        rows, slot = np.nonzero(top == e)
        if rows.size == 0:
            continue
        xe = x[rows]
        a = xe @ layer.gate[e].T
        y[rows] += w[rows, slot, None] * (((a * _sigmoid(a)) * (xe @ layer.up[e].T)) @ layer.down[e].T)
    return y


def relative_error(out: F32, y: F32) -> float:
    """Mean over tokens (rows) of ||out - y|| / ||y||."""
    return float(np.mean(np.linalg.norm(out - y, axis=1) / (np.linalg.norm(y, axis=1) + 1e-8)))


def rel_error(layer: MoeLayer, x: F32, y: F32, k: int, renorm: bool, sh_gate: float = 1.0) -> float:
    """Mean over tokens of ||y_moe - y|| / ||y||."""
    out = np.empty_like(y)
    for i in range(0, len(x), 2048):
        out[i : i + 2048] = forward(layer, x[i : i + 2048], k, renorm, sh_gate)
    return relative_error(out, y)


def loss_and_grads(
    layer: MoeLayer, x: F32, y: F32, k: int, renorm: bool, sh_gate: float = 1.0
) -> tuple[float, dict[str, F32]]:
    """Loss = mean over tokens of ||y_moe - y||^2 / ||y||^2, and its gradient for every weight."""
    n = x.shape[0]
    top, w, p = route(layer, x, k, renorm)
    g: dict[str, F32] = {}

    a = x @ layer.gate_sh.T
    b = x @ layer.up_sh.T
    sa = _sigmoid(a)
    silu = a * sa
    h = silu * b * np.float32(sh_gate)
    out = h @ layer.down_sh.T
    cache = []
    for e in range(layer.router.shape[0]):
        rows, slot = np.nonzero(top == e)
        xe = x[rows]
        ae = xe @ layer.gate[e].T
        be = xe @ layer.up[e].T
        sae = _sigmoid(ae)
        he = (ae * sae) * be
        oe = he @ layer.down[e].T
        out[rows] += w[rows, slot, None] * oe
        cache.append((rows, slot, xe, ae, be, sae, he, oe))

    diff = out - y
    inv = (1.0 / (np.einsum("ij,ij->i", y, y) + 1e-6)).astype(x.dtype)
    loss = float(np.mean(np.einsum("ij,ij->i", diff, diff) * inv))
    dy = diff * (2.0 / n) * inv[:, None]

    g["down_sh"] = dy.T @ h
    dh = (dy @ layer.down_sh) * np.float32(sh_gate)
    g["gate_sh"] = (dh * b * sa * (1.0 + a * (1.0 - sa))).T @ x
    g["up_sh"] = (dh * silu).T @ x

    dw = np.zeros((n, k), dtype=x.dtype)
    g["gate"] = np.zeros_like(layer.gate)
    g["up"] = np.zeros_like(layer.up)
    g["down"] = np.zeros_like(layer.down)
    for e, (rows, slot, xe, ae, be, sae, he, oe) in enumerate(cache):
        if rows.size == 0:
            continue
        dye = dy[rows]
        dw[rows, slot] = np.einsum("ij,ij->i", dye, oe)
        do = dye * w[rows, slot, None]
        g["down"][e] = do.T @ he
        dhe = do @ layer.down[e]
        g["gate"][e] = (dhe * be * sae * (1.0 + ae * (1.0 - sae))).T @ xe
        g["up"][e] = (dhe * ae * sae).T @ xe

    # router: w_j = p_j (/ sum over the top-k with renorm); d logit_m = P_m (G_m - sum_S w dw), with
    # G the weight gradients scattered over [N, E] and P the (renormalised) probabilities
    gfull = np.zeros_like(p)
    np.put_along_axis(gfull, top, dw, axis=1)
    s = np.einsum("ij,ij->i", w, dw)[:, None]
    dlogits = p * (gfull - s)
    g["router"] = dlogits.T @ x
    return loss, g


class _Adam:
    def __init__(self, layer: MoeLayer, lr: float) -> None:
        # one step size per tensor, relative to its scale: the router and the projections differ by orders
        self.lr = {n: lr * float(np.sqrt(np.mean(a.astype(np.float64) ** 2)) or 1.0) for n, a in layer.arrays().items()}
        self.m = {n: np.zeros_like(a) for n, a in layer.arrays().items()}
        self.v = {n: np.zeros_like(a) for n, a in layer.arrays().items()}
        self.t = 0

    def step(self, layer: MoeLayer, grads: dict[str, F32], scale: float) -> None:
        b1, b2, eps = 0.9, 0.999, 1e-12
        self.t += 1
        c1 = 1.0 - b1**self.t
        c2 = 1.0 - b2**self.t
        for n, gr in grads.items():
            m, v = self.m[n], self.v[n]
            m *= b1
            m += (1.0 - b1) * gr
            v *= b2
            v += (1.0 - b2) * gr * gr
            a = getattr(layer, n)
            a -= (self.lr[n] * scale / c1) * m / (np.sqrt(v / c2) + eps)


@dataclass
class DistillResult:
    layer: MoeLayer
    err_before: float  # held-out relative error of the starting layer
    err_after: float  # held-out relative error of the returned layer
    epochs_run: int
    best_epoch: int  # 0 = the starting layer was best
    # per epoch from 0 (the start): (relative error on up to 2048 training tokens, on the held-out ones)
    history: list[tuple[float, float]] = field(default_factory=list)


def distill_layer(
    start: MoeLayer, x: F32, y: F32, k: int, renorm: bool, cfg: DistillConfig, sh_gate: float = 1.0
) -> DistillResult:
    """Fits start (a copy is trained) to y = dense FFN outputs [N, d] on inputs x [N, d]."""
    n = x.shape[0]
    n_hold = max(1, int(n * cfg.holdout))
    # held out: the last tokens (contiguous text, as evaluation would be), never trained on
    xt, yt, xh, yh = x[: n - n_hold], y[: n - n_hold], x[n - n_hold :], y[n - n_hold :]
    layer = start.copy()
    best, best_err, best_epoch = start, rel_error(start, xh, yh, k, renorm, sh_gate), 0
    err0 = best_err
    x_fit, y_fit = xt[:2048], yt[:2048]
    history = [(rel_error(start, x_fit, y_fit, k, renorm, sh_gate), err0)]
    opt = _Adam(layer, cfg.lr)
    rng = np.random.default_rng(cfg.seed)
    n_steps = cfg.epochs * math.ceil(len(xt) / cfg.batch_tokens)
    step = 0
    for epoch in range(1, cfg.epochs + 1):
        order = rng.permutation(len(xt))
        for i in range(0, len(xt), cfg.batch_tokens):
            idx = np.sort(order[i : i + cfg.batch_tokens])
            _, grads = loss_and_grads(layer, xt[idx], yt[idx], k, renorm, sh_gate)
            # cosine decay to 10% over the whole run, after a short warm-up
            warm = min(1.0, (step + 1) / 20)
            opt.step(layer, grads, warm * (0.1 + 0.45 * (1.0 + math.cos(math.pi * step / max(1, n_steps)))))
            step += 1
        err = rel_error(layer, xh, yh, k, renorm, sh_gate)
        history.append((rel_error(layer, x_fit, y_fit, k, renorm, sh_gate), err))
        if err < best_err:
            best, best_err, best_epoch = layer.copy(), err, epoch
    return DistillResult(best, err0, best_err, cfg.epochs, best_epoch, history)
