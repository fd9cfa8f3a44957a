"""Layer-wise distillation of moefied layers: exact gradients, a fit that generalises, resumable work."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import ConfigError, Model, _core
from moetier.tools import distill as dl
from moetier.tools.moefy import MoefyConfig, moefy
from moetier.tools.tiny import write_tiny_model

CALIB = (LONG_PROMPT + " 0123456789 (){}[] <> +-*/=\n") * 12


def _random_layer(rng: np.random.Generator, e: int = 4, d: int = 6, ff: int = 5, n_sh: int = 3) -> dl.MoeLayer:
    return dl.MoeLayer(
        router=rng.normal(size=(e, d)),
        gate_sh=rng.normal(size=(n_sh, d)),
        up_sh=rng.normal(size=(n_sh, d)),
        down_sh=rng.normal(size=(d, n_sh)),
        gate=rng.normal(size=(e, ff, d)),
        up=rng.normal(size=(e, ff, d)),
        down=rng.normal(size=(e, d, ff)),
    )


@pytest.mark.parametrize("renorm", [True, False])
def test_gradients_match_finite_differences(renorm: bool) -> None:
    """Every weight's analytic gradient (router through the top-k weights included) against central
    differences in float64, for both llama.cpp routings (ernie renormalises, qwen2moe does not)."""
    rng = np.random.default_rng(0)
    layer = _random_layer(rng)
    x, y = rng.normal(size=(7, 6)), rng.normal(size=(7, 6))
    loss, grads = dl.loss_and_grads(layer, x, y, 2, renorm, 0.7)
    out = dl.forward(layer, x, 2, renorm, 0.7)
    assert loss == pytest.approx(np.mean(((out - y) ** 2).sum(1) / ((y**2).sum(1) + 1e-6)), rel=1e-12)
    for name in dl.MoeLayer.NAMES:
        a = getattr(layer, name)
        for _ in range(4):
            i = tuple(int(rng.integers(0, s)) for s in a.shape)
            old, h = a[i], 1e-6
            a[i] = old + h
            lp, _ = dl.loss_and_grads(layer, x, y, 2, renorm, 0.7)
            a[i] = old - h
            lm, _ = dl.loss_and_grads(layer, x, y, 2, renorm, 0.7)
            a[i] = old
            num = (lp - lm) / (2 * h)
            assert grads[name][i] == pytest.approx(num, rel=1e-4, abs=1e-8), name


def test_distill_fits_a_moe_teacher_on_held_out_tokens() -> None:
    """A MoE layer perturbed from a teacher MoE of the same shape is pulled back towards it: the
    held-out error (tokens never trained on) falls, and the best epoch is kept."""
    rng = np.random.default_rng(1)
    e, d, ff, n_sh = 4, 16, 8, 8
    teacher = _random_layer(rng, e, d, ff, n_sh)
    for n, a in teacher.arrays().items():
        setattr(teacher, n, (a * 0.3).astype(np.float32))
    x = rng.normal(size=(3000, d)).astype(np.float32)
    y = dl.forward(teacher, x, 2, True)
    start = teacher.copy()
    for n, a in start.arrays().items():
        if n != "router":
            a += (0.1 * rng.normal(size=a.shape)).astype(np.float32)
    start_gate = start.gate.copy()
    res = dl.distill_layer(start, x, y, 2, True, dl.DistillConfig(epochs=4, lr=1e-2, batch_tokens=128))
    assert res.err_after < 0.6 * res.err_before
    assert 1 <= res.best_epoch <= 4
    assert dl.rel_error(res.layer, x[-300:], y[-300:], 2, True) == pytest.approx(res.err_after, rel=1e-5)
    assert np.array_equal(start.gate, start_gate), "the start layer is not trained in place"
    # the history: the start and every epoch, held-out errors as the selection saw them
    assert len(res.history) == 5
    assert res.history[0][1] == pytest.approx(res.err_before)
    assert res.history[res.best_epoch][1] == pytest.approx(res.err_after)
    assert res.history[-1][0] < res.history[0][0], "the training tokens' error falls"


def test_bad_distill_config() -> None:
    with pytest.raises(ConfigError, match=r"distill\.epochs"):
        dl.DistillConfig(epochs=-1)
    with pytest.raises(ConfigError, match=r"distill\.lr"):
        dl.DistillConfig(lr=0)
    with pytest.raises(ConfigError, match=r"distill\.rounds"):
        dl.DistillConfig(rounds=0)
    with pytest.raises(ConfigError, match=r"distill\.holdout"):
        dl.DistillConfig(holdout=0.7)
    with pytest.raises(ConfigError, match="not a number"):
        dl.DistillConfig(epochs=True)


def test_quantize_matches_ggml_reference() -> None:
    """_core.quantize writes ggml's bytes: gguf-py's own quantizer agrees on q8_0, and a K-quant (which
    gguf-py cannot write) dequantizes close to its input, better with an importance matrix that
    matches where the error is measured."""
    rng = np.random.default_rng(2)
    a = rng.normal(size=(8, 256)).astype(np.float32)
    q = _core.quantize(a, "q8_0")
    assert np.array_equal(q, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0))
    imp = np.ones(256, dtype=np.float32)
    imp[::4] = 100.0  # within each block of 32, some values matter more
    for w in (None, imp):
        back = gguf.quants.dequantize(_core.quantize(a, "q4_K", w), gguf.GGMLQuantizationType.Q4_K)
        err = np.abs(back - a)[:, ::4].mean()
        assert err < 0.12
        if w is None:
            plain = err
    assert err < plain, "the imatrix weights the columns it says are important"
    with pytest.raises(ValueError, match="unknown ggml type"):
        _core.quantize(a, "q9_Z")
    with pytest.raises(ValueError, match="blocks"):
        _core.quantize(a[:, :100], "q4_K")


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dense") / "dense.gguf", "qwen2", n_layer=2, n_ff_exp=512, seed=5)


def test_moefy_distill_two_rounds_resumes(dense: Path, tmp_path: Path) -> None:
    """moefy with distillation: gate/up go back to the source's quantization type; the written layers
    fit the dense FFN better than the training-free plan; a second run finds every activation and
    layer in the work dir and writes the same file without training again."""
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024)
    dcfg = dl.DistillConfig(epochs=2, lr=1e-2, batch_tokens=128, rounds=2)
    out, work = tmp_path / "moe.gguf", tmp_path / "work"
    res = moefy(dense, out, CALIB, cfg, distill=dcfg, work_dir=work, progress=False)
    assert len(res.errors) == 2 and all(np.isfinite(res.errors))
    assert np.mean(res.errors) < np.mean(res.errors_plan)
    assert set(res.seconds) >= {"collect", "plan", "distill round 1", "distill round 2", "total"}
    src = {t.name: t.tensor_type for t in gguf.GGUFReader(dense).tensors}
    moe = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert moe["blk.0.ffn_gate_exps.weight"] == src["blk.0.ffn_gate.weight"]
    assert moe["blk.1.ffn_up_shexp.weight"] == src["blk.1.ffn_up.weight"]
    saved = sorted(p.name for p in work.rglob("round-*-layer-*.npz"))
    assert saved == ["round-1-layer-0.npz", "round-1-layer-1.npz", "round-2-layer-0.npz", "round-2-layer-1.npz"]

    out2 = tmp_path / "moe2.gguf"
    res2 = moefy(dense, out2, CALIB, cfg, distill=dcfg, work_dir=work, progress=False)
    assert res2.errors == res.errors
    assert out2.read_bytes() == out.read_bytes()
    m = Model(out2)
    assert np.isfinite(m.logits(m.tokenize(LONG_PROMPT))).all()


def test_routing_report(tiny_model: ModelFactory) -> None:
    """Selection frequencies sum to k per token and layer; the top-1 share lies between flat (1/k) and
    1; the stacked-gate accuracy comes from the engine's counters over real predictions."""
    from moetier.tools.routing import routing_report

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    rep = routing_report(path, LONG_PROMPT * 8, tokens=256, n_predict=8)
    f = np.asarray(rep.freq)
    assert f.shape == (3, 8)
    assert np.allclose(f.sum(axis=1), 2.0)
    assert rep.n_tokens == min(256, len(Model(path).tokenize(LONG_PROMPT * 8)))
    assert all(0.5 - 1e-6 <= s <= 1.0 for s in rep.top1_share)
    assert rep.n_pred > 0, "two layers are predicted per decoded token"
    assert 0.0 <= rep.stacked_allk <= 1.0 and 0.0 <= rep.stacked_top1 <= 1.0
    assert "selection frequency" in rep.summary() and rep.table().count("\n") == 3 + 1


def test_moefy_cli_distill_flags(dense: Path, tmp_path: Path) -> None:
    from moetier.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "moe.gguf"
    args = ["moefy", str(dense), "-o", str(out), "--calib", str(calib), "--n-expert", "4", "--n-expert-used", "2"]
    args += ["--calib-tokens", "1024", "--distill-epochs", "1", "--distill-rounds", "1", "--work-dir", str(tmp_path)]
    assert main([*args, "-q"]) == 0
    assert list(tmp_path.rglob("round-1-layer-1.npz"))
    assert main(["moefy", str(dense), "-o", str(out), "--calib", str(calib), "--distill-lr", "-1"]) == 1
