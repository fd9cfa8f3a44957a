"""The store checksum's aarch64 path (Jetson Orin: the ARMv8 CRC32 instructions) compiles cleanly for
aarch64 Linux. No aarch64 machine runs the suite, so this checks the build, not the values; the
values of the shared lane and table code are checked on this machine (test_checksum.py)."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "csrc" / "moetier-crc32c.cpp"
EM_AARCH64 = 183


def test_crc32c_compiles_for_aarch64(tmp_path: Path) -> None:
    pytest.importorskip("ziglang")  # a clang that cross-compiles, from PyPI (the test extra)
    obj = tmp_path / "crc32c-aarch64.o"
    cmd = [sys.executable, "-m", "ziglang", "c++", "-target", "aarch64-linux-gnu", "-std=c++17", "-O2"]
    cmd += ["-Wall", "-Wextra", "-Werror", "-c", str(SRC), "-o", str(obj)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    head = obj.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and struct.unpack("<H", head[18:20])[0] == EM_AARCH64
    # the hardware path is compiled in: it names the CPU feature it is built for
    assert b"armv8-crc" in obj.read_bytes()
