"""A corpus of hand-made damaged stores: every one fails with a StoreError naming the file
and the problem, at load or at the first read of a damaged expert, and never crashes, hangs, reads
outside experts.bin or allocates from an unchecked size. The damage is written into a copy of a
packed store; the fuzzer (bench/fuzz_store.py) drives the same loader with random bytes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model, StoreError, pack

Manifest = dict[str, Any]


def _proj(m: Manifest, layer: int = 0, proj: int = 0) -> dict[str, Any]:
    p: dict[str, Any] = m["layers"][layer]["projections"][proj]
    return p


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Manifest], None]:
    def edit(m: Manifest) -> None:
        d: Any = m
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return edit


def _drop(path: tuple[Any, ...]) -> Callable[[Manifest], None]:
    def edit(m: Manifest) -> None:
        d: Any = m
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]

    return edit


P0 = ("layers", 0, "projections", 0)
# name -> (edit of the parsed manifest, what the error must say)
EDITS: dict[str, tuple[Callable[[Manifest], None], str]] = {
    "wrong format": (_set(("format",), "gguf"), "not a moetier store"),
    "future version": (_set(("version",), 99), "store version 99"),
    "version a string": (_set(("version",), "1"), "corrupt"),
    "no layers": (_drop(("layers",)), "corrupt"),
    "layers not a list": (_set(("layers",), {"0": 1}), "corrupt"),
    "empty layers": (_set(("layers",), []), "manifest"),
    "layer index past the model": (_set(("layers", 0, "layer"), 4096), "manifest"),
    "negative layer index": (_set(("layers", 0, "layer"), -1), "manifest"),
    "layer listed twice": (lambda m: m["layers"].append(json.loads(json.dumps(m["layers"][0]))), "manifest"),
    "expert count off by one": (_set(("layers", 0, "n_expert"), 9), "manifest"),
    "huge expert count": (_set(("layers", 0, "n_expert"), 2**40), "manifest"),
    "offsets shorter than the experts": (lambda m: _proj(m)["offset_high"].pop(), "manifest"),
    "checksums shorter than the experts": (lambda m: _proj(m)["checksum_low"].pop(), "manifest"),
    "offset past the end": (lambda m: _proj(m)["offset_high"].__setitem__(3, m["data_size"] + 4096), "manifest"),
    "offset straddles the end": (
        lambda m: _proj(m)["offset_high"].__setitem__(3, m["data_size"] - 4096),
        "manifest",
    ),
    "negative offset": (lambda m: _proj(m)["offset_low"].__setitem__(0, -4096), "manifest"),
    "huge offset": (lambda m: _proj(m)["offset_high"].__setitem__(0, 2**63 - 4096), "manifest"),
    "misaligned offset": (lambda m: _proj(m)["offset_high"].__setitem__(1, _proj(m)["offset_high"][1] + 1), "manifest"),
    "overlapping ranges": (
        lambda m: _proj(m)["offset_high"].__setitem__(1, _proj(m)["offset_high"][0]),
        "manifest",
    ),
    "low over a high range": (
        lambda m: _proj(m)["offset_low"].__setitem__(2, _proj(m)["offset_high"][2]),
        "manifest",
    ),
    "huge expert size": (_set((*P0, "bytes_high"), 2**62), "manifest"),
    "expert size not the tensor's": (_set((*P0, "bytes_high"), 4096), "manifest"),
    "zero expert size": (_set((*P0, "bytes_low"), 0), "manifest"),
    "shape not the model's": (_set((*P0, "ne"), [64, 65]), "manifest"),
    "huge shape": (_set((*P0, "ne"), [2**40, 2**40]), "manifest"),
    "unknown type": (_set((*P0, "type_low"), "q9_9"), "manifest"),
    "tensor of another layer": (_set((*P0, "tensor"), "blk.1.ffn_gate_exps.weight"), "manifest"),
    "tensor name not a tensor": (_set((*P0, "tensor"), "blk.0.attn_q.weight"), "manifest"),
    "unknown projection": (_set((*P0, "name"), "gate_down"), "manifest"),
    "no checksums": (_drop((*P0, "checksum_high")), "corrupt"),
    "checksum not hex": (lambda m: _proj(m)["checksum_high"].__setitem__(0, "zz"), "manifest"),
    "huge alignment": (_set(("alignment",), 2**40), "manifest"),
    "zero alignment": (_set(("alignment",), 0), "manifest"),
    "data size past the file": (_set(("data_size",), 2**50), "experts.bin"),
    "data file elsewhere": (_set(("data_file",), "../../etc/passwd"), "manifest"),
    "another model's size": (_set(("model", "file_size"), 12345), "different model"),
    "non-ASCII string": (_set(("low_type",), "q4_\u00e9"), "manifest"),
}


@pytest.fixture(scope="module")
def packed_module(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from moetier.tools.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("bad-stores")
    path = write_tiny_model(root / "m.gguf", "qwen2moe", n_expert=8, n_expert_used=2)
    return path, pack(path, root / "store", progress=False)


def _damaged(packed: tuple[Path, Path], tmp_path: Path, text: bytes) -> Path:
    store = tmp_path / "store"
    shutil.copytree(packed[1], store)
    (store / "manifest.json").write_bytes(text)
    return store


def _expect_store_error(model: Path, store: Path, match: str) -> None:
    """The load, or else the first decode (every expert routed at some point), fails cleanly."""
    with pytest.raises(StoreError, match=match) as info:
        m = Model(model, store=store, cache=CacheConfig.exact(budget="16M"))
        m.generate(LONG_PROMPT, max_tokens=8)
    assert str(store) in str(info.value), "the message names the store's file"


@pytest.mark.parametrize("name", sorted(EDITS))
def test_damaged_manifest(name: str, packed_module: tuple[Path, Path], tmp_path: Path) -> None:
    edit, match = EDITS[name]
    m = json.loads((packed_module[1] / "manifest.json").read_text())
    edit(m)
    store = _damaged(packed_module, tmp_path, json.dumps(m, indent=1).encode())
    _expect_store_error(packed_module[0], store, match)


def test_manifest_truncated_at_every_section(packed_module: tuple[Path, Path], tmp_path: Path) -> None:
    text = (packed_module[1] / "manifest.json").read_bytes()
    # every top-level key and every layer's and projection's first key: a cut in each section
    cuts = sorted(
        {text.index(k) for k in (b'"format"', b'"version"', b'"store_id"', b'"model"', b'"low_type"')}
        | {i for i in range(len(text)) if text.startswith(b'"layer"', i) or text.startswith(b'"name"', i)}
        | {1, len(text) // 2, len(text) - 2}
    )
    assert len(cuts) > 10
    for i, cut in enumerate(cuts):
        store = _damaged(packed_module, tmp_path / str(i), text[:cut])
        _expect_store_error(packed_module[0], store, r"manifest.json.*corrupt")


@pytest.mark.parametrize("where", ["format", "middle", "store id", "end"])
def test_manifest_with_a_non_utf8_byte(where: str, packed_module: tuple[Path, Path], tmp_path: Path) -> None:
    """One byte 0xff (this used to surface as a UnicodeDecodeError, not a StoreError)."""
    text = (packed_module[1] / "manifest.json").read_bytes()
    pos = {
        "format": text.index(b"moetier-store") + 3,
        "middle": len(text) // 2,
        "store id": text.index(b'"store_id"') + 14,
        "end": len(text) - 3,
    }[where]
    store = _damaged(packed_module, tmp_path, text[:pos] + b"\xff" + text[pos + 1 :])
    _expect_store_error(packed_module[0], store, r"manifest.json.*corrupt.*\\xff")


def test_empty_and_binary_manifests(packed_module: tuple[Path, Path], tmp_path: Path) -> None:
    for i, text in enumerate([b"", b"\x00" * 64, b"\xff\xfe{}", b"[]", b"null", b'"moetier-store"', b"{}" * 3]):
        store = _damaged(packed_module, tmp_path / str(i), text)
        _expect_store_error(packed_module[0], store, r"manifest.json")


def test_store_of_another_model_with_the_same_shapes(
    packed_module: tuple[Path, Path], tiny_model: ModelFactory
) -> None:
    other = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, seed=11)
    _expect_store_error(other, packed_module[1], r"manifest.json.*different model")


def test_layers_with_other_low_types_get_pools_of_their_own(packed_module: tuple[Path, Path], tmp_path: Path) -> None:
    """A store whose layers hold low-precision copies of different types (or sizes): each layer's low
    copies are read into slots of its own type and size. A pool group took both from its first layer,
    so another layer's copies ran through the wrong kernels, or overran their slots."""
    from moetier import _core

    model, packed = packed_module
    m = json.loads((packed / "manifest.json").read_text())
    data = (packed / "experts.bin").read_bytes()
    for p in m["layers"][1]["projections"]:
        assert p["type_low"] == "q4_0" and p["ne"][0] % 32 == 0
        p["type_low"] = "q4_1"  # 20 bytes a block of 32 where q4_0 takes 18: still inside the padded range
        p["bytes_low"] = p["ne"][0] // 32 * 20 * p["ne"][1]
        p["checksum_low"] = [f"{_core.checksum(data[o : o + p['bytes_low']]):016x}" for o in p["offset_low"]]
    store = _damaged(packed_module, tmp_path, json.dumps(m, indent=1).encode())
    cache = CacheConfig(budget="16M", t1=0.0, t2=1.0)  # every miss but the top-1 read in low precision
    mixed = Model(model, store=store, cache=cache)
    assert mixed.cache_info()["n_groups"] == 2
    r = mixed.generate(LONG_PROMPT, max_tokens=8)
    assert r.stats.n_loads_low > 0 and len(r.tokens) == 8
    assert Model(model, store=packed, cache=cache).cache_info()["n_groups"] == 1


def test_a_model_that_differs_only_in_later_experts_is_not_the_stores(
    packed_module: tuple[Path, Path], tmp_path: Path
) -> None:
    """A GGUF with the packed one's header, size and first expert, but another expert in a later layer
    (a variant edited in some layers, a consolidated variant): the store is refused, not served with
    the old experts. A store packed before the manifest held the experts sample still loads."""
    import gguf

    model, packed = packed_module
    t = next(t for t in gguf.GGUFReader(model).tensors if t.name == "blk.1.ffn_down_exps.weight")
    edited = tmp_path / "edited.gguf"
    data = bytearray(model.read_bytes())
    last = int(t.data_offset) + int(t.n_bytes) * 7 // 8 + 64  # the last of 8 experts, replaced whole in a variant
    data[last : last + 8] = bytes(8 - i for i in range(8))
    edited.write_bytes(bytes(data))
    cache = CacheConfig.exact(budget="16M")
    with pytest.raises(StoreError, match="the store was packed from a different model"):
        Model(edited, store=packed, cache=cache)
    m = json.loads((packed / "manifest.json").read_text())
    assert len(m["model"]["experts_sample"]) == 16
    del m["model"]["experts_sample"]
    older = _damaged(packed_module, tmp_path, json.dumps(m, indent=1).encode())
    Model(edited, store=older, cache=cache)  # what the older format can tell: the same model
