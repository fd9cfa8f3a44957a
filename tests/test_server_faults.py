"""A failed expert read under `moetier serve`: the request that needed the expert fails with a clear
error, the server stays up, /metrics counts the fault, and once the store is whole again the next
request gets stock llama.cpp's answer."""

from __future__ import annotations

import json
import re
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from _server import serve
from conftest import StoredModel
from moetier import Model

PROMPT = "The quick brown fox jumps over"


@pytest.mark.parametrize("io_uring", [False, True])
def test_corrupt_expert_fails_the_request_not_the_server(
    stored_tiny: StoredModel, tmp_path: Path, io_uring: bool
) -> None:
    path, store, lo = stored_tiny
    want = Model(path).generate(PROMPT, max_tokens=16).text

    manifest = json.loads((store / "manifest.json").read_text())
    data = store / "experts.bin"
    good = data.read_bytes()
    bad = bytearray(good)
    for o in manifest["layers"][0]["projections"][0]["offset_high"]:  # whatever layer 0 routes is corrupt
        bad[o + 5] ^= 0xFF

    args = ["-m", str(path), "--store", str(store), "--cache", str(lo), "--cache-t1", "1", "--cache-t2", "1"]
    args.append("--cache-io-uring" if io_uring else "--no-cache-io-uring")
    # the store is damaged after the warm-up read its experts intact: only verify_all checks them again
    args += ["--cache-verify-all"]
    log = tmp_path / "server.log"
    with serve(args, log) as srv:
        assert srv.metric("expert_cache_read_errors_total") == 0
        data.write_bytes(bytes(bad))  # damaged while the server runs (reads bypass the page cache)
        for _ in range(2):  # nothing cached the bad expert: the second request fails as the first
            with pytest.raises(urllib.error.HTTPError) as e:
                srv.complete(PROMPT)
            body = json.loads(e.value.read())
            assert "expert read failed" in body["error"]["message"]
            assert "checksum mismatch" in body["error"]["message"]
        assert srv.proc.poll() is None, log.read_text()[-2000:]
        assert json.loads(srv.get("/health"))["status"] == "ok"
        assert srv.metric("expert_cache_read_errors_total") >= 2

        data.write_bytes(good)
        assert srv.complete(PROMPT)["content"] == want
        assert srv.proc.poll() is None


def test_store_damaged_in_place_never_gives_a_wrong_answer(stored_tiny: StoredModel, tmp_path: Path) -> None:
    """With the defaults (every read verified), a store damaged in place under a running server, at
    several random ranges of expert bytes: every answer is stock's or an error naming the file, layer
    and expert; once the file is restored the answer is stock's again (nothing damaged stayed cached)."""
    path, store, lo = stored_tiny
    want = Model(path).generate(PROMPT, max_tokens=16).text
    manifest = json.loads((store / "manifest.json").read_text())
    # the high copies' byte ranges: what an exact decode reads
    ranges = [
        (o, p["bytes_high"]) for layer in manifest["layers"] for p in layer["projections"] for o in p["offset_high"]
    ]
    data = store / "experts.bin"
    good = data.read_bytes()
    rng = np.random.default_rng(11)
    args = ["-m", str(path), "--store", str(store), "--cache", str(lo), "--cache-t1", "1", "--cache-t2", "1"]
    failed = 0
    with serve(args, tmp_path / "server.log") as srv, open(data, "r+b") as f:
        assert srv.complete(PROMPT)["content"] == want
        for _ in range(6):
            # a random run of random bytes inside a random expert copy, written in place
            start, size = ranges[int(rng.integers(len(ranges)))]
            at = start + int(rng.integers(size))
            f.seek(at)
            f.write(rng.integers(0, 256, int(rng.integers(1, size - (at - start) + 1)), dtype=np.uint8).tobytes())
            f.flush()
            for _ in range(2):
                try:
                    got = srv.complete(PROMPT)["content"]
                except urllib.error.HTTPError as e:
                    msg = json.loads(e.read())["error"]["message"]
                    assert re.search(r"experts\.bin: checksum mismatch for layer \d+ expert \d+", msg), msg
                    failed += 1
                else:
                    assert got == want, "a damaged store gave a wrong answer without an error"
            f.seek(0)
            f.write(good)  # restored: the next request is stock's again
            f.flush()
            assert srv.complete(PROMPT)["content"] == want
        assert srv.proc.poll() is None
        assert srv.metric("expert_cache_read_errors_total") >= failed > 0
