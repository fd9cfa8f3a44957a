"""A memory cap that counts page cache: cgroup v1 (/sys/fs/cgroup/memory), which works on these
machines; cgroup v2 memory control and systemd-run do not. And a slower disk: a cgroup v1 blkio
read throttle (blkio.throttle.read_bps_device) on the disk that holds the model, so a fast disk can
stand in for the ~200 MB/s of an SD card, a USB stick or a loaded NVMe."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")
BLKIO = Path("/sys/fs/cgroup/blkio")


def available() -> bool:
    return (ROOT / "cgroup.procs").exists() and os.access(ROOT, os.W_OK)


class _Group:
    """A cgroup v1 group under root: processes join it with join(pid) (or, from a child, by
    preexec=group.preexec); close() moves them back to the root and removes it."""

    root: Path
    path: Path

    def join(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def preexec(self) -> None:
        """For subprocess.Popen(preexec_fn=...): the child joins before it execs."""
        self.join(os.getpid())

    def close(self) -> None:
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                (self.root / "cgroup.procs").write_text(pid)
            self.path.rmdir()
        except OSError:
            pass


class MemoryCap(_Group):
    """A cgroup v1 memory group with limit_bytes. Removed on close()."""

    root = ROOT

    def __init__(self, name: str, limit_bytes: int) -> None:
        if not available():
            msg = f"{ROOT}: cgroup v1 memory controller is not writable here; a memory cap needs it"
            raise RuntimeError(msg)
        self.path = ROOT / name
        self.path.mkdir(exist_ok=True)
        # swap would hide the cap: page cache and anon memory both count, nothing escapes to swap
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        swap = self.path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            try:
                swap.write_text(str(limit_bytes))
            except OSError:
                pass
        (self.path / "memory.max_usage_in_bytes").write_text("0")
        self.limit_bytes = limit_bytes

    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def failcnt(self) -> int:
        return int((self.path / "memory.failcnt").read_text())


def block_device(path: str | os.PathLike[str]) -> str:
    """MAJ:MIN of the whole disk that holds path: blkio throttles disks, not their partitions."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    node = Path("/sys/dev/block") / dev
    if not node.exists():
        msg = f"{path}: its file system (device {dev}) is not on a block device; a read throttle needs one"
        raise RuntimeError(msg)
    if (node / "partition").exists():
        dev = (node.resolve().parent / "dev").read_text().strip()
    return dev


class ReadThrottle(_Group):
    """A cgroup v1 blkio group whose processes read the disk `device` (MAJ:MIN) at most bytes_per_s,
    O_DIRECT and io_uring reads included. Removed on close()."""

    root = BLKIO

    def __init__(self, name: str, device: str, bytes_per_s: int) -> None:
        if not ((BLKIO / "cgroup.procs").exists() and os.access(BLKIO, os.W_OK)):
            msg = f"{BLKIO}: cgroup v1 blkio controller is not writable here; a read throttle needs it"
            raise RuntimeError(msg)
        self.path = BLKIO / name
        self.path.mkdir(exist_ok=True)
        (self.path / "blkio.throttle.read_bps_device").write_text(f"{device} {bytes_per_s}")
        self.device, self.bytes_per_s = device, bytes_per_s
