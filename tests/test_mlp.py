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


def test_silu_and_its_derivative_at_known_points() -> None:
    """SiLU is z * sigmoid(z) and silu_grad its derivative, both returned as float32 whatever the input."""
    from moetier.tools.mlp import silu, silu_grad

    z = np.array([-2.0, 0.0, 1.0, 3.0])  # float64 in, float32 out
    out, grad = silu(z), silu_grad(z)
    assert out.dtype == np.float32 and grad.dtype == np.float32
    np.testing.assert_allclose(out, [-0.23840584, 0.0, 0.73105858, 2.85772238], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, [-0.09078425, 0.5, 0.92767051, 1.08810411], rtol=1e-6)
    eps = 1e-4
    fd = (z + eps) / (1 + np.exp(-(z + eps))) - (z - eps) / (1 + np.exp(-(z - eps)))
    np.testing.assert_allclose(grad, fd / (2 * eps), rtol=1e-5)


def test_init_scales_weights_by_fan_in_and_zeroes_biases() -> None:
    """MLP.init draws each layer's [out, in] weights as standard normals over sqrt(in); biases start at zero."""
    net = MLP.init([3, 5, 2], np.random.default_rng(7))
    rng = np.random.default_rng(7)
    want = [rng.standard_normal((5, 3)) / np.sqrt(3), rng.standard_normal((2, 5)) / np.sqrt(5)]
    assert [w.shape for w in net.weights] == [(5, 3), (2, 5)]
    for w, ref in zip(net.weights, want, strict=True):
        assert w.dtype == np.float32
        np.testing.assert_allclose(w, ref, rtol=1e-6)
    assert [b.dtype for b in net.biases] == [np.float32, np.float32]
    assert [b.tolist() for b in net.biases] == [[0.0] * 5, [0.0] * 2]
    assert [id(p) for p in net.params()] == [id(p) for p in [*net.weights, *net.biases]]


def _silu64(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def test_forward_applies_silu_between_layers_but_not_after_the_last() -> None:
    """forward returns the output and, per layer, its input and pre-activation; SiLU follows every
    layer but the last, whose output stays linear (negative values included)."""
    rng = np.random.default_rng(3)
    ws = [rng.standard_normal(s).astype(np.float32) for s in ((4, 3), (4, 4), (2, 4))]
    bs = [rng.standard_normal(n).astype(np.float32) for n in (4, 4, 2)]
    net = MLP(ws, bs)
    x = rng.standard_normal((6, 3))  # float64: every activation is float32 all the same
    out, ins, pre = net.forward(x)
    w64 = [w.astype(np.float64) for w in ws]
    b64 = [b.astype(np.float64) for b in bs]
    z0 = x @ w64[0].T + b64[0]
    z1 = _silu64(z0) @ w64[1].T + b64[1]
    z2 = _silu64(z1) @ w64[2].T + b64[2]
    assert (z2 < 0).any()  # a SiLU after the last layer would change these
    for got, want in zip([*pre, out], [z0, z1, z2, z2], strict=True):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(ins) == 3 and ins[0] is x
    np.testing.assert_allclose(ins[1], _silu64(z0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ins[2], _silu64(z1), rtol=1e-5, atol=1e-6)


def test_output_is_computed_in_chunks_of_16384_rows_by_default() -> None:
    """Calling the network runs forward once when the rows fit in a chunk and else one chunk at a time
    (16384 rows unless told), the last chunk holding the remainder."""
    seen: list[int] = []

    class Counting(MLP):
        def forward(self, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:  # type: ignore[override]
            seen.append(len(x))
            return super().forward(x)

    base = MLP.init([1, 2, 1], np.random.default_rng(4))
    net = Counting(base.weights, base.biases)
    x = np.linspace(-1, 1, 16385, dtype=np.float32)[:, None]
    np.testing.assert_allclose(net(x), base.forward(x)[0], rtol=1e-6, atol=1e-6)
    assert seen == [16384, 1]
    seen.clear()
    assert net(x[:16384]).shape == (16384, 1) and seen == [16384]
    seen.clear()
    assert net(x[:100], chunk=30).shape == (100, 1) and seen == [30, 30, 30, 10]


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_loss_value_is_the_mean_over_every_output(loss: Literal["mse", "bce"]) -> None:
    """grads' loss is the mean squared error, or the mean binary cross-entropy of the logits, over
    every row and output; each gradient comes back float32 with its parameter's shape."""
    net = MLP([np.array([[2.0, -1.0], [0.5, 1.0]], np.float32)], [np.array([0.5, -1.0], np.float32)])
    x = np.array([[1.0, 2.0], [-1.0, 0.5], [0.0, -2.0]])  # float64 input: gradients are float32 anyway
    y = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], np.float32)
    out = x @ np.array([[2.0, -1.0], [0.5, 1.0]]).T + [0.5, -1.0]
    if loss == "mse":
        want = np.mean((out - y) ** 2)
    else:
        p = 1 / (1 + np.exp(-out))
        want = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    value, grads = net.grads(x, y, loss)
    assert value == pytest.approx(want, rel=1e-6)
    assert [g.shape for g in grads] == [(2, 2), (2,)]
    assert [g.dtype for g in grads] == [np.float32, np.float32]


def _adamw_reference(
    net: MLP, x: np.ndarray, y: np.ndarray, cfg: FitConfig, seed: int
) -> tuple[list[np.ndarray], list[float]]:
    """Textbook AdamW (decoupled weight decay, bias-corrected moments) in float64 over the same batches."""
    rng = np.random.default_rng(seed)
    ps = [p.copy() for p in net.params()]
    m = [np.zeros(p.shape) for p in ps]
    v = [np.zeros(p.shape) for p in ps]
    b1, b2 = cfg.betas
    n_batches, t, losses = max(1, len(y) // cfg.batch), 0, []
    for _ in range(cfg.epochs):
        perm = rng.permutation(len(y))
        values = []
        for i in range(n_batches):
            idx = perm[i * cfg.batch : (i + 1) * cfg.batch]
            k = len(net.weights)
            value, gs = MLP(ps[:k], ps[k:]).grads(x[idx], y[idx], "mse")
            values.append(value)
            t += 1
            for j, g in enumerate(gs):
                m[j] = b1 * m[j] + (1 - b1) * g
                v[j] = b2 * v[j] + (1 - b2) * g.astype(np.float64) ** 2
                step = cfg.lr * (m[j] / (1 - b1**t)) / (np.sqrt(v[j] / (1 - b2**t)) + 1e-8)
                ps[j] = (ps[j] * (1 - cfg.lr * cfg.weight_decay) - step).astype(np.float32)
        losses.append(float(np.mean(values)))
    return ps, losses


def test_fit_takes_adamw_steps_over_shuffled_batches() -> None:
    """fit: each epoch shuffles the rows with rng and takes one AdamW step per whole batch (a partial
    last batch is left out), weight decay decoupled; it returns, and reports to progress, each epoch's
    mean batch loss."""
    rng = np.random.default_rng(5)
    net = MLP.init([2, 3, 1], rng)
    for b in net.biases:
        b += rng.standard_normal(b.shape).astype(np.float32)
    x = rng.standard_normal((10, 2)).astype(np.float32)
    y = rng.standard_normal((10, 1)).astype(np.float32)
    cfg = FitConfig(epochs=3, lr=0.05, weight_decay=0.5, batch=4, betas=(0.8, 0.9))
    want_params, want_losses = _adamw_reference(net, x, y, cfg, seed=11)
    seen: list[tuple[int, float]] = []
    losses = fit(net, x, y, "mse", cfg, np.random.default_rng(11), progress=lambda e, loss: seen.append((e, loss)))
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert seen == list(enumerate(losses))
    for got, want in zip(net.params(), want_params, strict=True):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fit_with_fewer_rows_than_a_batch_takes_one_step_on_them_all() -> None:
    """When the rows do not fill a batch, each epoch is one step on every row: its loss is the loss
    of the whole set before that step."""
    rng = np.random.default_rng(6)
    net = MLP.init([2, 1], rng)
    x = rng.standard_normal((3, 2)).astype(np.float32)
    y = rng.standard_normal((3, 1)).astype(np.float32)
    before = net.grads(x, y, "mse")[0]
    losses = fit(net, x, y, "mse", FitConfig(epochs=2, lr=0.01, batch=8), np.random.default_rng(0))
    assert len(losses) == 2 and losses[0] == pytest.approx(before, rel=1e-6)
    assert losses[1] == pytest.approx(net.grads(x, y, "mse")[0], rel=0.5) and losses[1] != losses[0]


def test_fit_shows_a_progress_bar_of_epochs_that_it_clears(capsys: pytest.CaptureFixture[str]) -> None:
    """fit draws a progress bar on stderr counting epochs, labelled "training" unless desc says
    otherwise, and clears it when done."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 1)).astype(np.float32)
    for desc, label in ((None, "training"), ("scorer", "scorer")):
        kw = {} if desc is None else {"desc": desc}
        fit(MLP.init([1, 1], rng), x, x, "mse", FitConfig(epochs=2, batch=4), rng, **kw)  # type: ignore[arg-type]
        err = capsys.readouterr().err
        assert err.startswith(f"\r{label}:   0%|") and "| 0/2 [" in err and "epoch/s]" in err, err
        assert err.endswith(" \r"), err  # cleared, not left on screen


def test_adamw_epsilon_is_1e_8() -> None:
    """AdamW divides by sqrt(v) + 1e-8: a first-step gradient of exactly 1e-8 moves its weight by half
    the learning rate (a larger gradient would move it by nearly the whole rate)."""
    net = MLP([np.zeros((1, 1), np.float32)], [np.zeros(1, np.float32)])
    x = np.array([[1.0], [-1.0]], np.float32)  # the weight's gradient cancels: only the bias moves
    y = np.full((2, 1), 5e-9, np.float32)  # d(mse)/d(bias) = 2 * (0 - 5e-9) = -1e-8
    fit(net, x, y, "mse", FitConfig(epochs=1, lr=0.1, weight_decay=0.0, batch=2), np.random.default_rng(0))
    assert net.biases[0][0] == pytest.approx(0.05, rel=1e-3)
    assert net.weights[0][0, 0] == 0.0


def test_forward_refuses_weights_and_biases_of_different_counts() -> None:
    """A network given more weight matrices than bias vectors fails on its first forward pass instead of
    silently dropping a layer."""
    rng = np.random.default_rng(9)
    net = MLP.init([2, 3, 1], rng)
    with pytest.raises(ValueError, match="zip"):
        MLP(net.weights, net.biases[:1]).forward(np.ones((1, 2), np.float32))
