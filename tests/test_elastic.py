"""The elastic budget (grow): the expert cache grows past its budget into memory the limit leaves
free, up to every expert, and gives it back under pressure, never below its budget; the output stays
stock llama.cpp's throughout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ModelFactory, fake_proc_tree
from moetier import CacheConfig, ConfigError, Model, ModelError, _core

MiB = 1 << 20
GiB = 1 << 30
PROMPT = "The quick brown fox jumps over the lazy dog and"


_tree = fake_proc_tree


def test_memory_free_counts_usage_less_inactive_page_cache(tmp_path: Path) -> None:
    v1 = "sys/fs/cgroup/memory/x"
    # cgroup v1: a 1 GiB limit, 600 MiB used of which 100 MiB is inactive page cache (hierarchical count)
    root = _tree(
        tmp_path / "a",
        "4:memory:/x\n",
        {
            f"{v1}/memory.limit_in_bytes": f"{GiB}\n",
            f"{v1}/memory.usage_in_bytes": f"{600 * MiB}\n",
            f"{v1}/memory.stat": f"cache 1\ninactive_file 7\ntotal_inactive_file {100 * MiB}\n",
        },
    )
    assert _core.memory_free(str(root)) == GiB - 500 * MiB
    # cgroup v2: memory.current and inactive_file
    v2 = "sys/fs/cgroup/app"
    files = {
        f"{v2}/memory.max": f"{2 * GiB}\n",
        f"{v2}/memory.current": f"{1536 * MiB}\n",
        f"{v2}/memory.stat": f"anon 5\ninactive_file {256 * MiB}\nactive_file 9\n",
    }
    assert _core.memory_free(str(_tree(tmp_path / "b", "0::/app\n", files))) == 768 * MiB
    # MemAvailable below what the limit leaves: it counts
    assert _core.memory_free(str(_tree(tmp_path / "c", "0::/app\n", files, meminfo_kb=128 << 10))) == 128 * MiB
    # no cgroup limit: MemAvailable alone; usage above the limit: nothing free
    assert _core.memory_free(str(_tree(tmp_path / "d", "0::/\n", {}, meminfo_kb=3 << 20))) == 3 * GiB
    over = {**files, f"{v2}/memory.current": f"{3 * GiB}\n"}
    assert _core.memory_free(str(_tree(tmp_path / "e", "0::/app\n", over))) == 0


def test_grow_is_on_for_auto_budgets_and_off_for_given_ones(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    assert CacheConfig().grow == -1
    probe = Model(path, cache=CacheConfig.exact(budget="64M"))
    lo = int(probe.cache_info()["min_cache_bytes"])
    del probe
    stock = Model(path).generate(PROMPT, max_tokens=12).tokens

    fixed = Model(path, cache=CacheConfig.exact(budget=lo))
    assert fixed.generate(PROMPT, max_tokens=12).tokens == stock
    info = fixed.cache_info()
    assert not info["grow"] and info["n_slots"] == info["n_slots_budget"] == info["n_slots_max"] == 8
    assert info["n_grown"] == 0 and info["free_margin"] == 0

    # grow=1 with a given budget: it is the least the cache keeps; this machine has GiBs free, so
    # the first layer pass grows it to every expert, and nothing is evicted after
    grown = Model(path, cache=CacheConfig.exact(budget=lo, grow=1))
    before = grown.cache_info()
    assert before["grow"] and before["n_slots"] == 8 and before["n_slots_max"] == 24
    assert before["cache_bytes"] == lo
    assert grown.generate(PROMPT, max_tokens=12).tokens == stock
    info = grown.cache_info()
    assert info["n_slots"] == info["n_slots_max"] == 24 and info["n_grown"] == 16
    assert info["n_slots_budget"] == 8 and info["cache_bytes"] == 3 * lo
    assert info["free_bytes"] > 2 * info["free_margin"] >= 128 * MiB
    s = grown.stats()
    assert s.n_misses == s.n_loads_high <= 24, "with room for every expert no expert is read twice"

    with pytest.raises(ConfigError, match="grow"):
        CacheConfig(grow=2)


@pytest.mark.parametrize("huge", [False, True])
def test_cache_grows_into_a_cgroup_limit_and_gives_memory_back(tiny_model: ModelFactory, huge: bool) -> None:
    """With huge_pages too: its thread faulting slots in ahead stops before a shrink gives them back."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    import cgroup

    if not cgroup.available():
        pytest.skip("needs a writable cgroup v1 memory controller")
    # 24 experts of 1.5 MiB: a budget of one layer's 8, room under the limit for every expert
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3, n_ff_exp=4096)
    stock = Model(path).generate(PROMPT, max_tokens=24).tokens
    code = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from moetier import CacheConfig, Model, _core\n"
        "cg = Path(sys.argv[2])\n"
        "def anon():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('RssAnon:'):\n"
        "            return int(line.split()[1]) * 1024\n"
        "probe = Model(sys.argv[1], cache=CacheConfig.exact(budget='256M'))\n"
        "lo = int(probe.cache_info()['min_cache_bytes'])\n"
        "del probe\n"
        "m = Model(sys.argv[1], cache=CacheConfig.exact(budget=lo, grow=1, huge_pages=sys.argv[4] == '1'))\n"
        "used = int((cg / 'memory.usage_in_bytes').read_text())\n"
        "(cg / 'memory.limit_in_bytes').write_text(str(used + int(m.cache_info()['expert_bytes']) + (320 << 20)))\n"
        "a = m.generate(sys.argv[3], max_tokens=24).tokens\n"
        "grown = m.cache_info()\n"
        "rss_grown = anon()\n"
        "time.sleep(0.15)\n"
        "# another allocation in the group takes all but 4 MiB of what is free\n"
        "hog = b'\\x01' * max(0, _core.memory_free() - (4 << 20))\n"
        "time.sleep(0.15)\n"
        "b = m.generate(sys.argv[3], max_tokens=24).tokens\n"
        "shrunk = m.cache_info()\n"
        "rss_shrunk = anon() - len(hog)\n"
        "print(json.dumps({'a': a, 'b': b, 'grown': grown, 'shrunk': shrunk, 'lo': lo,\n"
        "                  'rss_grown': rss_grown, 'rss_shrunk': rss_shrunk}))\n"
    )
    cap = cgroup.MemoryCap(f"moetier-test-elastic-{os.getpid()}", 1 << 40)
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, str(path), str(cap.path), PROMPT, "1" if huge else "0"],
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=cap.preexec,
        )
        oom = cap.failcnt()
    finally:
        cap.close()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["a"] == stock and out["b"] == stock, "growing and shrinking never change the output"
    grown, shrunk = out["grown"], out["shrunk"]
    assert grown["n_slots"] == grown["n_slots_max"] == 24 and grown["n_grown"] == 16
    # under pressure it gives memory back, never below its budget, and never so much that the layer
    # that gives it finds no slot for a miss (one layer's 8 stay free or evictable beside the slots
    # the layer uses)
    assert shrunk["n_slots_budget"] == 8 <= shrunk["n_slots"] <= 16 and shrunk["n_shrunk"] == 24 - shrunk["n_slots"]
    assert shrunk["free_bytes"] < 2 * shrunk["free_margin"]
    # the pages of the slots that held experts went back
    assert grown["n_held"] > shrunk["n_slots"]
    slot = grown["cache_bytes"] // 24
    assert out["rss_grown"] - out["rss_shrunk"] >= (grown["n_held"] - shrunk["n_slots"]) * slot - 4 * MiB
    assert oom == 0
    assert grown["n_huge"] == (3 if huge else 0)


def _note_bytes(note: str, what: str) -> int:
    m = re.search(rf"{what} ([0-9.]+) (B|KiB|MiB|GiB)", note)
    assert m, (what, note)
    return int(float(m.group(1)) * {"B": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": GiB}[m.group(2)])


def test_auto_budget_short_of_one_layer_takes_it_from_the_margin(tiny_model: ModelFactory) -> None:
    """An auto budget whose margin alone leaves less than one layer's experts starts at that minimum
    when it may give back what it grows; a fixed auto budget stays an error, as does one whose memory
    falls short before the margin."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    for _ in range(5):  # the machine's free memory moves (other processes): measure until it holds still
        note = Model(path, cache=CacheConfig()).budget_note
        usable = _note_bytes(note, "MemAvailable")
        needs = sum(_note_bytes(note, w) for w in ("non-expert weights", "KV cache", "compute buffers", "read staging"))
        margin = _note_bytes(note, "margin")
        # the needs and the reserve leave half the margin: nothing after the margin, plenty before it
        reserve = usable - needs - margin // 2
        m = Model(path, cache=CacheConfig(reserve=reserve))
        if abs(_note_bytes(m.budget_note, "MemAvailable") - usable) < margin // 4:
            break
    info = m.cache_info()
    assert info["n_slots"] == info["n_slots_budget"] == 8 and info["cache_bytes"] == info["min_cache_bytes"]
    assert "raised to the minimum" in m.budget_note and "out of the margin" in m.budget_note
    assert m.generate(PROMPT, max_tokens=4).tokens == Model(path).generate(PROMPT, max_tokens=4).tokens
    with pytest.raises(ModelError, match=r"expert cache auto: .* not enough memory"):
        Model(path, cache=CacheConfig(reserve=reserve, grow=0))
    with pytest.raises(ModelError, match=r"expert cache auto: .* not enough memory"):
        Model(path, cache=CacheConfig(reserve=usable))
