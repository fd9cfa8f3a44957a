"""Injected expert-read faults (MOETIER_FAULTS, csrc/moetier-io.h): EIO, short reads and flipped
bytes, on the pread and the io_uring paths, demand reads and prefetches. A transient fault
is read again and the output stays stock llama.cpp's; a fault that persists fails the decode (the
request, under the server) with the file named, the slot is not kept, and the next decode without the
fault is exact."""

from __future__ import annotations

import json
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from _server import serve
from conftest import LONG_PROMPT, StoredModel
from moetier import CacheConfig, ConfigError, Model, MoetierError, StoreError

PATHS = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (io_uring, prefetch)


@pytest.fixture
def setup(stored_tiny: StoredModel) -> StoredModel:
    return stored_tiny


def _model(setup: tuple[Path, Path, int], io_uring: int, prefetch: int, verify_all: bool = False) -> Model:
    path, store, lo = setup
    cache = CacheConfig.exact(
        budget=lo, io_uring=io_uring, prefetch=prefetch, prefetch_gate=False, verify_all=verify_all
    )
    return Model(path, store=store, cache=cache)


@pytest.mark.parametrize(("io_uring", "prefetch"), PATHS)
@pytest.mark.parametrize("faults", ["eio:3", "short:2", "flip:3", "eio:5,short:3,flip:7", "short:1"])
def test_transient_faults_are_read_again(
    setup: tuple[Path, Path, int], monkeypatch: pytest.MonkeyPatch, io_uring: int, prefetch: int, faults: str
) -> None:
    """Every N-th read faults, so the second try of a faulted read does not (short reads are
    finished even when every read is short): the logits are stock's, bit for bit. Flips run with
    verify_all, so a flip is caught whichever read of a copy it hits."""
    stock = Model(setup[0])
    tokens = stock.tokenize(LONG_PROMPT)
    want = stock.logits(tokens)
    monkeypatch.setenv("MOETIER_FAULTS", faults)
    m = _model(setup, io_uring, prefetch, verify_all="flip" in faults)
    np.testing.assert_array_equal(m.logits(tokens), want)
    assert m.stats().n_misses > 8, "the budget makes it read, so faults were injected"
    assert m.generate(LONG_PROMPT, max_tokens=8).tokens == stock.generate(LONG_PROMPT, max_tokens=8).tokens


@pytest.mark.parametrize(("io_uring", "prefetch"), PATHS)
@pytest.mark.parametrize(
    ("faults", "error", "says"),
    [
        ("eio:1", MoetierError, r"Input/output error \(layer \d+ expert \d+, "),
        ("flip:1", StoreError, "checksum mismatch"),
    ],
)
def test_persistent_faults_fail_cleanly(
    setup: tuple[Path, Path, int],
    monkeypatch: pytest.MonkeyPatch,
    io_uring: int,
    prefetch: int,
    faults: str,
    error: type[Exception],
    says: str,
) -> None:
    path = setup[0]
    monkeypatch.setenv("MOETIER_FAULTS", faults)
    m = _model(setup, io_uring, prefetch)
    with pytest.raises(error, match=rf"experts\.bin.*{says}|{says}.*experts\.bin"):
        m.generate(LONG_PROMPT, max_tokens=4)
    monkeypatch.delenv("MOETIER_FAULTS")
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    np.testing.assert_array_equal(_model(setup, io_uring, prefetch).logits(tokens), stock.logits(tokens))


@pytest.mark.parametrize(("io_uring", "prefetch"), PATHS)
def test_store_copies_checked_once(setup: tuple[Path, Path, int], io_uring: int, prefetch: int) -> None:
    """verify_all (the default) checks every read; verify_all=0 checks each expert copy's first read
    only and trusts the copy after. Both decode exactly."""
    want = Model(setup[0]).generate(LONG_PROMPT, max_tokens=24).tokens
    copies = 3 * 8  # layers x experts, high precision only
    for verify_all in (False, True):
        m = _model(setup, io_uring, prefetch, verify_all)
        assert m.generate(LONG_PROMPT, max_tokens=24).tokens == want
        reads = m.stats().n_misses + m.prefetch_stats().n_issued
        checked = int(m.cache_info()["reads_checked"])
        assert reads > 2 * copies, "the budget makes it read copies again"
        if verify_all:
            assert copies < checked <= reads
            assert checked >= m.stats().n_misses
            assert prefetch or checked == m.stats().n_misses
        else:
            assert 0 < checked <= copies


@pytest.mark.parametrize(("io_uring", "prefetch"), PATHS)
@pytest.mark.parametrize("faults", ["eio:3", "short:2", "eio:5,short:3", "short:1"])
def test_gguf_transient_faults_are_read_again(
    setup: tuple[Path, Path, int], monkeypatch: pytest.MonkeyPatch, io_uring: int, prefetch: int, faults: str
) -> None:
    """The same from the GGUF: with io_uring each projection is read as the blocks around it into a
    staging buffer (a task of up to three reads), then copied into the slot."""
    path = setup[0]
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    want = stock.logits(tokens)
    monkeypatch.setenv("MOETIER_FAULTS", faults)
    lo = int(Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    m = Model(path, cache=CacheConfig.exact(budget=lo, io_uring=io_uring, prefetch=prefetch, prefetch_gate=False))
    info = m.cache_info()
    assert info["from_store"] is False and info["direct_io"] is True
    assert info["io_uring"] is bool(io_uring), info
    np.testing.assert_array_equal(m.logits(tokens), want)
    assert m.stats().n_misses > 8, "the budget makes it read, so faults were injected"
    assert m.generate(LONG_PROMPT, max_tokens=8).tokens == stock.generate(LONG_PROMPT, max_tokens=8).tokens


@pytest.mark.parametrize(("io_uring", "prefetch"), PATHS)
def test_gguf_persistent_fault_fails_cleanly(
    setup: tuple[Path, Path, int], monkeypatch: pytest.MonkeyPatch, io_uring: int, prefetch: int
) -> None:
    path = setup[0]
    lo = int(Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    cache = CacheConfig.exact(budget=lo, io_uring=io_uring, prefetch=prefetch, prefetch_gate=False)
    monkeypatch.setenv("MOETIER_FAULTS", "eio:1")
    with pytest.raises(MoetierError, match=rf"{path.name}.*Input/output error \(layer \d+ expert \d+, blk\.\d+\.ffn_"):
        Model(path, cache=cache).generate(LONG_PROMPT, max_tokens=4)
    monkeypatch.delenv("MOETIER_FAULTS")
    stock = Model(path)
    tokens = stock.tokenize(LONG_PROMPT)
    np.testing.assert_array_equal(Model(path, cache=cache).logits(tokens), stock.logits(tokens))


def test_bad_fault_spec(setup: tuple[Path, Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("eio", "eio:0", "boom:3", "eio:3,", "short:x"):
        monkeypatch.setenv("MOETIER_FAULTS", bad)
        with pytest.raises(ConfigError, match="MOETIER_FAULTS"):
            _model(setup, 0, 0)


@pytest.mark.parametrize("io_uring", [False, True])
def test_server_under_faults(
    setup: tuple[Path, Path, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_uring: bool
) -> None:
    """Transient faults: every request gets stock's answer and /metrics counts the reads done again.
    Persistent ones: every request fails with the reason, the server stays up and counts them."""
    path, store, lo = setup
    prompt = "The quick brown fox jumps over"
    want = Model(path).generate(prompt, max_tokens=16).text
    args = ["-m", str(path), "--store", str(store), "--cache", str(lo), "--cache-t1", "1", "--cache-t2", "1"]
    args += ["--cache-prefetch", "1", "--cache-io-uring" if io_uring else "--no-cache-io-uring"]

    monkeypatch.setenv("MOETIER_FAULTS", "eio:4,short:3,flip:5")
    with serve(args, tmp_path / "transient.log") as srv:
        for _ in range(3):
            assert srv.complete(prompt)["content"] == want
        assert srv.metric("expert_cache_read_retries_total") > 0
        assert srv.metric("expert_cache_read_errors_total") == 0

    monkeypatch.setenv("MOETIER_FAULTS", "eio:1")
    with serve(args, tmp_path / "persistent.log") as srv:
        for _ in range(2):
            with pytest.raises(urllib.error.HTTPError) as e:
                srv.complete(prompt)
            msg = json.loads(e.value.read())["error"]["message"]
            assert "expert read failed" in msg and "Input/output error" in msg, msg
        assert srv.proc.poll() is None
        assert json.loads(srv.get("/health"))["status"] == "ok"
        assert srv.metric("expert_cache_read_errors_total") >= 2


@pytest.mark.parametrize("io_uring", [0, 1])
def test_store_without_o_direct(setup: tuple[Path, Path, int], monkeypatch: pytest.MonkeyPatch, io_uring: int) -> None:
    """A filesystem that refuses O_DIRECT (tmpfs on older kernels; this one's accepts it, so the
    refusal is injected): reads go through the page cache, without io_uring, and stay exact."""
    stock = Model(setup[0])
    tokens = stock.tokenize(LONG_PROMPT)
    monkeypatch.setenv("MOETIER_FAULTS", "nodirect:1")
    m = _model(setup, io_uring, 0)
    info = m.cache_info()
    assert info["direct_io"] is False and info["io_uring"] is False, info
    np.testing.assert_array_equal(m.logits(tokens), stock.logits(tokens))
    monkeypatch.delenv("MOETIER_FAULTS")
    assert _model(setup, io_uring, 0).cache_info()["direct_io"] is True
