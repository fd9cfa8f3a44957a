"""Routing from a trace (MOETIER_ROUTING_TRACE, benchmarks only): every served layer takes its experts
from a recorded routing trace instead of its router, so a random-weight model of a trained MoE's
geometry is cached as that MoE would be. Here a trace that always picks the same two experts per
layer fills a small cache once and then always hits, where the model's own routing keeps missing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model, ModelError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu import write_routing_file


@pytest.fixture(scope="module")
def model_path(tiny_model: ModelFactory) -> Path:
    return tiny_model("qwen3moe", n_expert=8, n_expert_used=2, n_layer=3)


def _trace(tmp_path: Path, layers: int = 3, k: int = 2, n_expert: int = 8) -> Path:
    ids = np.zeros((50, layers, k), dtype=np.uint8)
    ids[:, :, 1] = 1  # experts 0 and 1 in every layer, every token
    npz = tmp_path / "trace.npz"
    np.savez(npz, ids=ids, n_experts=np.int32(n_expert), top_k=np.int32(k))
    out = tmp_path / "routing.bin"
    assert write_routing_file(npz, out) == (50, layers, k, n_expert)
    return out


def test_trace_routing_drives_the_cache(model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mn = int(Model(model_path, cache=CacheConfig(budget="64M")).cache_info()["min_cache_bytes"])
    cfg = CacheConfig(budget=mn, prefetch=0, warm=False)
    own = Model(model_path, cache=cfg)
    own.generate(LONG_PROMPT, max_tokens=16)
    assert own.stats().n_misses > 6  # 3 layers x top-2 of 8 through one layer's 8 slots
    monkeypatch.setenv("MOETIER_ROUTING_TRACE", str(_trace(tmp_path)))
    m = Model(model_path, cache=cfg)
    assert any("taken from this routing trace" in w and "meaningless" in w for w in m.warnings), m.warnings
    m.generate(LONG_PROMPT, max_tokens=16)
    s = m.stats()
    assert s.n_misses == 6 and s.n_lookups > 6  # each layer's two experts, read once


def test_trace_of_another_geometry_is_refused(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOETIER_ROUTING_TRACE", str(_trace(tmp_path, layers=4)))
    with pytest.raises(ModelError, match=r"the trace routes 4 MoE layers, top-2 of 8 experts; the model has 3"):
        Model(model_path, cache=CacheConfig(budget="64M"))
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"nope")
    monkeypatch.setenv("MOETIER_ROUTING_TRACE", str(bad))
    with pytest.raises(ModelError, match=r"bad\.bin: not a routing trace"):
        Model(model_path, cache=CacheConfig(budget="64M"))
    dup = tmp_path / "dup.npz"
    ids = np.zeros((5, 3, 2), dtype=np.uint8)  # expert 0 twice in every row
    np.savez(dup, ids=ids, n_experts=np.int32(8), top_k=np.int32(2))
    write_routing_file(dup, tmp_path / "dup.bin")
    monkeypatch.setenv("MOETIER_ROUTING_TRACE", str(tmp_path / "dup.bin"))
    with pytest.raises(ModelError, match=r"routing trace row 0 names expert 0 twice"):
        Model(model_path, cache=CacheConfig(budget="64M"))


def test_trace_needs_slot_choice(model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A VRAM tier that holds every expert has no per-layer slot choice to route through: refused."""
    monkeypatch.setenv("MOETIER_ROUTING_TRACE", str(_trace(tmp_path)))
    with pytest.raises(ModelError, match=r"a VRAM tier that holds every expert"):
        Model(model_path, cache=CacheConfig(budget="64M", vram="64M", vram_host=True))
