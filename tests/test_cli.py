"""The moetier CLI and the shipped llama.cpp binaries with the expert cache flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _server import free_port, serve
from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model


def moetier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moetier.cli", *args], capture_output=True, text=True, timeout=120)


def test_run_matches_stock_at_quarter_budget(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=8)
    info = Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()
    budget = int(info["expert_bytes"]) // 4
    assert budget >= int(info["min_cache_bytes"]), "25% must be a real budget here, not the minimum"
    stock = moetier("run", "-m", str(path), "-p", LONG_PROMPT, "-n", "24", "--no-cache")
    exact = ["--cache-t1", "1", "--cache-t2", "1"]
    cached = moetier("run", "-m", str(path), "-p", LONG_PROMPT, "-n", "24", "--cache", str(budget), *exact)
    assert stock.returncode == 0, stock.stderr
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout == stock.stdout and stock.stdout.strip()
    assert "hit rate" in cached.stderr and "tok/s" in cached.stderr and "iB" in cached.stderr
    assert ", 0 low, 0 skipped)" in cached.stderr
    assert "expert cache off" in stock.stderr


def test_run_error_is_one_line(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    r = moetier("run", "-m", str(path), "-p", "hi", "--cache", "1K")
    assert r.returncode == 1
    assert r.stderr.startswith("moetier: error: ") and "below the minimum" in r.stderr
    assert "Traceback" not in r.stderr


def test_help_explains_every_option() -> None:
    for cmd in (["run"], ["pack"], ["serve"], ["stats"], ["bench-plot"]):
        r = moetier(*cmd, "--help")
        assert r.returncode == 0
        lines = r.stdout.splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if s.startswith("--") and "  " not in s:
                # a flag whose help wraps onto the next line
                assert i + 1 < len(lines) and lines[i + 1].strip(), f"{cmd}: {s} has no help"
    # a tool's --help is the tool's own
    r = moetier("tool", "llama-server", "--help")
    assert r.returncode == 0 and "--expert-cache SIZE" in r.stdout + r.stderr


def test_server_with_expert_cache_matches_stock(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """The real llama-server, with and without --expert-cache, hit by a real HTTP client."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    info = Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()
    results = []
    exact = ["--cache-t1", "1", "--cache-t2", "1"]
    # stock asks for /metrics; with an expert cache it is on without --metrics
    for i, extra in enumerate((["--metrics"], ["--cache", str(int(info["min_cache_bytes"])), *exact])):
        with serve(["-m", str(path), *extra], tmp_path / f"server{i}.log") as srv:
            results.append(srv.complete(LONG_PROMPT)["content"])
            lookups = srv.metric("expert_cache_lookups_total")
            hits, misses = srv.metric("expert_cache_hits_total"), srv.metric("expert_cache_misses_total")
            if i == 1:
                assert lookups > 0 and hits + misses == lookups and misses > 0
                assert srv.metric("expert_cache_bytes_read_total") > 0
                # the mode and the share of low/skipped loads are in view
                assert srv.metric("expert_cache_exact") == 1
                assert srv.metric("expert_cache_loads_low_total") == srv.metric("expert_cache_skipped_total") == 0
            else:
                assert lookups == 0  # stock: /metrics is there because it was asked for
                assert srv.metric("expert_cache_exact") == 1
    assert results[0] == results[1] and results[0]

    # mixed precision asked for (t2 below the top-1's share skips the second expert): /metrics says so
    mixed = ["--cache", str(int(info["min_cache_bytes"])), "--cache-t1", "0", "--cache-t2", "0.4"]
    with serve(["-m", str(path), *mixed], tmp_path / "server-mixed.log") as srv:
        srv.complete(LONG_PROMPT)
        assert srv.metric("expert_cache_exact") == 0
        assert srv.metric("expert_cache_skipped_total") > 0

    # the flag reaches the engine: a budget below one layer's experts stops the server at load
    r = subprocess.run(
        [sys.executable, "-m", "moetier.cli", "serve", "-m", str(path), "--cache", "1K", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert f"{path}: expert cache budget 1.00 KiB is below the minimum" in r.stderr


def test_demo_reads_from_its_store_and_packs_it_again_for_another_model(
    tiny_model: ModelFactory, tmp_path: Path
) -> None:
    import json
    import shutil

    from moetier.cli import demo_model

    notes: list[str] = []
    moe = tmp_path / "demo-moe.gguf"
    shutil.copy(tiny_model("qwen2moe", n_expert=8, n_expert_used=2, seed=3), moe)
    store = moe.with_suffix(".experts")
    budget = int(Model(moe, cache=CacheConfig.exact(budget="64M")).cache_info()["expert_bytes"]) // 2
    # first use: packed next to the model, and the cache reads from it
    m = demo_model(moe, budget, notes.append)
    assert m.cache_info()["from_store"] and (store / "experts.bin").is_file()
    assert notes and "packing the expert store" in notes[-1]
    r = m.generate(LONG_PROMPT, max_tokens=8)
    del m
    # second use: the same store, not packed again
    before = (store / "experts.bin").stat().st_mtime_ns
    n = len(notes)
    m = demo_model(moe, budget, notes.append)
    assert len(notes) == n and (store / "experts.bin").stat().st_mtime_ns == before
    assert m.generate(LONG_PROMPT, max_tokens=8).tokens == r.tokens
    del m
    # the conversion made again under the same name: the old store belongs to another model
    old_id = json.loads((store / "manifest.json").read_text())["model"]
    shutil.copy(tiny_model("qwen2moe", n_expert=8, n_expert_used=2, seed=4), moe)
    m = demo_model(moe, budget, notes.append)
    assert "packing the expert store again" in notes[-1]
    assert m.cache_info()["from_store"]
    assert json.loads((store / "manifest.json").read_text())["model"] != old_id
    stock = Model(moe).generate(LONG_PROMPT, max_tokens=8)
    assert m.generate(LONG_PROMPT, max_tokens=8).tokens == stock.tokens


def test_demo_compares_first_sentence_or_line() -> None:
    from moetier.cli import first_answer

    assert first_answer(" Paris. Paris is located in France.") == "Paris."
    assert first_answer(" Paris is a city of interest. More") == "Paris is a city of interest."
    assert first_answer("if n <= 0:\n        return 0") == "if n <= 0:"
    assert first_answer("0.5 degrees, about half") == "0.5 degrees, about half"  # a decimal point ends nothing
    assert first_answer("Stop! Go") == "Stop!"
