"""One parameter path: the C++ option table (csrc/moetier-params.cpp) drives the KEY=VALUE parser,
the checker, the defaults and help of CacheConfig and the --expert-opt help of the shipped tools."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from moetier import CacheConfig, ConfigError, ContextConfig, _core
from moetier.config import FIELD_ROWS, NOT_FIELDS, PARAM_TABLE
from moetier.server import tool_path


def test_table_and_cache_config_agree() -> None:
    fields = {FIELD_ROWS.get(f.name, f.name) for f in dataclasses.fields(CacheConfig)}
    rows = set(PARAM_TABLE) - set(NOT_FIELDS)
    assert fields == rows, f"CacheConfig fields without a row: {fields - rows}; rows without a field: {rows - fields}"


def test_defaults_and_help_come_from_the_table() -> None:
    p = _core.Params()
    for f in dataclasses.fields(CacheConfig):
        row = PARAM_TABLE[FIELD_ROWS.get(f.name, f.name)]
        assert f.metadata["help"].split(";")[0] in row["help"]
        if f.name != "budget":
            default = getattr(p, f.name)
            assert f.default == (round(default, 6) if isinstance(default, float) else default), f.name


def test_params_set_by_field_name() -> None:
    cfg = CacheConfig(budget="3M", policy="multi", t1=0.5, t2=0.8, w_fld=0.5, io_uring=0, prefetch=1)
    p = cfg.params("/some/store")
    assert (p.cache_bytes, p.store_dir, p.policy) == (3 << 20, "/some/store", "multi")
    assert (p.t1, p.t2, p.w_fld, p.io_uring, p.prefetch) == (0.5, pytest.approx(0.8), 0.5, False, 1)
    assert cfg.io_uring is False  # 0/1 normalised to the row's type
    assert p.check() is None


def test_opts_round_trip_through_the_parser() -> None:
    cfg = CacheConfig(budget="3M", t1=0.25, t2=0.75, low_frac=0.1, io_threads=3, io_uring=False, direct_io=False)
    p = _core.Params()
    p.set_opts(cfg.opts())
    for f in dataclasses.fields(CacheConfig):
        if PARAM_TABLE[FIELD_ROWS.get(f.name, f.name)]["is_opt"]:
            assert getattr(p, f.name) == pytest.approx(getattr(cfg, f.name)), f.name


@pytest.mark.parametrize(
    ("opts", "why"),
    [
        ("t1=1.5", r"t1=1.5: must lie in \[0, 1\]"),
        ("prefetch=9", r"prefetch=9: must lie in \[0, 8\]"),
        ("io_uring=2", "io_uring: '2' must be 0 or 1"),
        ("policy=lru", "unknown KEY; expected one of reserve, vram, t1, t2"),
        ("t1=0.9,t2=0.5", "t1 must not exceed t2"),
        ("prefetch_waste=-1", r"prefetch_waste=-1: must lie in \[0, 100\]"),
    ],
)
def test_opts_errors_name_the_option(opts: str, why: str) -> None:
    err = _core.check_opts(opts)
    assert err is not None
    assert __import__("re").search(why, err), err
    with pytest.raises(ConfigError, match=why):
        _core.Params().set_opts(opts)


def test_range_error_from_config() -> None:
    with pytest.raises(ConfigError, match=r"cache: expert cache low_frac=1: must lie"):
        CacheConfig(budget="1M", low_frac=1.0)
    with pytest.raises(ConfigError, match=r"cache.io_threads: 1.5 must be an integer"):
        CacheConfig(budget="1M", io_threads=1.5)  # type: ignore[arg-type]


def test_context_params_by_field_name() -> None:
    ctx = ContextConfig(n_ctx=256, n_threads=3, type_k="q8_0", flash_attn="on")
    p = ctx.params()
    assert (p.n_ctx, p.n_threads, p.type_k, p.type_v, p.flash_attn) == (256, 3, "q8_0", "f16", 1)
    with pytest.raises(ConfigError, match="type_k: 'f8' is not a KV cache type"):
        ContextConfig(type_k="f8")


def test_tool_help_lists_every_option_with_its_default() -> None:
    help_text = _core.params_help()
    d = _core.Params()
    for name, row in PARAM_TABLE.items():
        if row["is_opt"]:
            assert f"- {name}: " in help_text
    assert f"(default {d.t1:g})" in help_text
    try:
        cli = tool_path("llama-cli")
    except Exception:
        pytest.skip("built without the llama.cpp tools")
    out = subprocess.run([str(cli), "--help"], capture_output=True, text=True, timeout=60).stdout
    for name, row in PARAM_TABLE.items():
        if row["is_opt"]:
            assert f"- {name}: " in out, name


def test_format_size_is_the_cores() -> None:
    from moetier import format_size

    assert format_size(3 << 20) == "3.00 MiB"
    assert _core.parse_size("3M") == 3 << 20


def test_numbers_of_other_types() -> None:
    import numpy as np

    cfg = CacheConfig(budget="1M", t1=np.float32(0.5), t2=np.float64(0.75), prefetch=np.int64(1))
    assert (type(cfg.t1), type(cfg.t2), type(cfg.prefetch)) == (float, float, int)
    assert "t1=0.5," in cfg.opts() and "t2=0.75," in cfg.opts() and "prefetch=1," in cfg.opts()
    with pytest.raises(ConfigError, match=r"cache.io_threads: 4294967296 must lie in \[0, 64\]"):
        CacheConfig(budget="1M", io_threads=2**32)


@pytest.mark.parametrize("given", [None, "77"])
def test_openmp_spin_count(given: str | None) -> None:
    """Importing moetier sets libgomp's barrier spin count (so the compute threads leave the cores to
    the I/O threads) before the engine loads libgomp, unless the user set it."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    code = (
        "import os\n"
        "before = any('libgomp' in line for line in open('/proc/self/maps'))\n"
        "import moetier\n"
        "after = any('libgomp' in line for line in open('/proc/self/maps'))\n"
        "print(before, after, os.environ['GOMP_SPINCOUNT'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", given or "3000"]


def test_context_config_checks_each_field() -> None:
    ctx = ContextConfig(n_ctx=1, type_v="q8_0", flash_attn="on")  # the smallest context; a quantized V with FA
    assert (ctx.n_ctx, ctx.type_v) == (1, "q8_0")
    for t in ("f32", "f16", "bf16"):
        assert ContextConfig(type_v=t, flash_attn="off").type_v == t
    bad: list[tuple[dict[str, object], str]] = [
        ({"type_k": ""}, "context.type_k: '' must be a non-empty string"),
        ({"type_v": 5}, "context.type_v: 5 must be a non-empty string"),
        ({"n_ctx": 0}, "context.n_ctx: 0 must be a positive integer"),
        ({"n_batch": "512"}, "context.n_batch: '512' must be a positive integer"),
        ({"n_threads": True}, "context.n_threads: True must be a positive integer"),
        ({"flash_attn": "yes"}, "context.flash_attn: 'yes' must be one of auto, off, on"),
        (
            {"type_v": "q8_0", "flash_attn": "off"},
            "context.type_v: a quantized value cache (q8_0) needs flash attention (auto or on)",
        ),
    ]
    for kw, says in bad:
        with pytest.raises(ConfigError) as e:
            ContextConfig(**kw)  # type: ignore[arg-type]
        assert str(e.value) == says


def test_cache_config_sizes_and_int32_range() -> None:
    from moetier.config import AUTO, PARAM_TABLE

    c = CacheConfig(budget="1M", vram="auto", reserve="4K")
    assert (c.vram, c.reserve) == (AUTO, 4096)
    assert CacheConfig(budget="1M", vram="2M").vram == 2 << 20
    for kw, says in (
        ({"vram": "lots"}, "cache.vram: 'lots' is not a size or auto; use e.g. 512M"),
        (
            {"reserve": "auto"},
            "cache.reserve: 'auto' is not a size; use e.g. 512M",
        ),  # auto only where it means something
    ):
        with pytest.raises(ConfigError) as e:
            CacheConfig(budget="1M", **kw)  # type: ignore[arg-type]
        assert str(e.value) == says
    # an int outside int32 is refused here, by name (the core could not take it); inside, the core's
    # own range check speaks
    for v, says in (
        (2**31, "cache.prefetch: 2147483648 must lie in [0, 8]"),
        (-(2**31) - 1, "cache.prefetch: -2147483649 must lie in [0, 8]"),
        (2**31 - 1, "cache: expert cache prefetch=2147483647: must lie in [0, 8]"),
        (-(2**31), "cache: expert cache prefetch=-2147483648: must lie in [0, 8]"),
        (-100, "cache: expert cache prefetch=-100: must lie in [0, 8]"),
    ):
        with pytest.raises(ConfigError) as e:
            CacheConfig(budget="1M", prefetch=v)
        assert str(e.value) == says
    # each field's help is the core's table row
    helps = {f.name: f.metadata.get("help") for f in dataclasses.fields(CacheConfig)}
    assert helps["prefetch"] == PARAM_TABLE["prefetch"]["help"] and len(str(helps["prefetch"])) > 20


def test_check_gguf_says_what_the_path_is(tmp_path: Path) -> None:
    from moetier import ModelError
    from moetier.model import check_gguf

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF....")
    assert check_gguf(f) == f
    with pytest.raises(ModelError) as e:
        check_gguf(f / "inside.gguf")  # a path through a file
    assert str(e.value) == f"{f / 'inside.gguf'}: cannot read the model file: Not a directory"
