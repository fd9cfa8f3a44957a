"""The expert store: layout, atomic writes, and the oracle through a store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model, PackConfig, pack


def test_store_layout(tiny_model: ModelFactory, tmp_path: Path) -> None:
    path = tiny_model("qwen3moe", n_expert=16, n_expert_used=4, expert_type="f16")
    store = pack(path, tmp_path / "store", PackConfig(low_type="q4_0"), progress=False)
    assert sorted(p.name for p in store.iterdir()) == ["experts.bin", "manifest.json"]
    m = json.loads((store / "manifest.json").read_text())
    assert m["format"] == "moetier-store" and m["version"] == 1 and m["low_type"] == "q4_0"
    assert (store / "experts.bin").stat().st_size == m["data_size"]
    offsets: list[int] = []
    for layer in m["layers"]:
        assert layer["n_expert"] == 16
        assert sorted(p["name"] for p in layer["projections"]) == ["down", "gate", "up"]
        for p in layer["projections"]:
            assert p["type_high"] == "f16" and p["type_low"] == "q4_0"
            assert p["bytes_low"] < p["bytes_high"]
            for o in p["offset_high"] + p["offset_low"]:
                assert o % 4096 == 0
            offsets += p["offset_high"] + p["offset_low"]
    assert len(set(offsets)) == len(offsets), "no two slices share an offset"


def test_oracle_through_store(tiny_model: ModelFactory, tmp_path: Path) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    store = pack(path, tmp_path / "store", progress=False)
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    probe = Model(path, store=store, cache=CacheConfig.exact(budget="64M"))
    assert probe.cache_info()["from_store"] is True
    lo = int(probe.cache_info()["min_cache_bytes"])
    m = Model(path, store=store, cache=CacheConfig.exact(budget=lo))
    np.testing.assert_allclose(m.logits(tokens), stock.logits(tokens), rtol=0, atol=1e-5)
    assert m.generate(tokens, max_tokens=24).tokens == stock.generate(tokens, max_tokens=24).tokens
    s = m.stats()
    assert s.n_misses > 0 and s.n_bytes_read > 0


def test_repack_replaces_atomically(tiny_model: ModelFactory, tmp_path: Path) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    out = tmp_path / "store"
    pack(path, out, progress=False)
    first = json.loads((out / "manifest.json").read_text())["store_id"]
    pack(path, out, progress=False)
    second = json.loads((out / "manifest.json").read_text())["store_id"]
    assert first != second
    assert not list(out.glob("*.tmp")), "temporary files are renamed or removed"
    Model(path, store=out, cache=CacheConfig.exact(budget="16M")).generate("x", max_tokens=2)
