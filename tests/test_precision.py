"""Token-level dynamic precision (HOBBIT sec. 3.2): the score rule, the high/low pools, skipping,
and that t1 = t2 = 1 is exactly stock llama.cpp."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model, PackConfig, _core, pack


def test_score_rule() -> None:
    # ranked 0.5, 0.3, 0.15, 0.05: scores 0, 0.5, 0.8, 0.95
    w = [0.15, 0.5, 0.05, 0.3]
    assert _core.precision_levels(w, 0.6, 0.9) == [1, 2, 0, 2]
    assert _core.precision_levels(w, 0.4, 0.85) == [1, 2, 0, 1]
    assert _core.precision_levels(w, 1.0, 1.0) == [2, 2, 2, 2]
    # the top-1 is high even at t1 = t2 = 0; the others are skipped
    assert _core.precision_levels(w, 0.0, 0.0) == [0, 2, 0, 0]
    # unnormalised weights (softmax over all experts, not renormalised) rank the same
    assert _core.precision_levels([x / 7 for x in w], 0.6, 0.9) == [1, 2, 0, 2]
    # a tie keeps the earlier k first; a zero sum keeps everything high
    assert _core.precision_levels([0.5, 0.5], 0.4, 0.4) == [2, 0]
    assert _core.precision_levels([0.0, 0.0, 0.0], 0.1, 0.2) == [2, 2, 2]


def test_bad_thresholds() -> None:
    with pytest.raises(ConfigError, match="t1 must not exceed t2"):
        CacheConfig(budget="1M", t1=0.9, t2=0.5)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        CacheConfig(budget="1M", t2=1.5)
    with pytest.raises(ConfigError, match="low_frac"):
        CacheConfig(budget="1M", low_frac=1.0)
    with pytest.raises(ConfigError, match="policy weights"):
        CacheConfig(budget="1M", policy="multi", w_lru=0, w_lfu=0, w_lhu=0, w_fld=0)
    assert _core.check_opts("t1=0.2,t2=x") == "expert cache option t2: 'x' is not a number"


@pytest.fixture(scope="module")
def stored(tiny_model: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    path = tiny_model("qwen3moe", n_expert=16, n_expert_used=4, n_layer=3, expert_type="f16")
    return path, pack(path, tmp_path_factory.mktemp("store") / "s", PackConfig(low_type="q4_0"), progress=False)


def test_exact_with_low_pools_equals_stock(stored: tuple[Path, Path]) -> None:
    path, store = stored
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    lo = int(Model(path, store=store, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    m = Model(path, store=store, cache=CacheConfig.exact(budget=2 * lo, low_frac=0.5))
    # nothing can be read in low precision, so no budget goes to low slots
    assert m.cache_info()["n_slots_low"] == 0
    np.testing.assert_allclose(m.logits(tokens), stock.logits(tokens), rtol=0, atol=1e-5)
    s = m.stats()
    assert s.n_loads_low == 0 and s.n_skipped == 0 and s.n_loads_high == s.n_misses > 0


def test_low_precision_loads(stored: tuple[Path, Path]) -> None:
    path, store = stored
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)[:1]
    info = Model(path, store=store, cache=CacheConfig.exact("64M")).cache_info()
    full = 4 * int(info["expert_bytes"])
    # t1 = 0: only each token's top-1 is read in high precision; t2 = 1: nothing is skipped
    # no prefetch: its reads would raise some loads to high precision (it reads what it predicts)
    m = Model(path, store=store, cache=CacheConfig(budget=full, t1=0.0, t2=1.0, low_frac=0.5, prefetch=0))
    ci = m.cache_info()
    assert ci["n_slots_low"] > 0 and ci["cache_bytes"] <= full
    ref = stock.logits(tokens)
    got = m.logits(tokens)
    s = m.stats()
    n_layers = int(ci["n_layers"])
    # one token, 4 experts per layer: 1 high + 3 low each
    assert (s.n_loads_high, s.n_loads_low, s.n_skipped) == (n_layers, 3 * n_layers, 0)
    low_bytes = int(ci["expert_bytes_low"]) // (n_layers * 16)
    high_bytes = int(ci["expert_bytes"]) // (n_layers * 16)
    assert s.n_bytes_low == s.n_loads_low * low_bytes
    assert s.n_bytes_read == s.n_loads_high * high_bytes + s.n_bytes_low
    # q4_0 copies of three of four experts: close to, not equal to, the f16 model
    assert not np.array_equal(got, ref)
    assert np.corrcoef(got, ref)[0, 1] > 0.99
    # the same token again: every expert is a hit, the three low ones from the low pool
    m.reset_stats()
    assert np.array_equal(m.logits(tokens), got)
    s = m.stats()
    assert s.n_misses == 0 and s.n_hits_low == 3 * n_layers


def test_skip_changes_output_only_when_stats_say_so(stored: tuple[Path, Path]) -> None:
    path, store = stored
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    ref = stock.logits(tokens)
    full = 2 * int(Model(path, store=store, cache=CacheConfig.exact("64M")).cache_info()["expert_bytes"])
    seen = set()
    for t2 in (0.3, 0.6, 0.999):
        m = Model(path, store=store, cache=CacheConfig(budget=full, t1=t2, t2=t2))
        got = m.logits(tokens)
        s = m.stats()
        assert s.n_loads_low == 0 and s.n_misses == s.n_loads_high + s.n_skipped
        exact = bool(np.allclose(got, ref, rtol=0, atol=1e-5))
        assert exact == (s.n_skipped == 0), f"t2={t2}: {s.n_skipped} skipped, output equal to stock: {exact}"
        seen.add(exact)
    assert seen == {True, False}, "both a skipping and a non-skipping threshold were exercised"


def test_no_store_means_no_low_slots(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    m = Model(path, cache=CacheConfig(budget="16M", t1=0.2, t2=1.0, low_frac=0.5))
    assert m.cache_info()["n_slots_low"] == 0
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    # a low verdict reads the high version: exact
    np.testing.assert_allclose(m.logits(tokens), stock.logits(tokens), rtol=0, atol=1e-5)
    assert m.stats().n_loads_low == 0
