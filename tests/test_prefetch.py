"""Layer-level adaptive prefetch (HOBBIT sec. 3.3): background reads never change the output, every
queued read is accounted for, and the prediction counters are consistent. These tests count what
prefetch reads, so they turn its gate off (prefetch_gate=False: it always reads, whatever the step
times say; the gate has its own tests in test_prefetch_gate.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory, text_flag_refusals_and_help
from moetier import CacheConfig, ConfigError, Model, PackConfig, pack


@pytest.fixture(scope="module")
def model_and_store(tiny_model: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    path = tiny_model("qwen3moe", n_expert=16, n_expert_used=4, n_layer=6, expert_type="f16")
    return path, pack(path, tmp_path_factory.mktemp("pf") / "s", PackConfig(low_type="q4_0"), progress=False)


def _settled(m: Model, depth: int) -> None:
    p = m.prefetch_stats()
    assert p.n_issued > 0
    # every queued read ends used (hit or taken over), dropped unread, or read in vain
    assert p.n_hits + p.n_claimed + p.n_cancelled + p.n_wasted == p.n_issued, p
    assert p.n_waits <= p.n_hits and p.bytes_wasted <= p.bytes_read
    # a used or wasted prefetch was read: its bytes are counted (the read callbacks' bytes_done)
    assert p.bytes_read > 0 or p.n_hits + p.n_wasted == 0, p
    # predictions are checked at every distance up to the prefetch depth, and at none beyond
    assert len(p.n_pred) == len(p.n_top1) == len(p.n_allk) == len(p.n_any) == 8
    assert not any(p.n_pred[depth:]), p
    for n, t1, allk, any_ in zip(p.n_pred[:depth], p.n_top1[:depth], p.n_allk[:depth], p.n_any[:depth], strict=True):
        assert n > 0 and t1 <= n and allk <= any_ <= n


@pytest.mark.parametrize("use_store", [False, True])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetch_never_changes_output(model_and_store: tuple[Path, Path], use_store: bool, prefetch: int) -> None:
    path, store = model_and_store
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    lo = int(Model(path, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    for budget in (lo, 3 * lo):
        m = Model(
            path,
            store=store if use_store else None,
            cache=CacheConfig.exact(budget=budget, prefetch=prefetch, prefetch_gate=False, io_threads=2),
        )
        np.testing.assert_allclose(m.logits(tokens), stock.logits(tokens), rtol=0, atol=1e-5)
        assert m.generate(tokens, max_tokens=24).tokens == stock.generate(tokens, max_tokens=24).tokens
        if budget == lo:
            # one layer's experts fill the pool: a prompt's ubatch may route every one of them, so
            # prefetch holds no slot (it would leave the layer none to load into)
            assert m.prefetch_stats().n_issued == 0
        else:
            _settled(m, prefetch)


def test_prefetch_with_mixed_precision(model_and_store: tuple[Path, Path]) -> None:
    """With the precision rule on, a prefetch reads the version the rule gives the predicted weights;
    a layer then uses a cached high version even where its own rule says low, so prefetch can only
    raise precision. The accounting holds, and the output stays close to the exact one."""
    path, store = model_and_store
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    lo = int(Model(path, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    m = Model(
        path,
        store=store,
        cache=CacheConfig(budget=3 * lo, t1=0.3, t2=1.0, low_frac=0.3, prefetch=2, prefetch_gate=False),
    )
    want = stock.logits(tokens)
    err = float(np.abs(m.logits(tokens) - want).max())
    # the same selections skipped (t2 = t1) instead of read in low precision: low copies that
    # computed nothing would come out near this far (prefetch raises some back to high)
    skip = Model(path, store=store, cache=CacheConfig(budget=3 * lo, t1=0.3, t2=0.3, prefetch=0))
    err_skip = float(np.abs(skip.logits(tokens) - want).max())
    assert 0.0 < err < 0.25 * err_skip, (err, err_skip)
    m.generate(tokens, max_tokens=16)
    _settled(m, 2)
    assert m.stats().n_loads_low > 0


def test_prefetch_config_errors() -> None:
    with pytest.raises(ConfigError, match="prefetch"):
        CacheConfig(budget="1M", prefetch=9)
    with pytest.raises(ConfigError, match="io_threads"):
        CacheConfig(budget="1M", io_threads=-1)
    with pytest.raises(ConfigError, match="prefetch_waste"):
        CacheConfig(budget="1M", prefetch_waste=-0.5)
    CacheConfig(budget="1M", io_threads=0)  # the compute threads read
    with pytest.raises(ConfigError, match="integer"):
        CacheConfig(budget="1M", prefetch=1.5)  # type: ignore[arg-type]


def test_prefetch_without_lanes_is_off_with_a_warning(model_and_store: tuple[Path, Path]) -> None:
    """prefetch is on by default; io_threads=0 (no I/O pool) leaves it nothing to read on: said once."""
    path, _ = model_and_store
    m = Model(path, cache=CacheConfig.exact("64M", io_threads=0))
    assert any("io_threads=0" in w and "prefetch=3 is off" in w for w in m.warnings), m.warnings
    m.generate("hello", max_tokens=4)
    assert m.prefetch_stats().n_issued == 0


def test_no_prefetch_no_counters(model_and_store: tuple[Path, Path]) -> None:
    path, _ = model_and_store
    m = Model(path, cache=CacheConfig.exact("64M", prefetch=0))
    m.generate("hello", max_tokens=4)
    p = m.prefetch_stats()
    assert p.n_issued == 0 and not any(p.n_pred)


def test_no_prefetch_nodes_once_every_expert_is_cached(model_and_store: tuple[Path, Path]) -> None:
    """A cache with a high slot for every expert never evicts: once all are in, a graph built then
    has no prefetch nodes (they would cost time per token for nothing), and the output stays stock's."""
    path, store = model_and_store
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    m = Model(path, store=store, cache=CacheConfig.exact("64M", prefetch=2, prefetch_gate=False))
    info = m.cache_info()
    assert info["n_slots"] >= info["n_layers"] * info["n_expert"], info
    m.generate(tokens, max_tokens=4)
    first = _pred_counts(m)
    assert sum(first[0]) > 0  # the prompt's graph was built with nothing cached: it predicted
    # a short prompt may leave experts unread: read every one, so the next graphs are built with all in
    for t in range(0, len(tokens) - 8, 8):
        m.generate(tokens[t : t + 8], max_tokens=1)
    assert m.cache_info()["n_held"] == info["n_layers"] * info["n_expert"]
    before, misses = _pred_counts(m), m.stats().n_misses
    assert m.generate(tokens, max_tokens=12).tokens == stock.generate(tokens, max_tokens=12).tokens
    assert _pred_counts(m) == before and m.stats().n_misses == misses


def test_prefetch_reads_per_layer_at_most_in_flight(model_and_store: tuple[Path, Path]) -> None:
    """A walk starts at most io_threads reads (one per prefetch lane, surest prediction first): more
    would sit in the queue holding slots they evicted cached experts for."""
    path, store = model_and_store
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    lo = int(Model(path, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    n_walks = 5 * 16  # layers with a next layer x graph runs (the prompt, then 15 decodes)
    issued = {}
    for lanes in (1, 4):
        # no byte cap: the lanes alone bound the reads here
        cfg = CacheConfig.exact(budget=2 * lo, prefetch=1, prefetch_gate=False, io_threads=lanes, prefetch_waste=100)
        m = Model(path, store=store, cache=cfg)
        assert m.generate(tokens, max_tokens=16).tokens == stock.generate(tokens, max_tokens=16).tokens
        _settled(m, 1)
        issued[lanes] = m.prefetch_stats().n_issued
    assert issued[1] <= n_walks < issued[4], issued


def _half(path: Path) -> int:
    """A budget of half the tiny model's experts (three of its six layers): with every expert
    cached the graphs predict nothing (test_no_prefetch_nodes_once_every_expert_is_cached)."""
    return 3 * int(Model(path, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])


def _pred_counts(m: Model) -> tuple[tuple[int, ...], ...]:
    p = m.prefetch_stats()
    return tuple(p.n_pred), tuple(p.n_top1), tuple(p.n_allk), tuple(p.n_any)


@pytest.fixture()
def model_copy(model_and_store: tuple[Path, Path], tmp_path: Path) -> Path:
    """The tiny model in a directory of its own: its predictor sidecar (<model>.predictor.gguf) is
    seen by this test only (a copy has the model's identity: the identity is its bytes)."""
    import shutil

    return Path(shutil.copy(model_and_store[0], tmp_path / "m.gguf"))


def test_fitted_predictor_of_the_routers_predicts_as_the_stacked_gate(model_copy: Path) -> None:
    import gguf

    from moetier import _core
    from moetier.tools.predictor import moe_layers, write_predictor

    routers = {
        int(t.name.split(".")[1]): np.asarray(t.data, dtype=np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
        for t in gguf.GGUFReader(model_copy).tensors
        if t.name.endswith("ffn_gate_inp.weight")
    }
    layers = moe_layers(model_copy)
    maps = {(il, 1): (routers[il + 1], np.zeros(len(routers[il + 1]), np.float32)) for il in layers[:-1]}
    path = write_predictor(_core.predictor_path(str(model_copy)), model_copy, maps)
    assert path == model_copy.with_name("m.gguf.predictor.gguf")
    stock = Model(model_copy)
    tokens = stock.tokenize(LONG_PROMPT)
    runs = {}
    for fitted in (True, False):
        m = Model(model_copy, cache=CacheConfig.exact(budget=_half(model_copy), prefetch=1, fitted_prefetch=fitted))
        assert m.generate(tokens, max_tokens=24).tokens == stock.generate(tokens, max_tokens=24).tokens
        runs[fitted] = _pred_counts(m)
        want = f"fitted predictor {path} ({len(maps)} of {len(maps)} maps)" if fitted else "stacked routers"
        assert m.prefetch_source == want and not m.warnings
    assert runs[True] == runs[False] and sum(runs[True][0]) > 0


def test_fitted_predictor_is_fitted_and_exact(model_copy: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    text = tmp_path / "calib.txt"
    text.write_text(LONG_PROMPT * 4)
    store = tmp_path / "store"
    pack(model_copy, store, PackConfig(low_type="q4_0"), progress=False)
    args = ["fit-predictor", str(model_copy), "--text", str(text), "--store", str(store), "--depth", "2"]
    r = subprocess.run(
        [sys.executable, "-m", "moetier.cli", *args, "--tokens", "512"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert f"wrote {store / 'predictor.gguf'}" in r.stdout
    stock = Model(model_copy)
    tokens = stock.tokenize(LONG_PROMPT)
    top1 = {}
    for fitted in (True, False):
        cfg = CacheConfig.exact(budget=_half(model_copy), prefetch=2, fitted_prefetch=fitted)
        m = Model(model_copy, store=store, cache=cfg)
        np.testing.assert_allclose(m.logits(tokens), stock.logits(tokens), rtol=0, atol=1e-5)
        assert m.generate(tokens, max_tokens=32).tokens == stock.generate(tokens, max_tokens=32).tokens
        n_pred, n_top1, _, _ = _pred_counts(m)
        top1[fitted] = n_top1[0] / n_pred[0]
        assert m.prefetch_source.startswith("fitted predictor" if fitted else "stacked routers")
    # fitted on this very text: its distance-1 guesses of the top-1 are at least the routers' own
    assert top1[True] >= top1[False], top1


def test_stale_or_broken_predictor_is_ignored_with_a_warning(model_copy: Path, tmp_path: Path) -> None:
    from moetier import _core
    from moetier.tools.predictor import write_predictor

    other = tmp_path / "other.gguf"
    other.write_bytes(b"not a gguf")
    path = Path(_core.predictor_path(str(model_copy)))
    stock = Model(model_copy)
    for content in ("garbage", "other model"):
        if content == "garbage":
            path.write_bytes(b"GGUF" + bytes(60))
        else:
            n_embd = 64
            maps = {(0, 1): (np.zeros((16, n_embd), np.float32), np.zeros(16, np.float32))}
            write_predictor(path, model_copy, maps)
            # names another model: rewrite the key
            import gguf

            r = gguf.GGUFReader(path)
            w = gguf.GGUFWriter(path.with_name("x.gguf"), "moetier-predictor")
            w.add_string("moetier-predictor.model", "1:0000000000000000:0000000000000000")
            for t in r.tensors:
                w.add_tensor(t.name, np.asarray(t.data))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            path.with_name("x.gguf").replace(path)
        m = Model(model_copy, cache=CacheConfig.exact(budget="64M", prefetch=1, prefetch_gate=False))
        assert m.prefetch_source == "stacked routers"
        assert len(m.warnings) == 1 and m.warnings[0].startswith("prefetch predictor ignored, the routers predict:")
        assert str(path) in m.warnings[0]
        if content == "other model":
            assert "fitted on another model" in m.warnings[0]
        assert m.generate("hello", max_tokens=8).tokens == stock.generate("hello", max_tokens=8).tokens


def _write_wrong_predictor(model: Path) -> None:
    """A fitted predictor that names the experts the routers rank last: every read it asks for is
    of an expert the layer will not select (top-4 of 16 and the bottom 4 never meet)."""
    import gguf

    from moetier import _core
    from moetier.tools.predictor import moe_layers, write_predictor

    routers = {
        int(t.name.split(".")[1]): np.asarray(t.data, dtype=np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
        for t in gguf.GGUFReader(model).tensors
        if t.name.endswith("ffn_gate_inp.weight")
    }
    layers = moe_layers(model)
    maps = {(il, 1): (-routers[il + 1], np.zeros(len(routers[il + 1]), np.float32)) for il in layers[:-1]}
    write_predictor(_core.predictor_path(str(model)), model, maps)


def test_prefetch_byte_cap_bounds_wasted_reads(model_copy: Path) -> None:
    """prefetch_waste caps the bytes read for experts their layer then does not use at that share
    of the bytes the layers needed (their own reads and the prefetches they used); 0 reads nothing.
    A predictor that is always wrong shows it: uncapped, it wastes far more."""
    _write_wrong_predictor(model_copy)
    stock = Model(model_copy)
    tokens = stock.tokenize(LONG_PROMPT)
    want = stock.generate(tokens, max_tokens=16).tokens
    lo = int(Model(model_copy, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    share = {}
    for waste in (0.0, 0.25, 100.0):
        cfg = CacheConfig.exact(
            budget=2 * lo, prefetch=1, prefetch_gate=False, io_threads=4, prefetch_waste=waste, warm=False
        )
        m = Model(model_copy, cache=cfg)
        assert m.prefetch_source.startswith("fitted predictor")
        assert m.generate(tokens, max_tokens=16).tokens == want
        p, s = m.prefetch_stats(), m.stats()
        needed = s.n_bytes_read + p.bytes_read - p.bytes_wasted
        share[waste] = p.bytes_wasted / needed
        assert p.n_hits + p.n_claimed + p.n_cancelled + p.n_wasted == p.n_issued, p
        if waste == 0.0:
            assert p.n_issued == 0 and p.n_capped > 0, p
        elif waste == 0.25:
            assert 0 < p.bytes_wasted <= 0.25 * needed and p.n_capped > 0, (p, needed)
    assert share[100.0] > 0.25, share


def test_prefetch_stands_back_when_the_disk_is_behind(model_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the reads of earlier walks are still queued (the prefetch lanes are behind: here every
    read on an I/O thread starts 5 ms late; the I/O threads, not the ring, whose reads the kernel
    runs), a walk starts only as many as keep the queue within one walk's reads; the predicted misses
    it leaves are counted, and the output stays exact."""
    stock = Model(model_copy)
    tokens = stock.tokenize(LONG_PROMPT)
    want = stock.generate(tokens, max_tokens=24).tokens
    lo = int(Model(model_copy, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    monkeypatch.setenv("MOETIER_FAULTS", "slow:1")
    # most of the model cached: walks often find a layer's predictions cached and read further ahead,
    # and those reads are the ones still queued when the next walk starts
    cfg = CacheConfig.exact(
        budget=4 * lo, prefetch=3, prefetch_gate=False, io_threads=2, prefetch_waste=100, warm=False, io_uring=False
    )
    m = Model(model_copy, cache=cfg)
    assert m.generate(tokens, max_tokens=24).tokens == want
    p = m.prefetch_stats()
    assert p.n_busy > 0 and p.n_hits + p.n_claimed + p.n_cancelled + p.n_wasted == p.n_issued, p


def test_stacked_prediction_chooses_with_the_selection_bias(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """GLM-4.5's and DeepSeek-V3's routing (sigmoid probabilities plus a per-expert bias for the top-k
    choice only): the prefetcher predicts the choice the model makes. A bias of 1.05 on experts 0-3
    forces them in every layer (probabilities lie in [0, 1]), so every prediction of the whole top-k
    set is right (from the logits alone, without the bias, some are not), and the output stays
    stock's. moefy's softmax models: test_moefy's balance test."""
    import shutil

    import gguf

    path = Path(shutil.copy(tiny_model("glm4moe", n_expert=16, n_expert_used=4, n_layer=4), tmp_path / "m.gguf"))
    for t in gguf.GGUFReader(path, "r+").tensors:
        if t.name.endswith("exp_probs_b.bias"):
            t.data[:] = np.array([1.05] * 4 + [0.0] * 12, dtype=np.float32)
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    lo = int(Model(path, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    m = Model(path, cache=CacheConfig.exact(budget=2 * lo, prefetch=2, prefetch_gate=False))
    assert m.generate(tokens, max_tokens=24).tokens == stock.generate(tokens, max_tokens=24).tokens
    n_pred, _, n_allk, _ = _pred_counts(m)
    assert n_pred[0] > 0 and n_pred[1] > 0 and n_allk[:2] == n_pred[:2], (n_pred, n_allk)


@pytest.fixture()
def deepseek(tiny_model: ModelFactory) -> Path:
    """A tiny DeepSeek-V1 layout: layer 0 dense, layers 1-3 with 8 experts (top-2) behind a router."""
    return tiny_model("deepseek", n_expert=8, n_expert_used=2, n_layer=4)


def _predictor_tensors(path: Path) -> dict[str, np.ndarray]:
    import gguf

    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}


def test_moe_layers_are_the_layers_with_a_router(deepseek: Path, tiny_model: ModelFactory, tmp_path: Path) -> None:
    """moe_layers lists, sorted, the N of every tensor named exactly blk.N.ffn_gate_inp.weight; a model
    without one is refused, naming the file."""
    import gguf

    from moetier import ModelError
    from moetier.tools.predictor import moe_layers

    assert moe_layers(deepseek) == [1, 2, 3]
    path = tmp_path / "names.gguf"
    w = gguf.GGUFWriter(path, "test")
    for name in (
        "blk.3.ffn_gate_inp.weight",
        "blk.1.ffn_gate_inp.weight",
        "token_embd.weight",
        "blk.0.ffn_gate_inp.bias",
        "blk.2.ffn_gate_inp",
        "blk.4.ffn_gate_inp.weight.x",
        "blk.5.ffn_gate_exps.weight",
        "xblk.6.ffn_gate_inp.weight",
    ):
        w.add_tensor(name, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert moe_layers(str(path)) == [1, 3]
    dense = tiny_model("qwen2")
    with pytest.raises(ModelError) as e:
        moe_layers(dense)
    assert str(e.value) == f"{dense}: no MoE layer (no blk.N.ffn_gate_inp.weight): nothing to predict"


def test_ridge_fit_is_the_regularised_least_squares_solution() -> None:
    """ridge_fit(x, y, lam) minimises |x W^T + b - y|^2 + lam * s * |W|^2, s the mean of x^T x's diagonal
    (the bias unshrunk); lam 0 recovers an exact linear map. W and b come back float32 and contiguous."""
    from moetier.tools.predictor import ridge_fit

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((50, 3)) * [1.0, 10.0, 0.1]).astype(np.float32)
    w_true = np.array([[1.0, -2.0, 3.0], [0.5, 0.0, -1.0]])
    y = (x @ w_true.T + [4.0, -5.0]).astype(np.float32)
    w, b = ridge_fit(x, y, 0.0)
    assert w.shape == (2, 3) and b.shape == (2,)
    assert w.dtype == np.float32 and b.dtype == np.float32
    assert w.flags.c_contiguous and b.flags.c_contiguous
    np.testing.assert_allclose(w, w_true, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(b, [4.0, -5.0], rtol=1e-4)
    lam = 0.05
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    s = np.mean(np.sum(x64**2, axis=0))
    a = np.vstack([np.hstack([x64, np.ones((50, 1))]), np.hstack([np.sqrt(lam * s) * np.eye(3), np.zeros((3, 1))])])
    want = np.linalg.lstsq(a, np.vstack([y64, np.zeros((3, 2))]), rcond=None)[0]
    w, b = ridge_fit(x, y, lam)
    np.testing.assert_allclose(w, want[:3].T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, want[3], rtol=1e-5, atol=1e-6)
    assert np.abs(w).max() < 0.9 * np.abs(w_true).max()  # visibly shrunk


def test_fit_predictor_refuses_bad_settings(deepseek: Path, tiny_model: ModelFactory) -> None:
    """depth below 1, fewer than 16 tokens or a negative ridge are refused before the model is read
    (depth 1, 16 tokens and ridge 0 are fine), and so is a text of under 16 tokens."""
    from moetier import ModelError
    from moetier.tools.predictor import fit_predictor

    dense = tiny_model("qwen2")
    says = "fit-predictor: depth {} must be >= 1, tokens {} >= 16, ridge {} a finite number >= 0"
    for depth, tokens, ridge in (
        (0, 16, 0.0),
        (1, 15, 0.0),
        (1, 16, -1e-9),
        (1, 16, float("nan")),
        (1, 16, float("inf")),
    ):
        with pytest.raises(ConfigError) as e:
            fit_predictor(dense, LONG_PROMPT, depth=depth, tokens=tokens, ridge=ridge)
        assert str(e.value) == says.format(depth, tokens, ridge)
    with pytest.raises(ModelError, match="no MoE layer"):  # past the checks: the model has no router
        fit_predictor(dense, LONG_PROMPT, depth=1, tokens=16, ridge=0.0)
    with pytest.raises(ConfigError) as e:
        fit_predictor(deepseek, "Sphinx of quartz")
    n = len(Model(deepseek).tokenize("Sphinx of quartz"))
    assert n < 16 and str(e.value) == f"fit-predictor: the text gives {n} tokens; need at least 16"
    assert sorted(fit_predictor(deepseek, LONG_PROMPT, tokens=16)) == [(1, 1), (2, 1)]
    one = tiny_model("qwen2moe", n_layer=1)
    with pytest.raises(ModelError, match=r"one MoE layer \(layer 0\): a predictor maps a layer's input to a later"):
        fit_predictor(one, LONG_PROMPT, tokens=16)


def test_fit_predictor_maps_each_layer_to_the_next_routers(deepseek: Path) -> None:
    """Per MoE layer l and distance d up to depth (while l + d is a MoE layer): the ridge fit from l's gate
    input (ffn_norm) to l + d's router logits, over the first `tokens` tokens of the text, run as
    sequences of 512 tokens that each start from an empty context."""
    import gguf

    from moetier import _core
    from moetier.tools.predictor import fit_predictor, ridge_fit

    text = LONG_PROMPT * 6  # 840 tokens
    maps = fit_predictor(deepseek, text, depth=2, tokens=600, ridge=0.01, n_threads=1)
    assert sorted(maps) == [(1, 1), (1, 2), (2, 1)]
    m = Model(deepseek, n_ctx=512, n_threads=1)
    toks = m.tokenize(text)[:600]
    names = [f"{k}-{il}" for k in ("ffn_norm", "ffn_moe_logits") for il in (1, 2, 3)]
    rows = {k: np.asarray(v).reshape(600, -1) for k, v in _core.trace.collect(m._m, toks, names, 512).items()}
    for il in (1, 2, 3):  # the logits are the layer's router applied to its gate input
        t = next(t for t in gguf.GGUFReader(deepseek).tensors if t.name == f"blk.{il}.ffn_gate_inp.weight")
        router = np.asarray(t.data, dtype=np.float32).reshape(8, 64)
        np.testing.assert_allclose(rows[f"ffn_norm-{il}"] @ router.T, rows[f"ffn_moe_logits-{il}"], atol=1e-5)
    for (il, d), (w, b) in maps.items():
        assert w.shape == (8, 64) and b.shape == (8,)
        want_w, want_b = ridge_fit(rows[f"ffn_norm-{il}"], rows[f"ffn_moe_logits-{il + d}"], 0.01)
        np.testing.assert_array_equal(w, want_w)
        np.testing.assert_array_equal(b, want_b)


def test_write_predictor_file_layout(deepseek: Path, tmp_path: Path) -> None:
    """The predictor GGUF: architecture moetier-predictor, the model's key, the largest distance, then
    per (layer, distance) in order a float32 weight [n_embd, n_expert] and bias; no temporary file left."""
    import gguf

    from moetier import _core
    from moetier.tools.predictor import write_predictor

    rng = np.random.default_rng(1)
    maps = {
        (2, 1): (rng.standard_normal((64, 8)).T, rng.standard_normal(8)),  # float64, not contiguous
        (1, 2): (rng.standard_normal((8, 64)), rng.standard_normal(8)),
        (1, 1): (rng.standard_normal((8, 64)), rng.standard_normal(8)),
    }
    out = tmp_path / "p.gguf"
    assert write_predictor(str(out), deepseek, maps) == out  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.gguf"]
    r = gguf.GGUFReader(out)
    assert r.fields["general.architecture"].contents() == "moetier-predictor"
    assert r.fields["moetier-predictor.model"].contents() == _core.predictor_model_key(str(deepseek))
    assert r.fields["moetier-predictor.depth"].contents() == 2
    assert [t.name for t in r.tensors] == [
        f"blk.{il}.pred.{d}.{k}" for il, d in ((1, 1), (1, 2), (2, 1)) for k in ("weight", "bias")
    ]
    for t in r.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        il, d = int(t.name.split(".")[1]), int(t.name.split(".")[3])
        w, b = maps[(il, d)]
        if t.name.endswith("weight"):
            assert [int(n) for n in t.shape] == [64, 8]
            np.testing.assert_array_equal(np.asarray(t.data).reshape(8, 64), w.astype(np.float32))
        else:
            np.testing.assert_array_equal(np.asarray(t.data), b.astype(np.float32))


def test_write_predictor_keeps_the_old_file_when_writing_fails(
    deepseek: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The predictor is written to a temporary name and renamed: when that write fails (the disk fills
    half way), the file already there is left as it was, and nothing beside it."""
    import errno

    import gguf

    from moetier.tools.predictor import write_predictor

    out = tmp_path / "p.gguf"
    out.write_bytes(b"old predictor")

    def full_disk(self: gguf.GGUFWriter, *a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_predictor(out, deepseek, {(1, 1): (np.zeros((8, 64), np.float32), np.zeros(8, np.float32))})
    assert out.read_bytes() == b"old predictor"
    assert [f.name for f in tmp_path.iterdir()] == ["p.gguf"]


def test_fit_predictor_cli_flags(deepseek: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """moetier fit-predictor MODEL --text A B -o OUT --depth D --tokens N --ridge R -t T fits on the texts
    joined by a blank line and says what it wrote."""
    import re

    from moetier.tools.predictor import fit_predictor, main

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Pack my box.")
    b.write_text(LONG_PROMPT)
    out = tmp_path / "out.gguf"
    args = ["--text", str(a), str(b), "-o", str(out), "--depth", "2", "--tokens", "40", "--ridge", "0.5", "-t", "1"]
    assert main([str(deepseek), *args]) == 0
    said = capsys.readouterr().out
    wrote = rf"moetier: wrote {re.escape(str(out))}: 3 maps \(distances 1\.\.2\) fitted on up to 40 tokens"
    took = re.fullmatch(rf"{wrote} in (\d+) s\n", said)
    assert took and int(took[1]) < 300, said  # the seconds it took
    maps = fit_predictor(deepseek, "Pack my box.\n\n" + LONG_PROMPT, depth=2, tokens=40, ridge=0.5, n_threads=1)
    got = _predictor_tensors(out)
    assert len(got) == 2 * len(maps)
    for (il, d), (w, bias) in maps.items():
        np.testing.assert_array_equal(got[f"blk.{il}.pred.{d}.weight"].reshape(w.shape), w)
        np.testing.assert_array_equal(got[f"blk.{il}.pred.{d}.bias"], bias)


def test_fit_predictor_cli_defaults_and_store(
    deepseek: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without -o the predictor goes beside the model (<model>.predictor.gguf), or into --store as
    predictor.gguf; the defaults, depth 1 and 8192 tokens (and ridge 1e-3, as --help says), are
    fit_predictor's own."""
    import shutil

    from moetier.tools.predictor import fit_predictor, main

    model = Path(shutil.copy(deepseek, tmp_path / "m.gguf"))  # its sidecar is this test's alone
    text = tmp_path / "t.txt"
    text.write_text(LONG_PROMPT * 60 + "The end. " * 20)  # past 8192 tokens
    assert main([str(model), "--text", str(text)]) == 0
    side = tmp_path / "m.gguf.predictor.gguf"
    assert capsys.readouterr().out.startswith(
        f"moetier: wrote {side}: 2 maps (distances 1..1) fitted on up to 8192 tokens in "
    )
    maps = fit_predictor(model, text.read_text())
    got = _predictor_tensors(side)
    assert len(got) == 2 * len(maps)
    for (il, d), (w, b) in maps.items():
        np.testing.assert_array_equal(got[f"blk.{il}.pred.{d}.weight"].reshape(w.shape), w)
        np.testing.assert_array_equal(got[f"blk.{il}.pred.{d}.bias"], b)
    store = tmp_path / "store"
    store.mkdir()
    assert main([str(model), "--text", str(text), "--store", str(store), "--tokens", "16"]) == 0
    assert capsys.readouterr().out.startswith(f"moetier: wrote {store / 'predictor.gguf'}: 2 maps ")
    assert (store / "predictor.gguf").exists()


def test_fit_predictor_cli_errors_and_help(
    deepseek: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unreadable --text is refused naming the flag and file, and --text is required; --help shows
    the description and every flag's help, word for word."""
    from moetier.tools.predictor import main

    helptext = " ".join(text_flag_refusals_and_help(main, deepseek, tmp_path, monkeypatch, capsys).split())
    for s in (
        "usage: moetier fit-predictor [-h] --text TEXT [TEXT ...] [--store STORE] [-o OUTPUT] [--depth DEPTH] "
        "[--tokens TOKENS] [--ridge RIDGE] [-t THREADS] model",
        "Fit the prefetch predictor of a MoE model: per layer and distance, a linear map from the layer's gate input "
        "to a later layer's router logits (ridge regression on calibration text), written where the prefetcher "
        "finds it (<store>/predictor.gguf, or <model>.predictor.gguf); prefetch then predicts with it instead of "
        "the next layers' routers (cache option fitted_prefetch=0 turns it off).",
        "model MoE GGUF",
        "--text TEXT [TEXT ...] calibration text file(s), concatenated",
        "--store STORE expert store the predictor goes with (default: the model)",
        "-o OUTPUT, --output OUTPUT write here instead of where the prefetcher looks",
        "--depth DEPTH distances fitted, 1..depth (prefetch=N uses N; default: 1)",
        "--tokens TOKENS calibration tokens (default: 8192)",
        "--ridge RIDGE ridge strength, times x^T x's mean diagonal (default: 0.001)",
        "-t THREADS, --threads THREADS compute threads (default: the machine's cores, at most 8)",
    ):
        assert s in helptext, s


def test_fit_predictor_refuses_a_store_beside_an_output(deepseek: Path, tmp_path: Path) -> None:
    """--store only chooses where the predictor goes: with -o it would be ignored, so it is refused."""
    from moetier.tools import predictor

    text = tmp_path / "t.txt"
    text.write_text(LONG_PROMPT)
    with pytest.raises(ConfigError) as e:
        predictor.main([str(deepseek), "--text", str(text), "--store", "s.experts", "-o", str(tmp_path / "p.gguf")])
    assert (
        str(e.value)
        == f"--store s.experts: it only chooses where the predictor is written; -o {tmp_path / 'p.gguf'} chose already"
    )
