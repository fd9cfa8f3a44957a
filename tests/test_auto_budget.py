"""--cache auto: the budget from the memory limit (cgroup v2, v1, MemAvailable) minus the model's
other needs, printed with its reasons."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ModelFactory, fake_proc_tree
from moetier import CacheConfig, Model, ModelError, _core
from moetier.config import AUTO

GiB = 1 << 30


_tree = fake_proc_tree


def test_memory_limit_cgroup_v2_takes_the_lowest_on_the_path(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "0::/user/app\n",
        {
            "sys/fs/cgroup/user/app/memory.max": "max\n",
            "sys/fs/cgroup/user/memory.max": f"{3 * GiB}\n",
            "sys/fs/cgroup/memory.max": f"{5 * GiB}\n",
        },
    )
    n, source = _core.memory_limit(str(root))
    assert n == 3 * GiB
    assert source.startswith("cgroup v2") and source.endswith("user/memory.max")


def test_memory_limit_cgroup_v1_and_namespaces(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "a",
        "12:cpu,cpuacct:/x\n4:memory:/x\n",
        {"sys/fs/cgroup/memory/x/memory.limit_in_bytes": f"{2 * GiB}\n"},
    )
    assert _core.memory_limit(str(root)) == (2 * GiB, f"cgroup v1 {root}/sys/fs/cgroup/memory/x/memory.limit_in_bytes")
    # in a cgroup namespace the path of /proc/self/cgroup is not under the mount: its root counts
    root = _tree(tmp_path / "b", "4:memory:/elsewhere\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GiB}\n"})
    assert _core.memory_limit(str(root))[0] == GiB
    # no limit (v1's huge number): MemAvailable
    root = _tree(
        tmp_path / "c",
        "4:memory:/\n",
        {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"},
        meminfo_kb=1 << 20,
    )
    assert _core.memory_limit(str(root)) == (GiB, "MemAvailable /proc/meminfo")
    # a limit above what is available: what is available counts
    root = _tree(tmp_path / "d", "0::/\n", {"sys/fs/cgroup/memory.max": f"{64 * GiB}\n"}, meminfo_kb=2 << 20)
    assert _core.memory_limit(str(root))[0] == 2 * GiB


def test_auto_budget_is_chosen_and_explained(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    cache = CacheConfig()
    assert cache.budget_bytes == AUTO and cache.budget_text == "auto"
    m = Model(path, cache=cache)
    info = m.cache_info()
    # the machine has GiBs: every expert of the tiny model fits, and the note says so
    assert int(info["n_slots"]) == int(info["n_layers"]) * int(info["n_expert"])
    note = m.budget_note
    assert note.startswith("expert cache auto:") and "non-expert weights" in note and "KV cache" in note
    assert "capped at all experts" in note
    assert "n_ctx 2048" in note, "the context's KV cache is what is left room for"
    # reads from the GGUF on the ring go through staging buffers, which the budget leaves room for
    assert info["io_uring"] and not info["from_store"]
    staging = re.search(r"read staging ([\d.]+) KiB", note)
    assert staging, note
    # 2 x io_threads staging buffers: twice the lanes, twice the room
    wide = re.search(r"read staging ([\d.]+) KiB", Model(path, cache=CacheConfig(io_threads=12)).budget_note)
    assert wide and float(wide.group(1)) == 2 * float(staging.group(1)), (note, wide)
    assert "read staging" not in Model(path, cache=CacheConfig(io_uring=False)).budget_note
    stock = Model(path)
    assert m.generate("hello world", max_tokens=8).tokens == stock.generate("hello world", max_tokens=8).tokens
    assert Model(path, cache=CacheConfig.exact(budget="64M")).budget_note == "expert cache: 64.00 MiB (given)"


def test_auto_budget_too_small_is_a_clear_error(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    with pytest.raises(ModelError, match=r"expert cache auto: .* not enough memory"):
        Model(path, cache=CacheConfig(reserve="100T"))


def test_cli_prints_the_auto_budget(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    r = subprocess.run(
        [sys.executable, "-m", "moetier.cli", "run", "-m", str(path), "-p", "hi", "-n", "2", "--cache", "auto"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "moetier: expert cache auto:" in r.stderr


def test_server_auto_budget_metrics_and_sidecar(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """`moetier serve --cache auto`: the budget is chosen for -c, /metrics shows the cache's size and
    the read latency histogram, and the warm-start sidecar is written when the server exits."""
    from _server import serve

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    sidecar = Path(str(path) + ".cache-state")
    log = tmp_path / "server.log"
    with serve(["-m", str(path), "--cache", "auto"], log) as server:
        assert server.complete("hello world")["content"]
        assert server.metric("expert_cache_size_bytes") > 0
        n = server.metric("expert_cache_read_seconds_count")
        assert n > 0 and server.metric('expert_cache_read_seconds_bucket{le="+Inf"}') == n
        assert server.metric("expert_cache_read_seconds_sum") > 0
    text = log.read_text()
    assert "expert cache auto:" in text and "(n_ctx 512)" in text
    assert sidecar.is_file(), "llama-server writes the sidecar when it exits"


def _vm_locked() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    return 0


def test_non_expert_weights_are_locked_in_ram(tiny_model: ModelFactory) -> None:
    import gguf

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    r = gguf.GGUFReader(path)
    names = {t.name for t in r.tensors}
    # every tensor but the experts; the embeddings only where they are also the output matrix
    resident = sum(
        int(t.n_bytes)
        for t in r.tensors
        if "_exps" not in t.name and (t.name != "token_embd.weight" or "output.weight" not in names)
    )
    before = _vm_locked()
    m = Model(path, cache=CacheConfig.exact(budget="64M"), repack=False)
    locked = int(m.cache_info()["weights_locked"])
    # all of them, in whole pages (without repack every weight stays in the mapping; the loader's
    # madvise calls split it into areas that a tensor may span)
    assert resident <= locked <= resident + 64 * 4096
    assert _vm_locked() - before >= locked
    stock = Model(path)
    assert m.generate("hello world", max_tokens=8).tokens == stock.generate("hello world", max_tokens=8).tokens
    del m
    assert _vm_locked() <= before + 4096, "the locks go with the model's mapping"
    off = Model(path, cache=CacheConfig.exact(budget="64M", lock_weights=False))
    assert off.cache_info()["weights_locked"] == 0 and _vm_locked() <= before + 4096


def test_given_budget_over_the_memory_limit_warns(tiny_model: ModelFactory) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    import cgroup

    if not cgroup.available():
        pytest.skip("needs a writable cgroup v1 memory controller")
    # 24 experts of 3 MiB (72 MiB); the compute buffers of 512 tokens are estimated at ~50 MiB, the
    # margin is 64 MiB: a limit 120 MiB above what the process uses leaves a 64 MiB cache too little
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3, n_ff_exp=4096)
    code = (
        "import sys; from pathlib import Path; from moetier import CacheConfig, Model\n"
        "if sys.argv[2] != 'none':\n"
        "    cg = Path(sys.argv[2])\n"
        "    used = int((cg / 'memory.usage_in_bytes').read_text())\n"
        "    (cg / 'memory.limit_in_bytes').write_text(str(used + (120 << 20)))\n"
        "m = Model(sys.argv[1], cache=CacheConfig.exact(budget='64M'))\n"
        "print(m.generate('hello world', max_tokens=4).text)\n"
        "print('\\n'.join(m.warnings))\n"
    )
    out = {}
    for name in ("capped", "free"):
        cap = cgroup.MemoryCap(f"moetier-test-budget-{name}-{os.getpid()}", 1 << 40)
        try:
            r = subprocess.run(
                [sys.executable, "-c", code, str(path), str(cap.path) if name == "capped" else "none"],
                capture_output=True,
                text=True,
                timeout=120,
                preexec_fn=cap.preexec,
            )
        finally:
            cap.close()
        assert r.returncode == 0, r.stderr
        out[name] = r.stdout
    assert "expert cache 64.00 MiB is more than the memory limit leaves for it (cgroup v1" in out["capped"]
    assert "Use cache auto, or a budget of at most" in out["capped"]
    assert "memory limit" not in out["free"]
