"""The correctness oracle: with every expert in high precision and nothing skipped, the expert cache
must give stock llama.cpp's tokens and last-position logits, at every budget, prompt length and
thread count."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model

# experts per layer, used per token: >= 8 experts, as the models this project targets have
ARCHS = [("qwen2moe", 8, 2), ("qwen3moe", 16, 4)]


def budgets(model: Model) -> dict[str, int]:
    info = model.cache_info()
    lo, full = int(info["min_cache_bytes"]), int(info["expert_bytes"])
    n_layers = int(info["n_layers"])
    return {
        "one-layer": lo,
        "25pct": max(lo, full // 4 + lo // n_layers),
        "all": lo * n_layers,  # padded slots for every expert of every layer
    }


@pytest.mark.parametrize(("arch", "n_expert", "n_used"), ARCHS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_cache_matches_stock(tiny_model: ModelFactory, arch: str, n_expert: int, n_used: int, n_threads: int) -> None:
    path = tiny_model(arch, n_expert=n_expert, n_expert_used=n_used, n_layer=3)
    stock = Model(path, cache=None, n_threads=n_threads)
    probe = Model(path, cache=CacheConfig.exact(budget="64M"), n_threads=n_threads)
    prompts = [stock.tokenize("a", add_special=False)[:1], stock.tokenize(LONG_PROMPT)]
    assert len(prompts[1]) >= 64
    ref = [(stock.logits(p), stock.generate(p, max_tokens=24).tokens) for p in prompts]
    assert ref[0][1] != ref[1][1], "prompts should lead to different continuations"

    for name, budget in budgets(probe).items():
        m = Model(path, cache=CacheConfig.exact(budget=budget), n_threads=n_threads)
        assert m.has_cache
        for p, (logits, tokens) in zip(prompts, ref, strict=True):
            got = m.logits(p)
            np.testing.assert_allclose(got, logits, rtol=0, atol=1e-5, err_msg=f"{arch} budget {name}")
            assert m.generate(p, max_tokens=24).tokens == tokens, f"{arch} budget {name} prompt {len(p)}"
        s = m.stats()
        assert s.n_lookups > 0


def test_prefill_larger_than_ubatch(tiny_model: ModelFactory) -> None:
    """A prompt spanning several ubatches at the smallest budget (every ubatch routes to all experts)."""
    from moetier import ContextConfig

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    ctx = ContextConfig(n_ctx=512, n_threads=2, n_batch=32, n_ubatch=16)
    stock = Model(path, context=ctx)
    tokens = stock.tokenize(LONG_PROMPT * 3)
    probe = Model(path, cache=CacheConfig.exact(budget="64M"), context=ctx)
    lo = int(probe.cache_info()["min_cache_bytes"])
    cached = Model(path, cache=CacheConfig.exact(budget=lo), context=ctx)
    np.testing.assert_allclose(cached.logits(tokens), stock.logits(tokens), rtol=0, atol=1e-5)
