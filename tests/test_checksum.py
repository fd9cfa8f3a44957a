"""The store's checksum: CRC32C with the CPU's CRC instructions gives the standard values and the
portable loop's; a store says which checksum it holds; a store of the earlier version is verified
with its own hash and said so; every read is verified by default."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model, StoreError, _core, pack


def _crc32c_reference(data: bytes) -> int:
    """CRC32C bit by bit, from its definition (reflected polynomial 0x82F63B78, ~0 in and out)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_standard_values() -> None:
    # the check value of the CRC catalogue, and RFC 3720's (iSCSI) test vectors
    assert _core.checksum(b"123456789") == 0xE3069283
    assert _core.checksum(bytes(32)) == 0x8A9136AA
    assert _core.checksum(b"\xff" * 32) == 0x62A8AB43
    assert _core.checksum(bytes(range(32))) == 0x46DD794E
    assert _core.checksum(b"") == 0
    assert _core.crc32c_impl() in ("sse4.2", "armv8-crc", "portable")


def test_hardware_lanes_agree_with_the_portable_loop() -> None:
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, 3 * 3 * 8192 + 4096, dtype=np.uint8)
    # lengths around the 3-lane block sizes (3 x 256 and 3 x 8192 bytes) and the 8-byte words
    for n in (0, 1, 7, 8, 9, 767, 768, 769, 24575, 24576, 24577, 3 * 3 * 8192 + 4095):
        for off in (0, 1, 5):
            view = memoryview(buf[off : off + n].tobytes())
            hw = _core.checksum(view)
            assert hw == _core.checksum(view, "crc32c-portable"), (n, off)
            if n <= 769:
                assert hw == _crc32c_reference(bytes(view)), (n, off)
    with pytest.raises(ValueError, match="kind is one of"):
        _core.checksum(b"x", "md5")


def _manifest(store: Path) -> dict[str, object]:
    return dict(json.loads((store / "manifest.json").read_text()))


def test_store_holds_crc32c_of_each_copy(tiny_model: ModelFactory, tmp_path: Path) -> None:
    store = pack(tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3), tmp_path / "store", progress=False)
    m = _manifest(store)
    assert m["version"] == 2 and m["checksum"] == "crc32c"
    data = (store / "experts.bin").read_bytes()
    n = 0
    for layer in m["layers"]:  # type: ignore[attr-defined]
        for p in layer["projections"]:
            for prec in ("high", "low"):
                for off, want in zip(p[f"offset_{prec}"], p[f"checksum_{prec}"], strict=True):
                    got = _core.checksum(data[off : off + p[f"bytes_{prec}"]])
                    assert int(want, 16) == got
                    n += 1
    assert n == 3 * 3 * 8 * 2


def _as_version_1(store: Path) -> None:
    """Rewrites a store's manifest as the earlier version wrote it: no "checksum", 64-bit hashes."""
    m = _manifest(store)
    data = (store / "experts.bin").read_bytes()
    m["version"] = 1
    del m["checksum"]
    for layer in m["layers"]:  # type: ignore[attr-defined]
        for p in layer["projections"]:
            for prec in ("high", "low"):
                p[f"checksum_{prec}"] = [
                    f"{_core.checksum(data[o : o + p[f'bytes_{prec}']], 'fnv64'):016x}" for o in p[f"offset_{prec}"]
                ]
    (store / "manifest.json").write_text(json.dumps(m))


def test_store_of_the_earlier_version_is_verified_with_its_own_hash(tiny_model: ModelFactory, tmp_path: Path) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    store = pack(path, tmp_path / "store", progress=False)
    _as_version_1(store)
    lo = int(Model(path, store=store, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    m = Model(path, store=store, cache=CacheConfig.exact(budget=lo))
    (warning,) = [w for w in m.warnings if "earlier version" in w]
    assert str(store / "manifest.json") in warning and "fnv64" in warning and "re-run `moetier pack`" in warning
    stock = Model(path)
    assert m.generate(LONG_PROMPT, max_tokens=16).tokens == stock.generate(LONG_PROMPT, max_tokens=16).tokens
    assert m.cache_info()["reads_checked"] > 0
    # damaged: its own hash catches it (never a silent skip)
    data = bytearray((store / "experts.bin").read_bytes())
    for o in _manifest(store)["layers"][0]["projections"][0]["offset_high"]:  # type: ignore[index]
        data[o + 7] ^= 0x40
    (store / "experts.bin").write_bytes(bytes(data))
    bad = Model(path, store=store, cache=CacheConfig.exact(budget=lo, warm=False))
    with pytest.raises(StoreError, match=r"experts\.bin: checksum mismatch for layer 0 expert \d+"):
        bad.generate(LONG_PROMPT, max_tokens=16)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ({"version": 3}, "store version 3, this build reads versions 1 and 2"),
        ({"checksum": "sha1"}, 'checksum "sha1", this build reads "crc32c"'),
    ],
)
def test_unknown_version_or_checksum_is_refused(
    tiny_model: ModelFactory, tmp_path: Path, edit: dict[str, object], says: str
) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    store = pack(path, tmp_path / "store", progress=False)
    (store / "manifest.json").write_text(json.dumps(_manifest(store) | edit))
    with pytest.raises(StoreError, match=f"manifest.json.*{says}"):
        Model(path, store=store, cache=CacheConfig.exact(budget="64M"))


def test_every_read_is_verified_by_default(tiny_model: ModelFactory, tmp_path: Path) -> None:
    assert CacheConfig().verify_all is True
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    store = pack(path, tmp_path / "store", progress=False)
    lo = int(Model(path, store=store, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    m = Model(path, store=store, cache=CacheConfig.exact(budget=lo, warm=False, prefetch=0))
    m.generate(LONG_PROMPT, max_tokens=24)
    info, s = m.cache_info(), m.stats()
    # at the minimum budget experts are read again and again: every one of those reads was checked
    assert s.n_misses > 8 * 3 and info["reads_checked"] == s.n_misses
