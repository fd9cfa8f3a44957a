"""The numpy network behind the learned policy and predictor: gradients against finite
differences, and AdamW fits what it is given."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest

from moetier.tools.mlp import MLP, FitConfig, fit


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_gradients_match_finite_differences(loss: Literal["mse", "bce"]) -> None:
    rng = np.random.default_rng(0)
    net = MLP.init([3, 5, 4, 2], rng)
    for p in net.params():
        p += rng.standard_normal(p.shape).astype(np.float32) * 0.1  # biases off zero too
    x = rng.standard_normal((7, 3)).astype(np.float32)
    y = (rng.random((7, 2)) > 0.5).astype(np.float32)
    _, grads = net.grads(x, y, loss)
    eps = 1e-2
    for p, g in zip(net.params(), grads, strict=True):
        for idx in list(np.ndindex(p.shape))[:6]:
            old = p[idx]
            p[idx] = old + eps
            up = net.grads(x, y, loss)[0]
            p[idx] = old - eps
            down = net.grads(x, y, loss)[0]
            p[idx] = old
            assert g[idx] == pytest.approx((up - down) / (2 * eps), rel=0.05, abs=1e-4), (loss, idx)


def test_fit_learns_a_ranking() -> None:
    """Score = how far a point is from the origin: after training, the order matches."""
    rng = np.random.default_rng(1)
    x = rng.random((4000, 2)).astype(np.float32)
    y = np.linalg.norm(x, axis=1, keepdims=True).astype(np.float32)
    net = MLP.init([2, 16, 16, 1], rng)
    losses = fit(net, x, y, "mse", FitConfig(epochs=6, lr=3e-3, weight_decay=0.0, batch=64), rng)
    assert losses[-1] < losses[0] / 5
    t = rng.random((500, 2)).astype(np.float32)
    pred = net(t)[:, 0]
    truth = np.linalg.norm(t, axis=1)
    assert np.corrcoef(pred, truth)[0, 1] > 0.97


def test_output_in_chunks_is_the_whole_forward() -> None:
    rng = np.random.default_rng(2)
    net = MLP.init([2, 8, 3], rng)
    x = rng.standard_normal((1000, 2)).astype(np.float32)
    np.testing.assert_allclose(net(x, chunk=64), net.forward(x)[0], rtol=1e-6, atol=1e-6)
