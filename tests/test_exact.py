"""Exact unless asked: a cache with only a budget computes every selected expert in high precision
(output equals stock llama.cpp); mixed precision is an explicit choice; every surface says which mode
ran; a parameter that cannot take effect is a warning naming it, never silently ignored."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model, PackConfig, _core, pack


@pytest.fixture(scope="module")
def model_and_store(tiny_model: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=4, n_layer=3)
    return path, pack(path, tmp_path_factory.mktemp("exact") / "s", PackConfig(low_type="q4_0"), progress=False)


def _min_budget(path: Path) -> int:
    return int(Model(path, cache=CacheConfig(budget="64M")).cache_info()["min_cache_bytes"])


def test_default_config_is_exact(model_and_store: tuple[Path, Path]) -> None:
    path, store = model_and_store
    cfg = CacheConfig(budget=_min_budget(path))  # only a budget, and a store with low copies
    assert (cfg.t1, cfg.t2) == (1.0, 1.0)
    m = Model(path, store=store, cache=cfg)
    assert m.exact and m.cache_info()["exact"] and m.warnings == ()
    stock = Model(path)
    tokens = m.tokenize(LONG_PROMPT)
    assert m.generate(tokens, max_tokens=16).tokens == stock.generate(tokens, max_tokens=16).tokens
    s = m.stats()
    assert s.n_misses > 0 and s.n_loads_low == 0 and s.n_skipped == 0


def test_mixed_precision_is_asked_for(model_and_store: tuple[Path, Path]) -> None:
    path, store = model_and_store
    m = Model(path, store=store, cache=CacheConfig(budget=_min_budget(path) * 2, t1=0.3, t2=0.9))
    assert not m.exact and m.warnings == ()
    m.generate(LONG_PROMPT, max_tokens=16)
    assert m.stats().n_loads_low > 0


def test_low_band_without_store_warns(model_and_store: tuple[Path, Path]) -> None:
    path, _ = model_and_store
    m = Model(path, cache=CacheConfig(budget="64M", t1=0.3))  # t2 = 1: nothing skipped
    assert m.exact  # the low band reads the high version: still stock's output
    assert any("t1=0.3 < t2=1 asks for low-precision reads, but no expert store is given" in w for w in m.warnings)


def test_low_frac_zero_warns(model_and_store: tuple[Path, Path]) -> None:
    path, store = model_and_store
    m = Model(path, store=store, cache=CacheConfig(budget="64M", t1=0.3, t2=0.9, low_frac=0.0))
    assert any("low_frac=0 leaves no low-precision slots" in w for w in m.warnings), m.warnings


def test_policy_weights_without_multi_warn(model_and_store: tuple[Path, Path]) -> None:
    path, _ = model_and_store
    m = Model(path, cache=CacheConfig(budget="64M", policy="lru", w_fld=0.7))
    assert any("policy lru has no weights and ignores them" in w for w in m.warnings), m.warnings
    assert Model(path, cache=CacheConfig(budget="64M", policy="multi", w_fld=0.7)).warnings == ()


def test_prefetch_with_nothing_to_predict_warns(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=1)  # one MoE layer: no successor
    m = Model(path, cache=CacheConfig(budget="64M", prefetch=1))
    assert any("prefetch=1 has nothing to predict" in w for w in m.warnings), m.warnings


def test_cli_says_the_mode_and_the_warnings(model_and_store: tuple[Path, Path]) -> None:
    path, store = model_and_store
    budget = str(_min_budget(path) * 2)
    base = [sys.executable, "-m", "moetier.cli", "run", "-m", str(path), "-p", LONG_PROMPT, "-n", "8"]
    exact = subprocess.run([*base, "--store", str(store), "--cache", budget], capture_output=True, text=True)
    assert exact.returncode == 0, exact.stderr
    assert " | exact (every expert in high precision) | " in exact.stderr
    mixed = subprocess.run(
        [*base, "--store", str(store), "--cache", budget, "--cache-t1", "0.3", "--cache-t2", "0.9"],
        capture_output=True,
        text=True,
    )
    assert mixed.returncode == 0, mixed.stderr
    assert "mixed precision (t1 0.30, t2 0.90)" in mixed.stderr and "% of misses read low" in mixed.stderr
    warned = subprocess.run([*base, "--cache", budget, "--cache-t1", "0.3"], capture_output=True, text=True)
    assert warned.returncode == 0, warned.stderr
    assert "moetier: warning: t1=0.3 < t2=1 asks for low-precision reads" in warned.stderr


def _repacks_q4_k() -> bool:
    """Whether llama.cpp has repacked CPU kernels for q4_K on this CPU (AVX2, or NEON with dotprod)."""
    z = np.zeros((1, 8, 256), np.float32)
    try:
        _core.mul_mat_id(z, np.zeros((1, 1, 256), np.float32), np.zeros((1, 1), np.int32), 1, "q4_K", True)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("source", ["store", "gguf"])
@pytest.mark.parametrize("repack", [True, False])
def test_repacked_experts_equal_stock(
    tiny_model: ModelFactory, tmp_path_factory: pytest.TempPathFactory, source: str, repack: bool
) -> None:
    """Stock llama.cpp computes q4_K experts on its repacked CPU kernels (unless repack=False); the cache's
    pools do the same, each read repacked once checked, so logits and tokens stay bit-equal to stock's
    in both modes, whether the reads come from a store or from the GGUF."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3, n_embd=256, n_ff_exp=256, expert_type="q4_k")
    store = pack(path, tmp_path_factory.mktemp("rp") / "s", progress=False) if source == "store" else None
    lo = int(Model(path, cache=CacheConfig(budget="64M")).cache_info()["min_cache_bytes"])
    stock = Model(path, repack=repack)
    tokens = stock.tokenize(LONG_PROMPT)
    want_logits, want = stock.logits(tokens), stock.generate(tokens, max_tokens=24).tokens
    # verify_all=False: a copy's later reads skip the check, never the repack; the second load warm-starts
    for verify_all in (True, False) if store else (True,):
        m = Model(path, store=store, cache=CacheConfig(budget=lo + lo // 4, verify_all=verify_all), repack=repack)
        assert np.array_equal(m.logits(tokens), want_logits)
        assert m.generate(tokens, max_tokens=24).tokens == want
        assert m.stats().n_misses > 3 * 8  # more reads than experts: slots were evicted and read again
        n_repacked = m.cache_info()["n_repacked"]
        if not repack:
            assert n_repacked == 0
        elif _repacks_q4_k():
            assert n_repacked == 3  # gate, up, down: one group, high precision
        del m


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise or never; never where there is none)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1 : text.index("]")]


def _anon_huge_bytes() -> int:
    """This process's anonymous memory in transparent huge pages (/proc/self/smaps_rollup)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_huge_pages_equal_stock(tiny_model: ModelFactory) -> None:
    """huge_pages=1 puts the slot pools in transparent huge pages, faulted in ahead of the misses by a
    background thread; the output stays stock's, and cache_info says which pools took them."""
    path = tiny_model("qwen2moe", n_expert=16, n_expert_used=4, n_layer=2, n_embd=256, n_ff_exp=512)
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    want = stock.generate(tokens, max_tokens=16).tokens
    before = _anon_huge_bytes()
    m = Model(path, cache=CacheConfig(budget="64M", huge_pages=True, warm=False))
    assert m.warnings == ()
    if _thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this machine")
    assert m.cache_info()["n_huge"] == 3  # gate, up, down: one group, high precision
    # every expert fits (3 x 16 MiB of pools): the thread commits them all, in huge pages (at least a
    # few: a fragmented machine may fall back to small pages for some)
    deadline = time.monotonic() + 10
    while _anon_huge_bytes() - before < 4 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _anon_huge_bytes() - before >= 4 << 20
    assert m.generate(tokens, max_tokens=16).tokens == want
    off = Model(path, cache=CacheConfig(budget="64M", warm=False))
    assert off.cache_info()["n_huge"] == 0
