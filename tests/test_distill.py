"""Layer-wise distillation of moefied layers: exact gradients, a fit that generalises, resumable work."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory, text_flag_refusals_and_help
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


def _report(**kw: object) -> object:
    from moetier.tools.routing import RoutingReport

    fields: dict[str, object] = {
        "n_expert": 8,
        "n_expert_used": 2,
        "n_tokens": 100,
        "freq": [[1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0], [0.25] * 8],
        "top1_share": [0.6, 0.9],
        "stacked_top1": 0.625,
        "stacked_allk": 0.25,
        "n_pred": 8,
    }
    return RoutingReport(**{**fields, **kw})  # type: ignore[arg-type]


def test_routing_report_summary_and_table_text() -> None:
    """The report's one-paragraph summary and per-layer table, word for word: frequency range, the
    uniform share k/E, the mean coefficient of variation over layers, the top-1 share against flat 1/k,
    and the stacked-gate accuracies in percent."""
    from moetier.tools.routing import RoutingReport

    rep = _report()
    assert isinstance(rep, RoutingReport)
    lo, hi, cv = rep.freq_stats()
    # layer 0: mean 0.25, std sqrt(1/8), CV sqrt(2); layer 1 is uniform, CV 0
    assert (lo, hi) == (0.0, 1.0) and cv == pytest.approx(np.sqrt(2) / 2, rel=1e-12)
    assert rep.summary() == (
        "routing over 100 tokens, top-2 of 8: selection frequency 0.00-1.00 (uniform 0.25, CV 0.71); top-1 share "
        "of the selected weight 0.75 (layers 0.60-0.90; flat 0.50); stacked gate distance 1: top-1 62.5%, whole "
        "top-k 25.0% (8 predictions)"
    )
    assert rep.table() == (
        "| layer | freq min | freq max | top-1 share |\n|---|---|---|---|\n"
        "| 0 | 0.000 | 1.000 | 0.600 |\n| 1 | 0.250 | 0.250 | 0.900 |"
    )


def _counters(path: Path, prompt: str, n_predict: int) -> tuple[int, int, int]:
    """Distance-1 predictions, top-1 right, whole top-k right: the engine's counters for one generation
    with prefetch on and every expert cached."""
    from moetier import CacheConfig

    all_bytes = int(Model(path, cache=CacheConfig(budget="64G", warm=False)).cache_info()["expert_bytes"])
    m = Model(path, cache=CacheConfig.exact(all_bytes, prefetch=1, warm=False), n_ctx=1024)
    assert len(m.generate(prompt, max_tokens=n_predict).tokens) == n_predict
    pf = m.prefetch_stats()
    return int(pf.n_pred[0]), int(pf.n_top1[0]), int(pf.n_allk[0])


def test_routing_report_counts_the_trace_and_the_engine(tiny_model: ModelFactory) -> None:
    """Frequencies are each expert's share of the traced tokens (experts never picked at 0, so the row has
    every expert), the top-1 share is the mean of top-1 weight over the selected weights, and the stacked
    gate figures are the engine's own counters for the given prompt's generation."""
    from moetier.calibrate import CalibrateConfig, record_trace
    from moetier.tools.routing import routing_report

    path = tiny_model("qwen3moe", n_expert=16, n_expert_used=4, n_layer=3)
    rep = routing_report(path, LONG_PROMPT, tokens=3, prompts=["Sphinx of black quartz"], n_predict=6)
    trace = record_trace(path, LONG_PROMPT, CalibrateConfig(tokens=3))
    assert (rep.n_expert, rep.n_expert_used, rep.n_tokens) == (16, 4, 3)
    want = [[0.0] * 16 for _ in range(3)]
    for tok in trace.ids:
        for il, experts in enumerate(tok):
            for e in experts:
                want[il][int(e)] += 1 / 3
    assert np.allclose(rep.freq, want, rtol=0, atol=1e-12) and min(min(f) for f in rep.freq) == 0.0
    w = trace.weights.astype(np.float64)
    top1 = [np.mean([max(w[t, il]) / sum(w[t, il]) for t in range(3)]) for il in range(3)]
    assert rep.top1_share == pytest.approx(top1, rel=1e-12)
    n_pred, n_top1, n_allk = _counters(path, "Sphinx of black quartz", 6)
    assert n_pred == 2 * 5  # layers 0 and 1 predict the next layer at each of the 5 decoded tokens
    assert (rep.n_pred, rep.stacked_top1, rep.stacked_allk) == (n_pred, n_top1 / n_pred, n_allk / n_pred)


def test_routing_report_of_a_single_prediction(tiny_model: ModelFactory) -> None:
    """Two MoE layers and two generated tokens make one prediction: the accuracies are that prediction's
    counts, not halved."""
    from moetier.tools.routing import routing_report

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=2)
    assert _counters(path, "Sphinx", 2) == (1, 1, 1)
    rep = routing_report(path, LONG_PROMPT, tokens=4, prompts=["Sphinx"], n_predict=2)
    assert (rep.n_pred, rep.stacked_top1, rep.stacked_allk) == (1, 1.0, 1.0)


def test_routing_report_generates_in_a_1024_token_context(tiny_model: ModelFactory) -> None:
    """The generations run in a 1024-token context: after a long prompt they stop where it fills up."""
    from moetier.tools.routing import routing_report

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    prompt = (LONG_PROMPT * 8)[:1150]
    n = len(Model(path).tokenize(prompt))
    assert 1000 < n < 1024
    rep = routing_report(path, LONG_PROMPT, tokens=4, prompts=[prompt], n_predict=200)
    assert rep.n_pred == 2 * (1024 - n - 1)  # 1024 - n tokens generated, the first from the prompt's pass


def test_routing_report_prompts_default_to_four_slices_of_the_text(tiny_model: ModelFactory) -> None:
    """Without prompts, the generations start from four 400-character slices of the text, a quarter of
    its length apart (one character apart for a text under 8 characters)."""
    from moetier.tools.routing import routing_report

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    long = "".join(f"{i} {LONG_PROMPT[i % 40 :]}" for i in range(12))
    assert len(long) > 1600  # the last slice ends before the text does
    for text in (long, "Sphinx"):
        step = max(1, len(text) // 4)
        slices = [text[i * step : i * step + 400] for i in range(4)]
        got = routing_report(path, text, tokens=16, n_predict=3)
        assert got == routing_report(path, text, tokens=16, prompts=slices, n_predict=3)


def test_routing_report_defaults(tiny_model: ModelFactory) -> None:
    """By default the trace covers the first 4096 tokens of the text and each generation is 64 tokens."""
    from moetier.tools.routing import routing_report

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    rep = routing_report(path, LONG_PROMPT * 60, prompts=["abc"])  # 8400 tokens of text
    assert rep.n_tokens == 4096
    assert rep.n_pred == 2 * 63


def test_routing_report_leaves_no_warm_start_file(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """The report's models do not warm-start: nothing (no cache-state sidecar) is written beside the model."""
    import gc
    import shutil

    from moetier.tools.routing import routing_report

    path = Path(shutil.copy(tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3), tmp_path / "m.gguf"))
    routing_report(path, LONG_PROMPT, tokens=16, prompts=["abc"], n_predict=2)
    gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_routing_cli_prints_the_report_and_writes_its_json(
    tiny_model: ModelFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """moetier routing MODEL --text F --tokens N -n N -t N --json OUT: the summary, a blank line and the
    table on stdout, and the same report, every field, as JSON."""
    import json
    from dataclasses import asdict

    from moetier.tools.routing import RoutingReport, main, routing_report

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    text = tmp_path / "held-out.txt"
    text.write_text(LONG_PROMPT * 4)
    out = tmp_path / "r.json"
    assert main([str(path), "--text", str(text), "--tokens", "40", "-n", "3", "-t", "1", "--json", str(out)]) == 0
    got = RoutingReport(**json.loads(out.read_text()))
    assert got == routing_report(path, LONG_PROMPT * 4, tokens=40, n_predict=3, n_threads=1)
    assert got.n_tokens == 40
    assert capsys.readouterr().out == got.summary() + "\n\n" + got.table() + "\n"
    assert json.loads(out.read_text()) == asdict(got)
    assert out.read_text().startswith('{\n "n_expert": 8,\n "n_expert_used": 2,')  # indented by one


def test_routing_cli_defaults(tiny_model: ModelFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without flags the CLI traces 4096 tokens, generates 64 tokens per prompt, and writes no file."""
    from moetier.tools.routing import main

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    text = tmp_path / "held-out.txt"
    text.write_text(LONG_PROMPT * 60)  # 8400 tokens
    assert main([str(path), "--text", str(text)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("routing over 4096 tokens, top-2 of 8: selection frequency ")
    n_pred = int(out.split(" predictions)")[0].rsplit("(", 1)[1])
    assert n_pred > 0 and n_pred % (2 * 63) == 0  # two layers predicted at each of a generation's 63 decoded tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held-out.txt"]


def test_routing_cli_errors_and_help(
    tiny_model: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--text is required and must be readable (the error names the flag and the file); --help shows the
    module's description and every flag's help, word for word."""
    from moetier.tools.routing import main

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    out = text_flag_refusals_and_help(main, path, tmp_path, monkeypatch, capsys)
    assert "\n- per-layer expert selection frequency (the share of tokens that select each expert; top-k of E\n" in out
    helptext = " ".join(out.split())
    for s in (
        "usage: moetier routing [-h] --text TEXT [--tokens TOKENS] [-n N_PREDICT] [-t THREADS] [--json JSON] model",
        "model MoE GGUF",
        "--text TEXT text file to route (held-out text, not calibration text)",
        "--tokens TOKENS tokens of the trace (default: 4096)",
        "-n N_PREDICT, --n-predict N_PREDICT tokens per generation (default: 64)",
        "-t THREADS, --threads THREADS compute threads (default: the machine's cores, at most 8)",
        "--json JSON write the report as JSON here",
    ):
        assert s in helptext, s


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


def test_routing_report_counts_every_prompts_predictions(tiny_model: ModelFactory) -> None:
    """The stacked-gate figures cover the generations of every prompt, not only the last one."""
    from moetier.tools.routing import routing_report

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    one = routing_report(path, LONG_PROMPT, tokens=16, prompts=["hello world"], n_predict=5)
    both = routing_report(path, LONG_PROMPT, tokens=16, prompts=["abc", "hello world"], n_predict=5)
    assert both.n_pred == 2 * one.n_pred > 0


def test_distill_config_defaults_and_every_bound() -> None:
    """Distillation is off by default (0 epochs; 2 rounds, no residual target, Adam 1e-3 relative, 512-token
    steps, 10% held out, seed 0); each knob is checked at its edges, with a message naming it and its value."""
    assert dl.DistillConfig() == dl.DistillConfig(
        epochs=0, rounds=2, residual=0.0, lr=1e-3, batch_tokens=512, holdout=0.1, seed=0
    )
    for ok in (
        {"epochs": 0, "rounds": 1, "residual": 0.0, "batch_tokens": 1, "holdout": 1e-6, "lr": 1e-12},
        {"residual": 1.0, "holdout": 0.499, "lr": 1, "seed": 2**63 - 1},
    ):
        dl.DistillConfig(**ok)  # type: ignore[arg-type]
    bad: list[tuple[dict[str, object], str]] = [
        ({"epochs": True}, "distill.epochs: True is not a number"),
        ({"lr": "0.1"}, "distill.lr: '0.1' is not a number"),
        ({"seed": None}, "distill.seed: None is not a number"),
        ({"epochs": -1}, "distill.epochs: -1 must be >= 0"),
        ({"rounds": 0}, "distill.rounds: 0 must be >= 1"),
        ({"residual": -0.01}, "distill.residual: -0.01 must be in [0, 1]"),
        ({"residual": 1.01}, "distill.residual: 1.01 must be in [0, 1]"),
        ({"lr": 0}, "distill.lr: 0 must be > 0"),
        ({"lr": float("nan")}, "distill.lr: nan must be > 0"),
        ({"batch_tokens": 0}, "distill.batch_tokens: 0 must be >= 1"),
        ({"holdout": 0.0}, "distill.holdout: 0.0 must be in (0, 0.5)"),
        ({"holdout": 0.5}, "distill.holdout: 0.5 must be in (0, 0.5)"),
        ({"seed": -1}, "distill.seed: -1 must be an integer in [0, 2^63 - 1]"),
        ({"seed": 2**63}, f"distill.seed: {2**63} must be an integer in [0, 2^63 - 1]"),
        ({"seed": 0.5}, "distill.seed: 0.5 must be an integer in [0, 2^63 - 1]"),
    ]
    for kw, says in bad:
        with pytest.raises(ConfigError) as e:
            dl.DistillConfig(**kw)  # type: ignore[arg-type]
        assert str(e.value) == says


def test_moe_layer_arrays_and_copy() -> None:
    """arrays() gives the trained weights by name (the balancing bias apart); copy() copies every array and
    the bias, so training the copy leaves the original as it was."""
    rng = np.random.default_rng(3)
    layer = _random_layer(rng)
    assert list(layer.arrays()) == ["router", "gate_sh", "up_sh", "down_sh", "gate", "up", "down"]
    assert all(a is getattr(layer, n) for n, a in layer.arrays().items())
    twin = layer.copy()
    assert twin.bias is None
    for n, a in twin.arrays().items():
        assert np.array_equal(a, getattr(layer, n)) and not np.shares_memory(a, getattr(layer, n)), n
    layer.bias = np.array([0.5, -0.5, 0.0, 1.0])
    twin = layer.copy()
    assert twin.bias is not None and np.array_equal(twin.bias, layer.bias)
    twin.bias[0] = 9.0
    assert layer.bias[0] == 0.5


def test_sigmoid_and_softmax_values() -> None:
    """The logistic function (type kept) and llama.cpp's row-wise softmax, exact on small values and finite
    for logits far beyond exp's range."""
    a = np.array([-3.0, 0.0, 2.0], np.float32)
    s = dl._sigmoid(a)
    assert s.dtype == np.float32
    np.testing.assert_allclose(s, 1 / (1 + np.exp(-a.astype(np.float64))), rtol=1e-6)
    logits = np.array([[0.0, np.log(3.0)], [1.0, 1.0], [1000.0, 999.0]])
    p = dl.softmax(logits[:, :2])
    np.testing.assert_allclose(p, [[0.25, 0.75], [0.5, 0.5], [1 / (1 + np.exp(-1)), 1 / (1 + np.e)]], rtol=1e-12)
    wide = dl.softmax(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
    np.testing.assert_allclose(wide[0], np.exp([1.0, 2.0, 3.0]) / np.exp([1.0, 2.0, 3.0]).sum(), rtol=1e-12)
    np.testing.assert_allclose(wide[1], [1 / 3] * 3, rtol=1e-12)


def _routed_layer() -> tuple[dl.MoeLayer, np.ndarray]:
    """Four experts over three inputs: expert 1 never wins, expert 0 takes two tokens of four, 2 and 3 one
    each (top-1); random SwiGLU weights."""
    rng = np.random.default_rng(11)
    layer = _random_layer(rng, e=4, d=3, ff=2, n_sh=2)
    layer.router = np.array([[1.0, 0.0, 0.0], [-5.0, -5.0, -5.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    x = np.array([[3.0, 0.1, 0.2], [0.1, 3.0, 0.2], [0.2, 0.1, 3.0], [2.0, 0.3, 0.1]])
    return layer, x


def test_route_is_llama_cpp_top_k() -> None:
    """Top-k of the router's logits (ties to the lower expert), their softmax weights, and the whole softmax;
    with renorm the chosen weights sum to 1 and are all the scattered row has; the input's float type."""
    layer, x = _routed_layer()
    top, w, p = dl.route(layer, x, 2, False)
    assert top.tolist() == [[0, 3], [2, 3], [3, 0], [0, 2]]
    logits = x @ layer.router.T
    np.testing.assert_allclose(p, dl.softmax(logits), rtol=1e-12)
    np.testing.assert_allclose(w, np.take_along_axis(p, top, axis=1), rtol=1e-12)
    top_r, w_r, p_r = dl.route(layer, x, 2, True)
    assert np.array_equal(top_r, top)
    np.testing.assert_allclose(w_r, w / w.sum(axis=1, keepdims=True), rtol=1e-12)
    scattered = np.zeros_like(p)
    np.put_along_axis(scattered, top, w_r, axis=1)
    assert np.array_equal(p_r, scattered)
    tie = dl.MoeLayer(**{**layer.arrays(), "router": np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0]])})
    x2 = np.array([[1.0, 1.0], [-1.0, -1.0]], np.float32)
    t, w32, p32 = dl.route(tie, x2, 3, False)
    assert t.tolist() == [[0, 1, 2], [3, 0, 1]]
    assert w32.dtype == np.float32 and p32.dtype == np.float32
    # 64 experts with logits of three values: the order of the experts within a value is kept
    logit = np.random.default_rng(0).integers(0, 3, size=64).astype(np.float64)
    many = dl.MoeLayer(**{**layer.arrays(), "router": logit[:, None]})
    want = sorted(range(64), key=lambda e: (-logit[e], e))[:40]
    assert dl.route(many, np.ones((1, 1)), 40, False)[0].tolist() == [want]


def test_route_bias_moves_the_choice_not_the_weights() -> None:
    """A balancing bias is added to the softmax to choose the experts; the weights stay the softmax's."""
    layer, x = _routed_layer()
    x = x[:1]  # logits 3, -16.5, 0.1, 0.2
    layer.bias = np.array([0.0, 0.0, 0.99, 0.0])
    top, w, p = dl.route(layer, x, 2, False)
    assert top.tolist() == [[2, 0]]
    np.testing.assert_allclose(w, p[:, [2, 0]], rtol=1e-12)
    np.testing.assert_allclose(p, dl.softmax(x @ layer.router.T), rtol=1e-12)
    layer.bias = np.array([0.0, 0.0, -0.5, 0.2])
    assert dl.route(layer, x, 2, False)[0].tolist() == [[0, 3]]


def _forward_by_hand(layer: dl.MoeLayer, x: np.ndarray, k: int, renorm: bool, sh_gate: float) -> np.ndarray:
    """The MoE layer token by token: shared expert x sh_gate plus each chosen expert x its routing weight."""

    def swiglu(g: np.ndarray, u: np.ndarray, d: np.ndarray, v: np.ndarray) -> np.ndarray:
        a = g @ v
        return d @ (a / (1 + np.exp(-a)) * (u @ v))

    top, w, _ = dl.route(layer, x, k, renorm)
    out = np.zeros_like(x)
    for t, v in enumerate(x):
        out[t] = sh_gate * swiglu(layer.gate_sh, layer.up_sh, layer.down_sh, v)
        for j, e in enumerate(top[t]):
            out[t] += w[t, j] * swiglu(layer.gate[e], layer.up[e], layer.down[e], v)
    return out


@pytest.mark.parametrize(("k", "renorm"), [(1, False), (2, True)])
def test_forward_adds_each_chosen_expert_to_the_shared_one(k: int, renorm: bool) -> None:
    """forward: the shared expert (x sh_gate, 1 by default) plus every chosen expert's SwiGLU weighted by its
    routing weight, experts no token chose skipped, experts of one token included."""
    layer, x = _routed_layer()
    np.testing.assert_allclose(dl.forward(layer, x, k, renorm), _forward_by_hand(layer, x, k, renorm, 1.0), rtol=1e-12)
    np.testing.assert_allclose(
        dl.forward(layer, x, k, renorm, 0.5), _forward_by_hand(layer, x, k, renorm, 0.5), rtol=1e-12
    )


def test_relative_error_and_its_chunks() -> None:
    """relative_error: the mean over tokens of ||out - y|| / ||y|| (a zero target divides by 1e-8); rel_error
    runs the layer over any number of tokens (in chunks) with sh_gate 1 by default."""
    out = np.array([[3.0, 4.0], [1.0, 0.0], [2.0, 2.0]])
    y = np.array([[0.0, 4.0], [0.0, 0.0], [2.0, 2.0]])
    assert dl.relative_error(out, y) == pytest.approx((3 / 4 + 1 / 1e-8 + 0) / 3, rel=1e-12)
    rng = np.random.default_rng(4)
    layer = _random_layer(rng, e=4, d=3, ff=2, n_sh=2)
    x = rng.normal(size=(4100, 3))
    y = rng.normal(size=(4100, 3))
    for gate in (1.0, 0.5):
        want = dl.relative_error(dl.forward(layer, x, 2, True, gate), y)
        assert dl.rel_error(layer, x, y, 2, True, gate) == pytest.approx(want, rel=1e-12)
    assert dl.rel_error(layer, x, y, 2, True) == dl.rel_error(layer, x, y, 2, True, 1.0)
    assert dl.rel_error(layer, x, y, 2, True, 0.5) != dl.rel_error(layer, x, y, 2, True)


@pytest.mark.parametrize(("k", "renorm"), [(1, False), (2, True)])
def test_every_gradient_with_an_expert_left_out(k: int, renorm: bool) -> None:
    """With an expert no token chose (its gradients 0) and experts of one token, every element of every
    gradient matches central differences (sh_gate 1 by default); a zero target row weighs 1/1e-6."""
    layer, x = _routed_layer()
    y = np.random.default_rng(5).normal(size=x.shape)
    loss, grads = dl.loss_and_grads(layer, x, y, k, renorm)
    assert not grads["gate"][1].any() and not grads["up"][1].any() and not grads["down"][1].any()
    for name in dl.MoeLayer.NAMES:
        a = getattr(layer, name)
        num = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            old = a[i]
            a[i] = old + 1e-6
            lp, _ = dl.loss_and_grads(layer, x, y, k, renorm)
            a[i] = old - 1e-6
            lm, _ = dl.loss_and_grads(layer, x, y, k, renorm)
            a[i] = old
            num[i] = (lp - lm) / 2e-6
        np.testing.assert_allclose(grads[name], num, rtol=1e-5, atol=1e-8, err_msg=name)
    assert loss == pytest.approx(dl.loss_and_grads(layer, x, y, k, renorm, 1.0)[0], rel=1e-15)
    y[2] = 0.0
    out = dl.forward(layer, x, k, renorm)
    loss, _ = dl.loss_and_grads(layer, x, y, k, renorm)
    want = np.mean(((out - y) ** 2).sum(1) / ((y**2).sum(1) + 1e-6))
    assert loss == pytest.approx(want, rel=1e-12) and loss > 1e5


def test_gradients_keep_the_float_type() -> None:
    """float32 weights and activations give a float32 loss gradient for every weight (Adam updates in place)."""
    layer, x = _routed_layer()
    for n, a in layer.arrays().items():
        setattr(layer, n, a.astype(np.float32))
    y = np.random.default_rng(2).normal(size=x.shape).astype(np.float32)
    for renorm in (True, False):
        _, grads = dl.loss_and_grads(layer, x.astype(np.float32), y, 2, renorm)
        assert {n: g.dtype for n, g in grads.items()} == dict.fromkeys(dl.MoeLayer.NAMES, np.dtype(np.float32))


def _distill_by_hand(
    start: dl.MoeLayer, x: np.ndarray, y: np.ndarray, k: int, renorm: bool, cfg: dl.DistillConfig, sh_gate: float
) -> tuple[dl.MoeLayer, list[tuple[float, float]], int]:
    """distill_layer as its docstring and comments describe it, written out: the last tokens held out, Adam
    (0.9, 0.999) with a step per tensor of lr x its starting RMS (lr where it is all zeros), minibatches in a
    seeded order, a 20-step warm-up then cosine decay to 10%, the best held-out epoch kept."""
    n_hold = max(1, int(len(x) * cfg.holdout))
    xt, yt, xh, yh = x[:-n_hold], y[:-n_hold], x[-n_hold:], y[-n_hold:]

    def err(layer: dl.MoeLayer, x: np.ndarray, y: np.ndarray) -> float:
        return dl.rel_error(layer, x, y, k, renorm, sh_gate)

    layer = start.copy()
    lr = {n: cfg.lr * (np.sqrt(np.mean(a**2)) or 1.0) for n, a in layer.arrays().items()}
    m = {n: np.zeros_like(a) for n, a in layer.arrays().items()}
    v = {n: np.zeros_like(a) for n, a in layer.arrays().items()}
    rng = np.random.default_rng(cfg.seed)
    n_steps = cfg.epochs * -(-len(xt) // cfg.batch_tokens)
    best, best_err, best_epoch = start, err(start, xh, yh), 0
    history = [(err(start, xt[:2048], yt[:2048]), best_err)]
    step = 0
    for epoch in range(1, cfg.epochs + 1):
        order = rng.permutation(len(xt))
        for i in range(0, len(xt), cfg.batch_tokens):
            idx = np.sort(order[i : i + cfg.batch_tokens])
            _, grads = dl.loss_and_grads(layer, xt[idx], yt[idx], k, renorm, sh_gate)
            scale = min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 + np.cos(np.pi * step / n_steps)) / 2)
            t = step + 1
            for n, g in grads.items():
                m[n] = 0.9 * m[n] + 0.1 * g
                v[n] = 0.999 * v[n] + 0.001 * g * g
                update = lr[n] * scale * (m[n] / (1 - 0.9**t)) / (np.sqrt(v[n] / (1 - 0.999**t)) + 1e-12)
                setattr(layer, n, getattr(layer, n) - update)
            step += 1
        held = err(layer, xh, yh)
        history.append((err(layer, xt[:2048], yt[:2048]), held))
        if held < best_err:
            best, best_err, best_epoch = layer.copy(), held, epoch
    return best, history, best_epoch


@pytest.mark.parametrize(("renorm", "sh_gate"), [(True, None), (False, 0.5)])
def test_distill_layer_is_the_documented_schedule(renorm: bool, sh_gate: float | None) -> None:
    """The fitted layer, its per-epoch history (error on the first 2048 training tokens, on the held-out
    tail) and the best epoch are those of the schedule written out by hand, for either routing and a shared
    expert gate (1 by default); seeds give other orders."""
    rng = np.random.default_rng(6)
    teacher = _random_layer(rng, e=3, d=4, ff=2, n_sh=2)
    x = rng.normal(size=(2300, 4))  # 230 held out, 2070 trained on: 9 steps of 256 an epoch, 27 in all
    gate = 1.0 if sh_gate is None else sh_gate
    y = dl.forward(teacher, x, 2, renorm, gate)
    start = teacher.copy()
    start.gate = start.gate + 0.3 * rng.normal(size=start.gate.shape)
    start.up = np.zeros_like(start.up)  # a tensor of zeros steps by lr itself
    cfg = dl.DistillConfig(epochs=3, lr=2e-2, batch_tokens=256, seed=3)
    if sh_gate is None:
        res = dl.distill_layer(start, x, y, 2, renorm, cfg)
    else:
        res = dl.distill_layer(start, x, y, 2, renorm, cfg, sh_gate)
    layer, history, best_epoch = _distill_by_hand(start, x, y, 2, renorm, cfg, gate)
    for n, a in layer.arrays().items():
        np.testing.assert_allclose(getattr(res.layer, n), a, rtol=1e-9, atol=1e-15, err_msg=n)
    np.testing.assert_allclose(res.history, history, rtol=1e-9)
    assert (res.epochs_run, res.best_epoch, len(res.history)) == (3, best_epoch, 4)
    assert res.err_before == history[0][1] and res.err_after == pytest.approx(history[best_epoch][1], rel=1e-9)
    assert best_epoch > 0 and res.err_after < res.err_before
    other = dl.distill_layer(start, x, y, 2, renorm, replace(cfg, seed=4), gate)
    assert not np.array_equal(other.layer.gate, res.layer.gate)


def test_distill_layer_keeps_the_start_unless_an_epoch_is_better() -> None:
    """A start that already reproduces its targets stays the answer (best epoch 0, errors 0) however many
    epochs run; no epochs: the start back, judged on at least one held-out token."""
    rng = np.random.default_rng(8)
    start = _random_layer(rng, e=3, d=4, ff=2, n_sh=2)
    x = rng.normal(size=(300, 4))
    # the targets computed on the same rows as the fit sees them (270 trained on in one step, 30 held out)
    y = np.concatenate([dl.forward(start, x[:270], 2, True), dl.forward(start, x[270:], 2, True)])
    res = dl.distill_layer(start, x, y, 2, True, dl.DistillConfig(epochs=2))
    assert (res.best_epoch, res.epochs_run, res.err_before, res.err_after) == (0, 2, 0.0, 0.0)
    assert res.history == [(0.0, 0.0)] * 3
    assert all(np.array_equal(a, getattr(start, n)) for n, a in res.layer.arrays().items())
    y5 = rng.normal(size=(5, 4))
    res = dl.distill_layer(start, x[:5], y5, 2, True, dl.DistillConfig())  # 10% of 5 tokens: 1 held out
    assert (res.best_epoch, res.epochs_run) == (0, 0)
    assert res.err_before == res.err_after == dl.rel_error(start, x[4:5], y5[4:], 2, True)
    assert res.history == [(dl.rel_error(start, x[:4], y5[:4], 2, True), res.err_before)]


def test_routing_table_names_the_models_layers(tiny_model: ModelFactory) -> None:
    """Rows are labelled by the model's layer numbers (a MoE's first layers may be dense), not by position."""
    from moetier.tools.routing import routing_report

    rep = routing_report(tiny_model("deepseek", n_layer=3), LONG_PROMPT * 4, tokens=64, n_predict=2)
    assert rep.layers == [1, 2]  # its first layer is dense
    assert [line.split(" | ")[0] for line in rep.table().splitlines()[2:]] == ["| 1", "| 2"]
    assert [line.split(" | ")[0] for line in _report().table().splitlines()[2:]] == ["| 0", "| 1"]  # type: ignore[attr-defined]
