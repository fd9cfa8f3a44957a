"""The real patched llama-server for tests: `moetier serve` on a free port, stopped when the test ends.

As llama.cpp's tools/server/tests/conftest.py does, every test starts its own server process and
stops it afterwards; its stderr goes to a log file that a failure quotes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return str(r.read().decode())

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def complete(self, prompt: str, n_predict: int = 16) -> dict[str, Any]:
        """llama.cpp's own /completion, greedy, without the prompt cache."""
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": False}
        return dict(self.post("/completion", body))

    def metric(self, name: str) -> float:
        """llamacpp:NAME from /metrics, read line by line (independent of moetier.stats' parser)."""
        for line in self.get("/metrics").splitlines():
            if line.startswith(f"llamacpp:{name} "):
                return float(line.split()[1])
        pytest.fail(f"/metrics has no {name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def start(args: list[str], log: Path, *, ctx: int = 512, threads: int = 2) -> Server:
    """`moetier serve ARGS` on a free port, once /health says ok (fails the test if it exits first)."""
    port = free_port()
    cmd = [sys.executable, "-m", "moetier.cli", "serve", *args, "--port", str(port), "-t", str(threads), "-c", str(ctx)]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    server = Server(proc, port, log)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.2)
    server.stop()
    pytest.fail(f"server did not become healthy: {log.read_text()[-2000:]}")


@contextmanager
def serve(args: list[str], log: Path, *, ctx: int = 512, threads: int = 2) -> Iterator[Server]:
    server = start(args, log, ctx=ctx, threads=threads)
    try:
        yield server
    finally:
        server.stop()
