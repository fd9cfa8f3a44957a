"""moefy: a dense qwen2 GGUF becomes a qwen2moe GGUF that stock llama.cpp (and the cache) runs."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import LONG_PROMPT
from moetier import CacheConfig, ConfigError, Model, ModelError
from moetier.tools.moefy import MoefyConfig, moefy
from moetier.tools.tiny import write_tiny_model

CALIB = (LONG_PROMPT + " 0123456789 (){}[] <> +-*/=\n") * 12


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dense") / "dense.gguf", "qwen2", n_layer=2, n_ff_exp=512, seed=3)


def test_all_experts_active_equals_dense(dense: Path, tmp_path: Path) -> None:
    cfg = MoefyConfig(n_expert=4, n_expert_used=4, router_scale=0.0, refit=False, down_type="f16", calib_tokens=1024)
    out = tmp_path / "moe.gguf"
    errs = moefy(dense, out, CALIB, cfg, progress=False).errors
    assert max(errs) < 1e-5, "the split itself is lossless"
    d, m = Model(dense), Model(out)
    toks = d.tokenize(LONG_PROMPT)
    ld, lm = d.logits(toks), m.logits(toks)
    assert np.abs(ld - lm).max() < 1e-2 * np.abs(ld).max()  # f16 down projections
    assert d.generate(toks, max_tokens=16).tokens == m.generate(toks, max_tokens=16).tokens


def test_shapes_and_routing(dense: Path, tmp_path: Path) -> None:
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024)
    out = tmp_path / "moe.gguf"
    res = moefy(dense, out, CALIB, cfg, progress=False)
    assert all(0.0 < e < 0.5 for e in res.errors)
    assert res.errors == res.errors_plan, "no distillation asked, none done"
    r = gguf.GGUFReader(out)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    assert arch == "ernie4_5-moe"
    assert int(r.fields["ernie4_5-moe.expert_count"].parts[-1][0]) == 4
    assert int(r.fields["ernie4_5-moe.expert_used_count"].parts[-1][0]) == 2
    t = {x.name: x for x in r.tensors}
    ff_e = int(r.fields["ernie4_5-moe.expert_feed_forward_length"].parts[-1][0])
    n_sh = int(r.fields["ernie4_5-moe.expert_shared_feed_forward_length"].parts[-1][0])
    assert 4 * ff_e + n_sh == 512 and ff_e % 32 == 0 and n_sh >= 128
    assert [int(v) for v in t["blk.0.ffn_gate_exps.weight"].shape] == [64, ff_e, 4]
    assert [int(v) for v in t["blk.0.ffn_down_exps.weight"].shape] == [ff_e, 64, 4]
    assert t["blk.0.ffn_down_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert "blk.0.ffn_gate.weight" not in t

    # routing is real: different tokens pick different experts, and the cache agrees with stock
    m = Model(out, cache=CacheConfig.exact(budget="16M"))
    g = m.generate(LONG_PROMPT, max_tokens=16)
    stock = Model(out).generate(LONG_PROMPT, max_tokens=16)
    assert g.tokens == stock.tokens
    assert g.stats.n_misses >= 2 * 2, "more than one expert pair was read in each layer"
    router = np.asarray(t["blk.0.ffn_gate_inp.weight"].data, dtype=np.float32)
    assert router.std() > 0


def test_bad_config() -> None:
    with pytest.raises(ConfigError, match="n_expert_used"):
        MoefyConfig(n_expert=4, n_expert_used=5)


def test_rejects_moe_source(tmp_path: Path) -> None:
    from moetier import ModelError

    src = write_tiny_model(tmp_path / "moe.gguf", "qwen2moe")
    with pytest.raises(ModelError, match="converts qwen2 models"):
        moefy(src, tmp_path / "x.gguf", CALIB, progress=False)


def test_qwen2moe_target_still_available(dense: Path, tmp_path: Path) -> None:
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024, arch="qwen2moe")
    out = tmp_path / "moe.gguf"
    moefy(dense, out, CALIB, cfg, progress=False)
    r = gguf.GGUFReader(out)
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "qwen2moe"
    assert "blk.0.ffn_gate_inp_shexp.weight" in {t.name for t in r.tensors}
    m = Model(out)
    assert np.isfinite(m.logits(m.tokenize(LONG_PROMPT))).all()


def test_non_finite_logits_are_a_conversion_error(dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: a qwen2moe shared gate of exactly 0 makes llama.cpp's silu(z)/z 0/0 = NaN for
    every token; moefy's held-out check refuses the model and leaves no file behind."""
    import moetier.tools.moefy as mf

    monkeypatch.setattr(mf, "QWEN2MOE_SHEXP_GATE", 0.0)
    out = tmp_path / "moe.gguf"
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=512, arch="qwen2moe")
    with pytest.raises(ModelError, match="logits are not finite"):
        moefy(dense, out, CALIB, cfg, progress=False)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_builtin_calibration_text_mixes_prose_and_code() -> None:
    from moetier.tools.moefy import builtin_calibration_text

    text = builtin_calibration_text(60_000)
    assert len(text) == 60_000
    assert "statement" in text and "def " in text and "import " in text  # the language reference and sources
    # slice by slice: a topic of the language reference, then one of about 60 top-level stdlib sources
    import sysconfig
    from pydoc_data.topics import topics

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    step = max(1, len(files) // 60)
    names = sorted(topics)
    want = [topics[names[0]][:3000], files[0].read_text(errors="replace")[:3000]]
    want += [topics[names[1]][:3000], files[step].read_text(errors="replace")[:3000]]
    assert text.startswith("\n\n".join(want) + "\n\n")


def test_generated_prose_is_the_models_own_and_reproducible(dense: Path) -> None:
    """The dense model continues the prose prompts (sampled, one seed per text): the same model gives
    the same texts, enough of them for the token count asked, and they join the built-in text as a
    third stream."""
    from moetier.tools.moefy import PROSE_PROMPTS, builtin_calibration_text, generated_prose

    texts = generated_prose(dense, 300)
    assert texts == generated_prose(dense, 300)
    assert all(t.startswith(PROSE_PROMPTS[i % len(PROSE_PROMPTS)]) for i, t in enumerate(texts))
    m = Model(dense)
    assert sum(len(m.tokenize(t)) for t in texts) >= 300 - 2 * len(texts)  # BOS / joins aside
    extra = "\n\n".join(texts)
    mixed = builtin_calibration_text(20_000, extra=extra)
    assert extra[:200] in mixed and "def " in mixed


def test_collect_in_slices_equals_one_call(dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetier.tools import moefy as mf

    toks = Model(dense).tokenize(CALIB)[:1536]
    whole = mf._collect(dense, toks, 2, 2, None, ("ffn_norm", "l_out"))
    monkeypatch.setattr(mf, "COLLECT_SLICE", 512)  # three slices, written into the cached .npy files
    sliced = mf._collect(dense, toks, 2, 2, tmp_path / "acts", ("ffn_norm", "l_out"))
    for k in ("ffn_norm", "l_out"):
        for a, b in zip(whole[k], sliced[k], strict=True):
            assert a.shape == b.shape == (1536, a.shape[1])
            np.testing.assert_array_equal(a, b)
    assert not list((tmp_path / "acts").glob("*.tmp.npy"))
    again = mf._collect(dense, toks, 2, 2, tmp_path / "acts", ("ffn_norm", "l_out"))  # read back, not re-run
    np.testing.assert_array_equal(again["l_out"][1], whole["l_out"][1])


def test_refit_down_recovers_the_down_projections_of_a_layer() -> None:
    from moetier.tools.distill import MoeLayer, forward
    from moetier.tools.moefy import refit_down

    rng = np.random.default_rng(5)
    d, n_sh, E, ff_e, n = 16, 8, 4, 8, 4096

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    true = MoeLayer(r(E, d), r(n_sh, d), r(n_sh, d), r(d, n_sh), r(E, ff_e, d), r(E, ff_e, d), r(E, d, ff_e))
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = forward(true, x, 2, True)
    start = true.copy()
    start.down_sh, start.down = r(d, n_sh), r(E, d, ff_e)
    fit = refit_down(start, x, y, 2, True, 1.0, 1e-9)
    assert np.abs(fit.down - true.down).max() < 1e-3 and np.abs(fit.down_sh - true.down_sh).max() < 1e-3
    assert np.array_equal(fit.gate, true.gate) and np.array_equal(fit.router, true.router)
    # a strong ridge keeps the weights it started from
    kept = refit_down(start, x, y, 2, True, 1.0, 1e9)
    assert np.abs(kept.down - start.down).max() < 1e-4


def test_relative_fit_weights_keep_a_few_massive_tokens_from_taking_the_refit() -> None:
    # Qwen2.5's window starts carry FFN outputs ~100x the rest's; plain least squares then fits them
    # and leaves the ordinary tokens worse (bench/results/moefy-fitweight.md)
    from moetier.tools.distill import rel_error
    from moetier.tools.moefy import dense_ffn, layer_from_plan, plan_layer, token_weights

    rng = np.random.default_rng(7)
    d, ff, n = 32, 512, 4096
    wg, wu = (
        (rng.standard_normal((ff, d)) / np.sqrt(d)).astype(np.float32),
        (rng.standard_normal((ff, d)) / np.sqrt(d)).astype(np.float32),
    )
    wd = (rng.standard_normal((d, ff)) / np.sqrt(ff)).astype(np.float32)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[::256] *= 8.0  # massive tokens, ~60x the FFN output of the rest
    held = rng.standard_normal((1024, d)).astype(np.float32)
    errs = {}
    for how in ("uniform", "relative"):
        cfg = MoefyConfig(n_expert=4, n_expert_used=2, fit_weight=how)
        pl = plan_layer(x, wg, wu, wd, cfg, np.random.default_rng(0))
        errs[how] = rel_error(layer_from_plan(pl, wg, wu), held, dense_ffn(held, wg, wu, wd), 2, True, 1.0)
    assert errs["relative"] < 0.95 * errs["uniform"], errs
    w = token_weights(np.array([[3.0, 4.0], [0.0, 0.0], [30.0, 40.0]], dtype=np.float32), "relative")
    assert w is not None and w[0, 0] == pytest.approx(0.2) and w[2, 0] == pytest.approx(0.02) and np.isfinite(w).all()
    with pytest.raises(ConfigError, match="fit_weight"):
        MoefyConfig(fit_weight="huber")


def _random_ffn(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """FFN inputs x [2048, 32] and a random SwiGLU FFN of 512 neurons: gate, up [512, 32], down [32, 512]."""
    rng = np.random.default_rng(seed)
    d, ff, n = 32, 512, 2048
    wg, wu = ((rng.standard_normal((ff, d)) / np.sqrt(d)).astype(np.float32) for _ in range(2))
    wd = (rng.standard_normal((d, ff)) / np.sqrt(ff)).astype(np.float32)
    return rng.standard_normal((n, d)).astype(np.float32), wg, wu, wd


def test_cluster_features_each_split_the_routed_neurons_into_equal_experts() -> None:
    from moetier.tools.moefy import plan_layer

    x, wg, wu, wd = _random_ffn(3)
    ff = wg.shape[0]
    splits = {}
    for how in ("abs", "token", "binary"):
        pl = plan_layer(
            x, wg, wu, wd, MoefyConfig(n_expert=4, n_expert_used=2, cluster_features=how), np.random.default_rng(0)
        )
        cover = np.concatenate([pl.shared, pl.groups.ravel()])
        assert pl.groups.shape == (4, 64) and np.array_equal(np.sort(cover), np.arange(ff)), how
        splits[how] = {frozenset(g.tolist()) for g in pl.groups}
    assert splits["abs"] != splits["binary"] and splits["abs"] != splits["token"], "the features decide the clusters"
    # conversions cached before the knob existed (the demo's model, plan layers) keep their names
    from moetier.tools.moefy import cache_key, key_fields

    assert "cluster_features" not in key_fields(MoefyConfig())
    assert cache_key(key_fields(MoefyConfig())) != cache_key(key_fields(MoefyConfig(cluster_features="token")))
    with pytest.raises(ConfigError, match="cluster_features"):
        MoefyConfig(cluster_features="signed")


def test_correction_round_brings_the_logits_toward_dense(dense: Path, tmp_path: Path) -> None:
    base = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024, down_type="f16")
    plain, corrected = tmp_path / "plain.gguf", tmp_path / "corr.gguf"
    moefy(dense, plain, CALIB, base, progress=False, work_dir=tmp_path / "w")
    cfg = MoefyConfig(**{**base.__dict__, "correct_rounds": 1, "correct_share": 1.0})
    res = moefy(dense, corrected, CALIB, cfg, progress=False, work_dir=tmp_path / "w")
    assert "correction round 1" in res.seconds and res.errors != res.errors_plan
    d = Model(dense)
    toks = d.tokenize(CALIB)[:512]
    ld = d.logits(toks)
    err = [float(np.abs(Model(p).logits(toks) - ld).mean()) for p in (plain, corrected)]
    assert err[1] < err[0], f"mean |logit - dense| plain {err[0]:.4f}, corrected {err[1]:.4f}"
    # resumed from the work dir: the same weights again, with no collection
    again = tmp_path / "again.gguf"
    res2 = moefy(dense, again, CALIB, cfg, progress=False, work_dir=tmp_path / "w")
    assert res2.errors == res.errors
    assert again.read_bytes() == corrected.read_bytes()
    with pytest.raises(ConfigError, match="correct_share"):
        MoefyConfig(correct_share=1.5)


def _kept_energy(pl: object, x: np.ndarray, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray, k: int) -> float:
    """Share of the routed neurons' output energy (each token's relative to its total) in the experts
    the plan's router selects."""
    from moetier.tools.moefy import LayerPlan, _silu

    assert isinstance(pl, LayerPlan)
    h = _silu(x @ wg.T) * (x @ wu.T)
    routed = np.sort(pl.groups.ravel())
    energy = np.square(h[:, routed]) * np.square(np.linalg.norm(wd[:, routed], axis=0))
    energy /= energy.sum(axis=1, keepdims=True)
    top = np.argsort(-(x @ pl.router.T), axis=1)[:, :k]
    where = np.searchsorted(routed, pl.groups)  # [E, ff_e] columns of energy
    kept = sum(energy[np.nonzero(top == e)[0]][:, where[e]].sum() for e in range(pl.groups.shape[0]))
    return float(kept / energy.sum())


def test_split_rounds_move_neurons_to_the_experts_their_tokens_select() -> None:
    from moetier.tools.moefy import cache_key, key_fields, plan_layer

    x, wg, wu, wd = _random_ffn(5)
    ff = wg.shape[0]
    kept, splits = {}, {}
    for rounds in (0, 2):
        cfg = MoefyConfig(n_expert=4, n_expert_used=2, split_rounds=rounds)
        pl = plan_layer(x, wg, wu, wd, cfg, np.random.default_rng(0))
        cover = np.concatenate([pl.shared, pl.groups.ravel()])
        assert pl.groups.shape == (4, 64) and np.array_equal(np.sort(cover), np.arange(ff)), rounds
        kept[rounds], splits[rounds] = _kept_energy(pl, x, wg, wu, wd, 2), {frozenset(g.tolist()) for g in pl.groups}
    assert splits[0] != splits[2]
    assert kept[2] > kept[0] + 0.01, kept
    # the default stays out of the cache keys (conversions cached before the knob keep their names)
    assert "split_rounds" not in key_fields(MoefyConfig())
    assert cache_key(key_fields(MoefyConfig())) != cache_key(key_fields(MoefyConfig(split_rounds=1)))
    with pytest.raises(ConfigError, match="split_rounds"):
        MoefyConfig(split_rounds=-1)


def test_dense_lead_keeps_the_first_layers_dense(dense: Path, tmp_path: Path) -> None:
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024, dense_lead=1)
    out = tmp_path / "moe.gguf"
    res = moefy(dense, out, CALIB, cfg, progress=False)
    assert res.errors[1] > 0.0
    assert res.summary().endswith("; layer 0 dense") and res.summary().count("calibration tokens") == 1
    r = gguf.GGUFReader(out)
    assert int(r.fields["ernie4_5-moe.leading_dense_block_count"].parts[-1][0]) == 1
    t = {x.name: x for x in r.tensors}
    src = {x.name: x for x in gguf.GGUFReader(dense).tensors}
    for p in ("gate", "up", "down"):
        assert np.array_equal(
            np.asarray(t[f"blk.0.ffn_{p}.weight"].data), np.asarray(src[f"blk.0.ffn_{p}.weight"].data)
        )
        assert f"blk.0.ffn_{p}_exps.weight" not in t and f"blk.1.ffn_{p}_exps.weight" in t
        assert f"blk.1.ffn_{p}.weight" not in t
    # the cache serves the MoE layers and leaves the dense one alone: the same tokens as stock
    m = Model(out, cache=CacheConfig.exact(budget="16M"))
    g = m.generate(LONG_PROMPT, max_tokens=16)
    assert g.tokens == Model(out).generate(LONG_PROMPT, max_tokens=16).tokens
    assert g.stats.n_misses >= 2
    # the plans do not depend on it (each layer is planned on the dense inputs); the default stays out of keys
    from moetier.tools.moefy import _plan_fields, key_fields

    assert _plan_fields(cfg) == _plan_fields(MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024))
    assert "dense_lead" not in key_fields(MoefyConfig()) and "dense_lead" in key_fields(cfg)
    with pytest.raises(ConfigError, match="dense_lead"):
        MoefyConfig(dense_lead=1, arch="qwen2moe")
    with pytest.raises(ConfigError, match="dense_lead"):
        moefy(dense, tmp_path / "none.gguf", CALIB, MoefyConfig(calib_tokens=1024, dense_lead=2), progress=False)


def test_moefy_cli_writes_a_report_and_takes_the_split_knobs(dense: Path, tmp_path: Path) -> None:
    import json

    from moetier.cli import main

    calib, out, rep = tmp_path / "calib.txt", tmp_path / "moe.gguf", tmp_path / "report.json"
    calib.write_text(CALIB)
    args = ["moefy", str(dense), "-o", str(out), "--calib", str(calib), "--n-expert", "4", "--n-expert-used", "2"]
    args += ["--calib-tokens", "1024", "--dense-lead", "1", "--split-rounds", "1", "--report", str(rep), "-q"]
    assert main(args) == 0
    r = json.loads(rep.read_text())
    assert r["config"]["dense_lead"] == 1 and r["config"]["split_rounds"] == 1 and r["output"] == str(out)
    assert r["errors"][0] == 0.0 and 0.0 < r["errors"][1] < 0.5 and r["dense_lead"] == 1
    assert r["seconds"]["total"] > 0


def test_swap_improve_finds_the_best_balanced_assignment_where_greedy_does_not() -> None:
    from itertools import combinations

    from moetier.tools.moefy import _balanced_assign, _swap_improve

    # two columns: greedy gives row 0 its best column first and is then stuck; exchanges are exact here
    score = np.array([[10.0, 9.9], [9.0, 0.0], [8.0, 0.0], [0.0, 1.0]])
    greedy = _balanced_assign(score, 2)
    best = _swap_improve(score, greedy)
    # greedy: rows 0, 1 -> column 0 (10 + 9), rows 3, 2 -> column 1 (1 + 0); best: rows 1, 2 -> 0, rows 0, 3 -> 1
    assert np.isclose(score[np.arange(4), greedy].sum(), 20.0)
    assert np.isclose(score[np.arange(4), best].sum(), 27.9) and best.tolist() == [1, 0, 0, 1]
    rng = np.random.default_rng(1)
    for _ in range(20):
        s = rng.gamma(0.5, 1.0, (10, 1)) * rng.random((10, 2)) ** 3
        a = _swap_improve(s, _balanced_assign(s, 5))
        assert np.bincount(a, minlength=2).tolist() == [5, 5]
        rest = [[i for i in range(10) if i not in c] for c in combinations(range(10), 5)]
        opt = max(s[list(c), 0].sum() + s[r, 1].sum() for c, r in zip(combinations(range(10), 5), rest, strict=True))
        assert np.isclose(s[np.arange(10), a].sum(), opt)
    # more columns: balanced, never worse than greedy
    s = rng.gamma(0.5, 1.0, (64, 1)) * rng.random((64, 4)) ** 3
    g = _balanced_assign(s, 16)
    a = _swap_improve(s, g)
    assert np.bincount(a, minlength=4).tolist() == [16] * 4
    assert s[np.arange(64), a].sum() >= s[np.arange(64), g].sum()


def test_correction_rounds_run_the_model_with_its_dense_layers(dense: Path, tmp_path: Path) -> None:
    """Round 1 runs the planned model: with a dense layer it is another model than the all-MoE one, whose
    activations a shared work dir already holds."""
    work = tmp_path / "w"
    for lead, balance in ((0, 0.0), (1, 0.0), (0, 1.0)):
        cfg = MoefyConfig(
            n_expert=4, n_expert_used=2, calib_tokens=1024, correct_rounds=1, dense_lead=lead, balance=balance
        )
        moefy(dense, tmp_path / f"moe{lead}-{balance}.gguf", CALIB, cfg, progress=False, work_dir=work)
    # ... and with a balance too (its biased choice changes every later layer's inputs)
    assert len(list(work.rglob("correct-acts-*-r1"))) == 3


def test_selection_bias_reaches_its_target_frequencies() -> None:
    from moetier.tools.moefy import fit_selection_bias, selection_freq

    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4096, 8)).astype(np.float32) + np.linspace(-1.5, 1.5, 8, dtype=np.float32)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    k = 3
    f0 = selection_freq(p, k)
    assert f0.min() < 0.15 and f0.max() > 0.7, "skewed: the last experts are the router's favourites"
    for beta in (0.5, 1.0):
        target = (1 - beta) * f0 + beta * k / 8
        b = fit_selection_bias(p, k, target)
        f = selection_freq(p, k, b)
        assert np.abs(f - target).max() < 4 / 4096, (beta, f, target)
        assert abs(float(b.mean())) < 1e-6


def test_balance_writes_a_selection_bias_that_stock_the_cache_and_the_prefetch_follow(
    dense: Path, tmp_path: Path
) -> None:
    from moetier.calibrate import CalibrateConfig, record_trace
    from moetier.tools.moefy import _plan_fields, key_fields

    base = dict(n_expert=4, n_expert_used=2, calib_tokens=1024)
    freqs, errs = {}, {}
    for beta in (0.0, 1.0):
        out = tmp_path / f"moe{beta}.gguf"
        res = moefy(dense, out, CALIB, MoefyConfig(**base, balance=beta), progress=False, work_dir=tmp_path / "w")
        errs[beta] = res.errors_held_out
        t = {x.name: x for x in gguf.GGUFReader(out).tensors}
        assert ("blk.1.exp_probs_b.bias" in t) == (beta > 0)
        tr = record_trace(out, CALIB, CalibrateConfig(tokens=1024, seq_len=512))
        freqs[beta] = np.stack([np.bincount(tr.ids[:, i].ravel(), minlength=4) / len(tr.ids) for i in range(2)])
        # the cache follows the biased choice exactly
        m = Model(out, cache=CacheConfig.exact(budget="16M"))
        assert m.generate(LONG_PROMPT, max_tokens=16).tokens == Model(out).generate(LONG_PROMPT, max_tokens=16).tokens
    # llama.cpp's own choice on the calibration text is uniform (the fit is to the float64 softmax)
    assert np.abs(freqs[1.0] - 0.5).max() < 0.02 < np.abs(freqs[0.0] - 0.5).max(), freqs
    assert errs[1.0] and all(0.0 < e < 0.6 for e in errs[1.0])
    # the plans are shared (the balance is a step after them); the default stays out of keys
    assert _plan_fields(MoefyConfig(**base, balance=1.0)) == _plan_fields(MoefyConfig(**base))
    assert len(list((tmp_path / "w").rglob("plan-*"))) == 1
    assert "balance" not in key_fields(MoefyConfig()) and "balance" in key_fields(MoefyConfig(balance=0.5))
    with pytest.raises(ConfigError, match="balance"):
        MoefyConfig(balance=0.5, arch="qwen2moe")
    for bad in (dict(balance=1.5), dict(balance=0.5, n_expert=4, n_expert_used=4)):
        with pytest.raises(ConfigError, match="balance"):
            MoefyConfig(**bad)

    # the prefetcher chooses as the model does: a bias of 1.05 forces experts 0 and 1 in every layer
    # (the softmax lies in [0, 1]), so its stacked-router predictions of the whole top-k set are all
    # right (from the logits alone, without the bias, some are not)
    forced = tmp_path / "forced.gguf"
    forced.write_bytes((tmp_path / "moe1.0.gguf").read_bytes())
    for x in gguf.GGUFReader(forced, "r+").tensors:
        if x.name.endswith("exp_probs_b.bias"):
            x.data[:] = np.array([1.05, 1.05, 0.0, 0.0], dtype=np.float32)
    stock = Model(forced)
    toks = stock.tokenize(LONG_PROMPT)
    lo = int(Model(forced, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    m = Model(forced, cache=CacheConfig.exact(budget=lo * 3 // 2, prefetch=1, prefetch_gate=False))
    assert m.generate(toks, max_tokens=24).tokens == stock.generate(toks, max_tokens=24).tokens
    p = m.prefetch_stats()
    assert p.n_pred[0] > 0 and p.n_allk[0] == p.n_pred[0], p


def test_an_interrupted_conversion_keeps_the_old_model(
    dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or a full disk) while the converted model is written: the model converted before is
    left whole and no partial file (as large as the model) stays beside it."""
    import moetier.tools.moefy as mf

    out = tmp_path / "moe.gguf"
    out.write_bytes(b"the model converted before")
    write_moe = mf._write_moe

    def interrupted(*a: object, **k: object) -> None:
        write_moe(*a, **k)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(mf, "_write_moe", interrupted)
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=512, arch="qwen2moe")
    with pytest.raises(KeyboardInterrupt):
        moefy(dense, out, CALIB, cfg, progress=False)
    assert out.read_bytes() == b"the model converted before"
    assert [p.name for p in tmp_path.iterdir()] == ["moe.gguf"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_expert": 1, "n_expert_used": 1}, "moefy.n_expert: 1 must be >= 2"),
        ({"shared_frac": 1.0}, "moefy.shared_frac: 1.0 must be in [0, 1)"),
        ({"shared_frac": -0.1}, "moefy.shared_frac: -0.1 must be in [0, 1)"),
        ({"calib_tokens": True}, "moefy.calib_tokens: True must be an integer of at least 512 (one collection window)"),
        ({"calib_tokens": 511}, "moefy.calib_tokens: 511 must be an integer of at least 512"),
        ({"calib_tokens": 600.0}, "moefy.calib_tokens: 600.0 must be an integer"),
        ({"router_ridge": float("nan")}, "moefy.router_ridge: nan must be a finite number, 0 or more"),
        ({"refit_ridge": float("inf")}, "moefy.refit_ridge: inf must be a finite number, 0 or more"),
        ({"router_scale": -0.5}, "moefy.router_scale: -0.5 must be a finite number, 0 or more"),
        ({"arch": "llama"}, "moefy.arch: 'llama' must be one of ernie4_5-moe, qwen2moe"),
        ({"correct_rounds": -1}, "moefy: correct_rounds -1 must be >= 0 and correct_share"),
        ({"correct_share": 1.5}, "moefy: correct_rounds 0 must be >= 0 and correct_share 1.5 in [0, 1]"),
        ({"dense_lead": -1}, "moefy.dense_lead: -1 must be >= 0, and 0 for ernie4_5-moe"),
        ({"dense_lead": 1, "arch": "qwen2moe"}, "moefy.dense_lead: 1 must be >= 0, and 0 for qwen2moe"),
        ({"split_rounds": -1}, "moefy.split_rounds: -1 must be >= 0"),
        ({"balance": 1.5}, "moefy.balance: 1.5 must be in [0, 1]"),
        ({"balance": 0.25, "arch": "qwen2moe"}, "moefy.balance: must be 0 for qwen2moe"),
        (
            {"balance": 0.25, "n_expert": 4, "n_expert_used": 4},
            "moefy.balance: 0.25 needs a choice to even out: top-4 of 4 selects every expert",
        ),
        (
            {"router_scale": 0.0, "n_expert": 4, "n_expert_used": 2},
            "moefy.router_scale: 0 routes every token to "
            "the same 2 of 4 experts (all router logits 0); it needs every expert active (n_expert_used = "
            "n_expert), or use a small positive scale for flat weights",
        ),
        ({"seed": -1}, "moefy.seed: -1 must be an integer in [0, 2^63 - 1]"),
        ({"seed": 2**63}, f"moefy.seed: {2**63} must be an integer in [0, 2^63 - 1]"),
        ({"seed": 1.5}, "moefy.seed: 1.5 must be an integer"),
        ({"down_type": "q4_0"}, "moefy.down_type: 'q4_0' must be q8_0 or f16"),
    ],
)
def test_config_checks_name_the_field(kwargs: dict[str, object], message: str) -> None:
    """Each check of MoefyConfig refuses its own bad value with the field and the value named, and the
    limits themselves are accepted."""
    with pytest.raises(ConfigError) as err:
        MoefyConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_config_limits_accepted() -> None:
    MoefyConfig(n_expert=2, n_expert_used=1, shared_frac=0.0, calib_tokens=512, router_ridge=0.0, refit_ridge=0.0)
    MoefyConfig(correct_rounds=0, correct_share=0.0, split_rounds=0, balance=0.0, dense_lead=0, arch="qwen2moe")
    MoefyConfig(correct_share=1.0, balance=1.0, down_type="f16", seed=2**63 - 1)
    MoefyConfig(n_expert=4, n_expert_used=4, router_scale=0.0)


def _partition(tmp_path: Path, n_ff: int = 256, n_expert: int = 4, n_layer: int = 2) -> tuple[Path, MoefyConfig]:
    from moetier.tools.moefy import write_partition

    cfg = MoefyConfig(n_expert=n_expert, n_expert_used=2)
    rng = np.random.default_rng(0)
    splits: list[tuple[np.ndarray, np.ndarray] | None] = []
    for _ in range(n_layer):
        perm = rng.permutation(n_ff).astype(np.int64)
        n_sh = n_ff - n_expert * 32
        splits.append((perm[:n_sh], perm[n_sh:].reshape(n_expert, 32)))
    path = tmp_path / "part.npz"
    write_partition(path, splits, n_ff, cfg, "base.gguf")  # type: ignore[arg-type]
    return path, cfg


def test_partition_round_trip(tmp_path: Path) -> None:
    from moetier.tools.moefy import read_partition

    path, cfg = _partition(tmp_path)
    assert path.exists() and not (tmp_path / "part.npz.npz").exists()
    got = read_partition(path, 2, 256, cfg)
    assert len(got) == 2
    import json

    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
    assert meta["source"] == "base.gguf" and meta["format"] == "moetier-moefy-partition-1"
    for sp in got:
        assert sp is not None
        shared, groups = sp
        assert groups.shape == (4, 32) and shared.shape == (128,)
        assert sorted(np.concatenate([shared, groups.reshape(-1)]).tolist()) == list(range(256))


def _rewrite(path: Path, drop: str = "", **replace: object) -> None:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k != drop}
    arrays.update(replace)  # type: ignore[arg-type]
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def _meta(**changes: object) -> np.ndarray:
    import json

    meta = {"format": "moetier-moefy-partition-1", "source": "base.gguf", "n_layer": 2, "n_ff": 256}
    meta |= {"n_expert": 4, "dense_lead": 0}
    meta |= changes
    return np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ({"drop": "meta"}, "not a moefy partition (no meta record)"),
        ({"meta": np.frombuffer(b"{no json", dtype=np.uint8)}, "not a moefy partition (no meta record)"),
        ({"meta": _meta(format="other-2")}, "format 'other-2', expected moetier-moefy-partition-1"),
        ({"meta": _meta(n_layer=3)}, "n_layer 3 in the partition (of base.gguf), 2 here"),
        ({"meta": _meta(n_ff=512)}, "n_ff 512 in the partition (of base.gguf), 256 here"),
        ({"meta": _meta(n_expert=8)}, "n_expert 8 in the partition (of base.gguf), 4 here"),
        ({"meta": _meta(dense_lead=1)}, "dense_lead 1 in the partition (of base.gguf), 0 here"),
        ({"drop": "groups_1"}, "layer 1 is missing"),
        ({"drop": "shared_0"}, "layer 0 is missing"),
        ({"groups_1": np.arange(128, dtype=np.int64)}, "layer 1: groups of shape (128,), need [4, a multiple of 32]"),
        (
            {"groups_0": np.arange(128, dtype=np.int64).reshape(2, 64)},
            "layer 0: groups of shape (2, 64), need [4, a multiple of 32]",
        ),
        (
            {"groups_0": np.arange(120, dtype=np.int64).reshape(4, 30)},
            "layer 0: groups of shape (4, 30), need [4, a multiple of 32]",
        ),
        (
            {"shared_1": np.zeros(128, dtype=np.int64)},
            "layer 1: the shared and expert neurons are not each of the 256 neurons once",
        ),
    ],
)
def test_partition_errors_name_the_file(tmp_path: Path, damage: dict[str, object], problem: str) -> None:
    from moetier.tools.moefy import read_partition

    path, cfg = _partition(tmp_path)
    drop = str(damage.pop("drop", ""))
    _rewrite(path, drop, **damage)
    with pytest.raises(ConfigError) as err:
        read_partition(path, 2, 256, cfg)
    assert str(err.value) == f"{path}: {problem}"


def test_partition_unreadable_names_the_file(tmp_path: Path) -> None:
    from moetier.tools.moefy import read_partition

    cfg = MoefyConfig(n_expert=4, n_expert_used=2)
    with pytest.raises(ConfigError, match=r"missing\.npz: not a moefy partition \(") as err:
        read_partition(tmp_path / "missing.npz", 2, 256, cfg)
    assert "No such file" in str(err.value)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(ConfigError, match=r"junk\.npz: not a moefy partition \("):
        read_partition(junk, 2, 256, cfg)


def test_partition_with_dense_lead_skips_those_layers(tmp_path: Path) -> None:
    from moetier.tools.moefy import read_partition, write_partition

    cfg = MoefyConfig(n_expert=4, n_expert_used=2, dense_lead=1)
    perm = np.random.default_rng(1).permutation(256).astype(np.int64)
    path = tmp_path / "p.npz"
    write_partition(path, [None, (perm[:128], perm[128:].reshape(4, 32))], 256, cfg, "b.gguf")
    got = read_partition(path, 2, 256, cfg)
    assert got[0] is None and got[1] is not None
    assert np.array_equal(got[1][0], perm[:128])


def test_short_calibration_and_exclusive_modes_refused(dense: Path, tmp_path: Path) -> None:
    """Too little calibration text, and correction rounds with distillation, are refused before any
    activation is collected, and nothing is written."""
    from moetier.tools.distill import DistillConfig

    out = tmp_path / "moe.gguf"
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024)
    with pytest.raises(ConfigError, match=r"^moefy: calibration text gives \d+ tokens; need at least 512$") as err:
        moefy(dense, out, "a few words", cfg, progress=False, work_dir=tmp_path / "w")
    assert int(str(err.value).split()[4]) < 512
    with pytest.raises(ConfigError, match=r"^moefy: correction rounds and distillation are alternatives; ask for one$"):
        moefy(
            dense,
            out,
            CALIB,
            MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024, correct_rounds=1),
            distill=DistillConfig(epochs=1),
            progress=False,
            work_dir=tmp_path / "w",
        )
    assert not out.exists() and not (tmp_path / "w").exists()


def test_plan_refuses_an_ffn_too_small_for_the_experts() -> None:
    from moetier.tools.moefy import plan_layer

    rng = np.random.default_rng(0)
    d, ff = 16, 96
    x = rng.standard_normal((64, d)).astype(np.float32)
    wg, wu = (rng.standard_normal((ff, d)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((d, ff)).astype(np.float32)
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, shared_frac=0.0)
    msg = "moefy: FFN of 96 neurons is too small for 4 experts with shared_frac 0.0"
    with pytest.raises(ConfigError) as err:
        plan_layer(x, wg, wu, wd, cfg, rng)
    assert str(err.value) == msg
    # 128 neurons make 4 experts of 32 with nothing shared
    wg, wu = (rng.standard_normal((128, d)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((d, 128)).astype(np.float32)
    pl = plan_layer(x, wg, wu, wd, cfg, rng)
    assert pl.groups.shape == (4, 32) and len(pl.shared) == 0


def test_tied_output_embedding_is_written_out(dense: Path, tmp_path: Path) -> None:
    """A dense model whose output projection is its token embedding (Qwen2.5-0.5B ties them) gets an
    explicit output.weight, equal to the embedding, and with every expert active it answers as the dense
    model does."""
    from moetier.tools.moefy import _kv_copy

    tied = tmp_path / "tied.gguf"
    reader = gguf.GGUFReader(dense)
    writer = gguf.GGUFWriter(tied, "qwen2")
    _kv_copy(reader, writer, "qwen2", "qwen2")
    for t in reader.tensors:
        if t.name != "output.weight":
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "moe.gguf"
    cfg = MoefyConfig(n_expert=4, n_expert_used=4, router_scale=0.0, refit=False, down_type="f16", calib_tokens=1024)
    moefy(tied, out, CALIB, cfg, progress=False)
    t = {x.name: x for x in gguf.GGUFReader(out).tensors}
    src = {x.name: x for x in gguf.GGUFReader(tied).tensors}
    assert "output.weight" not in src
    assert t["output.weight"].tensor_type == src["token_embd.weight"].tensor_type
    assert np.array_equal(np.asarray(t["output.weight"].data), np.asarray(src["token_embd.weight"].data))
    d, m = Model(tied), Model(out)
    toks = d.tokenize(LONG_PROMPT)
    assert d.generate(toks, max_tokens=12).tokens == m.generate(toks, max_tokens=12).tokens


def test_quantize_like_keeps_the_source_type() -> None:
    """Distilled gate/up weights go back to their source's type: float types as arrays of that type,
    block types as ggml rows (q8_0 bit for bit as gguf-py quantizes it; a k-quant close to the input,
    its rows shaped like the input's leading axes)."""
    from moetier.tools.moefy import _ggml_type_name, _quantize_like

    qt = gguf.GGMLQuantizationType
    assert [_ggml_type_name(t) for t in (qt.Q4_K, qt.Q6_K, qt.Q8_0, qt.F16, qt.Q4_0)] == [
        "q4_K",
        "q6_K",
        "q8_0",
        "f16",
        "q4_0",
    ]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 256)).astype(np.float32)
    imat = np.abs(rng.standard_normal(256)).astype(np.float32) + 0.1
    f32 = _quantize_like(a, qt.F32, imat)
    assert f32.dtype == np.float32 and np.array_equal(f32, a)
    f16 = _quantize_like(a, qt.F16, imat)
    assert f16.dtype == np.float16 and np.array_equal(f16, a.astype(np.float16))
    q8 = _quantize_like(a, qt.Q8_0, imat)
    assert q8.shape == (2, 3, 256 // 32 * 34)
    assert np.array_equal(q8.reshape(6, -1), gguf.quants.quantize(a.reshape(6, 256), qt.Q8_0))
    q4 = _quantize_like(a, qt.Q4_K, imat)
    assert q4.shape == (2, 3, 144)
    back = gguf.quants.dequantize(q4.reshape(6, -1), qt.Q4_K).reshape(a.shape)
    assert 0 < np.abs(back - a).mean() < 0.15 * np.abs(a).mean()


@pytest.mark.parametrize(
    ("arrays", "problem"),
    [
        (
            {"meta": np.frombuffer(b"[1, 2]", dtype=np.uint8)},
            "not a moefy partition (its meta record is not an object)",
        ),
        (
            {"shared_0": np.arange(128, dtype=np.float32)},
            "layer 0: neuron indices of type float32/int64, need integers",
        ),
        (
            {"shared_0": np.arange(128, dtype=np.int64).reshape(2, 64)},
            "layer 0: shared neurons of shape (2, 64), need one list",
        ),
        ({"groups_1": np.zeros((4, 0), dtype=np.int64)}, "layer 1: groups of shape (4, 0), need [4, a multiple of 32]"),
    ],
)
def test_partition_malformed_arrays_refused(tmp_path: Path, arrays: dict[str, object], problem: str) -> None:
    from moetier.tools.moefy import read_partition

    path, cfg = _partition(tmp_path)
    _rewrite(path, **arrays)
    with pytest.raises(ConfigError) as err:
        read_partition(path, 2, 256, cfg)
    assert str(err.value) == f"{path}: {problem}"


def test_partition_of_objects_or_one_array_refused(tmp_path: Path) -> None:
    from moetier.tools.moefy import read_partition

    path, cfg = _partition(tmp_path)
    _rewrite(path, shared_1=np.array([object()], dtype=object))
    with pytest.raises(ConfigError, match=r"part\.npz: layer 1: Object arrays cannot be loaded"):
        read_partition(path, 2, 256, cfg)
    npy = tmp_path / "part.npy"
    np.save(npy, np.arange(4))
    with pytest.raises(ConfigError) as err:
        read_partition(npy, 2, 256, cfg)
    assert str(err.value) == f"{npy}: not a moefy partition (a single array, not an .npz archive)"


def test_partition_refuses_other_split_settings(tmp_path: Path) -> None:
    """A conversion given a partition takes its split from it: asking for another shared fraction, split
    rounds, cluster features or seed than the partition was made with is refused (the flags would do
    nothing); the same values are fine."""
    from moetier.tools.moefy import read_partition

    path, _ = _partition(tmp_path)  # made with the defaults
    read_partition(path, 2, 256, MoefyConfig(n_expert=4, n_expert_used=2))
    with pytest.raises(ConfigError) as err:
        read_partition(path, 2, 256, MoefyConfig(n_expert=4, n_expert_used=2, shared_frac=0.25, seed=3))
    d = MoefyConfig()
    assert str(err.value) == (
        f"{path}: the partition decides the split, and it was made with shared_frac {d.shared_frac!r}, seed 0; "
        "this conversion asks for shared_frac 0.25, seed 3 (leave those at the partition's values)"
    )
    with pytest.raises(
        ConfigError,
        match=r"made with split_rounds 0, cluster_features 'abs'; this conversion asks "
        r"for split_rounds 1, cluster_features",
    ):
        read_partition(path, 2, 256, MoefyConfig(n_expert=4, n_expert_used=2, split_rounds=1, cluster_features="token"))


def test_partition_key_tells_shared_from_expert_neurons() -> None:
    """Two partitions with the same neurons in the same order, split differently between the shared
    expert and the routed ones, are different cached work."""
    from moetier.tools.moefy import _partition_key

    a = np.arange(128, dtype=np.int64)
    one = [(a[:64], a[64:].reshape(2, 32))]
    other = [(a[:0], a.reshape(2, 64))]
    assert _partition_key(one) != _partition_key(other)  # type: ignore[arg-type]
    assert _partition_key(one) == _partition_key([(a[:64].copy(), a[64:].reshape(2, 32).copy())])  # type: ignore[arg-type]
    assert _partition_key([None, *one]) == _partition_key(one)  # type: ignore[list-item]
    # the shared neurons in another order: another model file (rows in another order), another key
    assert _partition_key([(a[:64][::-1].copy(), a[64:].reshape(2, 32))]) != _partition_key(one)  # type: ignore[arg-type]


def test_cached_work_of_another_partition_is_not_reused(dense: Path, tmp_path: Path) -> None:
    """A conversion with a partition, in the work folder of one without it (balance step cached), computes
    its own layers: the result equals the same conversion in a fresh folder, and differs from the first."""
    from moetier.tools.moefy import write_partition

    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024, balance=0.5)
    rng = np.random.default_rng(5)
    splits = []
    for _ in range(2):
        perm = rng.permutation(512).astype(np.int64)
        n_sh = 512 - 4 * 64
        splits.append((perm[:n_sh], perm[n_sh:].reshape(4, 64)))
    part = tmp_path / "p.npz"
    write_partition(part, splits, 512, cfg, "dense.gguf")  # type: ignore[arg-type]
    shared = tmp_path / "work"
    a = moefy(dense, tmp_path / "a.gguf", CALIB, cfg, progress=False, work_dir=shared)
    b = moefy(dense, tmp_path / "b.gguf", CALIB, cfg, progress=False, work_dir=shared, partition=part)
    fresh = moefy(dense, tmp_path / "c.gguf", CALIB, cfg, progress=False, work_dir=tmp_path / "w2", partition=part)
    assert b.errors == fresh.errors and b.errors != a.errors

    def tensors(p: Path) -> dict[str, bytes]:
        return {t.name: bytes(np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(p).tensors}

    tb, tc = tensors(tmp_path / "b.gguf"), tensors(tmp_path / "c.gguf")
    assert tb == tc
    assert tb["blk.0.ffn_gate_inp.weight"] != tensors(tmp_path / "a.gguf")["blk.0.ffn_gate_inp.weight"]


def test_settings_left_unused_are_refused(dense: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Distillation settings without distillation, a residual share with one distillation round, and a
    correction share without correction rounds would do nothing: each is refused before any work, the
    command line naming the flag."""
    from moetier.cli import main
    from moetier.tools.distill import DistillConfig

    out = tmp_path / "moe.gguf"
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024)
    cases: list[tuple[MoefyConfig, DistillConfig | None, str]] = [
        (
            cfg,
            DistillConfig(lr=0.01, seed=2),
            "distill.epochs: 0 (no distillation) leaves the other distill settings unused: lr 0.01, seed 2",
        ),
        (
            cfg,
            DistillConfig(epochs=1, rounds=1, residual=0.5),
            "distill.residual: 0.5 applies from the second round on, and one round is asked for",
        ),
        (
            MoefyConfig(n_expert=4, n_expert_used=2, correct_share=0.8),
            None,
            "moefy.correct_share: 0.8 applies to correction rounds, and none is asked for",
        ),
    ]
    for c, d, says in cases:
        with pytest.raises(ConfigError) as err:
            moefy(dense, out, "", c, distill=d, progress=False)
        assert str(err.value) == says
    # allowed: the defaults, a residual share from round 2, a share with correction rounds (checked only)
    for c, d in ((cfg, DistillConfig()), (cfg, None)):
        with pytest.raises(ConfigError, match="calibration text gives"):
            moefy(dense, out, "short", c, distill=d, progress=False)
    with pytest.raises(ConfigError, match="calibration text gives"):
        moefy(dense, out, "short", cfg, distill=DistillConfig(epochs=1, rounds=2, residual=0.5), progress=False)
    share = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024, correct_rounds=1, correct_share=0.8)
    with pytest.raises(ConfigError, match="calibration text gives"):
        moefy(dense, out, "short", share, progress=False, work_dir=tmp_path / "w")
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    base = ["moefy", str(dense), "-o", str(out), "--calib", str(calib), "--n-expert", "4", "--n-expert-used", "2"]
    capsys.readouterr()
    assert main([*base, "--correct-share", "0.8"]) == 1
    assert capsys.readouterr().err == (
        "moetier: error: --correct-share: 0.8 applies to correction rounds, and none is asked for\n"
    )
    assert main([*base, "--distill-lr", "0.01"]) == 1
    assert capsys.readouterr().err == (
        "moetier: error: --distill-epochs: 0 (no distillation) leaves the other distill settings unused: lr 0.01\n"
    )
    assert not out.exists()


def test_a_failed_correction_round_leaves_no_model_sized_file(
    dense: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converted model a correction round runs is written into the work folder; a failure while it
    runs removes it (a model-sized file was left behind)."""
    import moetier.tools.moefy as mf

    real = mf._collect
    calls: list[Path] = []

    def failing(model: Path, *a: object, **k: object) -> object:
        calls.append(Path(model))
        if len(calls) == 2:  # the first is the dense model's; the second the round's temporary model
            assert Path(model).exists()
            msg = "collection failed"
            raise RuntimeError(msg)
        return real(model, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(mf, "_collect", failing)
    cfg = MoefyConfig(n_expert=4, n_expert_used=2, calib_tokens=1024, correct_rounds=1)
    with pytest.raises(RuntimeError, match="collection failed"):
        moefy(dense, tmp_path / "moe.gguf", CALIB, cfg, progress=False, work_dir=tmp_path / "w")
    assert len(calls) == 2 and calls[1].suffix == ".gguf"
    assert not list((tmp_path / "w").rglob("*.gguf")) and not (tmp_path / "moe.gguf").exists()


def test_summary_is_the_conversions_one_line_report() -> None:
    """The line `moetier moefy` prints: means and maxima over the MoE layers (leading dense layers left
    out and named), the training-free plan's mean, the held-out errors when there are some, the
    calibration tokens and each step's seconds."""
    from moetier.tools.moefy import MoefyResult

    r = MoefyResult(
        errors_plan=[0.0, 0.25, 0.5],
        errors=[0.0, 0.125, 0.375],
        seconds={"collect": 12.4, "plan": 3.6},
        n_calib_tokens=4096,
        errors_held_out=[0.0, 0.3, 0.5],
        n_held_out_tokens=512,
        dense_lead=1,
    )
    assert r.summary() == (
        "FFN error mean 0.250, max 0.375 (training-free 0.375); held-out (512 tokens) mean 0.400, max 0.500; "
        "4096 calibration tokens; collect 12 s, plan 4 s; layer 0 dense"
    )
    r2 = MoefyResult(errors_plan=[0.5, 0.25], errors=[0.5, 0.25], seconds={"plan": 1.0}, n_calib_tokens=1024)
    assert r2.summary() == "FFN error mean 0.375, max 0.500 (training-free 0.375); 1024 calibration tokens; plan 1 s"
    r3 = MoefyResult(errors_plan=[0, 0, 0.5], errors=[0, 0, 0.5], n_calib_tokens=512, dense_lead=2)
    assert r3.summary().endswith("; 512 calibration tokens; layers 0-1 dense")


def test_quantize_like_takes_any_float_input_and_weighs_by_the_importance() -> None:
    """float64 weights are quantized as their float32 values; the importance matrix weighs the k-quant's
    fit (another one gives other bytes), as llama.cpp's quantize does."""
    from moetier import _core
    from moetier.tools.moefy import _quantize_like

    qt = gguf.GGMLQuantizationType
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 256)).astype(np.float32)
    imat = np.abs(rng.standard_normal(256)).astype(np.float32) + 0.1
    got = _quantize_like(a.astype(np.float64), qt.Q4_K, imat.astype(np.float64))
    assert np.array_equal(got, _core.quantize(a, "q4_K", imat).reshape(3, -1))
    other = np.ones(256, dtype=np.float32)
    other[:128] = 100.0
    assert not np.array_equal(got, _quantize_like(a, qt.Q4_K, other))
