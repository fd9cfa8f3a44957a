"""The store checksum's speed on one core: CRC32C with the CPU's CRC instructions (what a store of
version 2 holds), the portable CRC32C loop (the same values, for CPUs without them) and the 64-bit
hash stores of version 1 hold, over a buffer that stays in the CPU's caches and one that streams
from memory (an expert just read lies in memory). Every implementation runs in the same process,
interleaved; GB/s are medians of the repeats.

    python bench/checksum.py --out bench/results/checksum-x86-64-2026-11-27
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import moetier
from moetier import _core

KINDS = ("crc32c", "crc32c-portable", "fnv64")


def gb_per_s(buf: np.ndarray, kind: str, min_seconds: float = 0.2) -> float:
    n, t0 = 0, time.perf_counter()
    while True:
        _core.checksum(buf, kind)
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            return n * buf.nbytes / dt / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=7, help="rounds over every implementation (default: 7)")
    p.add_argument("--cached-kib", type=int, default=1024, help="the cache-resident buffer, KiB (default: 1024)")
    p.add_argument("--memory-mib", type=int, default=256, help="the buffer streamed from memory, MiB (default: 256)")
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    bufs = {
        f"in cache ({a.cached_kib} KiB)": rng.integers(0, 256, a.cached_kib << 10, dtype=np.uint8),
        f"from memory ({a.memory_mib} MiB)": rng.integers(0, 256, a.memory_mib << 20, dtype=np.uint8),
    }
    runs: dict[str, dict[str, list[float]]] = {b: {k: [] for k in KINDS} for b in bufs}
    for r in range(a.repeats):
        for i in range(len(KINDS)):  # each round starts one further along the list
            kind = KINDS[(i + r) % len(KINDS)]
            for name, buf in bufs.items():
                runs[name][kind].append(gb_per_s(buf, kind))
    med = {b: {k: statistics.median(v) for k, v in ks.items()} for b, ks in runs.items()}
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    machine = {
        "cpu": next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo if "model name" in ln),
            platform.processor(),
        ),
        "arch": platform.machine(),
        "crc32c": _core.crc32c_impl(),
        "loadavg": os.getloadavg(),
    }
    rows = [
        "| buffer | CRC32C, CPU instructions | CRC32C, portable | 64-bit hash (store version 1) | CRC32C vs the hash |",
        "|---|---|---|---|---|",
    ]
    for b, m in med.items():
        rows.append(
            f"| {b} | {m['crc32c']:.2f} GB/s | {m['crc32c-portable']:.2f} GB/s | {m['fnv64']:.2f} GB/s "
            f"| {m['crc32c'] / m['fnv64']:.2f}x |"
        )
    head = (
        f"one core of {machine['cpu']} ({machine['arch']}; CRC32C here: {machine['crc32c']}), load "
        f"{machine['loadavg'][0]:.2f}; medians of {a.repeats} interleaved rounds; moetier from {moetier.__file__}"
    )
    md = head + "\n\n" + "\n".join(rows) + "\n"
    sys.stdout.write(md)
    Path(a.out + ".md").write_text(md)
    report = {"config": vars(a), "machine": machine, "runs": runs, "medians": med}
    Path(a.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
