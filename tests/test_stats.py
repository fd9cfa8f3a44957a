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
from moetier.stats import EC, histogram, metrics_url, parse_prometheus, render

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


def test_formats_and_edges_of_the_view() -> None:
    """The small rules the view is made of: numbers, durations, shares, URLs, counters that went back,
    histograms without observations or with an empty bucket, lines the parser leaves out."""
    from moetier.stats import Histogram, _num, _pct, _seconds

    assert [_num(x) for x in (3.0, -3.0, 2.5, 1e16, 0.1234567)] == ["3", "-3", "2.5", "1e+16", "0.123457"]
    assert [_seconds(x) for x in (None, 0.0123, 0.999, 1.0, 2.345)] == ["-", "12.3 ms", "999 ms", "1 s", "2.35 s"]
    assert (_pct(1, 0), _pct(1, 3), _pct(0, 4)) == ("-", "33.3%", "0.0%")
    assert metrics_url(" h:1 ") == "http://h:1/metrics"
    assert metrics_url("https://h:1/") == "https://h:1/metrics"
    assert metrics_url("http://h:1/metrics") == "http://h:1/metrics"
    # no observations: no quantile, no mean
    assert Histogram((), 0.0, 0.0).quantile(0.5) is None
    assert Histogram(((1.0, 0.0), (float("inf"), 0.0)), 0.0, 0.0).quantile(0.5) is None
    assert Histogram(((1.0, 0.0), (float("inf"), 0.0)), 0.0, 0.0).mean is None
    # rank 0 falls in an empty first bucket: its bound; every observation past the finite bounds: the last
    h = Histogram(((1.0, 0.0), (2.0, 4.0), (float("inf"), 4.0)), 6.0, 4.0)
    assert (h.quantile(0.0), h.quantile(0.5), h.quantile(1.0), h.mean) == (1.0, 1.5, 2.0, 1.5)
    assert Histogram(((1.0, 2.0), (float("inf"), 4.0)), 0.0, 4.0).quantile(0.9) == 1.0
    # parsing: short TYPE lines, values that are not numbers and stray text are left out
    m = parse_prometheus(
        "# TYPE x\n# TYPE y_seconds histogram\nx NaNish\nnot a sample line at all\n"
        'y_seconds_bucket{le="0.5"} 1\ny_seconds_bucket{le="half"} 2\ny_seconds_bucket{le="+Inf"} 3\n'
        'y_seconds_count 3\nz{b="2",a="1"} -Inf\n'
    )
    assert m.types == {"y_seconds": "histogram"}
    assert m.values == {
        'y_seconds_bucket{le="0.5"}': 1.0,
        'y_seconds_bucket{le="half"}': 2.0,
        'y_seconds_bucket{le="+Inf"}': 3.0,
        "y_seconds_count": 3.0,
        'z{a="1",b="2"}': float("-inf"),
    }
    y = histogram(m, "y_seconds")
    assert y == Histogram(((0.5, 1.0), (float("inf"), 3.0)), 0.0, 3.0)  # no _sum: 0; a bad bound left out
    # a counter that went back (the server restarted) or no time between scrapes: no rate
    now = parse_prometheus("llamacpp:expert_cache_lookups_total 1\nllamacpp:expert_cache_bytes_read_total 10\n")
    before = parse_prometheus("llamacpp:expert_cache_bytes_read_total 20\n")
    assert "rate: needs two refreshes" in render("x", now, before, 2.0)
    assert "rate: needs two refreshes" in render("x", now, now, 0.0)
    assert "0 B/s since the last refresh" in render("x", now, now, 1.0)


def test_other_metrics_are_packed_to_the_width() -> None:
    """Samples the view does not know, two or more to a line up to 100 columns; a histogram of them
    as one entry with its median and count."""
    text = "".join(f"llamacpp:metric_{i:02d} {i}\n" for i in range(12))
    text += '# TYPE llamacpp:wait_seconds histogram\nllamacpp:wait_seconds_bucket{le="1"} 2\n'
    text += 'llamacpp:wait_seconds_bucket{le="+Inf"} 2\nllamacpp:wait_seconds_sum 1\nllamacpp:wait_seconds_count 2\n'
    lines = render("x", parse_prometheus(text)).splitlines()[2:]
    entries = [f"metric_{i:02d} {i}" for i in range(12)] + ["wait_seconds p50 500 ms n 2"]
    col = max(len(e) for e in entries) + 2
    per_line = (100 - 14) // col
    want = [
        f"{'other' if i == 0 else '':<14} " + "".join(e.ljust(col) for e in entries[i : i + per_line]).rstrip()
        for i in range(0, len(entries), per_line)
    ]
    assert lines == want and per_line > 1


def test_watch_once_and_a_plain_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a terminal: views one after the other, separated by a blank line; --once prints one and
    returns without sleeping; Ctrl-C ends it with status 0 and nothing more written."""
    monkeypatch.setattr(stats, "fetch", lambda url: parse_prometheus(SAMPLE))
    out = io.StringIO()
    assert stats.watch("h:1", once=True, out=out, sleep=lambda s: pytest.fail("slept")) == 0
    assert out.getvalue().startswith("moetier stats  http://h:1/metrics") and not out.getvalue().endswith("\n\n")
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    out = io.StringIO()
    assert stats.watch("h:1", out=out, sleep=nap) == 0
    assert naps == [2.0, 2.0] and out.getvalue().count("moetier stats  ") == 2
    assert out.getvalue().endswith("\n\n") and "\033[" not in out.getvalue()


def test_fetch_says_what_the_answer_was() -> None:
    """An HTTP error names its code (with how to turn /metrics on for the codes llama-server gives
    when it is off); an answer without samples is not taken for an empty view; a malformed address
    is named as given."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from moetier import MoetierError

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/f/metrics":  # hangs up without an answer
                self.close_connection = True
                return
            if self.path == "/g/metrics":  # answers too late
                time.sleep(1.0)
            code = {"/a/metrics": 404, "/b/metrics": 500, "/c/metrics": 501}.get(self.path, 200)
            body = b"<html>hello</html>" if self.path == "/d/metrics" else b"llamacpp:x_total 1\n"
            if self.path == "/e/metrics":  # a byte that is not UTF-8 in a comment
                body += b"# caf\xe9\n"
            try:
                self.send_response(code)
                self.end_headers()
                self.wfile.write(body)
            except BrokenPipeError:  # the client that timed out is gone
                pass

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads, srv.block_on_close = True, False
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        hint = ": /metrics is off; start llama-server with --metrics (`moetier serve --cache` turns it on)"
        for where, code, why in (("a", 404, "Not Found"), ("c", 501, "Not Implemented")):
            with pytest.raises(MoetierError) as e:
                stats.fetch(f"{base}/{where}")
            assert str(e.value) == f"{base}/{where}/metrics: HTTP {code} {why}{hint}"
        with pytest.raises(MoetierError) as e:
            stats.fetch(f"{base}/b")
        assert str(e.value) == f"{base}/b/metrics: HTTP 500 Internal Server Error"
        with pytest.raises(MoetierError) as e:
            stats.fetch(f"{base}/d")
        assert str(e.value) == f"{base}/d/metrics: no Prometheus metrics in the answer (is this a llama-server?)"
        assert stats.fetch(base).values == {"llamacpp:x_total": 1.0}
        assert stats.fetch(f"{base}/e").values == {"llamacpp:x_total": 1.0}
        with pytest.raises(MoetierError) as e:
            stats.fetch(f"{base}/f")
        assert (
            str(e.value) == f"{base}/f/metrics: cannot reach the server (Remote end closed connection without response)"
        )
        with pytest.raises(MoetierError) as e:
            stats.fetch(f"{base}/g", timeout=0.2)
        assert str(e.value) == f"{base}/g/metrics: cannot reach the server (timed out)"
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(MoetierError, match=r"^http://\[::1: not a server address \(.*\); give e\.g\. http://127"):
        stats.fetch("http://[::1")


def test_a_sparse_scrape_shows_zeros_for_what_is_missing() -> None:
    """Counters the server did not send count as 0 (never as 1); rows whose metrics are all absent
    are left out; a mode or size the server does not report shows as '-' or nothing."""
    m = parse_prometheus(
        "llamacpp:expert_cache_lookups_total 10\n"
        "llamacpp:expert_cache_vram_hits_total 0\n"
        "llamacpp:expert_cache_prefetch_used_total 4\n"
        "llamacpp:requests_processing 3\n"
    )
    rows = render("x", m).splitlines()[1:]
    assert rows == [
        "expert cache   -",
        "hit rate       0.0%  (0 hits / 10 lookups, 0 misses)",
        "misses         high 0 (-)  low 0 (-)  skipped 0 (-)",
        "bytes read     0 B  rate: needs two refreshes",
        "prefetch       used 4  wasted 0 (0.0% of the prefetched experts)",
        "requests       3 processing, 0 deferred",
    ]
    m = parse_prometheus(
        "llamacpp:expert_cache_lookups_total 10\nllamacpp:expert_cache_vram_hits_total 0\n"
        "llamacpp:expert_cache_vram_copies_total 5\nllamacpp:expert_cache_prefetch_wasted_total 2\n"
        "llamacpp:expert_cache_prefetch_on_steps_total 0\nllamacpp:expert_cache_prefetch_off_steps_total 0\n"
        "llamacpp:requests_deferred 2\n"
        'llamacpp:expert_cache_read_seconds_bucket{le="+Inf"} 0\nllamacpp:expert_cache_read_seconds_sum 0\n'
        "llamacpp:expert_cache_read_seconds_count 0\n"
    )
    rows = render("x", m).splitlines()[1:]
    assert "read latency   p50 -  p90 -  p99 -  mean -  (0 reads)" in rows
    assert "VRAM tier      hit rate 0.0%  (0 hits, 5 copies from RAM, 0 B copied)" in rows
    assert "prefetch       used 0  wasted 2 (100.0% of the prefetched experts)" in rows
    assert "requests       0 processing, 2 deferred" in rows


def test_small_numbers_and_boundaries() -> None:
    from moetier.stats import Histogram, _num, _pct

    assert _num(1e15) == "1e+15" and _num(999999999999999.0) == "999999999999999"
    assert _pct(0.5, 0.5) == "100.0%"
    # one observation is enough for a quantile
    assert Histogram(((1.0, 1.0), (float("inf"), 1.0)), 0.5, 1.0).quantile(0.5) == 0.5
    # a counter the new scrape lacks has no rate
    before = parse_prometheus("llamacpp:expert_cache_lookups_total 1\nllamacpp:expert_cache_bytes_read_total 5\n")
    now = parse_prometheus("llamacpp:expert_cache_lookups_total 1\n")
    assert "rate: needs two refreshes" in render("x", now, before, 1.0)


def test_histograms_and_labels_are_told_apart() -> None:
    """A histogram's buckets are its own, not those of another of the same name length; a sample
    named like a histogram part but typed otherwise is listed as it is; a label value may hold '{'."""
    text = (
        "# TYPE a_seconds histogram\n"
        'a_seconds_bucket{le="1"} 1\na_seconds_bucket{le="+Inf"} 2\na_seconds_sum 3\na_seconds_count 2\n'
        "# TYPE b_seconds histogram\n"
        'b_seconds_bucket{le="5"} 7\nb_seconds_bucket{le="+Inf"} 7\nb_seconds_sum 9\nb_seconds_count 7\n'
        "# TYPE c_total counter\nc_total_count 4\nd_sum 6\n"
        'e_total{path="/x{y}"} 8\n'
    )
    m = parse_prometheus(text)
    a = histogram(m, "a_seconds")
    assert a is not None and a.buckets == ((1.0, 1.0), (float("inf"), 2.0))
    other = " ".join(render("x", m).split("\nother", 1)[1].split())
    assert other == ('a_seconds p50 1 s n 2 b_seconds p50 2.5 s n 7 c_total_count 4 d_sum 6 e_total{path="/x{y}"} 8')


def test_watch_on_a_terminal_draws_each_view_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly what a terminal receives: the screen cleared once, each view from the top left with
    its lines erased to their end and the rest of the screen below it, rates over the time between
    the two scrapes, and a newline after Ctrl-C; the clock in the header as hours:minutes:seconds."""
    import datetime as dt

    class Clock(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Clock:
            return cls(2026, 1, 2, 3, 4, 5)

    scrapes = iter([SAMPLE, SAMPLE.replace("_total 64", "_total 84")])
    monkeypatch.setattr(stats, "fetch", lambda url: parse_prometheus(next(scrapes)))
    monkeypatch.setattr(stats, "datetime", Clock)
    ticks = iter([10.0, 14.0])
    monkeypatch.setattr(stats.time, "monotonic", lambda: next(ticks))

    def nap(seconds: float) -> None:
        if next(naps) == 2:
            raise KeyboardInterrupt

    naps = iter([1, 2])
    out = _Terminal()
    assert stats.watch("h:1", out=out, sleep=nap) == 0
    first = render("h:1", parse_prometheus(SAMPLE))
    assert first.startswith("moetier stats  http://h:1/metrics  03:04:05\n")
    second = render("h:1", parse_prometheus(SAMPLE.replace("_total 64", "_total 84")), parse_prometheus(SAMPLE), 4.0)
    assert "5.0 tok/s since the last refresh" in second
    frame = "\033[H{}\033[J"
    want = "\033[2J" + frame.format(first.replace("\n", "\033[K\n")) + frame.format(second.replace("\n", "\033[K\n"))
    assert out.getvalue() == want + "\n"


def test_watch_once_writes_one_view_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "fetch", lambda url: parse_prometheus(SAMPLE))
    out = io.StringIO()
    assert stats.watch("h:1", once=True, out=out) == 0
    text = out.getvalue()
    assert text.count("moetier stats  ") == 1 and text.endswith('value",pos="1"} 3\n')


def test_an_unreachable_server_is_named_with_the_reason_alone() -> None:
    """A refused connection: the reason urllib wraps, not its '<urlopen error ...>' wrapper."""
    from moetier import MoetierError

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(MoetierError) as e:
        stats.fetch(url)
    assert str(e.value).startswith(f"{url}/metrics: cannot reach the server ([Errno ")
    assert str(e.value).endswith("] Connection refused)") and "urlopen" not in str(e.value)


def test_only_slashes_are_trimmed_from_the_address() -> None:
    assert metrics_url("http://h:1/llamaX//") == "http://h:1/llamaX/metrics"
    assert metrics_url("BOX") == "http://BOX/metrics"


def test_vram_tier_and_prefetch_gate_at_their_edges() -> None:
    """VRAM hits without a copies counter: 0 copies; a prefetch gate that read in no step of one is
    still shown (0.0%), as is one that read in the one step there was, or in fewer steps than not."""
    base = "llamacpp:expert_cache_lookups_total 10\nllamacpp:expert_cache_prefetch_used_total 1\n"
    rows = render("x", parse_prometheus(base + "llamacpp:expert_cache_vram_hits_total 4\n")).splitlines()
    assert "VRAM tier      hit rate 40.0%  (4 hits, 0 copies from RAM, 0 B copied)" in rows
    for on, off, share in ((0, 1, "0.0%"), (1, 0, "100.0%"), (1, 3, "25.0%")):
        steps = f"{EC}prefetch_on_steps_total {on}\n{EC}prefetch_off_steps_total {off}\n"
        rows = render("x", parse_prometheus(base + steps)).splitlines()
        assert (
            f"prefetch       used 1  wasted 0 (0.0% of the prefetched experts)  reading in {share} of decode steps"
            in rows
        )


def test_a_histogram_without_buckets_is_one_entry() -> None:
    """Only _sum and _count (no buckets): one entry with no median, its samples not listed again."""
    m = parse_prometheus("# TYPE llamacpp:x_seconds histogram\nllamacpp:x_seconds_sum 3\nllamacpp:x_seconds_count 2\n")
    assert render("x", m).splitlines()[2:] == ["other          x_seconds p50 - n 2"]


def test_other_metrics_fill_the_width_exactly() -> None:
    """Two columns of 43 (entries of 41 characters and 2 spaces) fit the 86 after the label; 44 do not."""
    for n, per_line in ((39, 2), (40, 1)):
        entries = [f"{c * n} 1" for c in "abc"]
        lines = render("x", parse_prometheus("".join(f"llamacpp:{e}\n" for e in entries))).splitlines()[2:]
        col = n + 4
        want = [
            f"{'other' if i == 0 else '':<14} " + "".join(e.ljust(col) for e in entries[i : i + per_line]).rstrip()
            for i in range(0, len(entries), per_line)
        ]
        assert lines == want and max(len(line) for line in lines) <= 100


def test_a_histogram_the_view_cannot_sum_up_is_listed_as_it_is() -> None:
    """Labelled series (no unlabelled _count) and a _sum without _count are listed sample by sample
    under "other", not dropped; a histogram's summary hides only its own series, not a metric whose
    name begins with the histogram's."""
    text = (
        "# TYPE llamacpp:slot_wait_seconds histogram\n"
        'llamacpp:slot_wait_seconds_bucket{le="1",slot="0"} 2\n'
        'llamacpp:slot_wait_seconds_bucket{le="+Inf",slot="0"} 3\n'
        'llamacpp:slot_wait_seconds_sum{slot="0"} 2.5\n'
        'llamacpp:slot_wait_seconds_count{slot="0"} 3\n'
        "# TYPE llamacpp:h histogram\nllamacpp:h_sum 3\n"
    )
    other = " ".join(render("x", parse_prometheus(text)).splitlines()[2:])
    for sample in (
        'slot_wait_seconds_bucket{le="1",slot="0"} 2',
        'slot_wait_seconds_bucket{le="+Inf",slot="0"} 3',
        'slot_wait_seconds_count{slot="0"} 3',
        'slot_wait_seconds_sum{slot="0"} 2.5',
        "h_sum 3",
    ):
        assert sample in other, sample
    assert "llamacpp:" not in other  # listed without the prefix, as every other sample
    text = "# TYPE llamacpp:x histogram\nllamacpp:x_sum 3\nllamacpp:x_count 2\nllamacpp:x_other_total 7\n"
    assert render("x", parse_prometheus(text)).splitlines()[2:] == ["other          x p50 - n 2      x_other_total 7"]
