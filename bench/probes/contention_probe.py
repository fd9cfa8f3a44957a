"""Probe, 2026-11-27. Question: does prefetch stand back when another process saturates the disk, and
what does decode lose? Answer, the sh60 1.5B at 25%: prefetch kept decode where it was (3.48 / 3.55
tok/s) and never turned a read away, while decode without prefetch lost 14% (3.22 -> 2.77).
Result: bench/results/contention-1.5b-ernie-sh60-25.{json,md}.

Prefetch on a disk another process saturates: does it stand back, and what does decode lose?

Per configuration, decode alone and with a competitor on the same disk: a reader (O_DIRECT, 1 MiB reads)
reading a large file over and over (a second tenant streaming a model, say). The prefetcher starts
at most one walk's reads while earlier ones are still queued: a device that is slow to complete
them (because it is busy with someone else's reads) is "behind", and the predicted misses it turns
away are counted (`busy`). Reported per decoded token: tok/s, the wait for reads, bytes read,
prefetch reads issued / wasted / turned away busy, and the competitor's own MB/s.

No memory cap: non-expert weights are locked in RAM either way; the disk is what is shared.

    python bench/probes/contention_probe.py --model M.gguf --store M.experts --budget 84295680 \\
        --competitor-file BIG.gguf --prompts bench/results/prompts-eval6.json \\
        --config default=t1=1,t2=1 --config no-prefetch=t1=1,t2=1,prefetch=0 --out bench/results/x
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import probe
from moetier import Model

# the competitor: reads PATH with O_DIRECT, 1 MiB at a time from start to end and again, until
# SIGTERM; then prints the bytes it read and the seconds it took
READER = """
import mmap, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
size = os.fstat(fd).st_size
buf = mmap.mmap(-1, 1 << 20)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
n, off, t0 = 0, 0, time.perf_counter()
while not stop:
    r = os.preadv(fd, [buf], off)
    n, off = n + r, off + (1 << 20)
    if r < (1 << 20) or off >= size:
        off = 0
print(n, time.perf_counter() - t0)
"""


class Competitor:
    """A process that streams a file with O_DIRECT until stopped; stop() returns its MB/s and keeps
    the bytes it read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.proc: subprocess.Popen[str] | None = None
        self.bytes_read = 0

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", READER, self.path], stdout=subprocess.PIPE, text=True)

    def stop(self) -> float:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        self.proc = None
        n, secs = out.split()
        self.bytes_read = int(n)
        return int(n) / float(secs) / 1e6


def decode(m: Model, prompts: list[str], n: int) -> dict[str, float]:
    tok = secs = wait = mb = 0.0
    pf_sum = dict.fromkeys(("n_issued", "n_wasted", "n_busy", "n_capped", "bytes_read"), 0)
    for p in prompts:
        marks: dict[str, Any] = {}

        def first(marks: dict[str, Any] = marks) -> None:
            marks["stats"] = m.stats()
            marks["pf"] = m.prefetch_stats()

        r = m.generate(p, max_tokens=n, on_first_token=first)
        pf = m.prefetch_stats()
        s0, pf0 = marks["stats"], marks["pf"]
        tok += len(r.tokens) - 1
        secs += r.decode_seconds
        wait += (r.stats.total.read_us - s0.total.read_us) / 1e6
        mb += (r.stats.n_bytes_read - s0.n_bytes_read) / 1e6
        for k in pf_sum:
            pf_sum[k] += getattr(pf, k) - getattr(pf0, k)
    return {
        "tok_s": tok / secs,
        "wait_ms_per_tok": 1e3 * wait / tok,
        # demand reads and prefetch reads
        "mb_per_tok": (mb + pf_sum["bytes_read"] / 1e6) / tok,
        # prefetch counters of the decode steps, per decoded token
        "pf_issued": pf_sum["n_issued"] / tok,
        "pf_wasted": pf_sum["n_wasted"] / tok,
        "pf_busy": pf_sum["n_busy"] / tok,
        "pf_capped": pf_sum["n_capped"] / tok,
    }


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    probe.add_model_args(a, repeats=2)
    a.add_argument("--competitor-file", required=True, help="large file on the same disk that the competitor reads")
    a.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    ns = a.parse_args()
    prompts = probe.prompts(ns)
    configs = probe.configs(ns)
    load0 = os.getloadavg()[0]
    comp = Competitor(ns.competitor_file)
    runs: dict[str, list[dict[str, float]]] = {}
    for rep in range(ns.repeats):
        for name, opts in configs.items():
            for contended in (False, True):
                key = f"{name}{'+reader' if contended else ''}"
                m = probe.open_model(ns, opts)
                try:
                    if contended:
                        comp.start()
                    row = decode(m, prompts, ns.n)
                    row["competitor_mb_s"] = comp.stop() if contended else 0.0
                finally:
                    m.close()
                runs.setdefault(key, []).append(row)
                print(f"rep {rep} {key}: {row}", file=sys.stderr, flush=True)
    alone = Competitor(ns.competitor_file)
    alone.start()
    time.sleep(10)
    competitor_alone = alone.stop()
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    md = [
        f"model `{Path(ns.model).name}`, budget {ns.budget}, {len(prompts)} prompts x {ns.n} tokens, "
        f"{ns.repeats} repeats, {ns.threads} threads, no cap, competitor a reader (O_DIRECT, 1 MiB reads) on "
        f"`{Path(ns.competitor_file).name}` ({competitor_alone:.0f} MB/s alone); load {load0:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end",
        "",
        "| config | decode tok/s (min-max) | wait ms / token | MB / token "
        "| prefetch reads / wasted / turned away busy / capped, per token | competitor MB/s |",
        "|---|---|---|---|---|---|",
    ]
    for k, s in med.items():
        lo = min(r["tok_s"] for r in runs[k])
        hi = max(r["tok_s"] for r in runs[k])
        md.append(
            f"| {k} | {s['tok_s']:.2f} ({lo:.2f}-{hi:.2f}) | {s['wait_ms_per_tok']:.1f} | {s['mb_per_tok']:.1f} | "
            f"{s['pf_issued']:.1f} / {s['pf_wasted']:.2f} / {s['pf_busy']:.2f} / {s['pf_capped']:.2f} | "
            f"{s['competitor_mb_s']:.0f} |"
        )
    report = {"config": vars(ns), "competitor_alone_mb_s": competitor_alone, "median": med, "runs": runs}
    Path(ns.out + ".json").write_text(json.dumps(report, indent=1))
    Path(ns.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
