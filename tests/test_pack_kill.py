"""`moetier pack` killed with SIGKILL at random points over an existing store: the store
directory holds the old store or the new one, complete, after every kill; a re-run succeeds."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

from conftest import LONG_PROMPT
from moetier import CacheConfig, Model, pack
from moetier.tools.tiny import write_tiny_model

CHILD = """
import sys
from moetier import pack
print("ready", flush=True)
pack(sys.argv[1], sys.argv[2], progress=False)
print("done", flush=True)
"""


def _store_id(store: Path) -> str:
    return str(json.loads((store / "manifest.json").read_text())["store_id"])


def test_pack_killed_anywhere(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", "qwen2moe", n_expert=32, n_layer=8, n_embd=256, n_ff_exp=512)
    out = tmp_path / "store"
    pack(model, out, progress=False)
    want = Model(model).generate(LONG_PROMPT, max_tokens=6).tokens

    def spawn() -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(out)], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        return p

    # how long a pack takes once the child is ready: the kills land across all of it and a bit after
    p = spawn()
    t0 = time.monotonic()
    assert p.wait(timeout=120) == 0
    t_pack = time.monotonic() - t0
    assert p.stdout is not None
    p.stdout.close()

    seen = {_store_id(out)}
    outcomes = {"old": 0, "new": 0, "finished": 0}
    rng = random.Random(0)
    for _ in range(24):
        old = _store_id(out)
        p = spawn()
        time.sleep(rng.uniform(0.0, 1.1 * t_pack))
        p.kill()
        p.wait()
        assert p.stdout is not None
        finished = "done" in p.stdout.read()
        p.stdout.close()
        sid = _store_id(out)  # a manifest is always there
        outcomes["finished" if finished else "old" if sid == old else "new"] += 1
        assert sid == old or sid not in seen, "a store id of an earlier store with the new data: a mix"
        seen.add(sid)
        got = Model(model, store=out, cache=CacheConfig.exact(budget="64M")).generate(LONG_PROMPT, max_tokens=6)
        assert got.tokens == want, outcomes
    assert outcomes["old"] > 0, outcomes  # some kills landed mid-pack
    # a re-run after the kills succeeds and leaves nothing beside the store
    pack(model, out, progress=False)
    assert sorted(f.name for f in out.iterdir()) == ["experts.bin", "manifest.json"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m.gguf", "store"]


def test_pack_refuses_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    from moetier import StoreError

    model = write_tiny_model(tmp_path / "m.gguf", "qwen2moe")
    import pytest

    with pytest.raises(StoreError, match=r"holds m.gguf, so it is not a store directory"):
        pack(model, tmp_path, progress=False)
    assert (tmp_path / "m.gguf").exists()
