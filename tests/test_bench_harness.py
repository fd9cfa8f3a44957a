"""bench/run.py accounting: medians over repeats, hit rate and bytes per token from the worker's
counters, ratios against the capped stock run; and one end-to-end run on a tiny model."""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from conftest import ModelFactory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "probes"))

import cgroup
import contention_probe
import defaults
import diskstat
import frontier
import io_cost
import mutation
import peer_worker
import predictors
import run
import upstream_worker
import worker


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
    assert s["decode_tok_s"] == {"median": 15.0, "min": 2.0, "max": 30.0, "values": [15.0, 30.0, 2.0]}
    assert s["hit_rate"] == pytest.approx(6 / 8)
    assert s["bytes_read_per_token"] == pytest.approx(600 / 30)  # 2 prompts x (10 + 5) tokens
    assert s["disk_read_per_token"] == pytest.approx(900 / 30)  # the median repeat
    assert s["errors"] == ["timeout after 5 s"]
    # the workers say what cache they got (budget=auto chooses its size): kept, not dropped
    assert s["cache_bytes"] is None and s["budget_note"] is None
    w = {
        **_worker([10.0], 3, 4, 300),
        "cache_info": {"cache_bytes": 123},
        "budget_note": "expert cache auto: 1 MiB = ...",
    }
    s = run.summarize([w])
    assert s["cache_bytes"] == 123 and s["budget_note"].startswith("expert cache auto")


def test_decode_stall_is_the_decode_steps_wait_per_step() -> None:
    """The seconds the decode steps waited for expert reads (the worker's decode_read_s), per decode
    step (tokens - 1 per prompt: the first token comes from the prompt's pass), median over repeats;
    absent where no run reports it (upstream, the peer)."""
    reps = [_worker([10.0, 10.0], 3, 4, 300) for _ in range(3)]
    for r, wait in zip(reps, (0.4, 0.8, 2.0), strict=True):
        for run_ in r["runs"]:  # type: ignore[attr-defined]
            run_["decode_read_s"] = wait
    s = run.summarize(reps)
    assert s["decode_stall_s_per_token"] == pytest.approx(2 * 0.8 / 8)  # 2 prompts x 4 decode steps
    assert run.summarize([_worker([10.0], 3, 4, 300)])["decode_stall_s_per_token"] is None


def test_decode_rates_are_the_decode_steps_bytes_over_their_seconds() -> None:
    """The process's and the device's read rates and the device's busy share over the decode steps:
    summed over prompts, divided by their decode seconds, median over repeats; absent where a run
    has no device counters (a file system without a block device, upstream)."""
    reps = [_worker([10.0, 10.0], 3, 4, 300) for _ in range(3)]
    # prompts of 1 s and 3 s: a rate is the bytes of both over 4 s, not a mean of per-prompt rates
    for r, (mb, busy) in zip(reps, ((100, 0.5), (300, 0.9), (120, 0.6)), strict=True):
        for run_, secs, share in zip(r["runs"], (1.0, 3.0), (0.25, 0.75), strict=True):  # type: ignore[attr-defined]
            run_["decode_s"] = secs
            run_["decode_disk_read_bytes"] = 4 * share * mb * 10**6
            run_["decode_device"] = {"read_bytes": 8 * share * mb * 10**6, "busy_s": 4.0 * share * busy}
    s = run.summarize(reps)
    assert s["decode_disk_read_bps"] == pytest.approx(120e6)  # median repeat: 480 MB over 4 s
    assert s["decode_device_read_bps"] == pytest.approx(240e6)
    assert s["decode_device_busy"] == pytest.approx(0.6)
    bare = run.summarize([_worker([10.0], 3, 4, 300)])
    assert bare["decode_device_busy"] is None and bare["decode_device_read_bps"] is None


def test_diskstat_sees_a_direct_read_on_the_device_of_its_file(tmp_path: Path) -> None:
    """The device under a file is the whole disk /proc/diskstats counts; an O_DIRECT read of the file
    (past the page cache) shows up in its read bytes."""
    dev = diskstat.device_of(tmp_path)
    if dev is None:
        pytest.skip(f"{tmp_path} is on a file system without a block device")
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(8 << 20))
    os.sync()
    c0 = diskstat.counters(dev)
    fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 8 << 20)
    try:
        assert os.preadv(fd, [buf], 0) == 8 << 20
    finally:
        os.close(fd)
        buf.close()
    c1 = diskstat.counters(dev)
    assert c0 is not None and c1 is not None
    d = diskstat.delta(c1, c0)
    assert d["read_bytes"] >= 8 << 20 and d["busy_s"] >= 0
    assert diskstat.counters(None) is None and diskstat.delta(None, c0) == {}


def test_io_cost_reader_reads_at_its_pace_and_costs_are_per_mb(tmp_path: Path) -> None:
    """The I/O cost bench's reader (a child process, O_DIRECT) reads at the rate it is set to, stops on
    its file, and the CPU time it cost is counted per MB read."""
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(16 << 20))
    try:
        os.close(os.open(f, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path}: no O_DIRECT on this file system")
    a = argparse.Namespace(file=str(f), block_kib=64, depth=2, seconds=1.0)
    got = io_cost.cost_alone(a, "20")
    assert got["mb_s"] == pytest.approx(20, rel=0.3)
    assert set(got["core_ms_per_mb"]) == {"user", "system", "irq", "softirq", "steal"}
    assert all(v >= 0 for v in got["core_ms_per_mb"].values())
    assert io_cost.parse_rate("max") == 0.0 and io_cost.parse_rate("150") == 150.0
    # a reader that cannot read fails the measurement instead of reporting a cost of 0
    short = tmp_path / "short"
    short.write_bytes(b"x" * 4096)
    with pytest.raises(RuntimeError, match="need a multiple of 4096 and a larger file"):
        io_cost.cost_alone(argparse.Namespace(file=str(short), block_kib=64, depth=1, seconds=0.2), "max")


def test_direct_reads_raise_a_readers_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails in one of the reader threads (fault injected) fails the measurement instead
    of leaving the bytes of the others as the result."""
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(1 << 20))

    def broken(fd: int, bufs: list[mmap.mmap], off: int) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    with pytest.raises(OSError, match="Input/output error"):
        diskstat.direct_reads(f, 65536, 2, lambda: True)


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
    assert (s["capped_per_token"], s["busy_per_token"]) == (0.0, 0.0)  # an engine before the byte cap
    s = run.prefetch_summary({**pf, "n_capped": 10, "n_busy": 4}, 20)
    assert s is not None and (s["capped_per_token"], s["busy_per_token"]) == (0.5, 0.2)
    assert s["reading_share"] is None  # an engine before the prefetch gate
    s = run.prefetch_summary({**pf, "n_steps_on": 15, "n_steps_off": 5}, 20)
    assert s is not None and s["reading_share"] == 0.75
    assert run.prefetch_summary({**pf, "n_issued": 0}, 20) is None
    assert run.prefetch_summary(None, 20) is None


def test_prefetch_counters_of_the_decode_steps() -> None:
    """The worker's counters at the first token subtracted from those at the end, summed over a
    repeat's generations and divided by its decode steps: the prompt's pass is not in them."""
    at_end = {"n_issued": 50, "bytes_read": 5000, "n_pred": [12, 9]}
    at_first = {"n_issued": 30, "bytes_read": 3000, "n_pred": [2, 1]}
    d = worker.counter_delta(at_end, at_first)
    assert d == {"n_issued": 20, "bytes_read": 2000, "n_pred": [10, 8]}
    assert worker.counter_delta(at_end, {}) == at_end
    r = {"runs": [{"decode_prefetch": d, "tokens": 5, "prompt_tokens": 9}] * 2, "prefetch": at_end}
    total, steps = run.decode_prefetch(r, 8)
    assert steps == 8 and total == {"n_issued": 40, "bytes_read": 4000, "n_pred": [20, 16]}
    # an older worker: the last generation's counters over its prompt and generated tokens
    old = {"runs": [{"tokens": 5, "prompt_tokens": 9}], "prefetch": at_end}
    assert run.decode_prefetch(old, 4) == (at_end, 14)


def test_end_to_end_tiny(tiny_model: ModelFactory, tmp_path: Path) -> None:
    if not cgroup.available():
        pytest.skip("cgroup v1 memory controller not writable: capped runs cannot be measured here")
    # top-4 of 8 over 8 layers is 32 experts a token against 16 slots at 25%: every decode step
    # reads, whatever prefetch did before it (with top-2 a step's experts could all be cached, and
    # then only a prefetch landing after the first token made the decode's bytes nonzero)
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=4, n_layer=8)
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
    # decode alone: what the cache read after the first token, and the disk saw at least that
    assert m25["decode_steps"] == 3 * len(run.DEFAULT_PROMPTS) and m25["decode_bytes_per_token"] > 0
    assert m25["decode_disk_read_per_token"] >= m25["decode_bytes_per_token"] * 0.99
    if diskstat.device_of(path) is not None:
        # the device served at least what the process read, and was busy part of the decode time
        assert m25["decode_device_read_bps"] >= m25["decode_disk_read_bps"] * 0.99 > 0
        # device-wide io_ticks in whole jiffies, over a window a little longer than decode_s: no upper bound
        assert m25["decode_device_busy"] > 0
    # every capped run was inside its group: the group's peak counts it
    for name in ("stock-capped-25", "moetier-25", "stock-capped-100", "moetier-100"):
        assert rep["runs"][name]["cgroup_peak_bytes"] > 0, name
    assert rep["runs"]["stock-capped-25"]["hit_rate"] is None
    md = out.with_name(out.name + ".md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| moetier-25 |"))
    assert row.endswith("| yes |"), "moetier tokens equal the in-RAM stock tokens"
    # exact: its text is stock's in every repeat, and it left nothing out
    assert rep["runs"]["moetier-25"]["agreement"]["min"] == 1.0
    assert rep["runs"]["moetier-25"]["lossy"] == {"skipped": 0.0, "loads_low": 0.0}
    q = next(line for line in md.splitlines() if line.startswith("| moetier-25 |") and "skipped" in line)
    assert "| 1.00 (1.00-1.00) | 0.0% skipped |" in q


def test_prefix_agreement_takes_the_closest_reference() -> None:
    """The share of the reference reproduced before the first difference, per prompt, averaged;
    each prompt against whichever exact reference it is closer to."""
    assert run.prefix_agreement(["abcdef", "xy"], [["abcxyz", "xy"]]) == pytest.approx((0.5 + 1.0) / 2)
    assert run.prefix_agreement(["abcdef"], [["abcxyz"], ["abcdeg"]]) == pytest.approx(5 / 6)
    # trailing whitespace is not a difference (llama-completion ends with a blank line)
    assert run.prefix_agreement(["ab\n\n"], [["ab"]]) == 1.0
    assert run.prefix_agreement(["zz"], [["ab"]]) == 0.0
    assert run.prefix_agreement([""], [[""]]) == 1.0


def test_lossy_counts_of_moetier_and_the_peer() -> None:
    ours = [{"runs": [{"n_lookups": 10, "n_skipped": 1, "n_loads_high": 3, "n_loads_low": 1}]}] * 2
    assert run.lossy_counts(ours) == {"skipped": 0.1, "loads_low": 0.25}
    peer = [{"runs": [{"experts_routed": 100, "experts_dropped": 30}, {"experts_routed": 100, "experts_dropped": 10}]}]
    assert run.lossy_counts(peer) == {"dropped": 0.2}
    assert run.lossy_counts([{"runs": [{"n_lookups": 0, "n_skipped": 0}]}]) is None  # stock: no cache
    assert run.lossy_counts([{"runs": [{"n_lookups": 0}]}]) is None  # upstream: neither


def test_model_flags_name_the_other_files() -> None:
    assert run.model_flags(["-m /a/b.gguf --no-repack", "--model 'c d.gguf'", "--threads 2", "-m"]) == [
        Path("/a/b.gguf"),
        Path("c d.gguf"),
    ]


def test_peer_summary_counts() -> None:
    """The per-request '# summary' lines of the peer's --csv sink, in order."""
    text = (
        "step,wall_ms\n1,2\n# summary tokens=4 experts_routed=64 experts_dropped=0 tok/s=3.1\n"
        "1,2\n# summary experts_dropped=7 tokens=32 experts_routed=512\n"
    )
    assert peer_worker.summary_counts(text) == [
        {"experts_routed": 64, "experts_dropped": 0},
        {"experts_routed": 512, "experts_dropped": 7},
    ]


def test_peer_counts_skip_the_warm_up() -> None:
    runs: list[dict[str, object]] = [{"tokens": 32}, {"tokens": 32}]
    counts = [{"experts_routed": 64, "experts_dropped": 1}, {"experts_routed": 8}, {"experts_routed": 9}]
    peer_worker.attach_counts(runs, counts)
    assert runs == [{"tokens": 32, "experts_routed": 8}, {"tokens": 32, "experts_routed": 9}]


# llama-completion's perf lines as the pinned upstream build prints them (0.5B MoE, 32 tokens; log
# timestamps cut)
UPSTREAM_PERF = """\
common_perf_print:    sampling time =       8.85 ms
common_perf_print:    samplers time =       2.48 ms /   101 tokens
common_perf_print:        load time =     839.98 ms
common_perf_print: prompt eval time =     839.08 ms /    69 tokens (   12.16 ms per token,    82.23 tokens per second)
common_perf_print:        eval time =     653.29 ms /    31 runs   (   21.07 ms per token,    47.45 tokens per second)
common_perf_print:       total time =    1504.35 ms /   100 tokens
"""


def test_upstream_decode_time_holds_its_sampling_as_ours_does() -> None:
    t = upstream_worker.timings(UPSTREAM_PERF)
    assert t["prompt_tokens"] == 69 and t["prompt_ms"] == pytest.approx(839.08)
    assert t["eval_runs"] == 31
    # eval time plus the sampling of the 31 tokens after the first (32 samples in 8.85 ms)
    assert t["eval_ms"] == pytest.approx(653.29 + 8.85 * 31 / 32)
    with pytest.raises(SystemExit, match="no timings"):
        upstream_worker.timings(UPSTREAM_PERF.replace("sampling time", "other time"))


def test_variants_parse() -> None:
    v = run.parse_variants("lru-high=lru:t1=1,t2=1; +multi=multi:t1=0.6,t2=1,prefetch=1")
    assert v == [("lru-high", "lru", "t1=1,t2=1"), ("+multi", "multi", "t1=0.6,t2=1,prefetch=1")]
    with pytest.raises(SystemExit):
        run.parse_variants("stock-x=lru:t1=1")
    with pytest.raises(SystemExit):
        run.parse_variants("noequals")


def test_variant_budget_auto_becomes_cache_auto() -> None:
    assert run.cache_flag("t1=1,t2=1", 1234) == ("1234", "t1=1,t2=1")
    assert run.cache_flag("t1=1,budget=auto,t2=1", 1234) == ("auto", "t1=1,t2=1")
    assert run.cache_flag("", 7) == ("7", "")


class _FakeCap:
    """cgroup.MemoryCap's interface, recording its limit (bench/run.py's fairness is checked without
    a cgroup; test_memory_cap_limits_and_joins checks the real one)."""

    made: ClassVar[list[_FakeCap]] = []

    def __init__(self, name: str, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.closed = False
        _FakeCap.made.append(self)

    def preexec(self) -> None:  # pragma: no cover - never a real child here
        raise AssertionError

    def max_usage(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


def test_runs_are_fair_interleaved_and_ratios_use_their_baselines(
    tiny_model: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/run.py's main with the worker faked: every run starts after the pages were dropped, in a
    fresh cap; stock and moetier get the same cap at each budget, threads, context and warm-up; stock
    runs capped without repacking; configurations interleave across repeats; the ratios divide by
    the capped stock and the in-RAM stock of the same run (the audit's surviving harness mutants)."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=8)
    events: list[tuple[str, object]] = []
    speed = {"stock-ram": 40.0, "stock-capped": 5.0, "moetier": 20.0, "peer": 10.0}

    def fake_worker(
        args: list[str], cap: _FakeCap | None, timeout: float, script: str, throttle: object = None
    ) -> dict[str, object]:
        assert throttle is None  # no --throttle-read-mbps: every run reads at the disk's own speed
        events.append(("run", (list(args), cap)))
        if script == "peer_worker.py":
            kind = "peer"
        elif "--cache" in args:
            kind = "moetier"
        else:
            kind = "stock-ram" if cap is None or cap.limit_bytes >= 1 << 40 else "stock-capped"
        out = _worker([speed[kind], speed[kind]], 1, 2, 100)
        out["cgroup_peak_bytes"] = 300 << 20 if cap is not None else 0
        return out

    _FakeCap.made = []
    monkeypatch.setattr(run, "run_worker", fake_worker)
    monkeypatch.setattr(run, "drop_pages", lambda files: events.append(("drop", tuple(files))))
    monkeypatch.setattr(run, "MemoryCap", _FakeCap)
    monkeypatch.setattr(run, "available", lambda: True)
    monkeypatch.setattr(run, "disk_bandwidth", lambda p, chunk, seconds=2.0, depth=1: 1e8 * min(depth, 4))
    monkeypatch.setattr(run, "bench_plot", lambda *a, **k: None)
    out = tmp_path / "res"
    argv = ["run.py", "--model", str(path), "--budgets", "25,50", "--repeats", "2", "--threads", "2", "--out", str(out)]
    argv += ["--peer", "/peer/bmoe-cli", "--peer-variants", "peer=--moe-stream --cache-mb {budget_mib} --force-cache"]
    argv += ["--upstream", "/up/llama-completion", "--upstream-variants", "upstream-norepack=--no-repack"]
    monkeypatch.setattr(sys, "argv", argv)
    run.main()
    rep = json.loads(out.with_name(out.name + ".json").read_text())

    runs = [e[1] for e in events if e[0] == "run"]
    # a drop before every run, and nothing else between
    kinds = [e[0] for e in events]
    assert kinds == ["drop", "run"] * len(runs)
    assert all(c.closed for c in _FakeCap.made)
    # 1 headroom probe + 2 repeats x (3 in-RAM + 2 budgets x (capped stock + moetier + peer + upstream))
    assert len(runs) == 1 + 2 * 11
    names = list(rep["runs"])
    first, second = runs[1:12], runs[12:]
    assert [a for a, _ in first] != [a for a, _ in second], "the second repeat starts elsewhere"
    assert sorted(map(str, (a for a, _ in first))) == sorted(map(str, (a for a, _ in second)))
    # the headroom: the probe's peak minus the model (300 MiB - model) vs its anon (40 MiB), + 64 MiB
    assert rep["headroom_bytes"] == max(40 << 20, (300 << 20) - path.stat().st_size) + (64 << 20)
    for pct in (25, 50):
        stock, moe = rep["runs"][f"stock-capped-{pct}"], rep["runs"][f"moetier-{pct}"]
        assert (
            stock["cap_bytes"]
            == moe["cap_bytes"]
            == rep["non_expert_bytes"] + moe["budget_bytes"] + rep["headroom_bytes"]
        )
        assert "--no-repack" in stock["args"]
        peer = rep["runs"][f"peer-{pct}"]
        assert peer["cap_bytes"] == moe["cap_bytes"] and peer["budget_bytes"] == moe["budget_bytes"]
        mib = moe["budget_bytes"] >> 20
        assert peer["args"][-1] == f"--peer-args=--moe-stream --cache-mb {mib} --force-cache"
        up = rep["runs"][f"upstream-norepack-{pct}"]
        assert up["cap_bytes"] == moe["cap_bytes"]
        # one flag that starts with '-' is still read as the value of --upstream-args
        parsed = upstream_worker.parser().parse_args([*up["args"], "--model", "m", "--prompts", "p"])
        assert parsed.args == "--no-repack"
        assert peer_worker.parser().parse_args([*peer["args"], "--model", "m", "--prompts", "p"]).peer_args == (
            f"--moe-stream --cache-mb {mib} --force-cache"
        )
    for name in names:
        args = rep["runs"][name]["args"]
        assert args[:4] == ["--threads", "2", "--ctx", "1024"] and "--no-warmup" not in args
    capped = [cap.limit_bytes for _, cap in runs if cap is not None and cap.limit_bytes < 1 << 40]
    assert len(capped) == 2 * 8 and all(
        c == rep["runs"]["moetier-25"]["cap_bytes"] or c == rep["runs"]["moetier-50"]["cap_bytes"] for c in capped
    )
    # ratios: moetier 20 / capped stock 5 = 4.00x; / in-RAM 40 = 0.50x
    md = out.with_name(out.name + ".md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| moetier-25 |"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[4:6] == ["4.00x", "0.50x"]
    assert "QD1 100, QD2 200, QD4 400, QD8 400 MB/s" in md
    assert rep["disk_odirect_bytes_per_s"] == 4e8


def _fake_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """run.py's touches of the machine, faked: page drops, the memory cap, the disk probe, the plot."""
    monkeypatch.setattr(run, "drop_pages", lambda files: None)
    monkeypatch.setattr(run, "MemoryCap", _FakeCap)
    monkeypatch.setattr(run, "available", lambda: True)
    monkeypatch.setattr(run, "disk_bandwidth", lambda p, chunk, seconds=2.0, depth=1: 1e8)
    monkeypatch.setattr(run, "bench_plot", lambda *a, **k: None)


def test_a_variants_other_model_file_is_dropped_before_every_run(
    tiny_model: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variant that runs a smaller quantization (-m FILE) finds that file's pages dropped, like the model's."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=8)
    drops: list[tuple[Path, ...]] = []
    fake = _worker([1.0], 1, 2, 100) | {"cgroup_peak_bytes": 0}
    monkeypatch.setattr(run, "run_worker", lambda args, cap, timeout, script, throttle=None: fake)
    _fake_machine(monkeypatch)
    monkeypatch.setattr(run, "drop_pages", lambda files: drops.append(tuple(files)))
    out = tmp_path / "res"
    argv = ["run.py", "--model", str(path), "--budgets", "25", "--repeats", "1", "--out", str(out)]
    argv += ["--upstream", "/up/llama-completion", "--upstream-variants", "upstream-q2k=-m /x/q2k.gguf --no-repack"]
    monkeypatch.setattr(sys, "argv", argv)
    run.main()
    assert drops and all(Path("/x/q2k.gguf") in d and path in d for d in drops)


def test_throttle_reaches_every_run_and_the_table(
    tiny_model: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--throttle-read-mbps: every run starts in a read throttle on the model's disk at that rate, and
    the table's first line says so."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=8)
    made: list[tuple[str, int]] = []
    seen: list[object] = []

    class FakeThrottle:
        def __init__(self, name: str, device: str, bytes_per_s: int) -> None:
            made.append((device, bytes_per_s))

        def close(self) -> None:
            pass

    def fake_worker(args: list[str], cap: object, timeout: float, script: str, throttle: object = None) -> object:
        seen.append(throttle)
        return _worker([1.0], 1, 2, 100) | {"cgroup_peak_bytes": 0}

    monkeypatch.setattr(run, "run_worker", fake_worker)
    monkeypatch.setattr(run, "ReadThrottle", FakeThrottle)
    monkeypatch.setattr(run, "block_device", lambda p: "254:0")
    _fake_machine(monkeypatch)
    out = tmp_path / "res"
    argv = ["run.py", "--model", str(path), "--budgets", "25", "--repeats", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--throttle-read-mbps", "200"])
    run.main()
    assert seen and all(isinstance(t, FakeThrottle) for t in seen)
    assert made == [("254:0", 200_000_000)] * len(seen)
    assert "every run's reads throttled to 200 MB/s" in out.with_name("res.md").read_text().splitlines()[0]


def test_skip_stock_capped_runs_the_variants_alone(
    tiny_model: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--skip-stock-capped: no stock run under a cap; the variants' rows are still written, compared
    with nothing under the cap ('-') and with stock in RAM."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=8)
    ran: list[list[str]] = []

    def fake_worker(args: list[str], cap: object, timeout: float, script: str, throttle: object = None) -> object:
        ran.append(args)
        return _worker([1.0], 1, 2, 100) | {"cgroup_peak_bytes": 0}

    monkeypatch.setattr(run, "run_worker", fake_worker)
    _fake_machine(monkeypatch)
    out = tmp_path / "res"
    argv = ["run.py", "--model", str(path), "--budgets", "25,50", "--repeats", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--variants", "a=lru:prefetch=0;b=reuse-rank:", "--skip-stock-capped"])
    run.main()
    # the headroom probe and stock in RAM twice, then 2 variants x 2 budgets
    assert all("--cache" in r for r in ran[3:]) and len(ran) == 3 + 2 * 2
    report = json.loads(out.with_name("res.json").read_text())
    assert not any(k.startswith("stock-capped") for k in report["runs"])
    table = out.with_name("res.md").read_text().split("\n\n")[1]  # the first table
    rows = [line for line in table.splitlines() if line.startswith(("| a-", "| b-"))]
    assert [r.split(" | ")[0] for r in rows] == ["| a-25", "| b-25", "| a-50", "| b-50"]
    assert all(r.split(" | ")[3] == "-" for r in rows)


def test_cap_gib_gives_the_cache_what_the_cap_leaves(
    tiny_model: ModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cap-gib: one cap instead of --budgets; every capped run gets exactly that cap, and the cache's
    budget is the cap less the non-expert bytes and the headroom, the runs named by its share of the
    experts. A cap too small for the minimum cache is refused before anything runs."""
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=8)
    ran: list[tuple[list[str], int | None]] = []

    def fake_worker(
        args: list[str], cap: _FakeCap | None, timeout: float, script: str, throttle: object = None
    ) -> object:
        ran.append((args, cap.limit_bytes if cap is not None else None))
        return _worker([1.0], 1, 2, 100) | {"cgroup_peak_bytes": 0}

    monkeypatch.setattr(run, "run_worker", fake_worker)
    _fake_machine(monkeypatch)
    out = tmp_path / "res"
    cap = 0.01  # GiB
    argv = ["run.py", "--model", str(path), "--cap-gib", str(cap), "--repeats", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--headroom-mib", "2"])
    run.main()
    report = json.loads(out.with_name("res.json").read_text())
    capped = [r for r in report["runs"] if r.startswith(("moetier-", "stock-capped-"))]
    assert len(capped) == 2
    moe = report["runs"][next(r for r in capped if r.startswith("moetier-"))]
    budget = int(cap * (1 << 30)) - report["non_expert_bytes"] - 2 * (1 << 20)
    assert moe["budget_bytes"] == budget and moe["cap_bytes"] == int(cap * (1 << 30))
    pct = round(100 * budget / report["expert_bytes"])
    assert f"moetier-{pct}" in report["runs"] and f"stock-capped-{pct}" in report["runs"]
    assert all(c == int(cap * (1 << 30)) for a, c in ran if "--cache" in a)
    monkeypatch.setattr(sys, "argv", [*argv[:4], "0.0001", *argv[5:]])
    with pytest.raises(SystemExit, match="below the minimum cache"):
        run.main()


@pytest.mark.skipif(not cgroup.available(), reason="needs a writable cgroup v1 memory controller")
def test_memory_cap_limits_and_joins() -> None:
    cap = cgroup.MemoryCap(f"moetier-test-{id(object())}", 256 << 20)
    try:
        assert int((cap.path / "memory.limit_in_bytes").read_text()) == 256 << 20
        p = subprocess.Popen(["sleep", "5"], preexec_fn=cap.preexec)
        try:
            assert str(p.pid) in (cap.path / "cgroup.procs").read_text().split()
        finally:
            p.kill()
            p.wait()
    finally:
        cap.close()
    assert not cap.path.exists()


def test_memory_cap_binds_on_page_cache(tmp_path: Path) -> None:
    """The cap counts page cache, as the capped runs need: a child that reads a file four times the
    cap through the page cache fills the group to its limit and no further (the group reclaims), and
    is not killed."""
    if not cgroup.available():
        pytest.skip("cgroup v1 memory controller not writable")
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(128 << 20))
    os.sync()
    # drop the written pages: page cache is charged to the group that reads it in first
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    cap = cgroup.MemoryCap(f"moetier-test-bind-{id(object())}", 32 << 20)
    try:
        r = subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, preexec_fn=cap.preexec, check=False)
        assert r.returncode == 0
        # cat's own memory is ~1 MiB: a group that filled its limit counted the file's pages
        assert (32 << 20) * 3 // 4 <= cap.max_usage() <= 32 << 20, cap.max_usage()
    finally:
        cap.close()


def test_margin_bins_rank_each_token_by_its_top_two_logit_gap() -> None:
    """predictors.py's top-1 by margin: each token falls in the quintile of its top-1/top-2 logit
    gap among its layer's tokens, narrowest first, whatever the logits' scale or column order."""
    gaps = np.array([2.0, 0.1, 5.0, 0.5, 0.01, 3.0, 0.2, 1.0, 4.0, 0.05])
    logits = np.stack([np.zeros(10), gaps, -np.ones(10)], 1)[:, [2, 0, 1]].astype(np.float32)
    bins = predictors.margin_bins(logits)
    assert bins.tolist() == [3, 1, 4, 2, 0, 3, 1, 2, 4, 0]
    assert np.bincount(bins).tolist() == [2, 2, 2, 2, 2]
    assert (predictors.margin_bins(100 * logits) == bins).all()


def test_frontier_runs_a_configuration_with_the_cache_of_its_run() -> None:
    """A moetier point's perplexity uses its run's budget, store, policy and options, decoded token by
    token, without a warm start, the model option repack=0 as --no-repack; a stock point its flags."""
    report = {
        "config": {"store": "/s/m.experts"},
        "runs": {
            "mixed-25": {
                "budget_bytes": 1000,
                "args": [
                    "--threads",
                    "2",
                    "--cache",
                    "1000",
                    "--policy",
                    "lfu",
                    "--opts",
                    "t1=0.5,t2=0.9,prefetch=1,repack=0",
                ],
            },
            "stock-capped-25": {"args": ["--no-repack"]},
        },
    }
    flags = frontier.moetier_flags(report, "mixed-25")
    assert flags[:4] == ["-ub", "1", "--expert-cache", "1000"]
    opts = dict(kv.split("=") for kv in flags[flags.index("--expert-opt") + 1].split(","))
    assert (opts["t1"], opts["t2"], opts["prefetch"], opts["warm"]) == ("0.5", "0.9", "1", "0")
    assert "repack" not in opts and flags[-1] == "--no-repack"
    assert flags[flags.index("--expert-policy") + 1] == "lfu"
    assert flags[flags.index("--expert-store") + 1] == "/s/m.experts"
    with pytest.raises(SystemExit, match="stock-capped-25: not a moetier configuration"):
        frontier.moetier_flags(report, "stock-capped-25")
    assert frontier.parse_points("a-25=moetier; b-25=stock:--override-kv x.expert_used_count=int:6") == [
        ("a-25", "moetier", []),
        ("b-25", "stock", ["--override-kv", "x.expert_used_count=int:6"]),
    ]
    with pytest.raises(SystemExit, match="is not NAME=moetier"):
        frontier.parse_points("c-25=peer:--x")


def test_frontier_sets_points_against_the_runs_own_lossless_configurations() -> None:
    """Without names, the lossy points are set against the fastest exact configuration of ours and the
    fastest lossless one of the peer's at the points' budget; a name the run lacks is an error naming
    the run; with no peer in the run the column says so instead of a NaN."""

    def cfg(tok_s: float, **lossy: float) -> dict[str, object]:
        return {"decode_tok_s": {"median": tok_s}, "lossy": lossy}

    runs = {
        "stock-capped-25": cfg(0.5),
        "lru-high-25": cfg(6.0, skipped=0.0, loads_low=0.0),
        "exact-25": cfg(7.0, skipped=0.0, loads_low=0.0),
        "exact-50": cfg(12.0, skipped=0.0, loads_low=0.0),
        "mixed-25": cfg(8.0, skipped=0.0, loads_low=0.4),
        "peer-25": cfg(0.7, dropped=0.0),
        "peer-drop-25": cfg(0.9, dropped=0.2),
        # reduced top-k drops nothing it routes, and is lossy: never the peer's lossless point
        "peer-k4-25": {**cfg(1.5, dropped=0.0), "args": ["--peer-args=--moe-stream --n-expert-used 4"]},
        "peer-50": cfg(2.0, dropped=0.0),
        "upstream-norepack-25": cfg(0.6),
    }
    report = {"runs": runs}
    assert frontier.pick_lossless(report, "r.json", None, ["mixed-25"], peer=False) == "exact-25"
    assert frontier.pick_lossless(report, "r.json", None, ["mixed-25"], peer=True) == "peer-25"
    assert frontier.pick_lossless(report, "r.json", "lru-high-25", ["mixed-25"], peer=False) == "lru-high-25"
    with pytest.raises(SystemExit, match=r"r.json: no configuration 'exact-prefetch-25' ran"):
        frontier.pick_lossless(report, "r.json", "exact-prefetch-25", ["mixed-25"], peer=False)
    doc = {
        "model": "m.gguf",
        "run": "r.json",
        "ctx": 512,
        "chunks": 2,
        "exact": {"decode": {"a": 10.0}, "batch": {"a": 10.0}},
        "points": {"mixed-25": {"vs_exact": {"a": 1.01}}},
    }
    md = frontier.table(report, doc, "exact-25", "peer-25")
    assert "| vs peer-25 |" in md and "| exact-25 | 7.00 | 10.00x | +0.00% |" in md
    assert "| mixed-25 | 8.00 | 11.43x | +1.00% |" in md and "nan" not in md
    # the peer's rows are the points' budget's only
    assert "| peer-k4-25 |" in md and "peer-50" not in md
    with pytest.raises(SystemExit, match="several budgets"):
        frontier.pick_lossless(report, "r.json", None, ["mixed-25", "mixed-50"], peer=False)
    bare = {"runs": {k: v for k, v in runs.items() if not k.startswith("peer")}}
    assert frontier.pick_lossless(bare, "r.json", None, ["mixed-25"], peer=True) is None
    md = frontier.table(bare, doc, "exact-25", None)
    assert "| vs the peer (not run) |" in md and "| mixed-25 | 8.00 | - | +1.00% |" in md


def test_variant_store_0_reads_the_gguf() -> None:
    assert run.store_flag("t1=1,t2=1", "S") == ("S", "t1=1,t2=1")
    assert run.store_flag("t1=1,store=0,t2=1", "S") == (None, "t1=1,t2=1")
    assert run.store_flag("prefetch=0", None) == (None, "prefetch=0")


def test_requant_takes_a_type_list_per_tensor(tiny_model: ModelFactory, tmp_path: Path) -> None:
    """bench/requant.py --type q3_K,q4_0: rows of 256 values get q3_K, down rows of 32 fall back
    to q4_0, and every other tensor is copied byte for byte; a list none of whose blocks fits a
    tensor's rows is refused, naming it."""
    import gguf

    import requant

    src = tiny_model("qwen2moe", n_embd=256, n_ff_exp=32, seed=7)
    dst = tmp_path / "q3k.gguf"
    requant.requant(src, dst, "q3_K,q4_0")
    before = {t.name: t for t in gguf.GGUFReader(src).tensors}
    after = {t.name: t for t in gguf.GGUFReader(dst).tensors}
    assert before.keys() == after.keys()
    for name, t in after.items():
        if requant.EXPERT.search(name):
            want = gguf.GGMLQuantizationType.Q4_0 if "down" in name else gguf.GGMLQuantizationType.Q3_K
            assert t.tensor_type == want, name
        else:
            assert t.tensor_type == before[name].tensor_type
            assert bytes(t.data) == bytes(before[name].data), name
    with pytest.raises(SystemExit, match=r"ffn_down_exps.*rows of 32 values"):
        requant.requant(src, tmp_path / "bad.gguf", "q3_K")
    assert not list(tmp_path.glob("bad.gguf*"))


def test_contention_competitor_streams_a_file_with_o_direct_until_stopped(tmp_path: Path) -> None:
    """The competitor of bench/probes/contention_probe.py reads its file over and over (past the end it starts
    again) until stopped, and reports the rate it read at; a file it cannot open is an error, not 0."""
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(3 << 20) + b"x" * 1000)  # a short last block
    c = contention_probe.Competitor(str(f))
    c.start()
    time.sleep(1.0)
    rate = c.stop()
    assert c.bytes_read > 3 * f.stat().st_size and rate > 0  # three passes and more in a second
    bad = contention_probe.Competitor(str(tmp_path / "missing.bin"))
    bad.start()
    with pytest.raises(ValueError):
        bad.stop()


def _direct_read_seconds(path: Path, throttle: cgroup.ReadThrottle | None) -> float:
    """Seconds a child takes to read path with O_DIRECT (dd), inside throttle if given."""
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct", "status=none"],
        check=True,
        preexec_fn=throttle.preexec if throttle else None,
    )
    return time.perf_counter() - t0


def test_read_throttle_slows_direct_reads(tmp_path: Path) -> None:
    """--throttle-read-mbps's group: a child's O_DIRECT reads of the disk that holds a file run at
    the set rate (16 MiB at 8 MB/s: at least 1.5 s; unthrottled on these machines: well under 0.5 s)."""
    data = Path.home() / ".cache" / "moetier" / "throttle-probe.bin"  # a real disk, not a tmpfs
    data.parent.mkdir(parents=True, exist_ok=True)
    try:
        device = cgroup.block_device(data.parent)
        throttle = cgroup.ReadThrottle(f"moetier-test-{os.getpid()}", device, 8_000_000)
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        data.write_bytes(os.urandom(16 << 20))
        assert (throttle.path / "blkio.throttle.read_bps_device").read_text().split() == [device, "8000000"]
        assert _direct_read_seconds(data, throttle) >= 1.5
        assert _direct_read_seconds(data, None) < 1.0
    finally:
        throttle.close()
        data.unlink(missing_ok=True)
    assert not throttle.path.exists()


def test_defaults_runs_each_model_and_disk_once_and_ratios_pair_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/defaults.py: one run.py per (model, disk), throttled where asked, skipped when its JSON
    exists (resumable); the summary divides medians and pairs the repeats in run order."""
    cmds: list[list[str]] = []

    def speed(xs: list[float]) -> dict[str, object]:
        return {"decode_tok_s": {"median": sorted(xs)[len(xs) // 2], "values": xs}}

    def fake_run(cmd: list[str], check: bool) -> None:
        cmds.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        runs = {"lru-high-10": speed([10.0, 10.0, 8.0]), "default-10": speed([11.0, 12.0, 8.0])}
        out.with_suffix(".json").write_text(json.dumps({"runs": runs}))

    monkeypatch.setattr(defaults.subprocess, "run", fake_run)
    out = tmp_path / "d"
    (tmp_path / "d-b-full.json").write_text(json.dumps({"runs": {}}))  # done before
    argv = ["defaults.py", "--model", "a=/m/a.gguf:/m/a.experts", "--model", "b=/m/b.gguf", "--budgets", "10"]
    monkeypatch.setattr(sys, "argv", [*argv, "--disks", "full,200", "--out", str(out)])
    defaults.main()
    outs = [c[c.index("--out") + 1] for c in cmds]
    assert outs == [str(tmp_path / n) for n in ("d-a-full", "d-a-200mbps", "d-b-200mbps")]
    assert "--throttle-read-mbps" not in cmds[0] and cmds[1][cmds[1].index("--throttle-read-mbps") + 1] == "200"
    assert cmds[0][cmds[0].index("--store") + 1] == "/m/a.experts" and "--store" not in cmds[2]
    assert all("--skip-stock-capped" in c for c in cmds)
    table = (tmp_path / "d.md").read_text()
    assert "| a | full speed | default | 1.10x (1.00-1.20; 11.00 vs 10.00) |" in table
    assert "| b | full speed | default | - |" in table
    # --summary-only runs nothing: the table gathers what exists, a missing run is left out
    cmds.clear()
    (tmp_path / "d-a-200mbps.json").unlink()
    monkeypatch.setattr(sys, "argv", [*argv, "--disks", "full,200", "--out", str(out), "--summary-only"])
    defaults.main()
    assert cmds == []
    table = (tmp_path / "d.md").read_text()
    assert "| a | full speed | default | 1.10x" in table and "| a | 200 MB/s |" not in table
    assert "| b | 200 MB/s | default | 1.10x" in table
    with pytest.raises(SystemExit, match="NAME=MODEL"):
        defaults.parse_model("a.gguf")


def test_mutation_report_counts_per_module_and_scores_reached_mutants() -> None:
    """bench/mutation.py: mutmut's result lines become counts per module; the score is killed over
    killed + survived (the mutants a test reaches), timeouts and unreached ones apart."""
    lines = """
    moetier.config.x_parse_size__mutmut_1: killed
    moetier.config.x_parse_size__mutmut_2: killed
    moetier.config.xǁCacheConfigǁ__post_init____mutmut_3: survived
    moetier.config.x_help__mutmut_4: no tests
    moetier.errors.xǁMoetierErrorǁ__init____mutmut_1: timeout
    not a result line
    """
    counts = mutation.tally(lines)
    assert dict(counts["moetier.config"]) == {"killed": 2, "survived": 1, "no tests": 1}
    assert dict(counts["moetier.errors"]) == {"timeout": 1}
    data, md = mutation.report(counts, "python bench/mutation.py --mutate config.py")
    assert data["total"] == {"killed": 2, "survived": 1, "no tests": 1, "timeout": 1}
    assert "| moetier.config | 4 | 2 | 1 | 0 | 1 | 67% |" in md
    assert "| moetier.errors | 1 | 0 | 0 | 1 | 0 | - |" in md


def test_mutation_recheck_compares_only_the_selection() -> None:
    """A recheck refuses another selection of modules or tests (mutmut would forget its results) but
    not a change in the files copied beside them."""
    cfg = mutation.setup_cfg(["config.py", "model.py"], ["tests/test_params.py"])
    assert mutation.selection(cfg) == ("\nsrc/moetier/config.py\nsrc/moetier/model.py", "\ntests/test_params.py")
    assert mutation.selection(cfg.replace("    scripts\n", "")) == mutation.selection(cfg)
    assert mutation.selection(mutation.setup_cfg(["config.py"], ["tests/test_params.py"])) != mutation.selection(cfg)
    assert mutation.selection(mutation.setup_cfg(["config.py", "model.py"], ["tests/x.py"])) != mutation.selection(cfg)
