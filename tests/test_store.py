"""The expert store: layout, atomic writes, and the oracle through a store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model, PackConfig, pack


def test_store_layout(tiny_model: ModelFactory, tmp_path: Path) -> None:
    path = tiny_model("qwen3moe", n_expert=16, n_expert_used=4, expert_type="f16")
    store = pack(path, tmp_path / "store", PackConfig(low_type="q4_0"), progress=False)
    assert sorted(p.name for p in store.iterdir()) == ["experts.bin", "manifest.json"]
    m = json.loads((store / "manifest.json").read_text())
    assert m["format"] == "moetier-store" and m["version"] == 2 and m["low_type"] == "q4_0"
    assert m["checksum"] == "crc32c"
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


def test_low_type_list_falls_back_per_projection(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """q4_K packs 256 values per block: the gate and up rows (n_embd 256) take it, the down rows (64
    wide) fall back to q4_0; the engine reads and computes each low projection in its own type."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_embd=256)
    store = pack(path, tmp_path / "store", PackConfig(low_type="q4_K,q4_0"), progress=False)
    m = json.loads((store / "manifest.json").read_text())
    assert m["low_type"] == "q4_K"
    types = {p["name"]: p["type_low"] for layer in m["layers"] for p in layer["projections"]}
    assert types == {"gate": "q4_K", "up": "q4_K", "down": "q4_0"}
    # q4_K: 144 bytes per 256 values; q4_0: 18 per 32
    low_row = {"gate": 144, "up": 144, "down": 2 * 18}
    for layer in m["layers"]:
        for p in layer["projections"]:
            assert p["bytes_low"] == low_row[p["name"]] * p["ne"][1]
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)[:1]
    # t1 = 0, t2 = 1: each token's top-1 in high precision, the other expert in low
    low = Model(path, store=store, cache=CacheConfig(budget="64M", t1=0.0, t2=1.0, low_frac=0.5, prefetch=0))
    ref, got = stock.logits(tokens), low.logits(tokens)
    s = low.stats()
    assert s.n_loads_low > 0 and s.n_bytes_low == s.n_loads_low * sum(
        low_row[p["name"]] * p["ne"][1] for p in m["layers"][0]["projections"]
    )
    assert not np.array_equal(got, ref) and np.corrcoef(got, ref)[0, 1] > 0.99


def test_pack_default_place_and_progress(
    tiny_model: ModelFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without out_dir the store goes beside the model (MODEL.experts); progress=True draws a bar in
    bytes that ends at the store's data size; progress=None draws none when stderr is not a terminal."""
    src = tiny_model("qwen2moe", n_expert=4, n_expert_used=2, n_layer=2)
    model = tmp_path / "m.gguf"
    model.write_bytes(src.read_bytes())
    out = pack(model, progress=None)
    assert out == tmp_path / "m.experts" and (out / "manifest.json").is_file()
    assert capsys.readouterr().err == ""
    pack(model, tmp_path / "again", progress=True)
    err = capsys.readouterr().err
    size = (tmp_path / "again" / "experts.bin").stat().st_size
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("pack m.gguf: 100%"), last
    done = last.split("|")[2].split()[0]  # "197k/197k": scaled units, the whole total done
    assert done.split("/")[0] == done.split("/")[1] and done.endswith("k") and "B/s" in last, last
    assert size > 1000


def test_auto_low_type_is_smaller_than_the_experts(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """The default low type, auto: q4_0 below q8_0 experts; below Q4_K experts (4.5 bits per weight,
    as large as q4_0) q2_K where the rows hold 256-value blocks, and q4_0 only where they do not, so
    the low copies of a Q4_K model are smaller than the model's own experts."""
    assert PackConfig().low_type == "auto"
    q8 = tiny_model("qwen3moe", n_expert=8, n_expert_used=2, n_layer=2, n_embd=256, n_ff_exp=256, expert_type="q8_0")
    m = json.loads((pack(q8, tmp_path / "q8", progress=False) / "manifest.json").read_text())
    assert {p["type_low"] for layer in m["layers"] for p in layer["projections"]} == {"q4_0"}
    q4k = tiny_model("qwen3moe", n_expert=8, n_expert_used=2, n_layer=2, n_embd=256, n_ff_exp=256, expert_type="q4_k")
    store = pack(q4k, tmp_path / "q4k", progress=False)
    m = json.loads((store / "manifest.json").read_text())
    assert m["low_type"] == "q2_K"
    for layer in m["layers"]:
        for p in layer["projections"]:
            assert p["type_low"] == "q2_K" and p["bytes_low"] < p["bytes_high"]
    # and it serves mixed precision
    mixed = CacheConfig(budget="64M", t1=0.0, t2=1.0, prefetch=0)
    assert Model(q4k, store=store, cache=mixed).generate("x", max_tokens=4).stats.n_loads_low > 0
