"""`moetier bench-plot RESULT.json`: the plot bench/run.py draws, from the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import run

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
