"""The moetier CLI and the shipped llama.cpp binaries with the expert cache flags."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from _server import free_port, serve
from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model, pack
from moetier.cli import COMMANDS, build_parser, main


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
    assert stock.stderr.endswith(" tok/s) | expert cache off\n")
    assert "elastic cache" not in cached.stderr, "a given budget is fixed unless grow is asked for"
    # --cache-grow 1: the quarter is the least the cache keeps; with GiBs free it grows to every expert
    grown = moetier("run", "-m", str(path), "-p", LONG_PROMPT, "-n", "24", "--cache", str(budget), "--cache-grow", "1")
    assert grown.returncode == 0, grown.stderr
    assert grown.stdout == stock.stdout
    n = int(info["n_slots"])
    assert f"elastic cache: {n} of {n} slots" in grown.stderr and " given back)" in grown.stderr


def test_run_error_is_one_line(tiny_model: ModelFactory) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2)
    r = moetier("run", "-m", str(path), "-p", "hi", "--cache", "1K")
    assert r.returncode == 1
    assert r.stderr.startswith("moetier: error: ") and "below the minimum" in r.stderr
    assert "Traceback" not in r.stderr


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_lists_every_command_once_by_group(capsys: pytest.CaptureFixture[str]) -> None:
    registered = _subcommands(build_parser())
    names = [name for name, _, _ in COMMANDS]
    assert len(names) == len(set(names)) and set(names) == set(registered)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moetier [-h] [--debug] COMMAND [ARGS]\n")
    assert "{" not in out, "argparse's {run,serve,...} blob is back"
    assert "`moetier COMMAND --help` for a command's flags." in out
    lines = out.splitlines()
    for name in registered:
        assert sum(line.split()[:1] == [name] for line in lines) == 1, f"{name} is not listed exactly once"
    # each group: a heading, then its commands, one line each
    for group in dict.fromkeys(g for _, g, _ in COMMANDS):
        at = lines.index(f"{group}:")
        listed = [line.split()[0] for line in lines[at + 1 :] if line.startswith("  ")][: len(names)]
        assert listed[: sum(g == group for _, g, _ in COMMANDS)] == [n for n, g, _ in COMMANDS if g == group]
    # no arguments: the same help, as git does, and a usage error's status
    assert main([]) == 2 and capsys.readouterr().out == out


def test_every_command_and_flag_has_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's own parsers and those of the commands that hand their arguments to a tool's parser
    (captured when the tool parses)."""
    parsers = dict(_subcommands(build_parser()))

    class Parsed(Exception):
        pass

    def capture(self: argparse.ArgumentParser, *args: object, **kw: object) -> None:
        parsers[self.prog] = self
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    for name, parser in list(parsers.items()):
        if parser.get_default("passthrough") and name not in ("serve", "tool"):
            with pytest.raises(Parsed):
                parser.get_default("func")(argparse.Namespace(), [])
    assert {"moetier trace", "moetier replay", "moetier models", "moetier routing"} <= set(parsers)
    todo = list(parsers.items())
    while todo:
        name, parser = todo.pop()
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += list(a.choices.items())
                assert all(c.help for c in a._choices_actions), f"{name}: a subcommand has no help"
            elif not isinstance(a, argparse._HelpAction):
                assert a.help and a.help != argparse.SUPPRESS, f"{name}: {a.option_strings or a.dest} has no help"


def test_tool_help() -> None:
    # a tool's --help is the tool's own
    r = moetier("tool", "llama-server", "--help")
    assert r.returncode == 0 and "--expert-cache SIZE" in r.stdout + r.stderr
    r = moetier("tool", "--help")
    assert r.returncode == 0 and "llama-perplexity" in r.stdout


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


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """moetier ARGS in this process: the exit status and stderr."""
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's usage errors
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err


@pytest.fixture
def files(tiny_model: ModelFactory, tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A tiny MoE, a dense model, another MoE's store, and files a user can get wrong."""
    f = {"moe": tiny_model("qwen2moe", n_expert=8, n_expert_used=2), "dense": tiny_model("qwen2")}
    f["other_store"] = pack(tiny_model("qwen2moe", n_expert=8, n_expert_used=2, seed=9), tmp_path / "o", progress=False)
    f["dir"] = tmp_path / "model.gguf"
    f["dir"].mkdir()
    f["text"] = tmp_path / "notes.txt"
    f["text"].write_text("some text\n")
    f["full"] = tmp_path / "full"
    f["full"].mkdir()
    (f["full"] / "notes.txt").write_text("keep me\n")
    f["bad_json"] = tmp_path / "bad.json"
    f["bad_json"].write_text('{"policy": "lru",\n')
    f["bad_value"] = tmp_path / "value.json"
    f["bad_value"].write_text(json.dumps({"t1": 5}))
    f["text_named_model"] = tmp_path / "context.model"  # a file name that looks like a config field
    f["text_named_model"].write_text("not a model\n")
    f["pool"] = tmp_path / "pool.yaml"
    f["pool"].write_text(f"budget: 1G\nmodels:\n  a: {{path: {f['dense']}}}\n")
    f["neg_usage"] = tmp_path / "usage.json"
    f["neg_usage"].write_text('{"a": -1}')
    f["odd_result"] = tmp_path / "odd.json"
    f["odd_result"].write_text(json.dumps({"runs": {"moetier-25": 5}, "expert_bytes": 1}))
    f["npz"] = tmp_path / "other.npz"
    np.savez(f["npz"], x=np.zeros(3))
    yield f


# (arguments with {name} for a file of `files`, what the message says); each ends in one line, or two
# for a usage error (the problem, then where the flags are listed), with no traceback
USER_ERRORS = [
    (["run", "-m", "{missing}", "-p", "hi"], "{missing}: model file does not exist"),
    (["run", "-m", "{dir}", "-p", "hi"], "{dir}: is a directory, not a model file; give the .gguf file"),
    (["run", "-m", "{text}", "-p", "hi"], "{text}: not a GGUF file"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache", "12Q"], "--cache: '12Q' is not a size or auto; use e.g. 512M"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache", "-5M"], "--cache: '-5M' is not a size"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache", "150%"], "--cache: '150%' is not a size"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache-policy", "nope"], "--cache-policy: unknown policy 'nope'; available"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache-t1", "2"], "--cache-t1 2: must lie in [0, 1]"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache-t1", "x"], "argument --cache-t1: invalid float value: 'x'"),
    (["run", "-m", "{moe}", "-p", "hi", "-n", "-5"], "-n/--n-predict: '-5' is not a number of tokens"),
    (["run", "-m", "{moe}", "-p", "hi", "--n-ctx", "0"], "--n-ctx: 0 must be a positive integer"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache-polcy", "lru"], "unrecognized arguments: --cache-polcy lru"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache-config", "{bad_json}"], "{bad_json}: cannot read the cache config"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache-config", "{bad_value}"], "{bad_value}: cache: expert cache t1=5"),
    (["run", "-m", "{moe}", "-p", "hi", "--cache-config", "{missing}"], "{missing}: cannot read the cache config"),
    (["run", "-m", "{moe}", "-p", "hi", "--store", "{missing}"], "{missing}: expert store directory does not exist"),
    (["run", "-m", "{moe}", "-p", "hi", "--store", "{other_store}"], "packed from a different model"),
    (["run", "-m", "{moe}", "-p", "hi", "--store", "{text}"], "{text}: is a file, not an expert store"),
    (["run", "-m", "{moe}", "-p", "hi", "--no-cache", "--store", "{other_store}"], "drop --no-cache or --store"),
    (["run", "-m", "{dense}", "-p", "hi", "--cache", "1M"], "the expert cache needs a MoE model"),
    (["run", "-m", "{dense}", "-p", "hi"], "the expert cache needs a MoE model; run it with --no-cache"),
    (["run", "-m", "{moe}", "-p", "hi", "--n-threads", "100000"], "--n-threads: 100000 must be at most 512"),
    (["run", "-m", "{moe}", "-p", "hi", "--n-ctx", "99999999999"], "--n-ctx: 99999999999 must be at most 2147483647"),
    (
        ["run", "-m", "{moe}", "-p", "hi", "-n", "2147483648"],
        "'2147483648' is not a number of tokens (0 to 2147483647)",
    ),
    (["run", "-m", "{moe}", "-p", "hi", "--seed=-1"], "--seed -1 must be an integer in [0, 4294967295]"),
    (["run", "-m", "{moe}", "-p", "hi", "--seed", "4294967296"], "--seed 4294967296 must be an integer in"),
    (["run", "-m", "{moe}", "-p", "hi", "--temperature", "nan"], "--temperature nan must be a finite number"),
    (["run", "-m", "{moe}", "-p", "hi", "--temperature", "inf"], "--temperature inf must be a finite number"),
    (["run", "-m", "{moe}", "-p", "hi", "--temperature=-1"], "--temperature -1.0 must be a finite number, 0"),
    (["run", "-m", "{moe}", "-p", "hi", "-ngl", "9999999999999"], "-ngl 9999999999999 must be a non-negative"),
    (["run", "-m", "{moe}", "-p", ""], "-p: empty prompt"),
    (
        ["run", "-m", "{moe}", "-p", "hi", "--no-cache", "--cache", "1M", "--cache-t1", "0.5"],
        "--cache, --cache-t1: no effect with --no-cache",
    ),
    (
        ["run", "-m", "{moe}", "-p", "hi", "--no-cache", "--cache-config", "{bad_json}"],
        "--cache-config {bad_json}: no effect with",
    ),
    (["calibrate", "{moe}", "--corpus", "{text}", "--show", "-3"], "argument --show: '-3' is not a number of rows"),
    (["stats", "127.0.0.1:9", "--interval", "inf"], "--interval: inf is not a number of seconds in (0, 86400]"),
    (["stats", "127.0.0.1:9", "--interval", "0"], "--interval: 0.0 is not a number of seconds in (0, 86400]"),
    (["stats", "127.0.0.1:9", "--interval", "86400.5"], "--interval: 86400.5 is not a number of seconds in (0, 86400]"),
    (["serve-pool", "{text}", "--port", "65536"], "argument --port: '65536' is not a TCP port (0 to 65535"),
    (
        ["serve-variants", "{moe}", "{moe}", "--stores", "{dir}", "{dir}", "--names", "a,", "--cache", "1M"],
        "--names a,: each variant needs its own non-empty name",
    ),
    (
        ["serve-variants", "{moe}", "{moe}", "--stores", "{dir}", "{dir}", "--names", "a, a", "--cache", "1M"],
        "--names a, a: each variant needs its own",
    ),
    (
        ["moefy", "{dense}", "-o", "{missing}", "--calib", "{text}", "--calib-tokens=-5"],
        "--calib-tokens: -5 must be an integer of at least 512",
    ),
    (
        ["moefy", "{dense}", "-o", "{missing}", "--calib", "{text}", "--router-ridge", "nan"],
        "--router-ridge: nan must be a finite number",
    ),
    (
        ["moefy", "{dense}", "-o", "{missing}", "--calib", "{text}", "--distill-epochs=-3"],
        "--distill-epochs: -3 must be >= 0",
    ),
    (["demo", "--calib-tokens", "0"], "--calib-tokens: 0 must be an integer of at least 512"),
    (["pack", "{moe}", "-o", "{missing}", "--low-type", "foo"], "--low-type: unknown low-precision type 'foo'"),
    (
        ["trace", "{moe}", "--text", "{text}", "-o", "{missing}/t.npz"],
        "-o {missing}/t.npz: {missing} is not a directory",
    ),
    (["serve-pool", "{pool}", "--scheduler", "foo"], "--scheduler: unknown scheduler 'foo'; one of coserve"),
    (["serve-pool", "{pool}", "--threads", "513"], "--threads: 513 must be from 1 to 512 (0 keeps the file's)"),
    (
        ["serve-pool", "{pool}", "--executors", "-1"],
        "--executors: -1 must be from 1 to 2147483647 (0 keeps the file's)",
    ),
    (["profile", "{pool}", "-o", "{missing}/p.json"], "-o {missing}/p.json: {missing} is not a directory"),
    (
        ["profile", "{pool}", "--usage", "{neg_usage}", "-o", "{dir}/p.json"],
        "--usage {neg_usage}: a: weight -1.0 is negative",
    ),
    (["calibrate", "{moe}", "--corpus", "{text}", "--budget", "1M", "--tokens", "0"], "--tokens: 0 must be positive"),
    (
        ["calibrate", "{moe}", "--corpus", "{text}", "--budget", "1M", "--target-low", "2"],
        "--target-low: 2.0 must lie in [0, 1]",
    ),
    (["calibrate", "{moe}", "--corpus", "{text}", "--budget", "0"], "--budget: 0 turns the cache off"),
    (["run", "-m", "{text_named_model}", "-p", "hi"], "{text_named_model}: not a GGUF file"),
    (
        ["serve-variants", "{moe}", "{dense}", "--stores", "{dir}", "{dir}", "--cache", "1M", "-t", "0"],
        "--threads: 0 must be a positive integer",
    ),
    (
        ["serve-variants", "{moe}", "{dense}", "--stores", "{dir}", "{dir}", "--cache", "1M", "-c", "0"],
        "--ctx-size: 0 must be a positive integer",
    ),
    (
        ["serve-variants", "{moe}", "{moe}", "--stores", "{dir}", "{dir}", "--cache", "1M"],
        "--names (default: the files' stems, {moe_stem}, {moe_stem}): each variant needs its own non-empty name",
    ),
    (
        ["serve-variants", "{moe}", "{dense}", "--stores", "{dir}", "--cache", "1M"],
        "--stores: 1 stores for 2 variants; give one store per variant, in order",
    ),
    (
        ["serve-variants", "{moe}", "{dense}", "--stores", "{dir}", "{dir}", "--names", "a", "--cache", "1M"],
        "--names: 1 names for 2 variants",
    ),
    (
        ["serve-variants", "{moe}", "{dense}", "--stores", "{dir}", "{dir}"],
        "--cache: give the expert cache budget the variants share (e.g. 1GiB)",
    ),
    (["pack", "{moe}", "-o", "{full}", "-q"], "{full}: holds notes.txt, so it is not a store directory"),
    (["pack", "{moe}", "-o", "{text}", "-q"], "{text}: is a file, not a directory"),
    (["pack", "{text}", "-q"], "{text}: not a GGUF file"),
    (["pack", "{dense}", "-o", "{missing}", "-q"], "not a MoE model"),
    (["pack", "{moe}", "-o", "{missing}/deep/store", "-q"], "{missing}/deep is not a directory; create it first"),
    (["calibrate", "{moe}", "--corpus", "{missing}", "--budget", "1M"], "--corpus {missing}: cannot read it"),
    (["calibrate", "{moe}", "--corpus", "{dir}", "--budget", "1M"], "--corpus {dir}: cannot read it"),
    (["calibrate", "{moe}", "--corpus", "{text}", "--budget", "12Q"], "--budget: '12Q' is not a size"),
    # a file the command writes, in a directory that is not there: its name and the reason
    (
        ["calibrate", "{moe}", "--corpus", "{text}", "--budget", "1M", "--tokens", "8", "-o", "{missing}/c.json"],
        "{missing}/c.trace.npz: No such file or directory",
    ),
    (["replay", "{text}", "-m", "{moe}"], "{text}: not a moetier routing trace (not an .npz archive)"),
    (["replay", "{npz}", "-m", "{moe}"], "{npz}: not a moetier routing trace"),
    (["replay", "{missing}", "-m", "{moe}"], "{missing}: cannot read the routing trace"),
    (["trace", "{moe}", "--text", "{missing}", "-o", "{missing}"], "--text {missing}: cannot read it"),
    (["trace", "{moe}", "--text", "{text}", "-o", "{dir}/../t.npz", "--tokens", "0"], "--tokens: 0 must be positive"),
    (["trace", "{moe}", "--text", "{text}", "-o", "{dir}/../t.npz", "-t", "0"], "--threads: 0 must be a positive"),
    (["moefy", "{moe}", "-o", "{missing}", "--calib", "{text}"], "moefy converts qwen2 models, this one is 'qwen2moe'"),
    (["moefy", "{dense}", "-o", "{missing}", "--calib", "{missing}"], "--calib {missing}: cannot read it"),
    (["stats", "host:port", "--once"], "host:port: not a server address"),
    (["bench-plot", "{bad_json}"], "{bad_json}: not a bench result: not JSON"),
    (["bench-plot", "{odd_result}"], "{odd_result}: not a bench result (AttributeError: "),
    (["replay", "{npz}", "--budgets", "25", "--t1", "5"], "--t1: 5.0 must lie in [0, 1]"),
    (["replay", "{npz}", "--budgets", "25", "--weights=-1,0,0,0"], "--weights: '-1,0,0,0' needs 4 finite numbers"),
    (["replay", "{npz}", "--budgets", "25", "--tokens=-5"], "--tokens: -5 must be 0 (every token) or more"),
    (["replay", "{npz}", "--budgets", "25", "--policies", ","], "--policies: ',' names no policy"),
    (
        ["replay", "{npz}", "--budgets", "25", "--expert-bytes", "9223372036854775808"],
        "--expert-bytes: '9223372036854775808' is over 1 TiB",
    ),
    (["replay", "{npz}", "--budgets", "25,25"], "--budgets: 25.0 given twice; each is one replay"),
    (["replay", "{npz}", "--budgets", "25", "--policies", "lru,lru"], "--policies: lru given twice"),
    (
        ["replay", "{npz}", "--budgets", "25", "--low-frac", "0.3"],
        "--low-frac 0.3: a share in [0, 1) of a model's cache (with -m)",
    ),
    (["sever"], "'sever' is not a command; did you mean serve?"),
    (["tool"], "name the tool to run"),
]


@pytest.mark.parametrize(("args", "says"), USER_ERRORS, ids=[f"{a[0]}: {s[:32]}" for a, s in USER_ERRORS])
def test_user_errors_name_the_file_or_flag(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    names = {k: str(v) for k, v in files.items()} | {
        "missing": str(tmp_path / "missing"),
        "moe_stem": files["moe"].stem,
    }
    rc, err = cli(capsys, *(a.format(**names) for a in args))
    assert rc != 0
    assert "Traceback" not in err
    assert 1 <= len(err.splitlines()) <= 2, err
    assert says.format(**names) in err.splitlines()[0]


def test_errors_stay_one_line_after_llama_cpp_took_the_log(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Importing llama_cpp installs its own log callback for the whole process (llama_log_set); the
    CLI takes the stream back, so llama.cpp's own error lines do not join moetier's one-line error."""
    pytest.importorskip("llama_cpp")  # installed by `python -m moetier.lcpp install`
    from moetier.lcpp import import_llama_cpp

    import_llama_cpp()
    rc, err = cli(capsys, "run", "-m", str(files["moe"]), "-p", "hi", "--store", str(tmp_path / "missing"))
    assert rc != 0 and len(err.splitlines()) == 1, err


def test_serve_refuses_what_llama_server_would_log_pages_about(files: dict[str, Path], tmp_path: Path) -> None:
    """Checked before llama-server starts: each a one-line error, not its log."""
    moe = str(files["moe"])
    with socket.socket() as taken:
        # as another llama-server holds it: with SO_REUSEPORT, which a second server would share silently
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["-m", moe, "--cache", "1M", "--port", str(port)], f"--port {port}: 127.0.0.1:{port} is in use"),
            (["-m", str(tmp_path / "missing.gguf")], "missing.gguf: model file does not exist"),
            (["-m", str(files["dir"])], "is a directory, not a model file"),
            (["-m", moe, "--store", str(files["other_store"])], "add --cache SIZE (or auto)"),
            (["-m", moe, "--cache", "1M", "--expert-opt", "t1=0.5"], "--expert-opt: moetier serve writes it"),
            (["-m", moe, "--cache", "12Q"], "--cache: '12Q' is not a size"),
            (["-m", moe, "--cache-budget", "2M"], "--cache-budget: a flag of moetier run; moetier serve takes --cache"),
            (["-m", moe, "--n-ctx=512"], "--n-ctx: a flag of moetier run"),
        ]
        for args, says in cases:
            r = moetier("serve", *args)
            assert r.returncode == 1 and r.stderr.startswith("moetier: error: ") and says in r.stderr, r.stderr
            assert len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (
            ["run", "-p", "hi"],
            "moetier run: error: the following arguments are required: -m/--model\n"
            "moetier run: `moetier run --help` lists the flags\n",
        ),
        (
            ["sever"],
            "moetier: error: 'sever' is not a command; did you mean serve?\n"
            "moetier: `moetier --help` lists the commands\n",
        ),
        (
            ["tool"],
            "moetier tool: error: name the tool to run, e.g. `moetier tool llama-cli -m MODEL.gguf`\n"
            "moetier tool: `moetier tool --help` lists the flags\n",
        ),
    ],
)
def test_usage_errors_exit_2_and_say_where_the_help_is(
    argv: list[str], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error is two lines, the problem and which --help lists the commands (top level) or the
    flags (a command), with exit status 2 as argparse's own errors."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == want


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_tool_without_a_tool_lists_the_tools(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tool", flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moetier tool ") and "llama-perplexity" in out
    assert out.endswith("\n`moetier tool TOOL --help` for the tool's flags (llama.cpp's, with --expert-*).\n")


@pytest.mark.parametrize(
    ("command", "text", "want"),
    [
        ("run", "cache.t1: must lie in [0, 1]", "--cache-t1: must lie in [0, 1]"),
        ("run", "cache.budget: too small", "--cache: too small"),
        ("run", "cache: expert cache t1=2: above t2", "--cache-t1 2: above t2"),
        ("run", "type_k: not a ggml type", "--type-k: not a ggml type"),
        ("run", "context.n_ctx: must be positive", "--n-ctx: must be positive"),
        ("run", "context.n_threads: 0 must be a positive integer", "--n-threads: 0 must be a positive integer"),
        ("run", "n_gpu_layers: -2 is negative", "-ngl -2 is negative"),
        ("run", "rpc: no port", "--rpc no port"),
        ("run", "tensor_overrides: 'x' has no '='", "-ot 'x' has no '='"),
        ("run", "generate: max_tokens -1 must be an integer", "-n -1 must be an integer"),
        ("run", "generate: seed -1 must be an integer", "--seed -1 must be an integer"),
        ("run", "generate: empty prompt", "-p: empty prompt"),
        ("run", "dense model: drop the expert cache option for dense models", "dense model: run it with --no-cache"),
        ("moefy", "moefy.calib_tokens: 0 must be positive", "--calib-tokens: 0 must be positive"),
        ("moefy", "distill.epochs: -1 must be 0 or more", "--distill-epochs: -1 must be 0 or more"),
        ("calibrate", "calibrate.tokens: 0 must be positive", "--tokens: 0 must be positive"),
        # not a field of a config, no flag of this command, or no field named at all: unchanged
        ("run", "cache.colour: red", "cache.colour: red"),
        ("run", "colour: red", "colour: red"),
        ("run", "the store is damaged", "the store is damaged"),
        ("pack", "rpc: no port", "rpc: no port"),
        ("pack", "generate: empty prompt", "generate: empty prompt"),
        (
            "pack",
            "dense model: drop the expert cache option for dense models",
            "dense model: drop the expert cache option for dense models",
        ),
        ("moefy", "generate: seed -1 must be an integer", "generate: seed -1 must be an integer"),
    ],
)
def test_flag_errors_name_the_flag_that_set_the_value(command: str, text: str, want: str) -> None:
    """An error about a value that a flag set names the flag (the command's own spelling of it); an
    error about anything else, or about a value the command has no flag for, passes through as it is."""
    from moetier.cli import _named_flag, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert _named_flag(sub.choices[command], text) == want


def test_pack_takes_its_flags(tiny_model: ModelFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`moetier pack` writes the store with the pack flags given (here the low-precision type) and
    says where it wrote it."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    out = tmp_path / "q8.experts"
    assert main(["pack", str(path), "-o", str(out), "--low-type", "q8_0", "--quiet"]) == 0
    assert capsys.readouterr().err == f"moetier: store written to {out}\n"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["low_type"] == "q8_0"
    assert {p["type_low"] for layer in manifest["layers"] for p in layer["projections"]} == {"q8_0"}


def test_serve_passes_llama_servers_m_flags_through(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama-server's -md, -mg, -mm, -mmu, -mmdev and -mu reach it whole, not read as `-m` with a value
    (`-md X` was `-m d`); the model stays the one -m names."""
    from moetier import server

    got: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(server, "exec_tool", lambda tool, args: got.append((tool, list(args))))
    moe, dense = str(files["moe"]), str(files["dense"])
    extra = ["-md", dense, "-mg", "0", "-mmdev=none", "-mu", "http://x/m.gguf"]
    assert main(["serve", "-mm", "proj.gguf", "-m", moe, *extra, "--port", "0"]) == 0
    ((tool, args),) = got
    assert tool == "llama-server" and args[:2] == ["-m", moe]
    rest = args[2:]
    for flag, value in (("-md", dense), ("-mg", "0"), ("-mu", "http://x/m.gguf"), ("-mm", "proj.gguf")):
        assert rest[rest.index(flag) + 1] == value
    assert "-mmdev=none" in rest and rest.count("-m") == 0
    capsys.readouterr()


@pytest.mark.parametrize("command", ["serve-pool", "serve-variants"])
def test_a_server_that_cannot_listen_says_which_flag_and_frees_its_models(
    files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """An address in use or a host that does not resolve: one line naming --port or --host, after the
    models loaded for the server were freed."""
    import moetier.pool.executor as executor
    import moetier.variants as variants

    closed: list[str] = []
    for cls in (executor.Pool, variants.Variants):
        real = cls.close
        monkeypatch.setattr(
            cls, "close", lambda self, real=real, name=cls.__name__: (closed.append(name), real(self))[1]
        )
    if command == "serve-pool":
        cfg = tmp_path / "pool.yaml"
        cfg.write_text(f"budget: 1G\nmodels:\n  a: {{path: {files['dense']}}}\n")
        args = ["serve-pool", str(cfg), "--no-profile"]
    else:
        store = tmp_path / "moe.experts"
        assert main(["pack", str(files["moe"]), "-o", str(store), "-q"]) == 0
        capsys.readouterr()
        moe = str(files["moe"])
        args = ["serve-variants", moe, moe, "--stores", str(store), str(store), "--names", "a,b", "--cache", "1M"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err = cli(capsys, *args, "--port", str(port))
    assert rc == 1 and err.startswith(f"moetier: error: --port {port}: cannot listen on 127.0.0.1:{port} (")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    rc, err = cli(capsys, *args, "--host", "no-such-host.invalid", "--port", "0")
    assert rc == 1 and err.startswith("moetier: error: --host no-such-host.invalid: cannot resolve it (")
    assert closed == ["Pool" if command == "serve-pool" else "Variants"] * 2


def test_run_says_which_flags_cannot_act(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Flags given that this combination leaves without effect are each a warning, not silently dropped;
    without them, no warning."""
    moe = str(files["moe"])
    assert main(["run", "-m", moe, "-p", "hi", "-n", "2", "--cache", "1M"]) == 0
    assert "warning" not in capsys.readouterr().err
    args = ["--seed", "5", "--cache-reserve", "1M", "--cache-low-frac", "0.3", "--cache-prefetch", "0"]
    assert main(["run", "-m", moe, "-p", "hi", "-n", "2", "--cache", "1M", *args, "--cache-prefetch-waste", "5"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("moetier: warning: ")]
    assert [w.removeprefix("moetier: warning: ").split(" has no effect")[0].split(":")[0] for w in warnings] == [
        "low_frac=0.3",
        "reserve=1.00 MiB",
        "prefetch_waste=5",
        "--seed 5",
    ], warnings
    import moetier

    assert main(["run", "-m", moe, "-p", "hi", "-n", "2", "-ngl", "1"]) == 0
    err = capsys.readouterr().err
    said = "moetier: warning: -ngl 1: this build has no GPU backend (CPU only); every layer runs on the CPU"
    gpu = [f for f in Path(moetier.__file__).parent.glob("libggml-*.so*") if "cuda" in f.name or "vulkan" in f.name]
    assert (said in err) == (not gpu)


def test_gpu_backends_are_the_ggml_libraries_beside_the_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each libggml-NAME.so* beside the package is a backend, by NAME; base, cpu and rpc are not GPUs."""
    from moetier import cli

    for f in ("libggml-base.so", "libggml-cpu.so", "libggml-rpc.so.0", "libggml-cuda.so.13.0", "libggml-vulkan.so"):
        (tmp_path / f).touch()
    (tmp_path / "libllama.so").touch()
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "cli.py"))
    assert cli._gpu_backends() == ["cuda", "vulkan"]
    (tmp_path / "libggml-cuda.so.13.0").unlink()
    (tmp_path / "libggml-vulkan.so").unlink()
    assert cli._gpu_backends() == []


def test_demo_converts_once_compares_and_generates_with_a_quarter_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moetier demo` on a tiny dense model standing in for the download (no network here): it converts
    the model once (named by its recipe, next to the download), prints the dense model's answer beside
    the MoE's for each prompt, packs the store and generates with a quarter of the experts cached,
    token for token as stock with every expert in RAM (status 0); the next run reuses the conversion."""
    from moetier.tools import models
    from moetier.tools.tiny import write_tiny_model

    src = write_tiny_model(tmp_path / "qwen.gguf", "qwen2", n_layer=2, seed=3, n_ff_exp=1024, n_ff_shexp=1024)
    asked: list[str] = []
    monkeypatch.setattr(models, "fetch", lambda name, **kw: (asked.append(name), src)[1])
    assert main(["demo", "--calib-tokens", "1024", "-n", "8"]) == 0
    out, err = capsys.readouterr()
    assert asked == ["qwen2.5-coder-0.5b"]
    (moe,) = tmp_path.glob("qwen-moe-demo-*.gguf")
    assert "moetier demo: converting qwen.gguf into a MoE (16 experts, top-8): several minutes, once" in err
    assert out.count("--- ") == 4 and out.count("\n  dense: ") == 4 and out.count("\n  MoE:   ") == 4
    assert "first sentence or line as the dense model's: " in out and " of 4 prompts\n" in out
    last = out.splitlines()[-1]
    assert last.startswith("moetier: 8 tokens, ") and last.endswith("same tokens as stock: True")
    assert (moe.with_suffix(".experts") / "manifest.json").is_file()
    # again: the conversion is reused, one prompt when --prompt names it
    assert main(["demo", "--calib-tokens", "1024", "-n", "8", "--prompt", "def f(x):"]) == 0
    out2, err2 = capsys.readouterr()
    assert "converting" not in err2 and list(tmp_path.glob("qwen-moe-demo-*.gguf")) == [moe]
    assert out2.count("--- ") == 1 and out2.startswith("--- 'def f(x):'\n")
    assert " of 1 prompts\n" in out2 and out2.splitlines()[-1].endswith("same tokens as stock: True")


def test_a_system_error_without_a_file_is_one_line(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An OSError that names no file (a full disk, a size limit hit while writing) is the reason in one
    line, status 1, not a traceback."""
    pack_module = sys.modules["moetier.pack"]  # the module (moetier.pack is also the function)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pack_module, "pack", full)
    rc, err = cli(capsys, "pack", str(files["moe"]), "-q")
    assert (rc, err) == (1, "moetier: error: No space left on device\n")


def test_profile_passes_its_flags_and_writes_beside_the_pool_file(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moetier profile POOL`: the request weights of --usage and --max-tokens reach the measurement,
    its notes go to stderr a line each, and without -o the profile is written beside the pool file
    (POOL.profile.json). A usage file that is not an object of finite weights is named."""
    from moetier import ConfigError
    from moetier.pool import profile as prof

    calls: list[tuple[int, object]] = []

    def fake(spec: object, max_tokens: int, weights: object, note: Callable[[str], None]) -> dict[str, object]:
        calls.append((max_tokens, weights))
        note("[1/1] a")
        note("    load 0.10 s")
        return {"models": {}}

    monkeypatch.setattr(prof, "profile", fake)
    usage = tmp_path / "usage.json"
    usage.write_text('{"a": 2}')
    assert main(["profile", str(files["pool"]), "--usage", str(usage), "--max-tokens", "7"]) == 0
    out = files["pool"].with_suffix(".profile.json")
    assert calls == [(7, {"a": 2.0})]
    assert json.loads(out.read_text()) == {"models": {}}
    err = capsys.readouterr().err
    assert err.startswith("[1/1] a\n    load 0.10 s\nwrote ")
    assert f"wrote {out}; name it as `profile:` in {files['pool']}" in err
    for text, why in (('{"a": NaN}', "a weight is not a finite number"), ("[1, 2]", "'list' object has no attribute")):
        usage.write_text(text)
        rc = main(["profile", str(files["pool"]), "--usage", str(usage)])
        want = f"moetier: error: {usage}: expected a JSON object of model or pipeline name -> request weight ({why}"
        assert rc == 1 and capsys.readouterr().err.startswith(want)

    def refused(*a: object, **k: object) -> dict[str, object]:
        msg = "usage: z is not a model or pipeline of the pool"
        raise ConfigError(msg)

    monkeypatch.setattr(prof, "profile", refused)
    usage.write_text('{"z": 1}')
    assert main(["profile", str(files["pool"]), "--usage", str(usage)]) == 1
    assert capsys.readouterr().err == f"moetier: error: --usage {usage}: z is not a model or pipeline of the pool\n"
    assert main(["profile", str(files["pool"])]) == 1  # no --usage: the message as it is
    assert capsys.readouterr().err == "moetier: error: usage: z is not a model or pipeline of the pool\n"


class StoppedServer:
    """A server on port 4321 that stops at once, as on Ctrl-C: what a serve command does before it serves."""

    server_port = 4321

    def serve_forever(self) -> None:
        raise KeyboardInterrupt

    def server_close(self) -> None:
        pass

    def drain(self, timeout: float) -> int:
        return 0


def test_serve_pool_flags_override_the_files_settings(
    tmp_path: Path, files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--scheduler, --executors, --threads and --no-profile replace the pool file's values in the pool
    that is served (and in its banner); without them the file's values stand."""
    import moetier.pool.executor as executor
    import moetier.pool.server as pool_server

    seen: list[object] = []

    class FakePool:
        warnings = ("w1",)

        def __init__(self, spec: object) -> None:
            seen.append(spec)

        def close(self) -> None:
            pass

    monkeypatch.setattr(executor, "Pool", FakePool)
    monkeypatch.setattr(pool_server, "PoolService", lambda spec, pool: None)
    monkeypatch.setattr(pool_server, "make_server", lambda service, host, port: StoppedServer())
    cfg = tmp_path / "pool.yaml"
    (tmp_path / "p.json").write_text("{}")
    cfg.write_text(
        "budget: 1G\nexecutors: 2\nthreads: 3\nscheduler: fifo\nprofile: p.json\n"
        f"models:\n  a: {{path: {files['dense']}}}\n  b: {{path: {files['dense']}}}\n"
    )
    assert main(["serve-pool", str(cfg), "--port", "0"]) == 0
    spec = seen.pop()
    assert (spec.executors, spec.threads, spec.scheduler, spec.profile) == (2, 3, "fifo", tmp_path / "p.json")  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert err.startswith("moetier serve-pool: warning: w1\nmoetier serve-pool: 2 models, 0 pipelines, budget ")
    assert "2 executors, scheduler fifo" in err and "listening on http://127.0.0.1:4321\nserving: a, b\n" in err
    args = ["--scheduler", "round-robin", "--executors", "4", "--threads", "1", "--no-profile"]
    assert main(["serve-pool", str(cfg), "--port", "0", *args]) == 0
    spec = seen.pop()
    assert (spec.executors, spec.threads, spec.scheduler, spec.profile) == (4, 1, "round-robin", None)  # type: ignore[attr-defined]
    assert "4 executors, scheduler round-robin, costs from estimates (run moetier profile)" in capsys.readouterr().err


def _calibration_report(plot: str | None) -> dict[str, object]:
    """A report as moetier.calibrate.calibrate returns it (the command prints it)."""
    pol = {"n_hits": 30, "n_lookups": 40, "penalty_vs_random": 0.8125, "n_bytes_read": 3 << 20}
    return {
        "split": {"high": 0.5, "low": 0.375, "skip": 0.125},
        "config": {"t1": 0.25, "t2": 0.0625, "low_frac": 0.5},
        "tokens": 700,
        "policies": [
            {**pol, "policy": "multi", "weights": [0.5, 0.25, 0.125, 2.0]},
            {**pol, "policy": "lru", "weights": [1.0, 0.0, 0.0, 0.0], "n_lookups": 0, "penalty_vs_random": 1.5},
            {**pol, "policy": "lfu", "weights": [0.0, 1.0, 0.0, 0.0]},
        ],
        "low_frac_search": [
            {
                "low_frac": 0.0,
                "n_slots": 10,
                "n_slots_low": 0,
                "policy": "multi",
                "weights": [1, 0, 0, 0],
                "n_bytes_read": 5 << 20,
            },
            {
                "low_frac": 0.5,
                "n_slots": 6,
                "n_slots_low": 8,
                "policy": "lru",
                "weights": [0.25, 0.5, 0, 0],
                "n_bytes_read": 1 << 20,
            },
        ],
        "config_path": "out.json",
        "trace_path": "out.trace.npz",
        "plot_path": plot,
    }


def test_calibrate_passes_its_flags_and_prints_its_report(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moetier calibrate`: the corpus files joined, the budget, store, low_frac, output (by default beside
    the model) and the calibration flags reach calibrate(); the split, the first --show policies (hit rate
    0 where nothing was looked up; weights only for multi), the low_frac search and the files written are
    printed as they are; a progress bar only on a terminal and not with --quiet."""
    import moetier.calibrate as cal

    calls: list[tuple[tuple[object, ...], dict[str, object]]] = []
    plot: list[str | None] = ["out.png"]

    def fake(*a: object, **k: object) -> dict[str, object]:
        calls.append((a, k))
        progress = k["progress"]
        assert callable(progress)
        progress(1, 4)
        progress(4, 4)
        return _calibration_report(plot[0])

    monkeypatch.setattr(cal, "calibrate", fake)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first ")
    b.write_text("second")
    model = str(files["moe"])
    args = ["calibrate", model, "--corpus", str(a), str(b), "--budget", "2M", "--store", "s.experts"]
    args += ["--low-frac", "0.25", "-o", str(tmp_path / "c.json"), "--show", "2", "--tokens", "1024"]
    assert main(args) == 0
    ((pos, kw),) = calls
    assert pos[:4] == (model, "first second", "2M", str(tmp_path / "c.json"))
    assert pos[4] == cal.CalibrateConfig(tokens=1024)
    assert (kw["store"], kw["low_frac"]) == ("s.experts", 0.25)
    out, err = capsys.readouterr()
    assert out == (
        "thresholds t1=0.25 t2=0.0625 on 700 tokens: high 50.0% / low 37.5% / skip 12.5% of selections\n"
        "| policy | weights (lru, lfu, lhu, fld) | bytes read | vs random | hit rate |\n|---|---|---|---|---|\n"
        "| multi | 0.50, 0.25, 0.12, 2.00 | 3.00 MiB | 0.812 | 75.0% |\n"
        "| lru | - | 3.00 MiB | 1.500 | 0.0% |\n"
        "\nlow_frac 0.5 (the policy table is at it):\n"
        "| low_frac | slots high / low | best policy | bytes read |\n|---|---|---|---|\n"
        "| 0.0 | 10 / 0 | multi 1.00, 0.00, 0.00, 0.00 | 5.00 MiB |\n"
        "| 0.5 | 6 / 8 | lru 0.25, 0.50, 0.00, 0.00 | 1.00 MiB |\n"
    )
    assert err == "moetier: wrote out.json (trace out.trace.npz, plot out.png)\n"
    # the defaults: the config beside the model, no store, low_frac searched; without matplotlib no plot
    calls.clear()
    plot[0] = None
    assert main(["calibrate", model, "--corpus", str(b), "--budget", "auto"]) == 0
    ((pos, kw),) = calls
    assert pos[1:4] == ("second", "auto", str(files["moe"].with_suffix(".cache.json")))
    assert (kw["store"], kw["low_frac"]) == (None, None)
    out, err = capsys.readouterr()
    assert out.count("\n| ") == 1 + 3 + 1 + 2  # headers and rows: all three policies (--show 12), two low_frac rows
    assert err == "moetier: wrote out.json (trace out.trace.npz, no plot: matplotlib is not installed)\n"
    # one low_frac (given, not searched): no search table
    monkeypatch.setattr(
        cal, "calibrate", lambda *a, **k: {**_calibration_report(None), "low_frac_search": [{"low_frac": 0.5}]}
    )
    assert main(["calibrate", model, "--corpus", str(b), "--budget", "auto"]) == 0
    assert "low_frac 0.5 (the policy table" not in capsys.readouterr().out


def test_calibrate_shows_progress_on_a_terminal_unless_quiet(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tqdm

    import moetier.calibrate as cal

    bars: list[dict[str, object]] = []

    class Bar:
        def __init__(self, **kw: object) -> None:
            bars.append(kw)
            self.total, self.n, self.closed = kw["total"], 0, False
            kw["bar"] = self

        def update(self, n: int) -> None:
            self.n += n

        def close(self) -> None:
            self.closed = True

    def fake(*a: object, **k: object) -> dict[str, object]:
        progress = k["progress"]
        assert callable(progress)
        progress(1, 4)
        progress(3, 4)
        return _calibration_report(None)

    monkeypatch.setattr(cal, "calibrate", fake)
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    text = tmp_path / "t.txt"
    text.write_text("words")
    args = ["calibrate", str(files["moe"]), "--corpus", str(text), "--budget", "1M"]
    assert main(args) == 0
    ((kw,),) = [(b,) for b in bars]
    assert (kw["total"], kw["desc"], kw["unit"]) == (0, "replaying policies", "policy")
    bar = kw["bar"]
    assert isinstance(bar, Bar) and (bar.total, bar.n, bar.closed) == (4, 3, True)
    assert main([*args, "--quiet"]) == 0
    assert len(bars) == 1
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main(args) == 0
    assert len(bars) == 1


def test_moefy_passes_its_flags_and_writes_the_report(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moetier moefy`: the calibration files joined, the end of each as a held-out check, the threads,
    the partition files and --quiet reach the conversion; --report writes the flags, the config and
    the result as JSON."""
    import dataclasses

    import moetier.tools.moefy as mf

    @dataclasses.dataclass
    class Result:
        seconds: float = 1.5

        def summary(self) -> str:
            return "it went well"

    got: list[tuple[tuple[object, ...], dict[str, object]]] = []
    monkeypatch.setattr(mf, "moefy", lambda *a, **k: (got.append((a, k)), Result())[1])
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x" * 4500)
    b.write_text("yz")
    out, report = tmp_path / "moe.gguf", tmp_path / "r.json"
    args = ["moefy", str(files["dense"]), "-o", str(out), "--calib", str(a), str(b), "--threads", "3", "--quiet"]
    args += [
        "--partition",
        "p.npz",
        "--save-partition",
        "s.npz",
        "--report",
        str(report),
        "--n-expert",
        "4",
        "--n-expert-used",
        "2",
    ]
    assert main(args) == 0
    ((pos, kw),) = got
    assert pos[0] == str(files["dense"]) and pos[1] == str(out) and pos[2] == "x" * 4500 + "yz"
    assert kw["check_texts"] == ("x" * 4000, "yz")
    assert (kw["n_threads"], kw["progress"], kw["partition"], kw["save_partition"]) == (3, False, "p.npz", "s.npz")
    assert capsys.readouterr().err == f"moetier: wrote {out}: 4 experts, top-2; it went well\n"
    text = report.read_text()
    rep = json.loads(text)
    assert text == json.dumps(rep, indent=1) + "\n"
    assert list(rep)[:7] == ["model", "output", "calib", "config", "distill", "partition", "save_partition"]
    assert rep["seconds"] == 1.5
    assert (rep["model"], rep["output"], rep["calib"]) == (str(files["dense"]), str(out), [str(a), str(b)])
    assert rep["config"]["n_expert"] == 4
    assert (rep["partition"], rep["save_partition"]) == ("p.npz", "s.npz")
    assert rep["distill"] == dataclasses.asdict(kw["distill"])  # type: ignore[call-overload]
    assert rep["distill"]["epochs"] == 0
    got.clear()
    assert main(["moefy", str(files["dense"]), "-o", str(out), "--calib", str(b)]) == 0
    ((_, kw),) = got
    assert (kw["n_threads"], kw["progress"], kw["partition"], kw["save_partition"]) == (None, None, None, None)


def test_rows_is_a_count_of_table_rows() -> None:
    import argparse

    from moetier.cli import _rows

    assert _rows("0") == 0 and _rows("12") == 12 and isinstance(_rows("3"), int)
    for bad in ("-1", "x", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{bad!r} is not a number of rows"):
            _rows(bad)


def test_pack_quiet_turns_the_progress_bar_off(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--quiet: no bar even on a terminal; without it, the bar where stderr is a terminal (progress=None)."""
    import importlib

    pk = importlib.import_module("moetier.pack")  # the module: moetier.pack is also the function
    seen: list[object] = []
    monkeypatch.setattr(pk, "pack", lambda model, out, cfg, progress: (seen.append(progress), Path(out))[1])
    assert main(["pack", str(files["moe"]), "-o", str(tmp_path / "s"), "-q"]) == 0
    assert main(["pack", str(files["moe"]), "-o", str(tmp_path / "s")]) == 0
    assert seen == [False, None]
    assert capsys.readouterr().err == f"moetier: store written to {tmp_path / 's'}\n" * 2


def test_serve_variants_passes_its_flags(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """serve-variants: one exact cache of the given budget, without prefetch or warm start (the variants
    share it; a sidecar would be one variant's), each variant with its name, file and store in order,
    the consolidation map, the context and the threads."""
    import moetier.pool.server as pool_server
    import moetier.pool.variant_service as vsvc
    import moetier.variants as variants

    got: dict[str, object] = {}

    class FakeVariants:
        consolidated = True
        map: ClassVar[dict[str, int]] = {"capacity": 5}

        def __init__(self, specs: list[object], cache: CacheConfig, **kw: object) -> None:
            got.update(specs=specs, cache=cache, **kw)

        def cache_info(self) -> dict[str, int]:
            return {"cache_bytes": 1 << 20, "n_slots": 9}

        def close(self) -> None:
            got["closed"] = True

    monkeypatch.setattr(variants, "Variants", FakeVariants)
    monkeypatch.setattr(vsvc, "VariantService", lambda vs, n_ctx: got.update(service_ctx=n_ctx))
    monkeypatch.setattr(pool_server, "make_server", lambda service, host, port: StoppedServer())
    moe, dense = str(files["moe"]), str(files["dense"])
    args = ["serve-variants", moe, dense, "--stores", "s1", "s2", "--names", "a, b", "--cache", "1M"]
    assert main([*args, "--consolidate", "map.json", "-c", "512", "-t", "3"]) == 0
    specs = got["specs"]
    assert [(s.name, str(s.model), str(s.store)) for s in specs] == [("a", moe, "s1"), ("b", dense, "s2")]  # type: ignore[attr-defined]
    assert got["cache"] == CacheConfig.exact(budget="1M", prefetch=0, warm=False)
    assert (got["consolidation"], got["n_ctx"], got["n_threads"], got["service_ctx"]) == ("map.json", 512, 3, 512)
    assert got["closed"] is True
    err = capsys.readouterr().err
    assert err == (
        "moetier serve-variants: 2 variants (a, b) share one expert cache of 1.00 MiB, 9 slots; consolidated by "
        "map.json (5 shared positions; lossy); listening on http://127.0.0.1:4321\n"
    )
    # without a consolidation map: each variant's own experts, said so
    FakeVariants.consolidated = False
    FakeVariants.map = None  # type: ignore[assignment]
    assert main(args) == 0
    assert capsys.readouterr().err == (
        "moetier serve-variants: 2 variants (a, b) share one expert cache of 1.00 MiB, 9 slots; each variant's "
        "own experts (exact); listening on http://127.0.0.1:4321\n"
    )


def test_demo_follows_its_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's conversion is the recipe of its results page: 4096 tokens of the dense model's own
    prose beside 400,000 characters of built-in text, ridge 0.1 for the router and the refit, the
    distillation epochs asked for, named by that recipe; the dense model and the MoE answer in a
    512-token context; the cache holds a quarter of the expert bytes (or one layer's experts)."""
    import dataclasses

    from moetier import cli
    from moetier import model as model_module
    from moetier.tools import models
    from moetier.tools import moefy as mf
    from moetier.tools.tiny import write_tiny_model

    src = write_tiny_model(tmp_path / "qwen.gguf", "qwen2", n_layer=2, seed=3)
    fetched: list[dict[str, object]] = []
    monkeypatch.setattr(models, "fetch", lambda name, **kw: (fetched.append(kw), src)[1])
    monkeypatch.setattr(mf, "generated_prose", lambda path, n: (path, n) == (src, 4096) and ["one.", "two."])
    monkeypatch.setattr(mf, "builtin_calibration_text", lambda n, extra: f"{n}|{extra}")
    converted: list[tuple[object, ...]] = []

    def fake_moefy(s: Path, dst: Path, text: str, cfg: object, *, distill: object, progress: bool) -> object:
        converted.append((s, dst, text, cfg, distill, progress))
        write_tiny_model(dst, "qwen2moe", n_layer=6, n_expert=8, n_expert_used=2, seed=4)  # a layer: 1/6
        return type("Res", (), {"summary": lambda self: "converted"})()

    monkeypatch.setattr(mf, "moefy", fake_moefy)
    contexts: list[object] = []
    real_model = model_module.Model

    asked_tokens: list[int] = []

    class Counted:
        """The real model; each generate's max_tokens noted."""

        def __init__(self, m: object) -> None:
            self.m = m

        def generate(self, prompt: str, max_tokens: int = 64) -> object:
            asked_tokens.append(max_tokens)
            return self.m.generate(prompt, max_tokens=max_tokens)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.m, name)

    def model(path: object, **kw: object) -> object:
        contexts.append(kw.get("n_ctx"))
        return Counted(real_model(path, **kw))  # type: ignore[arg-type]

    monkeypatch.setattr(model_module, "Model", model)
    budgets: list[int] = []
    results: list[object] = []
    real_demo_model = cli.demo_model

    class Kept:
        def __init__(self, m: object) -> None:
            self.m = m

        def generate(self, prompt: str, max_tokens: int) -> object:
            r = self.m.generate(prompt, max_tokens=max_tokens)  # type: ignore[attr-defined]
            results.append((prompt, r))
            return r

    monkeypatch.setattr(
        cli,
        "demo_model",
        lambda moe, budget, note: (budgets.append(budget), Kept(real_demo_model(moe, budget, note)))[1],
    )
    monkeypatch.setattr(cli, "first_answer", lambda text: "the same")
    assert main(["demo", "--calib-tokens", "1024", "--distill-epochs", "2", "-n", "4"]) == 0
    out, err = capsys.readouterr()
    assert [set(kw) for kw in fetched] == [{"quiet", "log"}] and fetched[0]["quiet"] is True
    ((s, dst, text, cfg, dcfg, progress),) = converted
    want_cfg = mf.MoefyConfig(calib_tokens=1024, router_ridge=0.1, refit_ridge=0.1)
    assert (s, text, cfg, progress) == (src, "400000|one.\n\ntwo.", want_cfg, False)
    assert dataclasses.asdict(dcfg)["epochs"] == 2  # type: ignore[call-overload]
    key = mf.cache_key("generated prose + builtin text", mf.key_fields(want_cfg), dataclasses.asdict(dcfg))[:8]  # type: ignore[call-overload]
    assert dst == tmp_path / f"qwen-moe-demo-{key}.gguf"
    assert err.startswith(
        "moetier demo: converting qwen.gguf into a MoE (16 experts, top-8, 2 distillation epochs): several minutes, "
        "once\nmoetier demo: the dense model writes 4096 tokens of everyday prose for the calibration\n"
        "moetier demo: converted\n"
    )
    assert contexts[:2] == [512, 512]
    assert "first sentence or line as the dense model's: 4 of 4 prompts\n" in out
    info = real_model(dst, cache=CacheConfig(budget="64M")).cache_info()
    assert budgets == [int(info["expert_bytes"]) // 4] and budgets[0] > int(info["min_cache_bytes"])
    assert asked_tokens == [4] * 10  # four prompts on the dense model and the MoE, the stock and the cached run
    # the cached run answers the second prompt; its line gives the cache's share, hits and read rate
    ((prompt, r),) = results
    s = r.stats  # type: ignore[attr-defined]
    assert prompt == cli.DEMO_PROMPTS[1] and out.splitlines()[-2] == (prompt + r.text).splitlines()[-1]  # type: ignore[attr-defined]
    rate = s.n_bytes_read / s.read_seconds if s.read_seconds > 0 else 0.0
    assert (
        f"| expert cache {budgets[0] / 2**20:.0f} MiB of {int(info['expert_bytes']) / 2**20:.0f} MiB experts, hit rate "
        f"{100 * s.hit_rate:.1f}% | read {cli.format_size(s.n_bytes_read)} from the expert store at "
        f"{cli.format_size(rate)}/s | same tokens as stock: True\n"
    ) in out
    assert s.read_seconds > 0 and 0 < s.hit_rate < 1


def test_demo_fails_when_the_cached_run_differs_from_stock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's exit status is its check: 1 where the cached run's tokens are not stock's."""
    import dataclasses

    from moetier import cli
    from moetier.tools import models
    from moetier.tools.tiny import write_tiny_model

    src = write_tiny_model(tmp_path / "qwen.gguf", "qwen2", n_layer=2, seed=3, n_ff_exp=1024, n_ff_shexp=1024)
    monkeypatch.setattr(models, "fetch", lambda name, **kw: src)
    real_demo_model = cli.demo_model

    class Off:
        def __init__(self, m: object) -> None:
            self.m = m

        def generate(self, prompt: str, max_tokens: int) -> object:
            r = self.m.generate(prompt, max_tokens=max_tokens)  # type: ignore[attr-defined]
            return dataclasses.replace(r, tokens=[*r.tokens, 0])

    monkeypatch.setattr(cli, "demo_model", lambda moe, budget, note: Off(real_demo_model(moe, budget, note)))
    assert main(["demo", "--calib-tokens", "1024", "-n", "4", "--prompt", "x"]) == 1
    assert capsys.readouterr().out.endswith("same tokens as stock: False\n")


def test_stats_takes_an_interval_up_to_a_day(capsys: pytest.CaptureFixture[str]) -> None:
    """86400 s is the longest refresh `moetier stats` takes (then it goes on to reach the server)."""
    port = free_port()
    for interval in ("86400", "0.001"):
        assert main(["stats", f"127.0.0.1:{port}", "--interval", interval, "--once"]) == 1
        err = capsys.readouterr().err
        assert "--interval" not in err and f"127.0.0.1:{port}" in err
