"""`moetier stats URL`: Prometheus text parsing (histograms and their percentiles), the view against a
real served model, refreshes until Ctrl-C, and the errors."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _server import free_port, serve
from conftest import LONG_PROMPT, ModelFactory
from moetier import CacheConfig, Model, format_size, stats
from moetier.stats import histogram, metrics_url, parse_prometheus, render

# llama-server's layout (HELP, TYPE, sample) with the metrics the C++ side adds: a read-latency
# histogram, the cache size gauge, prefetch counters; plus a labeled series and one nobody knows yet
SAMPLE = """\
# HELP llamacpp:expert_cache_lookups_total moetier: experts needed by MoE layers
# TYPE llamacpp:expert_cache_lookups_total counter
llamacpp:expert_cache_lookups_total 1000
# TYPE llamacpp:expert_cache_hits_total counter
llamacpp:expert_cache_hits_total 750
# TYPE llamacpp:expert_cache_misses_total counter
llamacpp:expert_cache_misses_total 250
# TYPE llamacpp:expert_cache_bytes_read_total counter
llamacpp:expert_cache_bytes_read_total 2.62144e+07
# TYPE llamacpp:expert_cache_loads_low_total counter
llamacpp:expert_cache_loads_low_total 50
# TYPE llamacpp:expert_cache_skipped_total counter
llamacpp:expert_cache_skipped_total 25
# TYPE llamacpp:expert_cache_exact gauge
llamacpp:expert_cache_exact 0
# TYPE llamacpp:expert_cache_size_bytes gauge
llamacpp:expert_cache_size_bytes 67108864
# TYPE llamacpp:expert_cache_prefetch_used_total counter
llamacpp:expert_cache_prefetch_used_total 30
# TYPE llamacpp:expert_cache_prefetch_wasted_total counter
llamacpp:expert_cache_prefetch_wasted_total 10
# HELP llamacpp:expert_cache_read_seconds moetier: time of one expert read
# TYPE llamacpp:expert_cache_read_seconds histogram
llamacpp:expert_cache_read_seconds_bucket{le="0.0001"} 0
llamacpp:expert_cache_read_seconds_bucket{le="0.001"} 100
llamacpp:expert_cache_read_seconds_bucket{le="0.01"} 180
llamacpp:expert_cache_read_seconds_bucket{le="0.1"} 198
llamacpp:expert_cache_read_seconds_bucket{le="+Inf"} 200
llamacpp:expert_cache_read_seconds_sum 0.5
llamacpp:expert_cache_read_seconds_count 200
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 64
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 8
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 7.5
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{pos="1",note="a \\"quoted\\", value"} 3 1700000000000
# TYPE llamacpp:some_future_total counter
llamacpp:some_future_total 42
"""


def test_parse_prometheus_and_histogram_percentiles() -> None:
    m = parse_prometheus(SAMPLE)
    assert m.values["llamacpp:expert_cache_bytes_read_total"] == 26214400
    assert m.values['llamacpp:expert_cache_read_seconds_bucket{le="+Inf"}'] == 200
    assert m.values['llamacpp:spec_decode_num_accepted_tokens_per_pos_total{note="a \\"quoted\\", value",pos="1"}'] == 3
    assert m.types["llamacpp:expert_cache_read_seconds"] == "histogram"
    h = histogram(m, "llamacpp:expert_cache_read_seconds")
    assert h is not None and h.count == 200 and h.mean == pytest.approx(0.0025)
    assert [le for le, _ in h.buckets] == [0.0001, 0.001, 0.01, 0.1, float("inf")]
    # rank 100 is the top of the 0.001 bucket; rank 180 the top of 0.01; rank 198 the top of 0.1
    assert h.quantile(0.5) == pytest.approx(0.001)
    assert h.quantile(0.9) == pytest.approx(0.01)
    assert h.quantile(0.99) == pytest.approx(0.1)
    # linear inside a bucket (rank 140: half way through 0.001..0.01), as histogram_quantile does
    assert h.quantile(0.7) == pytest.approx(0.0055)
    # past the last finite bound: that bound
    assert h.quantile(0.999) == pytest.approx(0.1)
    assert histogram(m, "llamacpp:nothing") is None

    view = render("127.0.0.1:8080", m)
    assert view.startswith("moetier stats  http://127.0.0.1:8080/metrics")
    assert "75.0%  (750 hits / 1000 lookups, 250 misses)" in view
    assert "high 175 (70.0%)  low 50 (20.0%)  skipped 25 (10.0%)" in view
    assert "mixed precision | size 64.00 MiB" in view
    assert f"bytes read     {format_size(26214400)}" in view
    assert "p50 1 ms  p90 10 ms  p99 100 ms  mean 2.5 ms  (200 reads" in view
    assert "used 30  wasted 10 (25.0% of the prefetched experts)" in view
    assert "64 tokens" in view and "8.0 tok/s overall" in view and "2 processing" in view
    # a metric the view does not know is still listed
    assert "some_future_total 42" in view
    # a refresh later: rates over the interval
    later = parse_prometheus(SAMPLE.replace(" 2.62144e+07", " 3.2768e+07").replace("_total 64", "_total 84"))
    view2 = render("127.0.0.1:8080", later, prev=m, dt=2.0)
    assert f"{format_size(3276800)}/s since the last refresh" in view2
    assert "10.0 tok/s since the last refresh" in view2

    # without the new metrics (today's server) their lines are left out
    old = "\n".join(line for line in SAMPLE.splitlines() if "read_seconds" not in line and "prefetch" not in line)
    view = render("127.0.0.1:8080", parse_prometheus(old))
    assert "read latency" not in view and "prefetch" not in view and "expert_cache_read" not in view


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_watch_redraws_a_terminal_until_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    scrapes = iter([SAMPLE, SAMPLE.replace("_total 64", "_total 84")])
    monkeypatch.setattr(stats, "fetch", lambda url: parse_prometheus(next(scrapes)))
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    out = _Terminal()
    assert stats.watch("127.0.0.1:8080", interval=0.5, out=out, sleep=nap) == 0
    assert naps == [0.5, 0.5]
    text = out.getvalue()
    # cleared once, then each view drawn from the top left, lines erased to their end
    assert text.startswith("\033[2J\033[Hmoetier stats") and text.count("\033[2J") == 1
    assert text.count("\033[H") == 2 and "75.0%  (750 hits / 1000 lookups, 250 misses)\033[K\n" in text
    assert "tok/s since the last refresh" in text.split("\033[H")[2]


def moetier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moetier.cli", *args], capture_output=True, text=True, timeout=60)


def test_stats_against_server(tiny_model: ModelFactory, tmp_path: Path) -> None:
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    info = Model(path, cache=CacheConfig.exact(budget="64M")).cache_info()
    cache = ["--cache", str(int(info["min_cache_bytes"])), "--cache-t1", "1", "--cache-t2", "1"]
    with serve(["-m", str(path), *cache], tmp_path / "server.log") as srv:
        srv.complete(LONG_PROMPT, n_predict=16)
        r = moetier("stats", srv.url, "--once")
        assert r.returncode == 0, r.stderr
        lookups = srv.metric("expert_cache_lookups_total")
        hits, misses = srv.metric("expert_cache_hits_total"), srv.metric("expert_cache_misses_total")
        read = srv.metric("expert_cache_bytes_read_total")
        assert lookups > 0 and misses > 0
        view = r.stdout
        assert view.startswith(f"moetier stats  {srv.url}/metrics")
        assert f"{100 * hits / lookups:.1f}%  ({hits:.0f} hits / {lookups:.0f} lookups, {misses:.0f} misses)" in view
        assert f"high {misses:.0f} (100.0%)  low 0 (0.0%)  skipped 0 (0.0%)" in view
        assert "exact (every expert in high precision)" in view
        assert f"bytes read     {format_size(read)}  rate: needs two refreshes" in view
        assert f"generation     {srv.metric('tokens_predicted_total'):.0f} tokens" in view
        assert "\033[" not in view  # not a terminal: no screen control

        # refreshes until Ctrl-C, which exits with status 0
        out = tmp_path / "stats.out"
        with open(out, "w") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moetier.cli", "stats", srv.url, "--interval", "0.2"],
                stdout=f,
                stderr=subprocess.PIPE,
                text=True,
                # a shell that started pytest in the background ignores SIGINT, and an ignored signal
                # stays ignored across exec: give the child the default, as a terminal's Ctrl-C finds it
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        try:
            deadline = time.time() + 30
            while out.read_text().count("moetier stats") < 2 and time.time() < deadline and proc.poll() is None:
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        views = out.read_text()
        assert views.count("moetier stats") >= 2
        assert "0 B/s since the last refresh" in views  # no request between the refreshes


def test_stats_errors(tiny_model: ModelFactory, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = moetier("stats", url, "--once")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"moetier: error: {url}/metrics: cannot reach the server")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert metrics_url("localhost:8080/") == "http://localhost:8080/metrics"

    # a stock server without --metrics: the error says how to turn it on
    path = tiny_model("qwen2moe", n_expert=8, n_expert_used=2, n_layer=3)
    with serve(["-m", str(path)], tmp_path / "server.log") as srv:
        r = moetier("stats", srv.url, "--once")
    assert r.returncode == 1
    assert r.stderr.startswith(f"moetier: error: {srv.url}/metrics: HTTP 501") and "--metrics" in r.stderr


# the VRAM tier, the prefetch gate, prompts and deferred requests, on top of SAMPLE
MORE = """\
llamacpp:expert_cache_vram_hits_total 600
llamacpp:expert_cache_vram_copies_total 400
llamacpp:expert_cache_vram_bytes_total 4.194304e+08
llamacpp:expert_cache_prefetch_on_steps_total 90
llamacpp:expert_cache_prefetch_off_steps_total 10
llamacpp:prompt_tokens_total 512
llamacpp:prompt_tokens_cached_total 128
llamacpp:prompt_seconds_total 0.25
llamacpp:requests_deferred 1
"""

VIEW = """\
expert cache   mixed precision | size 64.00 MiB
hit rate       75.0%  (750 hits / 1000 lookups, 250 misses)
misses         high 175 (70.0%)  low 50 (20.0%)  skipped 25 (10.0%)
bytes read     25.00 MiB  7.50 MiB/s since the last refresh
read latency   p50 1 ms  p90 10 ms  p99 100 ms  mean 2.5 ms  (200 reads, 50.00 MiB/s per read)
VRAM tier      hit rate 60.0%  (600 hits, 400 copies from RAM, 400.00 MiB copied)
prefetch       used 30  wasted 10 (25.0% of the prefetched experts)  reading in 90.0% of decode steps
generation     64 tokens, 16.0 tok/s since the last refresh, 7.5 tok/s per request since the previous scrape, \
8.0 tok/s overall
prompt         512 tokens, 128 more from the prompt cache, 2048.0 tok/s overall
requests       2 processing, 1 deferred
other          some_future_total 42
               spec_decode_num_accepted_tokens_per_pos_total{note="a \\"quoted\\", value",pos="1"} 3
"""


def test_render_whole_view() -> None:
    """Every row of the view, character for character, from a scrape and the one 2 s before it."""
    m = parse_prometheus(SAMPLE + MORE)
    prev = parse_prometheus(
        SAMPLE.replace("bytes_read_total 2.62144e+07", "bytes_read_total 1.048576e+07").replace(
            "tokens_predicted_total 64", "tokens_predicted_total 32"
        )
    )
    head, *rest = render("http://x:8080", m, prev, 2.0).splitlines(keepends=True)
    assert head.startswith("moetier stats  http://x:8080/metrics  ")
    assert "".join(rest) == VIEW
    # exact, an empty cache, no lookups yet, no rates on the first scrape
    first = parse_prometheus(
        "llamacpp:expert_cache_lookups_total 0\nllamacpp:expert_cache_exact 1\nllamacpp:expert_cache_size_bytes 0\n"
    )
    assert render("x", first).splitlines()[1:4] == [
        "expert cache   exact (every expert in high precision) | off",
        "hit rate       - (no lookups yet)",
        "misses         high 0 (-)  low 0 (-)  skipped 0 (-)",
    ]
    assert "rate: needs two refreshes" in render("x", first)
    plain = parse_prometheus("llamacpp:tokens_predicted_total 5\n")
    assert render("x", plain).splitlines()[1:] == [
        "expert cache   no expert cache metrics (not a moetier llama-server?)",
        "generation     5 tokens",
    ]
