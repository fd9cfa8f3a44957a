"""What the Python layer reports and refuses, pinned by values it cannot get right by accident:
each test here killed a deliberately broken copy of config.py or model.py that the rest of the
suite let through (a hand-made mutation check; mutmut's run: bench/results/reliability-2026-11-24.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, ConfigError, Model
from moetier.model import CacheStats, GenerateResult


@pytest.mark.parametrize(
    ("budget", "says"),
    [(0, "turns the cache off"), ("0", "turns the cache off"), (-1, "negative"), (True, "not a size")],
)
def test_budget_refused(budget: object, says: str) -> None:
    with pytest.raises(ConfigError, match=rf"cache\.budget.*{says}"):
        CacheConfig(budget=budget)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["reserve"])
def test_size_fields_refuse_negative_and_bool(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"cache\.{field}.*negative"):
        CacheConfig(budget="1M", **{field: -4096})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=rf"cache\.{field}.*not a size"):
        CacheConfig(budget="1M", **{field: False})  # type: ignore[arg-type]


def test_hit_rate_and_rates_from_a_run(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    lo = int(Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    r = Model(path, cache=CacheConfig.exact(budget=lo)).generate(LONG_PROMPT, max_tokens=16)
    s = r.stats
    assert 0 < s.n_hits < s.n_lookups, "the budget must both hit and miss"
    assert s.hit_rate == pytest.approx(s.n_hits / s.n_lookups)
    assert s.hit_rate == pytest.approx(sum(ly.n_hits for ly in s.layers) / sum(ly.n_lookups for ly in s.layers))
    # timing: prefill runs to the first token, decode covers the rest, both inside the call
    assert len(r.tokens) == 16
    assert 0 < r.prefill_seconds and 0 < r.decode_seconds
    assert r.prefill_seconds + r.decode_seconds <= r.seconds * 1.01
    assert r.decode_tokens_per_second == pytest.approx(15 / r.decode_seconds)
    assert r.prefill_tokens_per_second == pytest.approx(r.prompt_tokens / r.prefill_seconds)
    assert r.tokens_per_second == pytest.approx(16 / r.seconds)


def test_one_token_has_no_decode(tiny_model: ModelFactory) -> None:
    """With one generated token everything is prefill: a swap of the two times shows here."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    r = Model(path).generate(LONG_PROMPT, max_tokens=1)
    assert len(r.tokens) == 1
    assert r.prefill_seconds > 0 and r.decode_seconds < 0.01 * r.prefill_seconds
    assert r.decode_tokens_per_second == 0.0


def test_rates_by_hand() -> None:
    r = GenerateResult(
        text="",
        tokens=[1, 2, 3, 4, 5],
        stats=CacheStats(),
        prompt_tokens=12,
        seconds=2.0,
        prefill_seconds=0.5,
        decode_seconds=1.0,
    )
    assert r.decode_tokens_per_second == 4.0  # 4 tokens after the first, in one second
    assert r.prefill_tokens_per_second == 24.0
    assert r.tokens_per_second == 2.5
    assert CacheStats().hit_rate == 0.0


def test_on_first_token_splits_counters_outside_both_timings(tiny_model: ModelFactory) -> None:
    """The callback the benchmark uses to split bytes into prefill and decode: called once, after the
    prompt's pass (the counters then hold the prefill's reads only), and its own time is in neither
    timing."""
    import time

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    lo = int(Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()["min_cache_bytes"])
    m = Model(path, cache=CacheConfig.exact(budget=lo))
    seen: list[int] = []

    def first() -> None:
        seen.append(m.stats().n_lookups)
        time.sleep(0.5)

    r = m.generate(LONG_PROMPT, max_tokens=8, on_first_token=first)
    assert len(seen) == 1 and 0 < seen[0] < r.stats.n_lookups  # decode looked up more after it
    assert r.seconds >= 0.5 and r.prefill_seconds + r.decode_seconds < r.seconds - 0.45
    with pytest.raises(ZeroDivisionError):  # an exception in the callback reaches the caller
        m.generate(LONG_PROMPT, max_tokens=4, on_first_token=lambda: 1 // 0)
    assert m.generate(LONG_PROMPT, max_tokens=8).tokens == r.tokens  # and the model still works


def test_opts_writes_sizes_and_switches_as_integers() -> None:
    """The --expert-opt string the shipped binaries parse: a size is a byte count, a switch 0/1."""
    cfg = CacheConfig(budget="1M", reserve="4K", io_uring=False, prefetch=2)
    opts = dict(kv.split("=") for kv in cfg.opts().split(","))
    assert (opts["reserve"], opts["io_uring"], opts["prefetch"], opts["t1"]) == ("4096", "0", "2", "1.0")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "cannot read the cache config"),
        ("[1, 2]", "the cache config must be a JSON object of CacheConfig fields"),
        ('{"budget": 1048576, "zeta": 1, "alpha": 2}', r"unknown cache config field\(s\) alpha, zeta; known: "),
    ],
)
def test_cache_config_file_errors_name_the_file(tmp_path: Path, text: str, says: str) -> None:
    f = tmp_path / "cache.json"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(f))}: {says}"):
        CacheConfig.from_file(f)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'missing.json'))}: cannot read"):
        CacheConfig.from_file(tmp_path / "missing.json")


def test_generate_defaults_sampling_and_wall_time(tiny_model: ModelFactory) -> None:
    m = Model(tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3))
    r = m.generate(LONG_PROMPT)
    assert len(r.tokens) == 64, "64 tokens by default (this model emits no end-of-generation)"
    assert r.prefill_seconds + r.decode_seconds <= r.seconds < 60
    # temperature reaches the sampler: the same seed repeats, another seed samples other tokens
    a, b, c = (m.generate(LONG_PROMPT, max_tokens=24, temperature=1.5, seed=s).tokens for s in (1, 1, 2))
    assert a == b != c and a != r.tokens[:24]
    # greedy ignores the seed; the same seed at another temperature samples other tokens
    assert m.generate(LONG_PROMPT, max_tokens=24, seed=7).tokens == r.tokens[:24]
    assert m.generate(LONG_PROMPT, max_tokens=24, temperature=0.3, seed=1).tokens != a


@pytest.mark.parametrize("value", [2, -1, 0.5, 1.0])
def test_switches_take_only_bools_or_0_1(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^cache\.io_uring: .* must be a bool \(or 0/1\)$"):
        CacheConfig(budget="1M", io_uring=value)  # type: ignore[arg-type]
    assert CacheConfig(budget="1M", io_uring=0).io_uring in (0, False)


def test_budget_auto_and_sizes_normalised() -> None:
    assert CacheConfig(budget="auto").budget_text == "auto"
    c = CacheConfig(budget="2M", reserve="4K")
    assert (c.budget_bytes, c.reserve, c.budget_text) == (2 << 20, 4096, str(2 << 20))
    off = (
        r"^cache\.budget: 0 turns the cache off; pass cache=None instead "
        r"\(moetier run: --no-cache; moetier serve: leave out --cache\)$"
    )
    with pytest.raises(ConfigError, match=off):
        CacheConfig(budget=0)


def test_cache_stats_reads_totals_and_refuses_dunders() -> None:
    s = CacheStats()
    assert s.n_hits == 0 and s.n_lookups == 0  # the totals' counters, read through
    # special names are not looked up in the totals (copy and pickle probe them): the name is the error
    with pytest.raises(AttributeError) as e:
        s.__reduce_ex_missing__  # noqa: B018
    assert e.value.args == ("__reduce_ex_missing__",)
    with pytest.raises(AttributeError, match="no_such_counter"):
        s.no_such_counter  # noqa: B018


def test_cache_config_file_messages_and_overrides(tmp_path: Path) -> None:
    import dataclasses

    f = tmp_path / "cache.json"
    with pytest.raises(ConfigError) as e:
        CacheConfig.from_file(f)
    assert str(e.value) == f"{f}: cannot read the cache config: No such file or directory"
    f.write_text('{"budget": "1M", "zeta": 1}')
    with pytest.raises(ConfigError) as e:
        CacheConfig.from_file(f)
    known = ", ".join(sorted(x.name for x in dataclasses.fields(CacheConfig)))
    assert str(e.value) == f"{f}: unknown cache config field(s) zeta; known: {known}"
    f.write_text('{"budget": "1M", "policy": "lru", "prefetch": 2}')
    assert CacheConfig.from_file(f) == CacheConfig(budget="1M", policy="lru", prefetch=2)
    # overrides win over the file; what they leave keeps the file's value
    got = CacheConfig.from_file(f, prefetch=0, budget="2M")
    assert got == CacheConfig(budget="2M", policy="lru", prefetch=0)


def test_tool_path_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetier import ModelError, server

    with pytest.raises(ModelError) as e:
        server.tool_path("llama-nope")
    assert str(e.value) == f"unknown tool 'llama-nope'; shipped: {', '.join(server.TOOLS)}"
    assert server.tool_path("llama-bench") == server.BIN_DIR / "llama-bench"
    monkeypatch.setattr(server, "BIN_DIR", tmp_path)
    with pytest.raises(ModelError) as e:
        server.tool_path("llama-bench")
    assert str(e.value) == f"{tmp_path / 'llama-bench'}: not installed (the package was built with MOETIER_TOOLS=OFF?)"


def test_exec_tool_runs_the_binary_under_its_own_name() -> None:
    import subprocess
    import sys

    from moetier.server import BIN_DIR

    code = "from moetier.server import exec_tool; exec_tool('llama-bench', ['--help'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # argv[0] is the binary's path: its usage line names it
    assert f"usage: {BIN_DIR / 'llama-bench'} [options]" in r.stdout + r.stderr


def test_pack_shows_progress_when_stderr_is_a_terminal(tiny_model: ModelFactory, tmp_path: Path) -> None:
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    code = f"from moetier import pack; pack({str(path)!r}, {str(tmp_path / 's')!r})"
    main, child = pty.openpty()
    # a terminal of 100 columns (a new pty has none, and tqdm then draws an empty line)
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        r = subprocess.run([sys.executable, "-c", code], stderr=child, stdout=subprocess.DEVNULL, timeout=120)
        os.close(child)
        out = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
    assert r.returncode == 0
    assert f"pack {path.name}".encode() in out  # the bar, since stderr is a terminal
    # and none without a terminal
    r2 = subprocess.run([sys.executable, "-c", code.replace("/s'", "/s2'")], capture_output=True, timeout=120)
    assert r2.returncode == 0 and f"pack {path.name}".encode() not in r2.stderr


def test_model_context_overrides_and_argument_checks(tiny_model: ModelFactory) -> None:
    import dataclasses
    import inspect

    from moetier import ContextConfig, StoreError

    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    base = ContextConfig()
    m = Model(path, n_threads=1)
    assert m.context == dataclasses.replace(base, n_threads=1) and m.cache is None
    assert Model(path, n_ctx=256).context == dataclasses.replace(base, n_ctx=256)
    # the keywords win over the context given, and only where given
    given = ContextConfig(n_ctx=512, n_threads=2)
    assert Model(path, context=given, n_threads=1).context == dataclasses.replace(given, n_threads=1)
    assert Model(path, context=given).context is given
    cache = CacheConfig.exact(budget="64M")
    assert Model(path, cache=cache).cache is cache
    with pytest.raises(StoreError) as e:
        Model(path, store=path.with_suffix(".experts"))
    says = "an expert store needs an expert cache; pass cache=CacheConfig(...)"
    assert str(e.value) == f"{path.with_suffix('.experts')}: {says}"
    for bad in (-1, "1", True, 1.5):
        with pytest.raises(ConfigError) as e:
            Model(path, n_gpu_layers=bad)  # type: ignore[arg-type]
        assert str(e.value) == f"n_gpu_layers: {bad!r} must be a non-negative integer (layers offloaded to a GPU)"
    # the documented defaults (docs/python-api.md): CPU repacking on, nothing offloaded
    params = inspect.signature(Model.__init__).parameters
    assert (params["repack"].default, params["n_gpu_layers"].default) == (True, 0)


def test_detokenize_replaces_bytes_that_are_not_utf8(tiny_model: ModelFactory) -> None:
    m = Model(tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_vocab=300))
    # byte-level vocab: one token is the lone byte 0xff, not UTF-8 on its own
    lone = [t for t in range(m.n_vocab) if m.detokenize([t]) == "\ufffd"]
    assert lone, "the vocab has single-byte tokens above 0x7f"
    assert m.detokenize([*m.tokenize("ok"), lone[0]]) == "ok\ufffd"


def test_generate_default_seed_is_zero(tiny_model: ModelFactory) -> None:
    m = Model(tiny_model("qwen2moe", n_expert=8, n_expert_used=2))
    r = m.generate("hello", max_tokens=8, temperature=0.9).tokens
    assert r == m.generate("hello", max_tokens=8, temperature=0.9, seed=0).tokens
    assert r != m.generate("hello", max_tokens=8, temperature=0.9, seed=1).tokens


def test_log_level_errors_and_auto_sizes_in_opts() -> None:
    from moetier._log import LEVELS, set_level

    with pytest.raises(ConfigError) as e:
        set_level("loud")
    assert str(e.value) == f"log level: 'loud' is not a level; use one of {', '.join(LEVELS)}"
    # a size the core chooses at load is passed as "auto"; the options after it follow
    opts = CacheConfig(budget="1M", vram="auto").opts().split(",")
    assert opts[opts.index("vram=auto") + 1] == "direct_io=1"
    assert "vram=0" in CacheConfig(budget="1M").opts().split(",")


def test_cache_flags_of_the_shipped_binaries() -> None:
    from moetier.server import cache_flags

    c = CacheConfig(budget="1M", policy="lru")
    want = ["--expert-cache", "1048576", "--expert-policy", "lru", "--expert-opt", c.opts()]
    assert cache_flags(c) == want
    assert cache_flags(c, "/s/m.experts") == [*want, "--expert-store", "/s/m.experts"]


def test_model_checks_rpc_and_tensor_overrides(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    cases: list[tuple[dict[str, object], str]] = [
        ({"rpc": 5}, "rpc: 5 must be a string of HOST:PORT, comma-separated"),
        ({"tensor_overrides": "a=CPU"}, "tensor_overrides: 'a=CPU' must be a sequence of PATTERN=BUFFER_TYPE strings"),
        ({"tensor_overrides": [1]}, "tensor_overrides: [1] must be a sequence of PATTERN=BUFFER_TYPE strings"),
        # the overrides reach the core, which checks each
        ({"tensor_overrides": ["nope"]}, "tensor override 'nope': expected PATTERN=BUFFER_TYPE (e.g. exps=CPU)"),
    ]
    for kw, says in cases:
        with pytest.raises(ConfigError) as e:
            Model(path, **kw)  # type: ignore[arg-type]
        assert str(e.value) == says
