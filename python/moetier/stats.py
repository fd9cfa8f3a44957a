"""`moetier stats URL`: a top-like view of a llama-server's /metrics.

The view shows the expert cache (hit rate, bytes read, the high/low/skip split of misses, exact or
mixed precision, read latency, prefetch) next to llama.cpp's own counters (tokens/s, requests).
Prometheus text is parsed generically (every sample, histograms included), so a metric the server
adds later shows up under "other" without a change here; the known ones are laid out by name.
ref: https://prometheus.io/docs/instrumenting/exposition_formats/ (text format 0.0.4)
"""

from __future__ import annotations

import http.client
import math
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TextIO

from .config import format_size
from .errors import MoetierError

__all__ = ["Histogram", "Metrics", "fetch", "metrics_url", "parse_prometheus", "render", "watch"]

P = "llamacpp:"
EC = P + "expert_cache_"

# name{labels} value [timestamp]; a label value may hold escaped quotes
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass
class Metrics:
    """One scrape: every sample as name (or name{labels}, labels sorted) -> value, plus # TYPE lines."""

    values: dict[str, float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative bucket counts by upper bound (the last one +Inf), sum, count."""

    buckets: tuple[tuple[float, float], ...]  # (le, observations <= le), le ascending
    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile estimated as Prometheus' histogram_quantile does: linear within the bucket
        that holds rank q * count, from its lower bound (0 for the first bucket); in the +Inf bucket,
        the largest finite bound. None without observations."""
        total = self.buckets[-1][1] if self.buckets else 0.0
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if math.isinf(le):
                    return lower
                if n == below:
                    return le
                return lower + (le - lower) * (rank - below) / (n - below)
            lower, below = le, n
        return lower


def _key(name: str, labels: str | None) -> str:
    if not labels:
        return name
    pairs = sorted(_LABEL.findall(labels))
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"


def parse_prometheus(text: str) -> Metrics:
    """Every sample of a Prometheus text exposition. Lines that are not samples (other comments,
    blank lines, a line this parser does not understand) are left out rather than failing the view."""
    m = Metrics()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                m.types[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        s = _SAMPLE.match(line)
        if s is None:
            continue
        try:
            value = float(s.group(3))  # also "+Inf", "-Inf", "NaN", "1.79405e+06"
        except ValueError:
            continue
        m.values[_key(s.group(1), s.group(2))] = value
    return m


def histogram(m: Metrics, name: str) -> Histogram | None:
    """name's histogram (its _bucket{le=...}, _sum and _count samples), or None if it is not there."""
    count = m.get(name + "_count")
    if count is None:
        return None
    prefix = name + '_bucket{le="'
    buckets = []
    for key, n in m.values.items():
        if key.startswith(prefix) and key.endswith('"}'):
            le = key[len(prefix) : -2]
            try:
                buckets.append((float(le), n))
            except ValueError:
                continue
    buckets.sort()
    return Histogram(tuple(buckets), m.get(name + "_sum") or 0.0, count)


def metrics_url(url: str) -> str:
    """host:port, http://host:port or .../metrics -> the /metrics URL."""
    u = url.strip()
    if "://" not in u:
        u = "http://" + u
    u = u.rstrip("/")
    return u if u.endswith("/metrics") else u + "/metrics"


def fetch(url: str, timeout: float = 5.0) -> Metrics:
    """Scrapes URL's /metrics; MoetierError naming the URL if it cannot."""
    u = metrics_url(url)
    try:
        with urllib.request.urlopen(u, timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        hint = (
            ": /metrics is off; start llama-server with --metrics (`moetier serve --cache` turns it on)"
            if e.code in (404, 501)
            else ""
        )
        msg = f"{u}: HTTP {e.code} {e.reason}{hint}"
        raise MoetierError(msg) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        msg = f"{u}: cannot reach the server ({reason})"
        raise MoetierError(msg) from None
    except (http.client.InvalidURL, ValueError) as e:
        msg = f"{url}: not a server address ({e}); give e.g. http://127.0.0.1:8080 or 127.0.0.1:8080"
        raise MoetierError(msg) from None
    m = parse_prometheus(text)
    if not m.values:
        msg = f"{u}: no Prometheus metrics in the answer (is this a llama-server?)"
        raise MoetierError(msg)
    return m


def _pct(n: float, d: float) -> str:
    return f"{100 * n / d:.1f}%" if d > 0 else "-"


def _num(x: float) -> str:
    return f"{x:.0f}" if x == int(x) and abs(x) < 1e15 else f"{x:.6g}"


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


@dataclass
class _View:
    """Builds the view's lines and remembers which samples it showed (the rest go under 'other')."""

    m: Metrics
    prev: Metrics | None
    dt: float | None
    shown: set[str] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)

    def v(self, name: str) -> float | None:
        self.shown.add(name)
        return self.m.get(name)

    def rate(self, name: str) -> float | None:
        """Per second since the previous scrape (None on the first, or if the counter went back)."""
        now, before = self.m.get(name), self.prev.get(name) if self.prev else None
        if now is None or before is None or not self.dt or now < before:
            return None
        return (now - before) / self.dt

    def hist(self, name: str) -> Histogram | None:
        h = histogram(self.m, name)
        if h is not None:
            parts = tuple(name + s for s in ("_bucket", "_sum", "_count"))
            self.shown.update(k for k in self.m.values if k.split("{", 1)[0] in parts)
        return h

    def row(self, label: str, text: str) -> None:
        self.lines.append(f"{label:<14} {text}")


def _cache_rows(w: _View) -> None:
    lookups = w.v(EC + "lookups_total")
    if lookups is None:
        w.row("expert cache", "no expert cache metrics (not a moetier llama-server?)")
        return
    hits = w.v(EC + "hits_total") or 0.0
    misses = w.v(EC + "misses_total") or 0.0
    low = w.v(EC + "loads_low_total") or 0.0
    skipped = w.v(EC + "skipped_total") or 0.0
    exact = w.v(EC + "exact")
    size = w.v(EC + "size_bytes")
    mode = "-" if exact is None else "exact (every expert in high precision)" if exact else "mixed precision"
    head = mode + ("" if size is None else f" | size {format_size(size)}" if size else " | off")
    w.row("expert cache", head)
    w.row(
        "hit rate",
        f"{_pct(hits, lookups)}  ({_num(hits)} hits / {_num(lookups)} lookups, {_num(misses)} misses)"
        if lookups
        else "- (no lookups yet)",
    )
    high = misses - low - skipped
    w.row(
        "misses",
        f"high {_num(high)} ({_pct(high, misses)})  low {_num(low)} ({_pct(low, misses)})  "
        f"skipped {_num(skipped)} ({_pct(skipped, misses)})",
    )
    read = w.v(EC + "bytes_read_total") or 0.0
    rate = w.rate(EC + "bytes_read_total")
    since = f"{format_size(rate)}/s since the last refresh" if rate is not None else "rate: needs two refreshes"
    w.row("bytes read", f"{format_size(read)}  {since}")
    h = w.hist(EC + "read_seconds")
    if h is not None:
        at = f", {format_size(read / h.sum)}/s per read" if h.sum > 0 else ""
        w.row(
            "read latency",
            f"p50 {_seconds(h.quantile(0.5))}  p90 {_seconds(h.quantile(0.9))}  p99 {_seconds(h.quantile(0.99))}  "
            f"mean {_seconds(h.mean)}  ({_num(h.count)} reads{at})",
        )
    vhits, vcopies = w.v(EC + "vram_hits_total"), w.v(EC + "vram_copies_total")
    if vhits is not None and (vhits or vcopies):
        vbytes = w.v(EC + "vram_bytes_total") or 0.0
        w.row(
            "VRAM tier",
            f"hit rate {_pct(vhits, lookups)}  ({_num(vhits)} hits, {_num(vcopies or 0.0)} copies from RAM,"
            f" {format_size(vbytes)} copied)",
        )
    used, wasted = w.v(EC + "prefetch_used_total"), w.v(EC + "prefetch_wasted_total")
    if used is not None or wasted is not None:
        u, x = used or 0.0, wasted or 0.0
        on, off = w.v(EC + "prefetch_on_steps_total") or 0.0, w.v(EC + "prefetch_off_steps_total") or 0.0
        gate = f"  reading in {_pct(on, on + off)} of decode steps" if on + off > 0 else ""
        w.row("prefetch", f"used {_num(u)}  wasted {_num(x)} ({_pct(x, u + x)} of the prefetched experts){gate}")


def _server_rows(w: _View) -> None:
    pred = w.v(P + "tokens_predicted_total")
    if pred is not None:
        parts = [f"{_num(pred)} tokens"]
        now = w.rate(P + "tokens_predicted_total")
        if now is not None:
            parts.append(f"{now:.1f} tok/s since the last refresh")
        # llama.cpp's gauge is per request and covers the time since the previous scrape (by anyone)
        avg, secs = w.v(P + "predicted_tokens_seconds"), w.v(P + "tokens_predicted_seconds_total")
        if avg:
            parts.append(f"{avg:.1f} tok/s per request since the previous scrape")
        if secs:
            parts.append(f"{pred / secs:.1f} tok/s overall")
        w.row("generation", ", ".join(parts))
    prompt = w.v(P + "prompt_tokens_total")
    if prompt is not None:
        parts = [f"{_num(prompt)} tokens"]
        cached, secs = w.v(P + "prompt_tokens_cached_total"), w.v(P + "prompt_seconds_total")
        if cached:
            parts.append(f"{_num(cached)} more from the prompt cache")
        if secs:
            parts.append(f"{prompt / secs:.1f} tok/s overall")
        w.row("prompt", ", ".join(parts))
    proc, deferred = w.v(P + "requests_processing"), w.v(P + "requests_deferred")
    if proc is not None or deferred is not None:
        w.row("requests", f"{_num(proc or 0)} processing, {_num(deferred or 0)} deferred")


def _other_rows(w: _View, width: int = 100) -> None:
    """Every sample not shown above, two to a line: what the server added since this view was written."""
    rest = []
    for key in sorted(w.m.values):
        if key in w.shown:
            continue
        base = key.split("{", 1)[0]
        for suffix in ("_bucket", "_sum", "_count"):
            name = base.removesuffix(suffix)
            if base.endswith(suffix) and w.m.types.get(name) == "histogram":
                break
        else:
            rest.append(f"{key.removeprefix(P)} {_num(w.m.values[key])}")
            continue
        h = w.hist(name)
        if h is not None:
            rest.append(f"{name.removeprefix(P)} p50 {_seconds(h.quantile(0.5))} n {_num(h.count)}")
        else:  # labelled series, or no _count: no summary to give, so the samples as they are
            rest.append(f"{key.removeprefix(P)} {_num(w.m.values[key])}")
    col = max((len(r) for r in rest), default=0) + 2
    per_line = max(1, (width - 14) // col) if col else 1
    for i in range(0, len(rest), per_line):
        w.row("other" if i == 0 else "", "".join(r.ljust(col) for r in rest[i : i + per_line]).rstrip())


def render(url: str, m: Metrics, prev: Metrics | None = None, dt: float | None = None) -> str:
    """The view of one scrape; prev and dt (seconds between the scrapes) give the rates."""
    w = _View(m, prev, dt)
    w.lines.append(f"moetier stats  {metrics_url(url)}  {datetime.now().strftime('%H:%M:%S')}")
    _cache_rows(w)
    _server_rows(w)
    _other_rows(w)
    return "\n".join(w.lines) + "\n"


def watch(
    url: str,
    interval: float = 2.0,
    once: bool = False,
    out: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Prints the view every interval seconds until Ctrl-C (status 0); on a terminal each refresh
    redraws the screen, as top does. MoetierError if the server cannot be read."""
    out = out or sys.stdout
    tty = out.isatty()
    prev: Metrics | None = None
    t_prev = 0.0
    try:
        while True:
            m = fetch(url)
            t = time.monotonic()
            view = render(url, m, prev, t - t_prev if prev is not None else None)
            if tty:
                # the screen cleared once, then redrawn in place: home, each line erased to its end,
                # then everything below (no flicker)
                clear = "\033[2J" if prev is None else ""
                out.write(clear + "\033[H" + view.replace("\n", "\033[K\n") + "\033[J")
            else:
                out.write(view + ("" if once else "\n"))
            out.flush()
            if once:
                return 0
            prev, t_prev = m, t
            sleep(interval)
    except KeyboardInterrupt:
        if tty:
            out.write("\n")
        return 0
