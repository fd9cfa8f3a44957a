"""The pool's configuration file, field by field: every value and default it reads, and every error
with the exact message, the file and the line (no models are loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier import ConfigError
from moetier.config import parse_size
from moetier.pool.sched import Mechanisms
from moetier.pool.spec import ModelSpec, Stage, load_spec

FULL = """\
budget: 512M
executors: 3
threads: 2
scheduler: +evict
profile: prof/pool.profile.json
models:
  a: {path: a.gguf, n_ctx: 1024, max_batch: 8}
  m: {path: moe.gguf, store: moe.experts, cache: 25%}
  s: {path: moe.gguf, store: moe.experts, cache: 64M}
pipelines:
  p:
    stages:
      one: {model: a, next: two}
      two: {model: m, max_tokens: 7, prompt: "{previous}!", next: {"^y": three, "^n": null, default: three}}
      three: {model: s, next: null}
"""


def write(tmp: Path, text: str) -> Path:
    for name in ("a.gguf", "moe.gguf"):
        (tmp / name).write_bytes(b"GGUF")
    (tmp / "moe.experts").mkdir(exist_ok=True)
    p = tmp / "pool.yaml"
    p.write_text(text)
    return p


def test_every_field_is_read(tmp_path: Path) -> None:
    s = load_spec(write(tmp_path, FULL))
    assert (s.budget, s.executors, s.threads, s.scheduler) == (512 << 20, 3, 2, "+evict")
    assert s.profile == tmp_path / "prof" / "pool.profile.json"  # relative to the file
    assert s.mechanisms == Mechanisms.baseline("+evict")
    assert s.models == {
        "a": ModelSpec("a", tmp_path / "a.gguf", None, "", 1024, 8),
        "m": ModelSpec("m", tmp_path / "moe.gguf", tmp_path / "moe.experts", "25%", 512, 4),
        "s": ModelSpec("s", tmp_path / "moe.gguf", tmp_path / "moe.experts", "64M", 512, 4),
    }
    p = s.pipelines["p"]
    assert p.first == "one"  # the first stage written, when `first` is not given
    assert p.stages == {
        "one": Stage("one", "a", 32, "{input}", (), "two"),
        "two": Stage("two", "m", 7, "{previous}!", (("^y", "three"), ("^n", None)), "three"),
        "three": Stage("three", "s", 32, "{input}", (), None),
    }
    assert s.deps() == {"m": {"a"}, "s": {"m"}}
    assert p.stages["two"].next_stage("no") is None and p.stages["two"].next_stage("maybe") == "three"
    assert s.models["a"].shape() == [4, False, "", 1024]
    assert [m.line for m in s.models.values()] == [7, 8, 9]  # where each is written, for errors found later


def test_defaults(tmp_path: Path) -> None:
    s = load_spec(write(tmp_path, "budget: 1G\nmodels:\n  a: {path: a.gguf}\n"))
    assert (s.executors, s.threads, s.scheduler, s.profile, s.pipelines) == (1, 1, "coserve", None, {})
    assert s.models["a"] == ModelSpec("a", tmp_path / "a.gguf")
    assert (s.models["a"].store, s.models["a"].cache, s.models["a"].n_ctx, s.models["a"].max_batch) == (
        None,
        "",
        512,
        4,
    )
    home = load_spec(write(tmp_path, f"budget: 1G\nmodels:\n  a: {{path: {tmp_path / 'a.gguf'}}}\n"))
    assert home.models["a"].path == tmp_path / "a.gguf"  # an absolute path stays as it is


BASE = "budget: 1G\nmodels:\n  a: {path: a.gguf}\n"
PIPE = BASE + "pipelines:\n  p:\n    stages:\n      one: {model: a}\n"


@pytest.mark.parametrize(
    ("text", "line", "msg"),
    [
        ("- a\n", 1, "pool: expected a mapping"),
        (
            BASE + "budgets: 2G\n",
            4,
            "pool: unknown key 'budgets'; known: budget, executors, models, pipelines, profile, scheduler, threads",
        ),
        ("models:\n  a: {path: a.gguf}\n", 1, "pool: 'budget' is required (bytes, e.g. 1.5G)"),
        (BASE.replace("1G", "0"), 1, "budget: must be positive"),
        (BASE.replace("1G", "[1]"), 1, "budget: expected a single value"),
        (BASE + "executors: 0\n", 4, "executors: expected an integer >= 1, got 0"),
        (BASE + "executors: true\n", 4, "executors: expected an integer >= 1, got True"),
        (BASE + "threads: 0\n", 4, "threads: expected an integer >= 1, got 0"),
        (BASE + "threads: 1.5\n", 4, "threads: expected an integer >= 1, got 1.5"),
        (BASE + "threads: 513\n", 4, "threads: expected an integer <= 512, got 513"),
        (BASE + "executors: 2147483648\n", 4, "executors: expected an integer <= 2147483647, got 2147483648"),
        (
            BASE + "scheduler: lifo\n",
            4,
            "unknown scheduler 'lifo'; one of coserve, none, +evict, +arrange, fcfs-lru, fifo, round-robin",
        ),
        (BASE + "scheduler: ''\n", 4, "scheduler: expected a non-empty string, got ''"),
        (BASE + "profile: 3\n", 4, "profile: expected a non-empty string, got 3"),
        ("budget: 1G\n", 1, "pool: 'models' is required"),
        ("budget: 1G\nmodels: {}\n", 2, "models: at least one model is needed"),
        ("budget: 1G\nmodels: [a]\n", 2, "models: expected a mapping"),
        ("budget: 1G\nmodels:\n  a: {path: a.gguf}\n  a: {path: a.gguf}\n", 4, "models: 'a' given twice"),
        ("budget: 1G\nmodels: {[a]: {path: a.gguf}}\n", 2, "models: keys must be names"),
        ("budget: 1G\nmodels:\n  a: a.gguf\n", 3, "models.a: expected a mapping"),
        ("budget: 1G\nmodels:\n  a: {n_ctx: 64}\n", 3, "models.a: 'path' is required"),
        (
            BASE.replace("a.gguf}", "a.gguf, ctx: 9}"),
            3,
            "models.a: unknown key 'ctx'; known: cache, max_batch, n_ctx, path, store",
        ),
        (BASE.replace("a.gguf}", "a.gguf, n_ctx: 32}"), 3, "models.a.n_ctx: expected an integer >= 64, got 32"),
        (BASE.replace("a.gguf}", "a.gguf, max_batch: 0}"), 3, "models.a.max_batch: expected an integer >= 1, got 0"),
        (
            BASE.replace("a.gguf}", "a.gguf, n_ctx: 9999999999}"),
            3,
            "models.a.n_ctx: expected an integer <= 2147483647, got 9999999999",
        ),
        (
            BASE.replace("a.gguf}", "moe.gguf, store: moe.experts}"),
            3,
            "models.a: a store needs a cache (bytes or a share of the expert bytes, e.g. 25%)",
        ),
        (
            BASE.replace("a.gguf}", "moe.gguf, store: moe.experts, cache: 0%}"),
            3,
            "models.a.cache: '0%' is not a share above 0% and at most 100%",
        ),
        (
            BASE.replace("a.gguf}", "moe.gguf, store: moe.experts, cache: 101%}"),
            3,
            "models.a.cache: '101%' is not a share above 0% and at most 100%",
        ),
        (
            BASE.replace("a.gguf}", "moe.gguf, store: moe.experts, cache: lots%}"),
            3,
            "models.a.cache: 'lots%' is not a share above 0% and at most 100%",
        ),
        (
            BASE.replace("a.gguf}", "a.gguf, cache: 1G}"),
            3,
            "models.a.cache: an expert cache needs a store (moetier pack); add store:",
        ),
        (PIPE.replace("  p:", "  a:"), 5, "pipelines.a: the name is also a model's; names must be unique"),
        (BASE + "pipelines:\n  p: {first: one}\n", 5, "pipelines.p: 'stages' is required"),
        (BASE + "pipelines:\n  p: {stages: {}}\n", 5, "pipelines.p.stages: at least one stage is needed"),
        (PIPE + "    firts: one\n", 8, "pipelines.p: unknown key 'firts'; known: first, stages"),
        (PIPE + "    first: zz\n", 8, "pipelines.p.first: no stage named 'zz'"),
        (PIPE.replace("{model: a}", "{max_tokens: 3}"), 7, "pipelines.p.stages.one: 'model' is required"),
        (
            PIPE.replace("{model: a}", "{model: a, max_token: 3}"),
            7,
            "pipelines.p.stages.one: unknown key 'max_token'; known: max_tokens, model, next, prompt",
        ),
        (PIPE.replace("{model: a}", "{model: zz}"), 7, "pipelines.p.stages.one.model: unknown model 'zz'; models: a"),
        (
            PIPE.replace("{model: a}", "{model: a, max_tokens: 0}"),
            7,
            "pipelines.p.stages.one.max_tokens: expected an integer >= 1, got 0",
        ),
        (
            PIPE.replace("{model: a}", "{model: a, next: {yes: 3}}"),
            7,
            "pipelines.p.stages.one.next.yes: expected a stage name or null",
        ),
        (
            PIPE.replace("{model: a}", "{model: a, next: 3}"),
            7,
            "pipelines.p.stages.one.next: expected a stage name, null or a map of patterns",
        ),
        (PIPE.replace("{model: a}", "{model: a, next: one}"), 7, "pipelines.p: the stages form a cycle: one -> one"),
        (
            PIPE.replace("{model: a}", "{model: a, next: two}"),
            7,
            "pipelines.p.stages.one.next: no stage named 'two' (dangling)",
        ),
        (
            PIPE + "      two: {model: a}\n",
            8,
            "pipelines.p.stages.two: unreachable from the first stage 'one'",
        ),
    ],
)
def test_errors_name_the_file_and_line(tmp_path: Path, text: str, line: int, msg: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_spec(p)
    assert str(e.value) == f"{p}:{line}: {msg}"


def test_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "none.yaml"
    with pytest.raises(ConfigError) as e:
        load_spec(missing)
    assert str(e.value) == f"{missing}: cannot read the pool configuration: No such file or directory"
    empty = write(tmp_path, "")
    with pytest.raises(ConfigError) as e:
        load_spec(empty)
    assert str(e.value) == f"{empty}: empty pool configuration"
    bad = write(tmp_path, "budget: 1G\nmodels: {a: [\n")
    with pytest.raises(ConfigError) as e:
        load_spec(bad)
    assert str(e.value).startswith(f"{bad}:3: not valid YAML or JSON: ")
    assert "expected" in str(e.value)  # the parser's problem, not the exception's repr
    store = write(tmp_path, BASE.replace("a.gguf}", "moe.gguf, store: gone.experts, cache: 25%}"))
    with pytest.raises(ConfigError) as e:
        load_spec(store)
    assert str(e.value) == f"{store}:3: models.a.store: {tmp_path / 'gone.experts'} does not exist"
    size = write(tmp_path, BASE.replace("a.gguf}", "moe.gguf, store: moe.experts, cache: lots}"))
    with pytest.raises(ConfigError) as want:
        parse_size("lots", "models.a.cache")
    with pytest.raises(ConfigError) as e:
        load_spec(size)
    assert str(e.value) == f"{size}:3: {want.value}"
