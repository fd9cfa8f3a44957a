"""Cache counters: hits + misses = lookups, bytes read = missed experts' bytes, and with a budget
that holds every expert each expert is read at most once."""

from __future__ import annotations

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model


def expert_bytes(m: Model) -> int:
    info = m.cache_info()
    n = int(info["n_layers"]) * int(info["n_expert"])
    assert int(info["expert_bytes"]) % n == 0
    return int(info["expert_bytes"]) // n


def test_counters_add_up(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    probe = Model(path, cache=CacheConfig.exact(budget="64M"))
    lo = int(probe.cache_info()["min_cache_bytes"])
    m = Model(path, cache=CacheConfig.exact(budget=lo))
    r = m.generate(LONG_PROMPT, max_tokens=32)
    s = r.stats
    assert s.n_lookups > 0
    assert s.n_misses > 0 and s.n_hits > 0, "a one-layer budget over 3 layers must both hit and miss"
    assert s.n_hits + s.n_misses == s.n_lookups
    assert s.n_bytes_read == s.n_misses * expert_bytes(m)
    for layer in s.layers:
        assert layer.n_hits + layer.n_misses == layer.n_lookups
        assert layer.n_bytes_read == layer.n_misses * expert_bytes(m)
    assert s.read_seconds > 0

    m.reset_stats()
    z = m.stats()
    assert (z.n_lookups, z.n_hits, z.n_misses, z.n_bytes_read) == (0, 0, 0, 0)


def test_full_budget_reads_each_expert_once(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen3moe", n_expert=16, n_expert_used=4, n_layer=3)
    probe = Model(path, cache=CacheConfig.exact(budget="64M"))
    info = probe.cache_info()
    m = Model(path, cache=CacheConfig.exact(budget=int(info["min_cache_bytes"]) * int(info["n_layers"])))
    assert m.cache_info()["n_slots"] == int(info["n_layers"]) * int(info["n_expert"])
    total_misses = 0
    for prompt in [LONG_PROMPT, "hello world", LONG_PROMPT[::-1]]:
        r = m.generate(prompt, max_tokens=32)
        total_misses += r.stats.n_misses
        for layer in r.stats.layers:
            assert layer.n_misses <= int(info["n_expert"])
    # every expert read at most once over all three generations
    assert total_misses <= int(info["n_layers"]) * int(info["n_expert"])
    r = m.generate(LONG_PROMPT, max_tokens=8)
    assert r.stats.n_misses == 0, "a repeated prompt with every expert cached reads nothing"
    assert r.stats.n_hits == r.stats.n_lookups > 0


def test_layers_keep_a_share_of_the_cache(tiny_model: ModelFactory) -> None:
    """One token needs more experts than the cache holds: a global recency order would evict each
    layer's experts right before that layer runs again (0% hits); the per-layer share keeps hits."""
    path = tiny_model("qwen3moe", n_expert=16, n_expert_used=8, n_layer=8)
    info = Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()
    per_token = int(info["n_layers"]) * 8
    budget = int(info["expert_bytes"]) // 4  # 32 of 128 experts, a quarter of one token's 64
    m = Model(path, cache=CacheConfig.exact(budget=budget))
    assert int(m.cache_info()["n_slots"]) < per_token
    r = m.generate("x", max_tokens=48)
    assert r.stats.hit_rate > 0.15, r.stats
