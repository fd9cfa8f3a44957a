"""A memory cap that counts page cache: cgroup v1 (/sys/fs/cgroup/memory), which works on these
machines; cgroup v2 memory control and systemd-run do not."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def available() -> bool:
    return (ROOT / "cgroup.procs").exists() and os.access(ROOT, os.W_OK)


class MemoryCap:
    """A cgroup v1 memory group with limit_bytes; processes join it with join(pid) (or, from a child,
    by preexec=cap.preexec). Removed on close()."""

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

    def join(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def preexec(self) -> None:
        """For subprocess.Popen(preexec_fn=...): the child joins before it execs."""
        self.join(os.getpid())

    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def failcnt(self) -> int:
        return int((self.path / "memory.failcnt").read_text())

    def close(self) -> None:
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                (ROOT / "cgroup.procs").write_text(pid)
            self.path.rmdir()
        except OSError:
            pass
