"""Reads overlapped with compute: with io_uring a layer's expert reads start when it is routed, and
the graph runs the nodes that do not need its experts (the shared expert) before it waits for them.
The order changes, the output must not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, ContextConfig, Model, PackConfig, pack


@pytest.fixture(scope="module")
def model_and_store(tiny_model: ModelFactory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=4)
    return path, pack(path, tmp_path_factory.mktemp("ov") / "s", PackConfig(low_type="q4_0"), progress=False)


def _index(nodes: list[str], name: str) -> int:
    assert name in nodes, f"{name} not in the graph"
    return nodes.index(name)


@pytest.mark.parametrize("io_uring", [0, 1])
def test_shared_expert_runs_while_reads_do(model_and_store: tuple[Path, Path], io_uring: int) -> None:
    path, store = model_and_store
    m = Model(path, store=store, cache=CacheConfig.exact("1M", io_uring=io_uring))
    info = m.cache_info()
    if io_uring and not info["io_uring"]:
        pytest.skip("the kernel refuses io_uring here (the I/O threads serve instead)")
    assert bool(info["io_uring"]) == bool(io_uring)
    nodes = m.graph_nodes(m.tokenize("the shared expert"))
    n_layers = int(info["n_layers"])
    n_prefetch = 0
    for il in range(n_layers):
        resolve = _index(nodes, f"moetier_resolve-{il}")
        load = _index(nodes, f"moetier_load-{il}")
        shexp = _index(nodes, f"ffn_shexp-{il}")
        out = _index(nodes, f"ffn_out-{il}")
        assert resolve < load < out and shexp < out
        if io_uring:
            # moved between the routing (the reads start) and the wait for them
            assert resolve < shexp < load
        else:
            assert load < shexp  # stock order: the compute threads read, then compute
        if f"moetier_prefetch-{il}" in nodes:  # every layer with a next one in its group
            n_prefetch += 1
            prefetch = nodes.index(f"moetier_prefetch-{il}")
            # on the ring the next layers' reads start before this layer waits for its own; the
            # I/O threads are woken only after the compute threads did this layer's reads
            assert resolve < prefetch < load if io_uring else load < prefetch < out
    assert n_prefetch == n_layers - 1


def test_overlap_output_equals_stock(model_and_store: tuple[Path, Path]) -> None:
    path, store = model_and_store
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    want = stock.logits(tokens)
    ref = stock.generate(tokens, max_tokens=16).tokens
    lo = int(Model(path, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    for io in ({"io_threads": 0}, {"io_uring": 0}, {"io_uring": 1}, {"io_uring": 1, "prefetch": 2}):
        for source in (None, store):
            m = Model(path, store=source, cache=CacheConfig.exact(lo, **io))
            np.testing.assert_allclose(m.logits(tokens), want, rtol=0, atol=1e-4)
            res = m.generate(tokens, max_tokens=16)
            assert res.tokens == ref
            assert res.stats.n_misses > 0 and res.stats.n_bytes_read > 0


def test_overlap_keeps_kv_cache_reads_behind_writes(model_and_store: tuple[Path, Path]) -> None:
    """With an F32 KV cache, flash attention casts the cache views to F16: casts that depend on the
    cache only, not on this token. Moved ahead of the load op they would read the cache before this
    token's keys and values are written into it; they must stay behind the write."""
    path, store = model_and_store
    ctx = ContextConfig(n_ctx=512, type_k="f32", type_v="f32", flash_attn="on")
    stock = Model(path, context=ctx)
    tokens = stock.tokenize(LONG_PROMPT)
    ref = stock.generate(tokens, max_tokens=16).tokens
    lo = int(Model(path, cache=CacheConfig.exact("64M")).cache_info()["min_cache_bytes"])
    m = Model(path, store=store, cache=CacheConfig.exact(lo, io_uring=1), context=ctx)
    if not m.cache_info()["io_uring"]:
        pytest.skip("the kernel refuses io_uring here (no reorder)")
    nodes = m.graph_nodes(tokens[:1])
    for il in range(1, int(m.cache_info()["n_layers"])):
        # layer il writes this token into its cache after layer il - 1's experts were loaded; the
        # casts that read it stay behind that load
        for kv in ("k", "v"):
            cast = _index(nodes, f"cache_{kv}_l{il} (view) (permuted) (copy)")
            assert cast > _index(nodes, f"moetier_load-{il - 1}")
    np.testing.assert_allclose(m.logits(tokens), stock.logits(tokens), rtol=0, atol=1e-4)
    assert m.generate(tokens, max_tokens=16).tokens == ref


def test_context_config_errors(model_and_store: tuple[Path, Path]) -> None:
    path, _ = model_and_store
    with pytest.raises(ConfigError, match="flash_attn"):
        ContextConfig(flash_attn="yes")
    with pytest.raises(ConfigError, match="type_k"):
        ContextConfig(type_k="")
    with pytest.raises(ConfigError, match="'f99' is not a KV cache type"):
        Model(path, context=ContextConfig(type_v="f99"))
    with pytest.raises(ConfigError, match="'iq2_xxs' is not a KV cache type"):
        Model(path, context=ContextConfig(type_k="iq2_xxs"))
    with pytest.raises(ConfigError, match="needs flash attention"):
        ContextConfig(type_v="q8_0", flash_attn="off")
