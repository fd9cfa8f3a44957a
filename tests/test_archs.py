"""The correctness oracle over every MoE architecture the tiny generator writes: at the smallest
budget the expert cache must give stock llama.cpp's greedy tokens and last-position logits."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ModelFactory
from moetier import CacheConfig, Model
from moetier.tools.tiny import MOE_ARCHS

PROMPT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. Sphinx of quartz!"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_arch_cache_matches_stock(tiny_model: ModelFactory, arch: str) -> None:
    path = tiny_model(arch, n_expert=8, n_expert_used=2, n_layer=3)
    stock = Model(path, cache=None)
    assert not stock.has_cache
    lo = int(Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    cached = Model(path, cache=CacheConfig.exact(budget=lo))
    assert cached.has_cache

    tokens = stock.tokenize(PROMPT)
    assert tokens == cached.tokenize(PROMPT)
    np.testing.assert_allclose(cached.logits(tokens), stock.logits(tokens), rtol=0, atol=1e-5, err_msg=arch)

    want = stock.generate(PROMPT, max_tokens=16).tokens
    got = cached.generate(PROMPT, max_tokens=16).tokens
    assert want, f"{arch}: stock generated nothing"
    assert got == want, arch
    assert cached.stats().n_misses > 0
