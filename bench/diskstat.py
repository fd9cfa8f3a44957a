"""The block device under a file and its kernel counters (/proc/diskstats): bytes it read and time it
was busy, whoever asked. Beside a process's own I/O counter they show whether the disk was the limit
of a decode step (busy near all of the time) and the rate it served at, measured, not probed."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple


class DiskCounters(NamedTuple):
    read_bytes: int  # sectors read x 512
    busy_ms: int  # time with at least one request in flight (io_ticks)


def device_of(path: str | Path) -> str | None:
    """The whole disk (not the partition) that holds path, as /proc/diskstats names it; None where the
    file system has no block device (tmpfs, overlay)."""
    st = os.stat(path)
    sys_dir = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not sys_dir.exists():
        return None
    real = sys_dir.resolve()
    return real.parent.name if (real / "partition").exists() else real.name


def counters(device: str | None) -> DiskCounters | None:
    """The device's counters now; None for no device."""
    if device is None:
        return None
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if len(f) > 12 and f[2] == device:
            return DiskCounters(int(f[5]) * 512, int(f[12]))
    return None


def delta(now: DiskCounters | None, then: DiskCounters | None) -> dict[str, float]:
    """What the device read and how long it was busy between two readings, for a worker's JSON
    (empty without a device)."""
    if now is None or then is None:
        return {}
    return {"read_bytes": now.read_bytes - then.read_bytes, "busy_s": (now.busy_ms - then.busy_ms) / 1e3}


def direct_reads(path: str | Path, block: int, depth: int, going: Callable[[], bool], mbps: float = 0.0) -> int:
    """O_DIRECT reads of `block` bytes (a multiple of 4096) at random aligned offsets of path, `depth`
    threads (os.preadv lets the GIL go), all together paced to mbps MB/s (0: as fast as the disk
    goes), while going() holds: the bytes read. A thread's OSError (O_DIRECT refused) is raised."""
    size = os.path.getsize(path)
    if block % 4096 or size < block + 4096:
        msg = f"{path}: {size} bytes; reads of {block} bytes need a multiple of 4096 and a larger file"
        raise ValueError(msg)
    done = [0] * depth
    errors: list[OSError] = []
    per = mbps * 1e6 / depth if mbps > 0 else 0.0
    t0 = time.perf_counter()

    def reader(i: int) -> None:
        try:
            buf = mmap.mmap(-1, block)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            errors.append(e)
            return
        rng = random.Random(i)
        try:
            while going():
                done[i] += os.preadv(fd, [buf], rng.randrange(0, (size - block) // 4096) * 4096)
                if per > 0 and (wait := t0 + done[i] / per - time.perf_counter()) > 0:
                    time.sleep(wait)
        except OSError as e:
            errors.append(e)
        finally:
            os.close(fd)
            buf.close()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(done)
