"""bench/run.py accounting: medians over repeats, hit rate and bytes per token from the worker's
counters, ratios against the capped stock run; and one end-to-end run on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ModelFactory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import cgroup
import run


def _worker(decode: list[float], n_hits: int, n_lookups: int, n_bytes_read: int, disk: int = 0) -> dict[str, object]:
    return {
        "peak_rss_bytes": 100 << 20,
        "rss_anon_bytes": 40 << 20,
        "disk_read_bytes": disk,
        "major_faults": 0,
        "runs": [
            {
                "prompt_tokens": 10,
                "tokens": 5,
                "ttft_s": 0.1,
                "prefill_tok_s": 100.0,
                "decode_tok_s": d,
                "decode_s": 1.0,
                "n_lookups": n_lookups,
                "n_hits": n_hits,
                "n_bytes_read": n_bytes_read,
                "read_s": 0.1,
                "token_ids": [1, 2, 3],
            }
            for d in decode
        ],
    }


def test_summarize_medians_and_counters() -> None:
    s = run.summarize(
        [
            _worker([10.0, 20.0], 3, 4, 300, disk=3000),
            _worker([30.0, 30.0], 3, 4, 300, disk=600),
            _worker([1.0, 3.0], 3, 4, 300, disk=900),
            {"error": "timeout after 5 s"},
        ]
    )
    assert s["repeats"] == 3
    assert s["decode_tok_s"] == {"median": 15.0, "min": 2.0, "max": 30.0}
    assert s["hit_rate"] == pytest.approx(6 / 8)
    assert s["bytes_read_per_token"] == pytest.approx(600 / 30)  # 2 prompts x (10 + 5) tokens
    assert s["disk_read_per_token"] == pytest.approx(900 / 30)  # the median repeat
    assert s["errors"] == ["timeout after 5 s"]


def test_summarize_all_failed() -> None:
    assert run.summarize([{"error": "boom"}]) == {"error": "boom"}


def test_prefetch_summary() -> None:
    """The worker's Model.prefetch_stats()._asdict(): per token, and the distance-1 accuracy."""
    pf: dict[str, object] = {
        "n_issued": 40,
        "n_hits": 30,
        "n_waits": 2,
        "n_claimed": 4,
        "n_cancelled": 4,
        "n_wasted": 2,
        "bytes_read": 4000,
        "bytes_wasted": 200,
        "n_pred": [10, 8, 0, 0, 0, 0, 0, 0],
        "n_top1": [6, 4, 0, 0, 0, 0, 0, 0],
        "n_allk": [5, 2, 0, 0, 0, 0, 0, 0],
        "n_any": [9, 8, 0, 0, 0, 0, 0, 0],
    }
    s = run.prefetch_summary(pf, 20)
    assert s is not None
    assert (s["reads_per_token"], s["hits_per_token"], s["bytes_per_token"]) == (2.0, 1.5, 200.0)
    assert (s["top1"], s["allk"]) == (0.6, 0.5)
    assert run.prefetch_summary({**pf, "n_issued": 0}, 20) is None
    assert run.prefetch_summary(None, 20) is None


def test_end_to_end_tiny(tiny_model: ModelFactory, tmp_path: Path) -> None:
    if not cgroup.available():
        pytest.skip("cgroup v1 memory controller not writable: capped runs cannot be measured here")
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=8)
    out = tmp_path / "res"
    r = subprocess.run(
        [
            sys.executable,
            str(Path(run.__file__)),
            "--model",
            str(path),
            "--budgets",
            "25,100",
            "--repeats",
            "1",
            "-n",
            "4",
            "--out",
            str(out),
            "--headroom-mib",
            "512",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.with_name(out.name + ".json").read_text())
    assert set(rep["runs"]) == {
        "stock-ram",
        "stock-ram-norepack",
        "stock-capped-25",
        "moetier-25",
        "stock-capped-100",
        "moetier-100",
    }
    m25 = rep["runs"]["moetier-25"]
    assert m25["budget_bytes"] == rep["expert_bytes"] // 4
    assert m25["cap_bytes"] == rep["non_expert_bytes"] + m25["budget_bytes"] + rep["headroom_bytes"]
    # the token embedding is read by rows through the mapping: not counted as resident
    assert 0 < rep["embedding_bytes"] < rep["model_bytes"] - rep["expert_bytes"] - rep["non_expert_bytes"] + 1
    assert 0 < m25["hit_rate"] < 1 and m25["bytes_read_per_token"] > 0
    # O_DIRECT expert reads reach the disk: the process's own I/O counter sees at least them
    assert m25["disk_read_per_token"] >= m25["bytes_read_per_token"] * 0.99
    assert rep["runs"]["stock-capped-25"]["hit_rate"] is None
    md = out.with_name(out.name + ".md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| moetier-25 |"))
    assert row.endswith("| yes |"), "moetier tokens equal the in-RAM stock tokens"


def test_variants_parse() -> None:
    v = run.parse_variants("lru-high=lru:t1=1,t2=1; +multi=multi:t1=0.6,t2=1,prefetch=1")
    assert v == [("lru-high", "lru", "t1=1,t2=1"), ("+multi", "multi", "t1=0.6,t2=1,prefetch=1")]
    with pytest.raises(SystemExit):
        run.parse_variants("stock-x=lru:t1=1")
    with pytest.raises(SystemExit):
        run.parse_variants("noequals")
