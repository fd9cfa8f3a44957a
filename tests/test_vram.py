"""The VRAM tier: a cache of experts in a GPU's memory over the RAM cache. Its code runs here over host
memory (vram_host=1: the same bookkeeping, copies and graph, computed on the CPU), which checks it on
a CPU-only build: exact against stock at every VRAM budget, per-tier counters that add up, and clear
errors for what it cannot do. What a GPU measured is in bench/results/gpu.md (bench/gpu.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _server import serve
from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model, ModelError, _core
from moetier.config import AUTO
from moetier.stats import fetch, render


@pytest.fixture(scope="module")
def model_path(tiny_model: ModelFactory) -> Path:
    return tiny_model("qwen2moe", n_expert=8, n_expert_used=4, n_layer=3)


def _min_budget(path: Path) -> int:
    return int(Model(path, cache=CacheConfig(budget="64M")).cache_info()["min_cache_bytes"])


def _vram(mn: int, layers: int) -> int:
    """A VRAM budget of `layers` layers' experts (mn: one layer's 8), plus its 4 zero slots (top-4)."""
    return mn * layers + 4 * (mn // 8)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_exact_at_every_vram_budget(model_path: Path, layers: int) -> None:
    """One, two or all three layers' experts in the VRAM tier, the RAM tier at two: greedy tokens and
    logits (a 40-token ubatch, as a prompt) equal stock's."""
    mn = _min_budget(model_path)
    stock = Model(model_path)
    tokens = stock.tokenize(LONG_PROMPT)
    m = Model(model_path, cache=CacheConfig(budget=mn * 2, vram=_vram(mn, layers), vram_host=True))
    info = m.cache_info()
    assert info["n_slots_vram"] == 8 * layers and info["vram_bytes"] >= mn * layers
    assert m.generate(tokens, max_tokens=16).tokens == stock.generate(tokens, max_tokens=16).tokens
    s = m.stats()
    if layers == 3:
        # every expert fits: all were read at load and compute from VRAM as stock's do, with no lookups
        assert s.n_lookups == s.n_vram_copies == s.n_bytes_read == 0
        nodes = m.graph_nodes(tokens[:4])
        assert "moetier_resolve-0" not in nodes
        # the layers' slots are leaves, as stock's expert tensors: no view node between the gate and up
        # products, which ggml-cuda fuses only where they are adjacent
        assert not any(n.startswith("moetier_vram") for n in nodes)
    else:
        # every expert computed went through the VRAM tier: a hit there, or a copy from the RAM tier
        assert s.n_vram_hits + s.n_vram_copies == s.n_lookups > 0
        assert s.n_vram_bytes == s.n_vram_copies * (mn // 8)
        assert s.n_vram_copies > 24  # too small for every expert: evictions and copies again
    assert np.array_equal(m.logits(tokens[:40]), stock.logits(tokens[:40]))


def test_vram_tier_over_a_small_ram_tier(model_path: Path) -> None:
    """The RAM tier at one layer's experts (every VRAM miss that misses there is read first)."""
    mn = _min_budget(model_path)
    stock = Model(model_path)
    tokens = stock.tokenize(LONG_PROMPT)
    m = Model(model_path, cache=CacheConfig(budget=mn, vram=_vram(mn, 2), vram_host=True))
    assert m.generate(tokens, max_tokens=12).tokens == stock.generate(tokens, max_tokens=12).tokens
    s = m.stats()
    assert s.n_misses > 0 and s.n_vram_hits > 0


def test_vram_errors(model_path: Path) -> None:
    mn = _min_budget(model_path)
    with pytest.raises((ConfigError, ModelError), match="below the minimum"):
        Model(model_path, cache=CacheConfig(budget=mn, vram=mn // 2, vram_host=True))
    with pytest.raises(ConfigError, match=r"vram_cpu=1 \(cooperative compute\) serves exact modes only"):
        Model(model_path, cache=CacheConfig(budget=mn, vram=_vram(mn, 1), vram_cpu=True, t1=0.5, t2=0.9))
    for knob in ("vram_host", "vram_cpu"):
        with pytest.raises((ConfigError, ModelError), match=rf"{knob}=1 \(.*\) works on the VRAM tier, but vram=0"):
            Model(model_path, cache=CacheConfig(budget=mn, **{knob: True}))
    # this build computes on the CPU: a tier asked of a GPU names the build and the way out
    with pytest.raises((ConfigError, ModelError), match=r"no GPU backend|no MoE layer runs on a GPU"):
        Model(model_path, cache=CacheConfig(budget=mn, vram=_vram(mn, 1)))


def test_cli_run_shows_the_vram_tier(model_path: Path) -> None:
    mn = _min_budget(model_path)
    cmd = [sys.executable, "-m", "moetier.cli", "run", "-m", str(model_path), "-p", LONG_PROMPT, "-n", "8",
           "--cache", str(mn * 2), "--cache-vram", str(_vram(mn, 2)), "--cache-vram-host"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert re.search(r"VRAM tier hit rate [\d.]+% \(\d+/\d+, \d+ copies from RAM", r.stderr), r.stderr


def test_server_metrics_count_the_vram_tier(model_path: Path, tmp_path: Path) -> None:
    mn = _min_budget(model_path)
    args = ["-m", str(model_path), "--cache", str(mn * 2), "--cache-vram", str(_vram(mn, 2)), "--cache-vram-host"]
    with serve(args, tmp_path / "server.log") as srv:
        srv.complete(LONG_PROMPT, n_predict=8)
        lookups = srv.metric("expert_cache_lookups_total")
        hits, copies = srv.metric("expert_cache_vram_hits_total"), srv.metric("expert_cache_vram_copies_total")
        assert lookups > 0 and hits + copies == lookups and copies > 0
        assert srv.metric("expert_cache_vram_bytes_total") == copies * (mn // 8)
        assert "VRAM tier" in render(srv.url, fetch(srv.url))


def test_n_gpu_layers_is_checked(model_path: Path) -> None:
    with pytest.raises(ConfigError, match="n_gpu_layers"):
        Model(model_path, n_gpu_layers=-1)


def _decode_counts(m: Model, tokens: list[int]) -> tuple[Any, Any, list[int]]:
    """The counters of the prompt (one ubatch) and of 12 decoded tokens, and the tokens."""
    snap: dict[str, Any] = {}

    def first() -> None:
        snap["prompt"] = m.stats()
        m.reset_stats()

    out = m.generate(tokens, max_tokens=12, on_first_token=first)
    return snap["prompt"], m.stats(), out.tokens


@pytest.mark.parametrize(
    ("costs", "outcome"),
    [("1,1000", "copy"), ("1000,1", "cpu"), ("100,100", "split")],
)
def test_cooperative_compute_rule(model_path: Path, monkeypatch: pytest.MonkeyPatch, costs: str, outcome: str) -> None:
    """The rule on purpose (MOETIER_VRAM_COSTS=COPY_US,CPU_US): a cheap copy copies every decode miss,
    a cheap CPU computes them all there, equal costs split them; prompts copy every miss whatever the
    costs. Here both sides compute on the CPU (vram_host), so the output equals stock's exactly."""
    monkeypatch.setenv("MOETIER_VRAM_COSTS", costs)
    mn = _min_budget(model_path)
    stock = Model(model_path)
    tokens = stock.tokenize(LONG_PROMPT)
    m = Model(model_path, cache=CacheConfig(budget=mn * 3, vram=_vram(mn, 1), vram_host=True, vram_cpu=True))
    info = m.cache_info()
    assert (info["vram_copy_us"], info["vram_cpu_us"]) == tuple(float(x) for x in costs.split(","))
    prompt, decode, out = _decode_counts(m, tokens)
    # a prompt's ubatch copies every miss; its last layer runs on the last token alone (llama.cpp computes
    # only the rows it outputs there), a decode-sized ubatch
    assert prompt.n_vram_copies > 0 and all(ls.n_vram_cpu == 0 for ls in prompt.layers[:-1])
    for s in (prompt, decode):
        assert s.n_vram_hits + s.n_vram_copies + s.n_vram_cpu == s.n_lookups
    if outcome == "copy":
        assert decode.n_vram_cpu == 0 and decode.n_vram_copies > 0
    elif outcome == "cpu":
        assert decode.n_vram_copies == 0 and decode.n_vram_cpu > 0
    else:
        assert decode.n_vram_copies > 0 and decode.n_vram_cpu > 0
    assert out == stock.generate(tokens, max_tokens=12).tokens
    # a decode step's CPU plane computes its experts' whole FFN (activation and down product) in the
    # upload op's split; a prompt's layers have no CPU plane (but its last, on the last token alone)
    one = m.graph_nodes(tokens[:1])
    assert {"moetier_cpu_act-0", "moetier_cpu_down-0"} <= set(one)
    assert one.index("moetier_upload-0") < one.index("moetier_cpu_down-0")
    prompt_nodes = m.graph_nodes(tokens[:40])
    assert "moetier_upload-0" in prompt_nodes and "moetier_cpu_down-0" not in prompt_nodes


def test_cooperative_costs_are_measured(model_path: Path) -> None:
    mn = _min_budget(model_path)
    m = Model(model_path, cache=CacheConfig(budget=mn * 3, vram=_vram(mn, 1), vram_host=True, vram_cpu=True))
    info = m.cache_info()
    assert info["vram_copy_us"] >= 1.0 and info["vram_cpu_us"] >= 1.0
    alone = Model(model_path, cache=CacheConfig(budget=mn * 3, vram=_vram(mn, 1), vram_host=True))
    assert alone.cache_info()["vram_cpu_us"] == 0


def test_vram_auto(model_path: Path) -> None:
    """vram=auto: the device's free memory less what the context needs; here (vram_host: the host's
    memory) every expert of the tiny model fits, so all are read at load. The option takes auto in
    --expert-opt too, and says what it took."""
    mn = _min_budget(model_path)
    cfg = CacheConfig(budget=mn, vram="auto", vram_host=True)
    assert "vram=auto" in cfg.opts()
    m = Model(model_path, cache=cfg)
    info = m.cache_info()
    assert info["n_slots_vram"] == 24 and m.stats().n_lookups == 0
    p = _core.Params()
    p.set_opts("vram=auto")
    assert p.vram == AUTO
    with pytest.raises(ConfigError, match=r"vram: 'lots' is not a size \(e\.g\. 512M\) or auto"):
        p.set_opts("vram=lots")


def test_mixed_precision_in_vram(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """Mixed precision under the VRAM tier (HOBBIT's low-precision copies in GPU memory): a pool of low
    slots beside the high one, low misses copied from the RAM tier's low slots. Computed here in host
    memory (vram_host), it must give exactly what the same mixed precision gives without the tier, and
    copy fewer bytes per expert than the high versions."""
    from moetier import PackConfig, pack

    path = tiny_model("qwen3moe", n_expert=16, n_expert_used=4, n_layer=3, expert_type="f16")
    store = pack(path, tmp_path / "s", PackConfig(low_type="q4_0"), progress=False)
    info = Model(path, store=store, cache=CacheConfig(budget="64M")).cache_info()
    high = int(info["expert_bytes"]) // (3 * 16)
    low = int(info["expert_bytes_low"]) // (3 * 16)
    # the RAM tier holds every version; the VRAM tier one layer and a half of each precision
    mixed = dict(budget=int(info["expert_bytes"]) * 2, t1=0.0, t2=1.0, low_frac=0.5, prefetch=0)
    ref = Model(path, store=store, cache=CacheConfig(**mixed))  # type: ignore[arg-type]
    vram = (high + low) * (16 + 4) + (high + low) * 16
    m = Model(path, store=store, cache=CacheConfig(**mixed, vram=vram, vram_host=True))  # type: ignore[arg-type]
    ci = m.cache_info()
    assert ci["n_slots_vram"] > 2 * 16 and ci["vram_bytes"] <= vram
    tokens = ref.tokenize(LONG_PROMPT)
    assert np.array_equal(m.logits(tokens[:24]), ref.logits(tokens[:24]))
    assert m.generate(tokens, max_tokens=12).tokens == ref.generate(tokens, max_tokens=12).tokens
    s = m.stats()
    assert s.n_loads_low > 0 and s.n_vram_copies > 0 and s.n_vram_hits > 0
    # each copy is a high or a low version: the bytes copied lie between all-low and all-high
    assert low * s.n_vram_copies < s.n_vram_bytes < high * s.n_vram_copies
