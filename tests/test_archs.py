"""The correctness oracle over every MoE architecture the tiny generator writes: at the smallest
budget the expert cache must give stock llama.cpp's greedy tokens and last-position logits."""

from __future__ import annotations

from pathlib import Path

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


def test_q4_k_experts_at_real_shapes_cache_and_pack(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """The generator's q4_k experts (random K-quant blocks, for models at a real MoE's size): they
    load, decode, match stock through the cache and through a packed store, and the values are
    finite and centred (d * scale * q - dmin * min over random quants)."""
    from moetier import pack
    from moetier.tools.tiny import _random_q4_k

    path = tiny_model("qwen3moe", n_expert=8, n_expert_used=2, n_layer=2, n_embd=256, n_ff_exp=256, expert_type="q4_k")
    stock = Model(path, cache=None)
    want = stock.generate(PROMPT, max_tokens=12).tokens
    store = pack(path, tmp_path / "store", progress=False)
    lo = int(Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    for st in (None, store):
        cached = Model(path, store=st, cache=CacheConfig.exact(budget=lo))
        assert cached.generate(PROMPT, max_tokens=12).tokens == want
        assert cached.stats().n_misses > 0
    import gguf

    blocks = _random_q4_k(1, "x", (4, 512), 0.05)
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    assert values.shape == (4, 512) and np.isfinite(values).all()
    assert abs(float(values.mean())) < 0.01 and 0.02 < float(values.std()) < 0.1
    with pytest.raises(ValueError, match="multiples of 256"):
        tiny_model("qwen3moe", n_embd=128, n_ff_exp=256, expert_type="q4_k")
