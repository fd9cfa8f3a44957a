"""A failed expert read under `moetier serve`: the request that needed the expert fails with a clear
error, the server stays up, /metrics counts the fault, and once the store is whole again the next
request gets stock llama.cpp's answer."""

from __future__ import annotations

import json
import urllib.error
from pathlib import Path

import pytest

from _server import serve
from conftest import ModelFactory
from moetier import CacheConfig, Model, pack

PROMPT = "The quick brown fox jumps over"


@pytest.mark.parametrize("io_uring", [False, True])
def test_corrupt_expert_fails_the_request_not_the_server(
    tiny_model: ModelFactory, tmp_path: Path, io_uring: bool
) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    store = pack(path, tmp_path / "store", progress=False)
    lo = int(Model(path, store=store, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
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
