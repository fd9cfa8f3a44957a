"""`moetier bench-plot RESULT.json`: the plot bench/run.py draws, from the JSON it writes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import run
from moetier import MoetierError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MiB = 1 << 20


def _summary(tok_s: float, hit_rate: float | None, cap: int | None) -> dict[str, Any]:
    """One configuration's summary as run.summarize() gives it (token_ids included, as before write_outputs)."""
    stat = {"median": tok_s, "min": tok_s * 0.9, "max": tok_s * 1.1}
    return {
        "repeats": 2,
        "decode_tok_s": stat,
        "prefill_tok_s": {"median": 4 * tok_s, "min": 4 * tok_s, "max": 4 * tok_s},
        "ttft_s": {"median": 0.2, "min": 0.2, "max": 0.2},
        "hit_rate": hit_rate,
        "bytes_read_per_token": 0.0 if hit_rate is None else 1e6 * (1 - hit_rate),
        "disk_read_per_token": 0.0 if hit_rate is None else 1e6 * (1 - hit_rate),
        "major_faults_per_token": 0.0,
        "rss_anon_bytes": 80 * MiB,
        "peak_rss_bytes": 600 * MiB,
        "cgroup_peak_bytes": 0,
        "prefetch": None,
        "errors": [],
        "cap_bytes": cap,
        "token_ids": [[1, 2, 3]],
    }


def _report() -> dict[str, Any]:
    """bench/run.py's report for budgets 10, 25, 50 with two variants; one run failed."""
    expert = 400 * MiB
    runs: dict[str, Any] = {"stock-ram": _summary(30.0, None, None), "stock-ram-norepack": _summary(28.0, None, None)}
    for pct, stock, lru, multi in ((10, 1.5, 8.0, 9.0), (25, 2.5, 12.0, 14.0), (50, 20.0, 18.0, 21.0)):
        cap = 300 * MiB + expert * pct // 100
        runs[f"stock-capped-{pct}"] = _summary(stock, None, cap)
        for name, tok_s in (("lru-high", lru), ("multi", multi)):
            runs[f"{name}-{pct}"] = {**_summary(tok_s, pct / 60, cap), "budget_bytes": expert * pct // 100}
    runs["multi-10"] = {"error": "timeout after 900 s"}
    return {
        "model": "/models/tiny-moe.gguf",
        "model_bytes": 800 * MiB,
        "expert_bytes": expert,
        "non_expert_bytes": 250 * MiB,
        "embedding_bytes": 50 * MiB,
        "min_cache_bytes": 10 * MiB,
        "machine": {"cores": 2, "loadavg": [0.5, 0.5, 0.5], "platform": "Linux"},
        "disk_odirect_bytes_per_s": 500e6,
        "config": {"budgets": "10,25,50"},
        "variants": ["lru-high", "multi"],
        "runs": runs,
        "headroom_bytes": 100 * MiB,
    }


def test_bench_plot_draws_the_harness_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    # the harness writes OUT.json and OUT.png (through moetier.plot)
    run.write_outputs(_report(), tmp_path / "res")
    src = tmp_path / "res.json"
    r = subprocess.run(
        [sys.executable, "-m", "moetier.cli", "bench-plot", str(src), "-o", str(tmp_path / "again.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    png = (tmp_path / "again.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 20_000
    # one drawing function: the CLI's picture is the harness's, byte for byte
    assert png == (tmp_path / "res.png").read_bytes()
    assert r.stderr == f"moetier: wrote {tmp_path / 'again.png'}\n"
    # without -o: beside the result, as RESULT.png
    (tmp_path / "res.png").unlink()
    from moetier.cli import main

    assert main(["bench-plot", str(src)]) == 0
    assert (tmp_path / "res.png").read_bytes() == png


def test_bench_plot_errors(tmp_path: Path) -> None:
    src = tmp_path / "res.json"
    src.write_text(json.dumps(_report()))
    # matplotlib missing (hidden from the import system): one line naming the install command
    hide = (
        "import sys; sys.modules['matplotlib'] = None; from moetier.cli import main; "
        f"sys.exit(main(['bench-plot', {str(src)!r}]))"
    )
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr == "moetier: error: matplotlib is not installed: pip install matplotlib\n"
    # not the harness's JSON
    other = tmp_path / "ab.json"
    other.write_text(json.dumps({"config": {}, "runs": {"exact": {"a": []}}}))
    r = subprocess.run(
        [sys.executable, "-m", "moetier.cli", "bench-plot", str(other)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and r.stderr.startswith(f"moetier: error: {other}: not a bench/run.py result")
    # no such file: its name and why, one line
    from moetier.cli import main

    gone = tmp_path / "gone.json"
    from moetier.cli import cmd_bench_plot

    with pytest.raises(MoetierError) as e:
        cmd_bench_plot(argparse.Namespace(result=str(gone), output=None))
    assert str(e.value) == f"{gone}: cannot read the bench result: No such file or directory"
    assert main(["bench-plot", str(gone)]) == 1


def _drawn(monkeypatch: pytest.MonkeyPatch, report: dict[str, Any], out: Path) -> Any:
    """bench_plot's figure, kept open to be read (bench_plot closes it once saved)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from moetier.plot import bench_plot

    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    assert bench_plot(report, out, "res.json") == out
    assert len(kept) == 1
    return kept[0]


def _lines(ax: Any) -> dict[str, tuple[list[float], list[float], str, str]]:
    """label -> (x, y, line style, marker) of every line an axis draws."""
    return {
        ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()), ln.get_linestyle(), ln.get_marker())
        for ln in ax.get_lines()
    }


def test_bench_plot_draws_each_run_where_it_belongs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rep = _report()
    runs = rep["runs"]
    # the cache each variant ran with is recorded (here 2 MiB above expert_bytes * pct / 100)
    for name in ("lru-high", "multi"):
        for pct in (10, 25, 50):
            if "budget_bytes" in runs[f"{name}-{pct}"]:
                runs[f"{name}-{pct}"]["budget_bytes"] += 2 * MiB
    runs["multi-10"] = {**_summary(99.0, 0.99, None), "error": "timeout after 900 s"}  # failed: not drawn
    runs["lru-high-75"] = {**_summary(25.0, 0.9, None), "budget_bytes": 302 * MiB}  # one variant only
    runs["stock-capped-5"] = _summary(1.0, None, None)  # stock only: a budget too, at the formula's size
    out = tmp_path / "new" / "dir" / "plot.png"  # its folder is made
    fig = _drawn(monkeypatch, rep, out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    # 11 x 4.2 inches at 100 dpi
    assert out.read_bytes()[16:24] == (1100).to_bytes(4, "big") + (420).to_bytes(4, "big")
    speed, hits = fig.axes
    # side by side: speed on the left
    assert speed.get_position().x1 < hits.get_position().x0 and speed.get_position().y0 == hits.get_position().y0
    assert fig._suptitle.get_text() == "tiny-moe.gguf (2 cores)" and fig._suptitle.get_fontsize() == 10
    xs = [20.0, 42.0, 102.0, 202.0, 302.0]
    assert _lines(speed) == {
        "lru-high": (xs[1:], [8.0, 12.0, 18.0, 25.0], "-", "o"),
        "multi": ([102.0, 202.0], [14.0, 21.0], "-", "o"),
        "stock, same memory cap": (xs[:4], [1.0, 1.5, 2.5, 20.0], "--", "x"),
        "stock, every expert in RAM": ([0.0, 1.0], [30.0, 30.0], "--", "None"),
    }
    assert [ln.get_color() for ln in speed.get_lines()][2:] == ["tab:red", "gray"]
    got = _lines(hits)
    assert list(got) == ["lru-high", "multi"]
    assert got["lru-high"][0] == xs[1:] and got["lru-high"][2:] == ("-", "o")
    assert got["lru-high"][1] == pytest.approx([100 * 10 / 60, 100 * 25 / 60, 100 * 50 / 60, 90.0])
    assert got["multi"] == ([102.0, 202.0], pytest.approx([100 * 25 / 60, 100 * 50 / 60]), "-", "o")
    for ax in (speed, hits):
        assert list(ax.get_xticks()) == xs
        labels = ["20 MiB\n5%", "42 MiB\n10%", "102 MiB\n25%", "202 MiB\n50%", "302 MiB\n75%"]
        assert [t.get_text() for t in ax.get_xticklabels()] == labels
        assert ax.get_xlabel() == "expert cache size (% of expert bytes)"
        assert ax.get_legend() is not None and ax.get_legend().get_texts()[0].get_fontsize() == 8
        assert ax.xaxis.get_gridlines()[0].get_visible() and ax.xaxis.get_gridlines()[0].get_alpha() == 0.3
    assert (speed.get_ylabel(), speed.get_title(), speed.get_ylim()[0]) == ("decode tok/s", "decode speed", 0.0)
    assert speed.get_ylim()[1] >= 30.0
    assert (hits.get_ylabel(), hits.get_title(), hits.get_ylim()) == ("hit rate %", "expert cache hit rate", (0, 100))


def test_bench_plot_one_budget_and_missing_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rep = _report()
    # one budget, no recorded budget_bytes, no variant list (the harness's default "moetier"), no stock
    # in RAM, no machine: the cache is max(min_cache_bytes, expert_bytes * pct / 100)
    runs = {
        "stock-capped-10": rep["runs"]["stock-capped-10"],
        "moetier-10": {k: v for k, v in rep["runs"]["lru-high-10"].items() if k != "budget_bytes"},
        "moetier-x": {"error": "not a budget"},  # a tail that is not a number is no budget
        "other-25": rep["runs"]["lru-high-25"],  # not a variant: no budget either
    }
    del rep["variants"], rep["machine"]
    fig = _drawn(monkeypatch, {**rep, "runs": runs, "min_cache_bytes": 64 * MiB}, tmp_path / "one.png")
    speed, hits = fig.axes
    assert fig._suptitle.get_text() == "tiny-moe.gguf"
    # one budget: stock under the same cap is a dotted horizontal line
    assert _lines(speed) == {
        "moetier": ([64.0], [8.0], "-", "o"),
        "stock, same memory cap": ([0.0, 1.0], [1.5, 1.5], ":", "None"),
    }
    assert [t.get_text() for t in speed.get_xticklabels()] == ["64 MiB\n10%"]
    assert speed.get_lines()[1].get_color() == "tab:red"
    assert _lines(hits)["moetier"][:2] == ([64.0], pytest.approx([100 * 10 / 60]))
    # no min_cache_bytes, no model name; expert_bytes * pct / 100 rounds down to whole bytes
    rep2 = {k: v for k, v in rep.items() if k not in ("min_cache_bytes", "model")}
    fig = _drawn(monkeypatch, {**rep2, "runs": runs, "expert_bytes": 400 * MiB + 55}, tmp_path / "two.png")
    assert list(fig.axes[0].get_xticks()) == [(40 * MiB + 5) / MiB]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["40 MiB\n10%"]
    assert fig._suptitle.get_text() == ""
    # without a variant list the harness's run is "moetier": its recorded cache size counts
    recorded = {**runs, "moetier-10": {**runs["moetier-10"], "budget_bytes": 50 * MiB}}
    fig = _drawn(monkeypatch, {**rep2, "runs": recorded}, tmp_path / "three.png")
    assert list(fig.axes[0].get_xticks()) == [50.0]
    # no hit rate and no speed for any run: the axes have no lines and no legend
    bare = {"stock-capped-25": {"error": "killed"}, "moetier-25": {"decode_tok_s": {}, "hit_rate": None}}
    fig = _drawn(monkeypatch, {**rep, "runs": bare}, tmp_path / "bare.png")
    assert all(not ax.get_lines() and ax.get_legend() is None for ax in fig.axes)


def test_bench_plot_rejects_what_is_not_a_result(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from moetier.errors import MoetierError
    from moetier.plot import bench_plot

    rep = _report()
    bad = [
        ([], "res.json: not a bench/run.py result (it has 'runs' and 'expert_bytes')"),
        ({**rep, "runs": []}, "res.json: not a bench/run.py result (it has 'runs' and 'expert_bytes')"),
        ({k: v for k, v in rep.items() if k != "expert_bytes"}, "res.json: not a bench/run.py result"),
        (
            {**rep, "runs": {"stock-ram": rep["runs"]["stock-ram"], "lru-high-x": {}}},
            "res.json: no budget runs (stock-capped-PCT or VARIANT-PCT) in 'runs'",
        ),
    ]
    for report, msg in bad:
        with pytest.raises(MoetierError) as e:
            bench_plot(report, tmp_path / "x.png", Path("res.json"))  # type: ignore[arg-type]
        assert str(e.value).startswith(msg)
    # the source named by default
    with pytest.raises(MoetierError, match=r"^report: not a bench/run.py result"):
        bench_plot([], tmp_path / "x.png")  # type: ignore[arg-type]
    assert not (tmp_path / "x.png").exists()


def test_pyplot_draws_to_files_only() -> None:
    matplotlib = pytest.importorskip("matplotlib")
    from moetier.plot import pyplot

    assert pyplot() is matplotlib.pyplot
    assert matplotlib.get_backend().lower() == "agg"


def test_bench_plot_names_its_output_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An output without a suffix is written as NAME.png and said so; another suffix is refused naming the
    output, not blamed on the result; a result of the wrong shape names the result."""
    pytest.importorskip("matplotlib")
    from moetier import MoetierError
    from moetier.cli import main
    from moetier.plot import bench_plot

    src = tmp_path / "res.json"
    src.write_text(json.dumps(_report()))
    assert main(["bench-plot", str(src), "-o", str(tmp_path / "plot")]) == 0
    assert capsys.readouterr().err == f"moetier: wrote {tmp_path / 'plot.png'}\n"
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_SIGNATURE)
    with pytest.raises(MoetierError) as e:
        bench_plot(_report(), tmp_path / "plot.txt", source=src)
    assert str(e.value) == f"{tmp_path / 'plot.txt'}: the plot is a PNG; give an output name ending in .png"
    with pytest.raises(MoetierError) as e:
        bench_plot({"runs": {"moetier-25": 5}, "expert_bytes": 1}, tmp_path / "x.png", source=src)
    assert str(e.value).startswith(f"{src}: not a bench result (")
