"""Layer-level adaptive prefetch (HOBBIT sec. 3.3): background reads never change the output, every
queued read is accounted for, and the prediction counters are consistent. These tests count what
prefetch reads, so they turn its gate off (prefetch_gate=False: it always reads, whatever the step
times say; the gate has its own tests in test_prefetch_gate.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
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
