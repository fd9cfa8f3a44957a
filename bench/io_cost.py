"""What a read costs the CPU on this machine, and what that does to decode: a separate reader process
reads a file with O_DIRECT (random expert-sized blocks, several in flight) at a set rate while

1. nothing else runs: the machine's CPU time (/proc/stat: system, softirq, irq, steal) per MB read;
2. stock llama.cpp decodes in RAM (worker.py, no cache, no repack): decode ms per token against the
   same decode with no reader, the configurations interleaved over repeats.

An engine that overlaps expert reads with compute pays (1) out of the compute's cores: on a VM the
hypervisor's share of the I/O shows up as steal. With the engine's decode MB/token (bench/run.py) it
predicts how far a decode step's "rest" can sit above stock's compute however well reads overlap.

    python bench/io_cost.py --model M.gguf --file S/experts.bin --rates 0,150,300,max --out bench/results/NAME
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import diskstat

STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> dict[str, int]:
    """The machine's CPU time per kind since boot, in clock ticks (/proc/stat's first line)."""
    vals = Path("/proc/stat").read_text().splitlines()[0].split()[1 : 1 + len(STAT_FIELDS)]
    return dict(zip(STAT_FIELDS, map(int, vals), strict=True))


def reader_main(path: str, mbps: float, block: int, depth: int, stop_file: str) -> None:
    """The reader process: diskstat.direct_reads paced to mbps MB/s (0: unpaced) until stop_file
    exists; prints the bytes and seconds. A reader that cannot read fails, naming the file."""
    t0 = time.perf_counter()
    try:
        got = diskstat.direct_reads(path, block, depth, lambda: not os.path.exists(stop_file), mbps)
    except ValueError as e:  # names the file
        raise SystemExit(str(e)) from e
    except OSError as e:
        msg = f"{path}: {e}"
        raise SystemExit(msg) from e
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t0}))


class Reader:
    """The reader as a child process, stopped by a file (a signal could land inside a read)."""

    def __init__(self, a: argparse.Namespace, mbps: float, tag: str) -> None:
        self.stop = Path(f"/tmp/io_cost.{os.getpid()}.{tag}.stop")
        self.stop.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--reader", str(mbps), "--file", a.file]
        cmd += ["--block-kib", str(a.block_kib), "--depth", str(a.depth), "--stop-file", str(self.stop)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # its threads are reading before the measurement starts

    def close(self) -> dict[str, float]:
        self.stop.touch()
        out, err = self.proc.communicate(timeout=60)
        self.stop.unlink(missing_ok=True)
        if self.proc.returncode != 0:
            msg = f"reader exited {self.proc.returncode}: {err.strip()}"
            raise RuntimeError(msg)
        res: dict[str, float] = json.loads(out)
        return res


def parse_rate(text: str) -> float:
    return 0.0 if text == "max" else float(text)


def cost_alone(a: argparse.Namespace, rate: str) -> dict[str, Any]:
    """CPU time per kind while only the reader runs, per MB read (ms of one core per MB)."""
    r = Reader(a, parse_rate(rate), "alone")
    before = cpu_times()  # after the reader's start: its start-up is not a cost of reading
    t0 = time.perf_counter()
    time.sleep(a.seconds)
    after = cpu_times()
    secs = time.perf_counter() - t0
    got = r.close()
    tick = os.sysconf("SC_CLK_TCK")
    used = {k: (after[k] - before[k]) / tick for k in STAT_FIELDS}
    mb = got["bytes"] / 1e6 * secs / got["seconds"]  # the share read inside the window
    per_mb = {k: 1e3 * used[k] / mb for k in ("user", "system", "irq", "softirq", "steal")} if mb else {}
    return {"rate": rate, "mb_s": mb / secs, "cpu_s": used, "core_ms_per_mb": per_mb}


def decode_with(a: argparse.Namespace, rate: str) -> dict[str, Any]:
    """Stock in RAM (no repack) decoding while the reader reads at rate ('0': no reader)."""
    r = Reader(a, parse_rate(rate), "decode") if rate != "0" else None
    cmd = [sys.executable, str(Path(__file__).with_name("worker.py")), "--model", a.model, "--prompts", a.prompts]
    cmd += ["-n", str(a.n), "--threads", str(a.threads), "--ctx", "1024", "--no-repack"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:  # a failed decode must not leave the reader reading
        got = r.close() if r else {"bytes": 0, "seconds": 1.0}
    runs = json.loads(out.stdout)["runs"]
    steps = sum(x["tokens"] - 1 for x in runs)
    return {
        "rate": rate,
        "reader_mb_s": got["bytes"] / 1e6 / got["seconds"],
        "decode_ms_per_token": 1e3 * sum(x["decode_s"] for x in runs) / steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF model stock decodes in RAM")
    p.add_argument("--file", required=True, help="file the reader reads (an expert store's experts.bin)")
    p.add_argument("--rates", default="0,150,300,max", help="reader MB/s, comma-separated; max: unpaced")
    p.add_argument("--block-kib", type=int, default=736, help="bytes per read, KiB (default: one expert)")
    p.add_argument("--depth", type=int, default=8, help="reads in flight (reader threads)")
    p.add_argument("--seconds", type=float, default=8.0, help="length of each reader-alone measurement")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats")
    p.add_argument("--prompts", default="bench/results/prompts-eval6.json", help="JSON list of prompts")
    p.add_argument("-n", type=int, default=32, help="tokens per prompt")
    p.add_argument("--threads", type=int, default=2, help="decode threads")
    p.add_argument("--out", help="output prefix: OUT.json and OUT.md")
    p.add_argument("--reader", default=None, help=argparse.SUPPRESS)  # the child's mode: its MB/s
    p.add_argument("--stop-file", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.reader is not None:
        reader_main(a.file, float(a.reader), a.block_kib * 1024, a.depth, a.stop_file)
        return
    if not a.model or not a.out:
        p.error("--model and --out are needed")
    rates = a.rates.split(",")
    alone: dict[str, list[dict[str, Any]]] = {r: [] for r in rates if r != "0"}
    decode: dict[str, list[dict[str, Any]]] = {r: [] for r in rates}
    subprocess.run(["cat", a.model], stdout=subprocess.DEVNULL, check=True)  # the model in the page cache
    for rep in range(a.repeats):
        for r in rates:
            if r != "0":
                alone[r].append(cost_alone(a, r))
            decode[r].append(decode_with(a, r))
            sys.stderr.write(f"#{rep + 1} {r}: {decode[r][-1]}\n")
    write(a, alone, decode)


def write(
    a: argparse.Namespace, alone: dict[str, list[dict[str, Any]]], decode: dict[str, list[dict[str, Any]]]
) -> None:
    base = statistics.median(x["decode_ms_per_token"] for x in decode["0"]) if "0" in decode else None
    rows = [
        f"reader: O_DIRECT, {a.block_kib} KiB random reads, {a.depth} in flight, on `{Path(a.file).name}`; stock "
        f"`{Path(a.model).name}` in RAM, no repack, {a.threads} threads, {a.n} tokens x prompts of "
        f"`{Path(a.prompts).name}`; {a.repeats} interleaved repeats (medians); {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}",
        "",
        "| reader MB/s (set) | alone: MB/s | core ms per MB: system | softirq+irq | steal | kernel+steal | "
        "decode: reader MB/s | decode ms / token | over no reader |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {}
    for r in decode:
        al = alone.get(r, [])

        def med(xs: list[float]) -> float:
            return statistics.median(xs) if xs else float("nan")

        cost = {k: med([x["core_ms_per_mb"].get(k, 0.0) for x in al]) for k in ("system", "irq", "softirq", "steal")}
        ms = med([x["decode_ms_per_token"] for x in decode[r]])
        summary[r] = {
            "alone_mb_s": med([x["mb_s"] for x in al]),
            "core_ms_per_mb": cost,
            "decode_reader_mb_s": med([x["reader_mb_s"] for x in decode[r]]),
            "decode_ms_per_token": ms,
        }
        s = summary[r]
        total = cost["system"] + cost["irq"] + cost["softirq"] + cost["steal"]
        over = f"{ms - base:+.1f} ms" if base is not None else "-"
        if not al:  # no reader: the baseline row
            rows.append(f"| {r} | - | - | - | - | - | 0 | {ms:.1f} | - |")
            continue
        rows.append(
            f"| {r} | {s['alone_mb_s']:.0f} | {cost['system']:.2f} | {cost['irq'] + cost['softirq']:.2f} "
            f"| {cost['steal']:.2f} | {total:.2f} | {s['decode_reader_mb_s']:.0f} | {ms:.1f} | {over} |"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": {k: v for k, v in vars(a).items() if k not in ("reader", "stop_file")}}
    doc |= {"alone": alone, "decode": decode, "summary": summary}
    out.with_name(out.name + ".json").write_text(json.dumps(doc, indent=1))
    text = "\n".join(rows) + "\n"
    out.with_name(out.name + ".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
